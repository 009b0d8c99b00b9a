"""The ASGI application: OpenAI's routes over one model, its held conversations and one engine worker.

``create_app(model, config)`` builds it; ``hetero-jax serve`` runs it with uvicorn. The event loop parses and
checks requests, queues them for the engine worker (``worker.EngineWorker``) and streams what the worker emits;
the worker runs every model call, one request at a time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import queue
import time
import types
import typing
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from hetero_jax.errors import ConfigError, HeteroJaxError
from hetero_jax.policies import (
    REGISTRY, BudgetError, FullKV, Policy, PolicyError, default_policy, make_policy, parse_options, registry_key,
)
from hetero_jax.profile.schema import ProfileError
from hetero_jax.runtime import generate
from hetero_jax.runtime.prompts import stop_token_ids
from hetero_jax.serve import schema
from hetero_jax.serve.metrics import Metrics
from hetero_jax.serve.schema import RequestError, error_body
from hetero_jax.serve.sessions import Conversations, SessionStore, Turn, run_fitted
from hetero_jax.serve.worker import ClientGone, EngineStopped, EngineWorker, Job, QueueFull

log = logging.getLogger("hetero_jax.serve")
POLL_S = 0.5  # how often a waiting request checks that its client is still there
COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """What ``hetero-jax serve`` was started with.

    ``policy``: the default policy (a ``Policy``, its spec as ``--policy`` takes it, or None: full KV), also run
    at a request's own ``budget`` when it names no policy; ``policy_name``: the ``--policy`` it was built from,
    for messages; ``max_sessions``: conversations held between requests; ``max_device_bytes`` /
    ``max_host_bytes``: bounds on their KV bytes (None: none); ``max_queue``: requests that may wait;
    ``max_tokens``: a chat answer's cap when the request gives none."""

    model_id: str
    policy: object = None
    policy_name: str = "full"
    max_sessions: int = 16
    max_device_bytes: int | None = None
    max_host_bytes: int | None = None
    max_queue: int = 64
    max_tokens: int = 512

    def __post_init__(self):
        if isinstance(self.policy, str):  # a spec as --policy takes it ("freekv", "quest:offload=true")
            object.__setattr__(self, "policy_name", self.policy.partition(":")[0].strip())
            object.__setattr__(self, "policy", make_policy(self.policy))
        elif self.policy is not None and not isinstance(self.policy, Policy):
            raise ConfigError(f"ServeConfig.policy must be a policy (hetero_jax.policies.make_policy('freekv', "
                              f"0.3)), its spec as --policy takes it ('quest:offload=true') or None for full KV; "
                              f"got {type(self.policy).__name__}")


