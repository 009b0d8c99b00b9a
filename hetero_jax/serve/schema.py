"""The OpenAI request and response shapes the server speaks.

Requests are parsed and checked into frozen dataclasses before anything is queued; every refusal is a
``RequestError`` carrying the HTTP status and OpenAI's error fields (``message``, ``type``, ``param``,
``code``). Responses are plain dicts in OpenAI's JSON layout.
"""

from __future__ import annotations

import dataclasses
import json
import math
import secrets
import time
import uuid

from hetero_jax.errors import HeteroJaxError
from hetero_jax.runtime.prompts import check_request, is_int, is_real

ROLES = ("system", "user", "assistant")  # "developer" (OpenAI's newer name for system) is read as "system"
MAX_STOPS = 4  # OpenAI's limit on stop sequences
MAX_DEPTH = 64  # arrays / objects nested in a request body (OpenAI's requests nest 5 or so: messages' parts)
# fields of OpenAI's schema whose non-default values would change the answer in ways this server does not offer:
# refused rather than ignored, so a client never gets an answer that silently lacks what it asked for
UNSUPPORTED = {
    "logprobs": (None, False), "top_logprobs": (None,), "tools": (None, []), "functions": (None, []),
    "tool_choice": (None, "none", "auto"), "function_call": (None, "none", "auto"), "logit_bias": (None, {}),
    "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0), "best_of": (None, 1),
    "echo": (None, False), "suffix": (None, ""), "audio": (None,), "modalities": (None, ["text"]),
    "parallel_tool_calls": (None, True, False), "prediction": (None,), "response_format": (None, {"type": "text"}),
}


def _is_default(value, allowed: tuple) -> bool:
    """Whether ``value`` is one of an UNSUPPORTED field's ``allowed`` values; a bool only equals a bool (0 is not
    False: completions' ``logprobs: 0`` asks for the chosen tokens' log-probabilities)."""
    return any(value is None if a is None else
               value is not None and isinstance(value, bool) == isinstance(a, bool) and value == a for a in allowed)


class RequestError(HeteroJaxError, ValueError):
    """A request the server refuses: the HTTP ``status`` and OpenAI's error fields."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.param, self.code, self.type = status, param, code, type


def error_body(message: str, *, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error JSON: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


@dataclasses.dataclass(frozen=True)
class Sampling:
    """The decoding settings of one request. ``max_tokens`` None: the endpoint's default."""

    max_tokens: int | None
    temperature: float
    top_p: float
    seed: int
    stop: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Request:
    """What chat and completions requests share (``_common`` checks it). ``policy`` / ``budget``: this server's
    extension (a policy spec as ``--policy`` takes, and its rho); None: the server's."""

    model: str
    sampling: Sampling
    stream: bool
    include_usage: bool
    user: str
    policy: str | None
    budget: float | None


@dataclasses.dataclass(frozen=True)
class ChatRequest(Request):
    """``POST /v1/chat/completions``. ``messages``: ((role, content), ...), roles in ``ROLES``, the last a user's."""

    messages: tuple[tuple[str, str], ...]


@dataclasses.dataclass(frozen=True)
class CompletionRequest(Request):
    """``POST /v1/completions``: a raw-text (or token-id) prompt, continued without the chat template."""

    prompt: str | tuple[int, ...]


def parse_json(body: bytes) -> dict:
    """The request body as a JSON object; RequestError naming what is wrong otherwise (not JSON, not an object,
    or nested deeper than ``MAX_DEPTH``: JSON nested past the interpreter's recursion limit fails to parse,
    and a body just under it fails later wherever its values are printed or copied)."""
    try:
        value = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"the request body is not valid JSON ({e}); send a JSON object",
                           code="invalid_json") from None
    except RecursionError:
        raise RequestError(f"the request body nests arrays or objects too deeply to parse; send a JSON object "
                           f"nested at most {MAX_DEPTH} levels deep", code="invalid_json") from None
    if not isinstance(value, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(value).__name__}",
                           code="invalid_json")
    depth = json_depth(value)
    if depth > MAX_DEPTH:
        raise RequestError(f"the request body nests arrays or objects {depth} levels deep; send a JSON object "
                           f"nested at most {MAX_DEPTH} levels deep", code="invalid_json")
    return value


def json_depth(value) -> int:
    """How deeply ``value`` (parsed JSON) nests lists and dicts: 0 for a scalar, 1 for ``[]`` or ``{}``. Walks
    iteratively, so no nesting exhausts the recursion limit."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, dict):
            v = v.values()
        elif not isinstance(v, list):
            continue
        deepest = max(deepest, d)
        todo.extend((x, d + 1) for x in v)
    return deepest


def _common(d: dict) -> dict:
    """The fields chat and completions share, checked: model, sampling, stream, user, policy, budget."""
    for name, allowed in UNSUPPORTED.items():
        if not _is_default(d.get(name), allowed):
            raise RequestError(f"{name}={d[name]!r} is not supported by this server; leave {name} out",
                               param=name, code="unsupported_parameter")
    model = d.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError("model is required: the id of a model from GET /v1/models", param="model")
    n = d.get("n", 1)
    if n is not None and (not is_int(n) or n != 1):
        raise RequestError(f"n must be 1 (one answer per request), got {n!r}", param="n")
    mct, mt = d.get("max_completion_tokens"), d.get("max_tokens")
    param = "max_completion_tokens" if mct is not None else "max_tokens"
    max_tokens = mct if mct is not None else mt
    if max_tokens is not None and (not is_int(max_tokens) or max_tokens < 1):
        raise RequestError(f"{param} must be an integer >= 1, got {max_tokens!r}", param=param)
    temperature = _number(d, "temperature", 1.0, 0.0, 2.0, "[0, 2] (0 = greedy)")
    top_p = _number(d, "top_p", 1.0, 0.0, 1.0, "(0, 1]", lo_open=True)
    seed = d.get("seed")
    if seed is None:  # OpenAI's: no seed is a fresh draw (a regenerated answer differs), a seed repeats
        seed = secrets.randbits(63)
    elif not is_int(seed) or not -(2**63) <= seed < 2**63:
        raise RequestError(f"seed must be an integer in [-2**63, 2**63), got {seed!r}", param="seed")
    stop = d.get("stop")
    stops = () if stop is None else (stop,) if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError(f"stop must be a non-empty string or a list of non-empty strings, got {stop!r}",
                           param="stop")
    if len(stops) > MAX_STOPS:
        raise RequestError(f"stop takes at most {MAX_STOPS} strings, got {len(stops)}", param="stop")
    # the library's own checks of the same values (ranges agree; a refusal here names the library's rule)
    check_request(max_tokens or 1, temperature, top_p, seed=seed, stop=list(stops))
    stream = d.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise RequestError(f"stream must be true or false, got {stream!r}", param="stream")
    opts = d.get("stream_options")
    include_usage = False
    if opts is not None:
        if not stream:
            raise RequestError("stream_options is only allowed with stream: true", param="stream_options")
        if not isinstance(opts, dict) or not isinstance(opts.get("include_usage", False), bool):
            raise RequestError(f"stream_options must be an object like {{\"include_usage\": true}}, got {opts!r}",
                               param="stream_options")
        include_usage = opts.get("include_usage", False)
    user = d.get("user")
    if user is None:
        user = ""
    if not isinstance(user, str):
        raise RequestError(f"user must be a string, got {user!r}", param="user")
    policy = d.get("policy")
    if policy is not None and (not isinstance(policy, str) or not policy.strip()):
        raise RequestError(f"policy must be a policy name such as 'snapkv' or 'quest:offload=true', got {policy!r}",
                           param="policy")
    budget = d.get("budget")
    if budget is not None and (not is_real(budget) or not 0.0 < budget <= 1.0):
        raise RequestError(f"budget must be a number in (0, 1] (the fraction of the prompt's KV kept on the device), "
                           f"got {budget!r}", param="budget", code="invalid_budget")
    return dict(model=model, sampling=Sampling(max_tokens, float(temperature), float(top_p), int(seed),
                                               tuple(stops)),
                stream=stream, include_usage=include_usage, user=user, policy=policy,
                budget=None if budget is None else float(budget))


def _number(d: dict, name: str, default: float, lo: float, hi: float, interval: str, *, lo_open=False) -> float:
    v = d.get(name)
    if v is None:
        return default
    ok = is_real(v) and math.isfinite(v) and (v > lo if lo_open else v >= lo) and v <= hi
    if not ok:
        raise RequestError(f"{name} must be a number in {interval}, got {v!r}", param=name)
    return float(v)


def _content(i: int, m: dict) -> str:
    """A message's text: a string, or a list of text parts (joined); RequestError for anything else."""
    c = m.get("content")
    if isinstance(c, str):
        return c
    if isinstance(c, list) and c and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in c):
        return "".join(p["text"] for p in c)
    raise RequestError(f"messages[{i}].content must be a string or a list of text parts "
                       f"([{{\"type\": \"text\", \"text\": ...}}]); got {c!r:.80}", param=f"messages[{i}].content")