class Channel:
    """Events from the worker thread to one request's coroutine: a thread-safe queue and a loop-side wake-up."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.items, self.wake = loop, queue.SimpleQueue(), asyncio.Event()

    def put(self, item) -> None:  # worker thread
        self.items.put(item)
        self.loop.call_soon_threadsafe(self.wake.set)

    def drain(self) -> list:
        out = []
        while True:
            try:
                out.append(self.items.get_nowait())
            except queue.Empty:
                return out


def check_served_policy(model, config: ServeConfig) -> None:
    """ConfigError when the server's policy cannot run on ``model`` (no shipped profile, Quest's full_layers past
    its layers): it would otherwise pass /health and refuse every request with a 400 blaming a 'policy' field the
    client never sent. The policy is bound and planned for the longest prompt. A budget too small for some prompt
    is not refused: the server serves a short prompt at the least budget that fits it."""
    if config.policy is None:
        return
    try:
        config.policy.bind(model).make_prefill(model.config, [model.config.max_position_embeddings - 1])
    except (PolicyError, ProfileError) as e:
        name = getattr(config.policy, "name", type(config.policy).__name__)  # policy_name may be left "full"
        if registry_key(config.policy_name) == name:
            name = config.policy_name
        raise ConfigError(f"the server's policy (--policy {name}) cannot run on this model: {e}") from None
    except BudgetError:
        pass


class Server:
    """The model, its held conversations, the engine worker and the metrics behind the routes."""

    def __init__(self, model, config: ServeConfig):
        check_served_policy(model, config)
        self.model, self.config = model, config
        self.store = SessionStore(config.max_sessions, config.max_device_bytes, config.max_host_bytes)
        self.conversations = Conversations(model, self.store)
        self.worker = EngineWorker(config.max_queue)
        self.metrics = Metrics()
        self.created = int(time.time())

    # ------------------------------------------------------------------------------------------------ checks
    def check_model(self, name: str) -> None:
        if name != self.config.model_id:
            raise RequestError(f"the model {name!r} does not exist on this server; it serves "
                               f"{self.config.model_id!r} (GET /v1/models)", status=404, param="model",
                               code="model_not_found")

    @staticmethod
    def is_own_policy(req) -> bool:
        """Whether ``req`` runs at the server's policy and budget (it names neither): a prompt too short for
        them is then served at the least budget that fits it (``sessions.fit_to_prompt``), where a request's
        own policy or budget is refused."""
        return req.policy is None and req.budget is None

    def policy_for(self, policy: str | None, budget: float | None):
        """The request's policy: the server's, its own (``policy``), or the server's at another ``budget`` (the
        server's policy object with that budget: its options and the files they named, read once at start)."""
        if policy is None and budget is None:
            return default_policy(self.config.policy)
        try:
            if policy is None:
                own = default_policy(self.config.policy)
                if isinstance(own, FullKV):
                    raise RequestError("this server keeps the whole prompt (full KV), which has no budget: send "
                                       "\"policy\" with \"budget\" (e.g. \"snapkv\"), or leave \"budget\" out",
                                       param="budget", code="invalid_budget")
                return dataclasses.replace(own, budget=budget)
            refuse_file_options(policy)  # before make_policy, which would open the file
            return make_policy(policy, budget)
        except PolicyError as e:
            raise RequestError(str(e), param="policy", code="invalid_policy") from None
        except BudgetError as e:
            raise RequestError(str(e), param="budget", code="invalid_budget") from None

    # ------------------------------------------------------------------------------------------------ jobs
    # A job function makes the request's own checks (before it is queued, so a refused request waits for no other
    # and takes no place in the queue) and returns ``job(emit)``: the engine's work, ``emit`` taking its text.
    def chat_job(self, req: schema.ChatRequest, policy):
        s = req.sampling
        max_tokens = s.max_tokens or self.config.max_tokens
        prepared = self.conversations.prepare(req.messages, s)

        def job(emit):
            def run(job: Job) -> Turn:
                on_token = _token_sink(job, emit)
                return self.conversations.answer(req.messages, policy, s, req.user, max_tokens, on_token=on_token,
                                                 fit_short=self.is_own_policy(req), prepared=prepared)
            return run
        return job

    def completion_job(self, req: schema.CompletionRequest, policy):
        s = req.sampling
        n = len(req.prompt) if isinstance(req.prompt, tuple) else len(
            self.model.tokenizer.encode_prompt(req.prompt, chat=False))
        context = self.model.config.max_position_embeddings
        if n + 1 > context:  # the code and param the chat route gives (clients' retry logic keys on them)
            raise RequestError(f"the prompt is {n} tokens long but the model's context is {context} tokens, "
                               "and the answer needs at least one more; shorten the prompt", param="prompt",
                               code="context_length_exceeded")
        stop_token_ids(self.model.tokenizer, s.stop)  # a stop that could never match
        prompt = list(req.prompt) if isinstance(req.prompt, tuple) else req.prompt

        def job(emit):
            def run(job: Job) -> Turn:
                def run_at(pol):
                    return generate(self.model, prompt, pol, max_new_tokens=s.max_tokens or COMPLETIONS_MAX_TOKENS,
                                    temperature=s.temperature, top_p=s.top_p, seed=s.seed,
                                    stop=list(s.stop) or None, chat=False, on_token=_token_sink(job, emit))
                res, short = run_fitted(self.model, policy, n, self.is_own_policy(req), run_at)
                st = res.stats
                return Turn(text=res.text, token_ids=tuple(res.token_ids), stop_reason=st.stop_reason,
                            prompt_tokens=st.prompt_tokens, cached_tokens=0, resumed=False,
                            prefill_seconds=st.prefill_seconds, decode_seconds=float(sum(st.decode_seconds)),
                            decode_steps=len(st.decode_seconds), recalls=int(st.policy_stats.get("recalls", 0)),
                            short_prompt=short)
            return run
        return job

    def record(self, turn: Turn) -> None:
        self.metrics.turn(prompt_tokens=turn.prompt_tokens, cached_tokens=turn.cached_tokens,
                          completion_tokens=len(turn.token_ids), prefill_seconds=turn.prefill_seconds,
                          decode_seconds=turn.decode_seconds, decode_steps=turn.decode_steps, resumed=turn.resumed,
                          recalls=turn.recalls, short_prompt=turn.short_prompt)