def parse_chat(d: dict) -> ChatRequest:
    msgs = d.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise RequestError("messages must be a non-empty list of {\"role\", \"content\"} objects",
                           param="messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise RequestError(f"messages[{i}] must be an object with role and content, got {m!r:.80}",
                               param=f"messages[{i}]")
        role = m.get("role")
        role = "system" if role == "developer" else role
        if role not in ROLES:
            raise RequestError(f"messages[{i}].role must be one of system, developer, user, assistant; got "
                               f"{m.get('role')!r}", param=f"messages[{i}].role")
        text = _content(i, m)
        if role == "user" and not text.strip():
            raise RequestError(f"messages[{i}] is a user message with no text", param=f"messages[{i}].content")
        out.append((role, text))
    if out[-1][0] != "user":
        raise RequestError(f"the last message must be the user's (the one to answer), got {out[-1][0]!r}",
                           param="messages")
    return ChatRequest(messages=tuple(out), **_common(d))


def parse_completion(d: dict) -> CompletionRequest:
    p = d.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one
    if isinstance(p, str):
        if not p.strip():
            raise RequestError("prompt has no text", param="prompt")
        prompt = p
    elif isinstance(p, list) and p and all(is_int(t) for t in p):
        prompt = tuple(int(t) for t in p)
    else:
        raise RequestError("prompt must be a non-empty string or a list of token ids (one prompt per request), "
                           f"got {p!r:.80}", param="prompt")
    return CompletionRequest(prompt=prompt, **_common(d))


# ---------------------------------------------------------------------------------------------------- responses
FINISH = {"eos": "stop", "stop": "stop", "max_new_tokens": "length", "context": "length"}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def chat_response(rid: str, model: str, text: str, finish: str, use: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": finish}],
            "usage": use}


def chat_chunk(rid: str, model: str, delta: dict | None, finish: str | None = None, use: dict | None = None) -> dict:
    """One streamed chunk; ``delta`` None: the closing usage chunk (no choices)."""
    out = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
           "choices": [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None,
                                                 "finish_reason": finish}]}
    if use is not None:
        out["usage"] = use
    return out


def completion_response(rid: str, model: str, text: str | None, finish: str | None, use: dict | None) -> dict:
    """A completion, or one streamed chunk of it; ``text`` None: the closing usage chunk (no choices)."""
    out = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
           "choices": [] if text is None else [{"index": 0, "text": text, "logprobs": None,
                                                "finish_reason": finish}]}
    if use is not None:
        out["usage"] = use
    return out


def models_response(model: str, created: int) -> dict:
    return {"object": "list", "data": [model_entry(model, created)]}


def model_entry(model: str, created: int) -> dict:
    return {"id": model, "object": "model", "created": created, "owned_by": "hetero-jax"}