SCALARS = (bool, int, float, str, type(None))  # what a policy option written as text can stand for
UNIONS = (typing.Union, types.UnionType)


def file_options(cls) -> tuple[str, ...]:
    """The options of policy class ``cls`` that hold an object read from a file (a head profile, a ranking, a
    codebook): its init fields whose declared type is not made of bool, int, float, str and None. Written in a
    policy spec such an option's value can only be text, a path, which the policy opens."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        t = hints.get(f.name, object)
        kinds = typing.get_args(t) if typing.get_origin(t) in UNIONS else (t,)
        if f.init and not all(k in SCALARS for k in kinds):
            out.append(f.name)
    return tuple(out)


FILE_OPTIONS = {key: file_options(cls) for key, cls in REGISTRY.items()}
ANY_FILE_OPTION = frozenset(o for opts in FILE_OPTIONS.values() for o in opts)


def refuse_file_options(spec: str) -> None:
    """RequestError, before ``make_policy`` runs, when a request's policy spec gives an option read from a file.
    Which files the server reads is its operator's choice (``--option profile=PATH`` at start-up), never a
    client's: a client could otherwise make the server open any path and learn from the policy's message whether
    it exists. A spec whose name is no policy is checked against every policy's file options (``make_policy``
    then refuses the name)."""
    name, _, opts = spec.partition(":")
    options = parse_options([x for x in opts.split(",") if x.strip()])  # PolicyError for a malformed one
    key = registry_key(name.strip())
    for option in options:
        if option in FILE_OPTIONS.get(key, ANY_FILE_OPTION):
            known = key in REGISTRY
            owner, flag = (f"{REGISTRY[key].__name__}'s", name.strip()) if known else ("a policy's", "NAME")
            raise RequestError(
                f"the policy option {option!r} ({owner} {option}, read from a file) cannot be given in a request: "
                "a request may not name files on the server, which are chosen by the server's own flags at "
                f"start-up (hetero-jax serve --policy {flag} --option {option}=PATH). Leave {option} out "
                f"for the model's shipped {option}, or leave policy out for the server's policy and its options "
                "(a budget alone keeps them)", param="policy", code="invalid_policy")


def _token_sink(job: Job, emit):
    """The ``on_token`` of a job: stop at a disconnect; when streaming, send each piece of text (the library
    holds back text a stop string could still cut, and incomplete characters)."""

    def on_token(delta: str) -> None:
        job.check()
        if emit is not None and delta:
            emit(delta)
    return on_token


def error_response(e: BaseException) -> JSONResponse:
    """OpenAI's error body for ``e``: the request's own status for a RequestError, 400 for the library's
    refusals (they name the value and the fix), 503 when the queue is full or the engine stopped, 500 for anything
    else."""
    if isinstance(e, RequestError):
        return JSONResponse(error_body(str(e), type=e.type, param=e.param, code=e.code), status_code=e.status)
    if isinstance(e, QueueFull):
        return JSONResponse(error_body(str(e), type="server_error", code="queue_full"), status_code=503)
    if isinstance(e, EngineStopped):
        return JSONResponse(error_body(str(e), type="server_error", code="engine_stopped"), status_code=503)
    if isinstance(e, HeteroJaxError):  # raised on the engine thread (before any compute: the checks come first)
        if isinstance(e, PolicyError):
            param, code = "policy", "invalid_policy"
        elif isinstance(e, BudgetError):
            param, code = "budget", "invalid_budget"
        else:
            param, code = None, type(e).__name__
        return JSONResponse(error_body(str(e), param=param, code=code), status_code=400)
    if isinstance(e, ClientGone):
        return JSONResponse(error_body(str(e), code="client_disconnected"), status_code=499)
    log.error("request failed", exc_info=e)
    return JSONResponse(error_body(f"internal error: {type(e).__name__}: {e}", type="server_error"), status_code=500)


_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")


def _endpoint_label(path: str) -> str:
    """The metrics label of a refused request: its route's (a 405 on /v1/models/x is /v1/models/{id}), else
    "other". A client's path never becomes a label value: it would grow the series without bound, and a quote
    in it broke the exposition's syntax."""
    if path in _ENDPOINTS:
        return path
    return "/v1/models/{id}" if path.startswith("/v1/models/") else "other"


def _retrieve(fut: asyncio.Future) -> None:
    """Mark a job's exception as seen: a request whose client left never reads it."""
    if not fut.cancelled():
        fut.exception()


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def create_app(model, config: ServeConfig) -> Starlette:
    """The ASGI app serving ``model`` (a ``hetero_jax.load`` bundle) as ``config.model_id``."""
    server = Server(model, config)

    @asynccontextmanager
    async def lifespan(app):
        server.worker.start()
        try:
            yield
        finally:
            server.worker.stop()

    def counted(endpoint: str):
        def wrap(handler):
            async def route(request: Request) -> Response:
                try:
                    resp = await handler(request)
                except Exception as e:  # noqa: BLE001 - every failure becomes an OpenAI error body
                    resp = error_response(e)
                    if isinstance(e, ClientGone):
                        server.metrics.disconnect()
                server.metrics.request(endpoint, resp.status_code)
                return resp
            return route
        return wrap

    async def wait_done(fut: asyncio.Future, request: Request, job: Job, wake: asyncio.Event | None = None) -> None:
        """Wait for ``fut`` (or ``wake``), cancelling the job when the client disconnects meanwhile."""
        while not fut.done() and not (wake is not None and wake.is_set()):
            waiters = {fut} if wake is None else {fut, asyncio.ensure_future(wake.wait())}
            done, pending = await asyncio.wait(waiters, timeout=POLL_S, return_when=asyncio.FIRST_COMPLETED)
            for p in pending:
                if p is not fut:
                    p.cancel()
            if not done and await request.is_disconnected():
                job.cancel()
                raise ClientGone("the client disconnected")

    async def run_request(request: Request, req, job_fn, respond, stream_chunk, final_chunks):
        """Queue the job; answer with ``respond(turn)``, or stream (``stream_chunk(text)`` per piece of text, then
        ``final_chunks(turn)``) when the request asks. Errors before the first streamed text get their status."""
        policy = server.policy_for(req.policy, req.budget)
        make_job = await asyncio.to_thread(job_fn, req, policy)  # the request's checks, off the event loop
        if not req.stream:
            job = server.worker.submit(make_job(None))
            fut = asyncio.wrap_future(job.future)
            fut.add_done_callback(_retrieve)
            await wait_done(fut, request, job)
            turn = fut.result()
            server.record(turn)
            return JSONResponse(respond(turn))
        chan = Channel(asyncio.get_running_loop())
        job = server.worker.submit(make_job(chan.put))
        fut = asyncio.wrap_future(job.future)
        fut.add_done_callback(_retrieve)
        fut.add_done_callback(lambda _f: chan.wake.set())
        await wait_done(fut, request, job, chan.wake)  # headers wait for the first text, or the outcome
        if fut.done() and fut.exception() is not None:
            raise fut.exception()

        async def body():
            try:
                yield stream_chunk(None)
                while True:
                    chan.wake.clear()
                    for text in chan.drain():
                        yield stream_chunk(text)
                    if fut.done():
                        for text in chan.drain():
                            yield stream_chunk(text)
                        break
                    await chan.wake.wait()
                e = fut.exception()
                if e is not None:  # after text was sent: the error as an event (OpenAI clients raise it)
                    yield _sse(json.loads(error_response(e).body))
                    return
                turn = fut.result()
                server.record(turn)
                for chunk in final_chunks(turn):
                    yield chunk
                yield "data: [DONE]\n\n"
            finally:
                if not fut.done():  # the client went away mid-stream: free the engine at the next token
                    job.cancel()
                    server.metrics.disconnect()
        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @counted("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = schema.parse_chat(schema.parse_json(await request.body()))
        server.check_model(req.model)
        rid, name = schema.new_id("chatcmpl"), config.model_id

        def use(t: Turn) -> dict:
            return schema.usage(t.prompt_tokens, len(t.token_ids), t.cached_tokens)

        def respond(t: Turn) -> dict:
            return schema.chat_response(rid, name, t.text, schema.FINISH[t.stop_reason], use(t))

        sent = []  # the streamed pieces of text, to find what the final answer adds to them

        def stream_chunk(text):
            if text is not None:
                sent.append(text)
            delta = {"role": "assistant", "content": ""} if text is None else {"content": text}
            return _sse(schema.chat_chunk(rid, name, delta))

        def final_chunks(t: Turn):
            rest = t.text[sum(len(x) for x in sent):]
            out = [_sse(schema.chat_chunk(rid, name, {"content": rest}))] if rest else []
            out.append(_sse(schema.chat_chunk(rid, name, {}, schema.FINISH[t.stop_reason])))
            if req.include_usage:
                out.append(_sse(schema.chat_chunk(rid, name, None, use=use(t))))
            return out

        return await run_request(request, req, server.chat_job, respond, stream_chunk, final_chunks)

    @counted("/v1/completions")
    async def completions(request: Request) -> Response:
        req = schema.parse_completion(schema.parse_json(await request.body()))
        server.check_model(req.model)
        rid, name = schema.new_id("cmpl"), config.model_id
        sent = []

        def use(t: Turn) -> dict:
            return schema.usage(t.prompt_tokens, len(t.token_ids), 0)

        def respond(t: Turn) -> dict:
            return schema.completion_response(rid, name, t.text, schema.FINISH[t.stop_reason], use(t))

        def stream_chunk(text):
            if text is None:
                return ""  # completions have no role chunk
            sent.append(text)
            return _sse(schema.completion_response(rid, name, text, None, None))

        def final_chunks(t: Turn):
            rest = t.text[sum(len(x) for x in sent):]
            out = [_sse(schema.completion_response(rid, name, rest, schema.FINISH[t.stop_reason], None))]
            if req.include_usage:
                out.append(_sse(schema.completion_response(rid, name, None, None, use(t))))
            return out

        return await run_request(request, req, server.completion_job, respond, stream_chunk, final_chunks)

    @counted("/v1/models")
    async def models(request: Request) -> Response:
        return JSONResponse(schema.models_response(config.model_id, server.created))

    @counted("/v1/models/{id}")
    async def model_info(request: Request) -> Response:
        server.check_model(request.path_params["model_id"])
        return JSONResponse(schema.model_entry(config.model_id, server.created))

    @counted("/health")
    async def health(request: Request) -> Response:
        ok = server.worker.available
        body = {"status": "ok" if ok else "engine worker stopped", "model": config.model_id,
                "queue_depth": server.worker.depth, "busy": server.worker.running, **server.store.totals()}
        return JSONResponse(body, status_code=200 if ok else 503)

    @counted("/metrics")
    async def metrics(request: Request) -> Response:
        text = server.metrics.render(server.store.totals(), server.worker.depth, server.worker.running)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def http_error(request: Request, exc: HTTPException) -> Response:
        server.metrics.request(_endpoint_label(request.url.path), exc.status_code)
        msg = (f"no route {request.method} {request.url.path}; the server has GET /v1/models, POST "
               "/v1/chat/completions, POST /v1/completions, GET /health, GET /metrics") if exc.status_code in (
                   404, 405) else str(exc.detail)
        return JSONResponse(error_body(msg, code="not_found" if exc.status_code == 404 else None),
                            status_code=exc.status_code)

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", model_info, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error})
    app.state.server = server
    return app
