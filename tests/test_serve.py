"""``hetero-jax serve``: the OpenAI-compatible server (hetero_jax/serve).

The real-model tests run a live uvicorn server on 127.0.0.1 (a free port, a background thread) over the embedded
SmolLM2-135M and talk to it with the official ``openai`` client and httpx; their references are ``generate`` and
``Session`` run in this process. The others check the parts without a model: request parsing, the session store,
the CLI's refusals.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time

import pytest

from hetero_jax.errors import ConfigError
from hetero_jax.serve import schema
from hetero_jax.serve.schema import RequestError
from hetero_jax.serve.sessions import Conversation, SessionStore, digests, parse_size

MODEL = "smollm2-135m"
NEW = 12  # answer tokens per request: short, the tests are about the plumbing


# ------------------------------------------------------------------------------------------- without a model
def _chat(**kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **kw}


@pytest.mark.parametrize("body, param, needle", [
    (_chat(temperature=-0.5), "temperature", "temperature must be a number in [0, 2]"),
    (_chat(temperature=float("nan")), "temperature", "temperature must be"),
    (_chat(top_p=0), "top_p", "top_p must be a number in (0, 1]"),
    (_chat(max_tokens=0), "max_tokens", "max_tokens must be an integer >= 1"),
    (_chat(max_completion_tokens=2.5), "max_completion_tokens", "max_completion_tokens must be an integer"),
    (_chat(seed="1"), "seed", "seed must be an integer"),
    (_chat(stop=["a", ""]), "stop", "non-empty"),
    (_chat(stop=["a", "b", "c", "d", "e"]), "stop", "at most 4"),
    (_chat(n=2), "n", "n must be 1"),
    (_chat(stream="yes"), "stream", "stream must be true or false"),
    (_chat(stream_options={"include_usage": True}), "stream_options", "only allowed with stream"),
    (_chat(logprobs=True), "logprobs", "not supported"),
    (_chat(presence_penalty=0.5), "presence_penalty", "not supported"),
    (_chat(response_format={"type": "json_object"}), "response_format", "not supported"),  # it was ignored
    (_chat(budget=1.5), "budget", "budget must be a number in (0, 1]"),
    (_chat(user=3), "user", "user must be a string"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "model", "model is required"),
    (_chat(messages=[]), "messages", "non-empty list"),
    (_chat(messages="hi"), "messages", "non-empty list"),
    (_chat(messages=["hi"]), "messages[0]", "must be an object"),
    (_chat(messages=[{"role": "tool", "content": "x"}]), "messages[0].role", "must be one of"),
    (_chat(messages=[{"role": "user"}]), "messages[0].content", "must be a string or a list of text parts"),
    (_chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), "messages[0].content", "text parts"),
    (_chat(messages=[{"role": "user", "content": "  "}]), "messages[0].content", "no text"),
    (_chat(messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]), "messages",
     "the last message must be the user's"),
])
def test_bad_chat_requests_are_refused_naming_the_field(body, param, needle):
    with pytest.raises(RequestError) as e:
        schema.parse_chat(body)
    assert e.value.status == 400 and e.value.param == param and needle in str(e.value)
    if param == "budget":  # docs/serve.md's code, as for a budget too small for the prompt (it was null)
        assert e.value.code == "invalid_budget"


def test_completions_logprobs_0_is_refused_and_the_defaults_of_unsupported_fields_pass():
    """``logprobs: 0`` on /v1/completions asks for the chosen tokens' log-probabilities (it passed as False, and
    the answer had none); the values that ask for nothing pass."""
    body = {"model": MODEL, "prompt": "hi"}
    with pytest.raises(RequestError) as e:
        schema.parse_completion({**body, "logprobs": 0})
    assert e.value.param == "logprobs" and "logprobs=0 is not supported" in str(e.value)
    for ok in ({"logprobs": None}, {"logprobs": False}, {"presence_penalty": 0}, {"presence_penalty": 0.0},
               {"best_of": 1}, {"echo": False}):
        schema.parse_completion({**body, **ok})
    schema.parse_chat(_chat(response_format={"type": "text"}))


def test_chat_request_parsing_defaults_and_forms():
    r = schema.parse_chat(_chat(messages=[{"role": "developer", "content": "be brief"},
                                          {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                       {"type": "text", "text": "b"}]}],
                                max_tokens=5, max_completion_tokens=7, stop="x", seed=3))
    assert r.messages == (("system", "be brief"), ("user", "ab"))
    assert r.sampling == schema.Sampling(7, 1.0, 1.0, 3, ("x",))  # max_completion_tokens wins; OpenAI's defaults
    assert (r.stream, r.include_usage, r.user, r.policy, r.budget) == (False, False, "", None, None)
    c = schema.parse_completion({"model": MODEL, "prompt": [[1, 2, 3]]})
    assert c.prompt == (1, 2, 3)
    with pytest.raises(RequestError, match="prompt must be"):
        schema.parse_completion({"model": MODEL, "prompt": ["a", "b"]})
    for body in (b"{bad", b"[1]", b"\xff"):
        with pytest.raises(RequestError) as e:
            schema.parse_json(body)
        assert e.value.code == "invalid_json"


def test_parse_size():
    assert parse_size("8GiB", "--host-memory") == 8 * 2**30
    assert parse_size("1.5 MB", "--x") == 1_500_000
    assert parse_size("4096", "--x") == 4096
    with pytest.raises(ConfigError, match="--host-memory '8 apples' is not a size"):
        parse_size("8 apples", "--host-memory")
    # a fraction without a unit was 0 bytes: no session could ever be held
    with pytest.raises(ConfigError, match=r"--host-memory '0.5' is not a whole number of bytes; give a unit for a "
                                          r"fraction \(e.g. 0.5GiB\)"):
        parse_size("0.5", "--host-memory")
    with pytest.raises(ConfigError, match="not a whole number of bytes"):
        parse_size("2.5B", "--x")


def _conv(owner, messages, dev=0, host=0):
    return Conversation(session=object(), owner=owner, messages=tuple(messages), rendered="", unfed=0,
                        kv_device=dev, kv_host=host)


def test_session_store_finds_the_longest_held_prefix_per_owner():
    store = SessionStore(max_sessions=8)
    u, a = ("user", "q1"), ("assistant", "a1")
    c1 = _conv(("alice", None), [u, a])
    store.put(c1)
    assert store.take(("bob", None), [u, a, ("user", "q2")]) is None  # another user's conversation
    assert store.take(("alice", None), [u, ("user", "q2")]) is None  # not a continuation
    assert store.take(("alice", None), [u, a]) is None  # the same messages: nothing new to answer
    assert store.take(("alice", None), [u, a, ("user", "q2")]) is c1
    assert store.totals()["sessions"] == 0  # taken out while it answers
    longer = _conv(("alice", None), [u, a, ("user", "q2"), ("assistant", "a2")])
    store.put(c1)
    store.put(longer)
    assert store.take(("alice", None), list(longer.messages) + [("user", "q3")]) is longer
    assert digests(("x",), [u])[-1] != digests(("y",), [u])[-1]


def test_session_store_evicts_least_recently_used_within_its_bounds():
    store = SessionStore(max_sessions=2, max_device_bytes=100, max_host_bytes=1000)
    a, b, c = (_conv(("u",), [("user", q), ("assistant", "x")], dev=40, host=10) for q in "abc")
    store.put(a)
    store.put(b)
    assert store.take(("u",), list(a.messages) + [("user", "more")]) is a
    store.put(a)  # a is now the most recent
    assert store.put(c) == 1  # b, the least recent, goes
    assert store.take(("u",), list(b.messages) + [("user", "more")]) is None
    assert store.totals() == {"sessions": 2, "kv_bytes_device": 80, "kv_bytes_host": 20, "evictions": 1}
    for evictions, big in enumerate((_conv(("u",), [("user", "big"), ("assistant", "x")], dev=10, host=1001),
                                     _conv(("u",), [("user", "big"), ("assistant", "y")], dev=101, host=1)), 2):
        # alone over a byte bound: not held, and a and c stay (evicting them would hold nothing more)
        assert store.put(big) == 1
        assert store.totals() == {"sessions": 2, "kv_bytes_device": 80, "kv_bytes_host": 20,
                                  "evictions": evictions}
        assert store.take(("u",), list(big.messages) + [("user", "more")]) is None
    assert store.take(("u",), list(c.messages) + [("user", "more")]) is c
    none = SessionStore(max_sessions=0)
    assert none.put(_conv(("u",), [("user", "q"), ("assistant", "x")])) == 1


def test_queued_requests_whose_clients_left_hold_no_place_in_the_queue():
    """Two waiting clients left while a long answer ran: their jobs still filled --max-queue 2, and a live client
    got 503 queue_full with nobody waiting."""
    import threading

    from hetero_jax.serve.worker import ClientGone, EngineWorker, QueueFull

    worker, release = EngineWorker(max_queue=2), threading.Event()
    worker.start()
    try:
        running = worker.submit(lambda job: release.wait(30) and "long")
        while not worker.running:
            threading.Event().wait(0.01)
        gone = [worker.submit(lambda job: "never") for _ in range(2)]
        with pytest.raises(QueueFull, match="2 requests are already waiting"):
            worker.submit(lambda job: "refused")
        for job in gone:
            job.cancel()
        assert worker.depth == 0
        live = worker.submit(lambda job: "answered")
        assert worker.depth == 1
        for job in gone:  # told at once, not when the engine reaches them
            with pytest.raises(ClientGone, match="before its turn"):
                job.future.result(timeout=1)
        release.set()
        assert running.future.result(timeout=30) == "long" and live.future.result(timeout=30) == "answered"
    finally:
        release.set()
        worker.stop()
    assert not worker.alive


def test_a_cancelled_future_does_not_end_the_engine_thread():
    """Setting the result of a future something had cancelled raised InvalidStateError on the engine thread, which
    ended it (every later request would wait forever); the job is skipped and the worker goes on."""
    import threading

    from hetero_jax.serve.worker import EngineWorker

    worker, release, ran = EngineWorker(max_queue=4), threading.Event(), []
    worker.start()
    try:
        first = worker.submit(lambda job: release.wait(30) and "first")
        while not worker.running:
            threading.Event().wait(0.01)
        dropped = worker.submit(lambda job: ran.append("dropped"))
        assert dropped.future.cancel()  # still queued: cancellable
        after = worker.submit(lambda job: "after")
        release.set()
        assert first.future.result(timeout=30) == "first" and after.future.result(timeout=30) == "after"
        assert ran == [] and worker.alive
    finally:
        release.set()
        worker.stop()


@pytest.fixture
def no_load(monkeypatch):
    import hetero_jax

    def boom(*a, **k):
        raise AssertionError("model loaded for flags that should have been refused")
    monkeypatch.setattr(hetero_jax, "load", boom)


@pytest.mark.parametrize("flags, needle", [
    (["--policy", "snapkv", "--option", "bogus=1"], "SnapKV has no option 'bogus'"),
    (["--policy", "nope"], "unknown policy 'nope'"),
    (["--host-memory", "lots"], "--host-memory 'lots' is not a size"),
    (["--port", "70000"], "--port 70000 is out of range"),
    (["--max-sessions", "-1"], "--max-sessions -1 is out of range"),
])
def test_serve_flags_are_refused_before_loading(capsys, no_load, flags, needle):
    from hetero_jax.cli import main

    assert main(["serve", *flags]) == 2
    assert needle in capsys.readouterr().err


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("body, needle", [
    (_nested(100_000).encode(), "too deeply to parse"),  # past the recursion limit: json.loads raises
    (('{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "user": %s}'
      % (MODEL, _nested(100_000))).encode(), "too deeply to parse"),
    # parses, but 1 (the object) + 500 lists deep: refused before anything prints or copies it
    (('{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "user": %s}'
      % (MODEL, _nested(500))).encode(), "nests arrays or objects 501 levels deep"),
])
def test_deeply_nested_json_is_refused_as_invalid_json(body, needle):
    with pytest.raises(RequestError) as e:
        schema.parse_json(body)
    assert (e.value.status, e.value.code) == (400, "invalid_json") and needle in str(e.value)
    assert f"at most {schema.MAX_DEPTH} levels" in str(e.value)


def test_json_nesting_up_to_the_limit_is_accepted():
    # {"user": [[...]]}: the object and MAX_DEPTH - 1 lists
    ok = schema.parse_json(json.dumps({"user": json.loads(_nested(schema.MAX_DEPTH - 1))}).encode())
    assert schema.json_depth(ok) == schema.MAX_DEPTH
    assert [schema.json_depth(v) for v in (3, [], {}, {"a": [1, {"b": []}]}, [[], [[[]]]])] == [0, 1, 1, 4, 4]
    with pytest.raises(RequestError, match=f"{schema.MAX_DEPTH + 1} levels deep"):
        schema.parse_json(json.dumps({"user": json.loads(_nested(schema.MAX_DEPTH))}).encode())


@pytest.fixture
def modelless_app(monkeypatch):
    """The app over a stand-in model, for requests refused before the engine: a job submitted fails the test."""
    from types import SimpleNamespace

    from hetero_jax.serve import ServeConfig, create_app

    model = SimpleNamespace(tokenizer=None, config=SimpleNamespace(max_position_embeddings=8192))
    app = create_app(model, ServeConfig(model_id=MODEL))

    def boom(*a, **k):
        raise AssertionError("a request that should have been refused reached the engine")
    monkeypatch.setattr(app.state.server.worker, "submit", boom)
    return app


def test_a_deeply_nested_body_gets_400_invalid_json_over_http(modelless_app):
    from starlette.testclient import TestClient

    client = TestClient(modelless_app, raise_server_exceptions=False)
    chat = '{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "user": %s}'
    for path, body in (("/v1/chat/completions", _nested(100_000)), ("/v1/completions", _nested(100_000)),
                       ("/v1/chat/completions", chat % (MODEL, _nested(100_000))),
                       ("/v1/chat/completions", chat % (MODEL, _nested(990)))):  # parses, just under the limit
        r = client.post(path, content=body.encode(), headers={"Content-Type": "application/json"})
        assert r.status_code == 400, (path, len(body), r.text[:200])
        err = r.json()["error"]
        assert (err["code"], err["type"]) == ("invalid_json", "invalid_request_error") and "nest" in err["message"]


def test_refused_paths_are_counted_under_their_route_and_labels_are_escaped(modelless_app):
    """A 405 counted the client's path as its label: one new series per path, and a quote in it wrote a second
    label (Prometheus then refused the whole scrape)."""
    from starlette.testclient import TestClient

    from hetero_jax.serve.metrics import Metrics

    client = TestClient(modelless_app, raise_server_exceptions=False)
    for path in ("/v1/models/random-1", '/v1/models/x",status="999', "/v1/models/y", "/nothing/here"):
        client.post(path, content=b"{}")
    text = client.get("/metrics").text
    requests = [line for line in text.splitlines() if line.startswith("hetero_jax_requests_total")]
    assert 'hetero_jax_requests_total{endpoint="/v1/models/{id}",status="405"} 3' in requests
    assert 'hetero_jax_requests_total{endpoint="other",status="404"} 1' in requests
    assert not any("random" in line or "999" in line for line in requests)
    m = Metrics()
    m.request('a"b\\c\nd', 400)
    line = next(x for x in m.render({"sessions": 0, "kv_bytes_device": 0, "kv_bytes_host": 0, "evictions": 0},
                                    0, False).splitlines() if x.startswith("hetero_jax_requests_total"))
    assert line == 'hetero_jax_requests_total{endpoint="a\\"b\\\\c\\nd",status="400"} 1', line


# every option of a registered policy that holds an object read from a file, found by reading the policies:
# SyncKV (synckv.py) and ContextKeeper (contextkeeper/policy.py) load a str as a JSON path, HCAttention a str
# as a codebook .npz; HeteroCache and ProfiledSnapKV hold a HeadProfile
FILE_OPTIONS = {"heterocache": ("profile",), "synckv": ("profile",), "profiledsnapkv": ("profile",),
                "contextkeeper": ("ranking",), "hcattention": ("codebook",)}


def test_the_file_options_are_found_from_the_policies_types():
    from hetero_jax.serve.app import FILE_OPTIONS as found

    assert {k: v for k, v in found.items() if v} == FILE_OPTIONS


@pytest.mark.parametrize("spec, option, owner", [
    ("synckv:profile={}", "profile", "SyncKV"),
    ("contextkeeper:ranking={}", "ranking", "ContextKeeper"),
    ("hcattention:codebook={}", "codebook", "HCAttention"),
    ("HeteroCache:window=5,profile={}", "profile", "HeteroCache"),
    ("profiled-snapkv:profile={}", "profile", "ProfiledSnapKV"),
    ("sync_kv: profile = {}", "profile", "SyncKV"),  # make_policy's spellings of the name and the option
    ("no-such-policy:ranking={}", "ranking", "a policy"),  # every policy's file options for an unknown name
])
def test_a_request_may_not_name_a_file_for_a_policy(modelless_app, monkeypatch, tmp_path, spec, option, owner):
    import builtins

    from starlette.testclient import TestClient

    real = tmp_path / "exists.json"
    real.write_text("{}")
    opened = []
    real_open = builtins.open

    def spy(file, *a, **k):
        opened.append(str(file))
        return real_open(file, *a, **k)
    monkeypatch.setattr(builtins, "open", spy)
    client = TestClient(modelless_app, raise_server_exceptions=False)
    answers = []
    for path in (str(tmp_path / "missing.json"), str(real)):
        r = client.post("/v1/chat/completions", json={**_chat(), "policy": spec.format(path), "budget": 0.5})
        err = r.json()["error"]
        assert (r.status_code, err["code"], err["param"]) == (400, "invalid_policy", "policy"), err
        assert f"the policy option {option!r} ({owner}'s {option}" in err["message"]
        assert "a request may not name files" in err["message"] and f"--option {option}=PATH" in err["message"]
        assert path not in err["message"] and "not found" not in err["message"]
        answers.append(err["message"])
    assert answers[0] == answers[1]  # nothing in the answer depends on whether the file exists
    assert not [f for f in opened if str(tmp_path) in f], opened


def test_request_policies_without_files_and_the_servers_own_profile_still_work(monkeypatch):
    """A budget alone runs the server's policy object at that budget: its --option profile=PATH read once at start
    (each such request read the file again, and failed once it had moved). An app built in Python with a policy
    and policy_name left at "full" ran "full" at the budget, which refused it."""
    from types import SimpleNamespace

    from hetero_jax.policies import Quest, SnapKV, SyncKV, make_policy
    from hetero_jax.profile import official
    from hetero_jax.profile.shipped import SHIPPED_SYNCKV_PROFILES, shipped_data_path
    from hetero_jax.serve import ServeConfig
    from hetero_jax.serve.app import Server

    path = shipped_data_path(SHIPPED_SYNCKV_PROFILES, MODEL)
    model = SimpleNamespace(tokenizer=None, config=SimpleNamespace(max_position_embeddings=8192))
    policy = make_policy("synckv", 0.5, profile=path)
    server = Server(model, ServeConfig(model_id=MODEL, policy=None, policy_name="synckv"))
    server.config = ServeConfig(model_id=MODEL, policy=policy, policy_name="synckv")  # unchecked: no real model

    def no_read(*a, **k):
        raise AssertionError("the profile file was read for a request")
    monkeypatch.setattr(official, "load_profile", no_read)
    own = server.policy_for(None, 0.25)  # a budget alone: the server's policy with its --option profile=PATH
    assert isinstance(own, SyncKV) and own.budget == 0.25 and own.profile is policy.profile
    server.config = ServeConfig(model_id=MODEL, policy=SnapKV(budget=0.5))  # policy_name left at "full"
    assert server.policy_for(None, 0.3) == SnapKV(budget=0.3)
    q = server.policy_for("quest:offload=true,page_size=8", 0.5)
    assert isinstance(q, Quest) and (q.offload, q.page_size, q.budget) == (True, 8, 0.5)


def test_serve_accepts_a_profile_path_among_its_own_flags(capsys, no_load):
    """--option profile=PATH at start-up is the server's choice: accepted (and read), where a request's is not;
    the busy port refuses the start after the policy was built."""
    import socket

    from hetero_jax.profile.shipped import SHIPPED_SYNCKV_PROFILES, shipped_data_path

    path = shipped_data_path(SHIPPED_SYNCKV_PROFILES, MODEL)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        from hetero_jax.cli import main

        assert main(["serve", "--policy", "synckv", "--option", f"profile={path}", "--port", str(port)]) == 2
        assert f"--port {port} is already in use" in capsys.readouterr().err
        assert main(["serve", "--policy", "synckv", "--option", "profile=/no/such/synckv.json"]) == 2
        assert "/no/such/synckv.json" in capsys.readouterr().err  # the operator's own path: read and reported


def test_a_busy_port_or_a_bad_host_is_refused_before_the_model_loads(capsys, no_load):
    import socket

    from hetero_jax.cli import main

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        start = time.monotonic()
        assert main(["serve", "--host", "127.0.0.1", "--port", str(port)]) == 2
        out = capsys.readouterr()
        assert f"--port {port} is already in use on 127.0.0.1" in out.err and "give another --port" in out.err
        assert "serving" not in out.out  # no banner for a server that never listened
    for host, needle in (("999.1.1.1", "--host '999.1.1.1' is not an address or a host name that resolves"),
                         ("192.0.2.1", "--host 192.0.2.1 is not an address of this machine")):  # TEST-NET-1
        assert main(["serve", "--host", host]) == 2
        out = capsys.readouterr()
        assert needle in out.err and "0.0.0.0" in out.err and "serving" not in out.out
    assert time.monotonic() - start < 30  # refused without loading anything (no_load also fails a load)


@pytest.mark.slow
def test_serve_prints_its_banner_once_listening_and_answers(tiny_checkpoint, tmp_path):
    """The whole command on a tiny model: --port 0 binds a free port before the load, the banner names it once
    uvicorn listens, and the server answers there; Ctrl-C stops it cleanly."""
    import os
    import signal
    import subprocess
    import sys

    import httpx

    _, ours = tiny_checkpoint("llama")
    proc = subprocess.Popen([sys.executable, "-m", "hetero_jax.cli", "serve", "--model", ours, "--port", "0",
                             "--served-model-name", "tiny", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=(tmp_path / "err").open("w"), text=True,
                            env=os.environ.copy())
    try:
        line = proc.stdout.readline()
        assert line.startswith("serving tiny (FullKV") and " on http://127.0.0.1:" in line, (
            line, proc.poll(), (tmp_path / "err").read_text()[-2000:])
        base = line.split(" on ")[-1].strip().removesuffix("/v1")
        assert int(base.rsplit(":", 1)[1]) > 0  # the port the system chose, not 0
        r = httpx.get(base + "/v1/models", timeout=30)  # listening as soon as the banner is out
        assert r.status_code == 200 and [m["id"] for m in r.json()["data"]] == ["tiny"]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("flags, needle", [
    (["--policy", "quest", "--budget", "0.5"], "the server's policy (--policy quest) cannot run on this model: Quest: "
                                               "full_layers=2 leaves no layer of the model's 2 to select pages in"),
    (["--policy", "heterocache"], "the server's policy (--policy heterocache) cannot run on this model: "
                                 "HeteroCache(profile=None) needs the shipped profile of the loaded model"),
    # the fix in the command line's words too (it gave only HeteroCache(profile='profile.json'); review 94)
    (["--policy", "heterocache"], "on the command line: generate --profile profile.json, serve --option "
                                 "profile=profile.json"),
])
def test_a_servers_policy_that_cannot_run_on_the_model_is_refused_before_serving(tiny_checkpoint, capsys, flags,
                                                                                needle, monkeypatch):
    """The server started, /health said ok, and every request got a 400 blaming a 'policy' field the client
    never sent; now the command exits 2 once the model is loaded, naming the flag."""
    from hetero_jax.cli import main
    from hetero_jax.serve import listen

    def never(*a, **k):
        raise AssertionError("served with a policy that cannot run")
    monkeypatch.setattr(listen, "serve", never)
    assert main(["serve", "--model", tiny_checkpoint("llama")[1], "--port", "0", *flags]) == 2
    assert needle in capsys.readouterr().err


def test_an_app_built_with_a_policy_that_cannot_run_on_the_model_is_refused(tiny_checkpoint):
    """The check lives in create_app, so an app built in Python (create_app, BackgroundServer) is refused as the
    command is; it used to start and answer every request with a 400."""
    from hetero_jax.errors import ConfigError
    from hetero_jax.policies import HeteroCache
    import hetero_jax
    from hetero_jax.serve import BackgroundServer, ServeConfig, create_app

    model = hetero_jax.load(tiny_checkpoint("llama")[1])
    config = ServeConfig(model_id=MODEL, policy=HeteroCache(budget=0.5))  # policy_name left at its default
    for build in (create_app, BackgroundServer):
        with pytest.raises(ConfigError, match=r"the server's policy \(--policy heterocache\) cannot run on this "
                                              r"model: HeteroCache\(profile=None\) needs the shipped profile"):
            build(model, config)


def test_a_servers_budget_too_small_for_some_prompts_still_serves(tiny_checkpoint, monkeypatch):
    """FreeKV at 0.5 holds no page of the tiny model's longest prompt; the server serves such prompts at the least
    budget that fits, so the command is not refused."""
    from hetero_jax.cli import main
    from hetero_jax.serve import listen

    served = []
    monkeypatch.setattr(listen, "serve", lambda app, sock, **k: served.append(k["banner"]))
    assert main(["serve", "--model", tiny_checkpoint("llama")[1], "--port", "0", "--policy", "freekv",
                 "--budget", "0.5"]) == 0
    assert served and "FreeKV(budget=0.5" in served[0]


# --------------------------------------------------------------------------------------- a live server
class LiveServer:
    def __init__(self, model, **config):
        from hetero_jax.serve import BackgroundServer, ServeConfig

        self.running = BackgroundServer(model, ServeConfig(model_id=MODEL, **config))
        self.app, self.base = self.running.app, self.running.base

    @property
    def server(self):
        return self.app.state.server

    def client(self):
        import openai

        return openai.OpenAI(base_url=self.base + "/v1", api_key="unused", max_retries=0, timeout=300)

    def post(self, path, body, **kw):
        import httpx

        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        return httpx.post(self.base + path, content=data, headers={"Content-Type": "application/json"},
                          timeout=300, **kw)

    def metric(self, name: str) -> float:
        import httpx

        text = httpx.get(self.base + "/metrics", timeout=30).text
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(f"hetero_jax_{name}"))

    def close(self):
        self.running.close()


@pytest.fixture(scope="module")
def live(smollm2):
    srv = LiveServer(smollm2, max_sessions=8)
    yield srv
    srv.close()


QUESTION = "What is the capital of France? Answer in one sentence."


def _stream_text(stream):
    parts, usage, finish = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            delta = getattr(ch, "delta", None)  # chat chunks carry a delta, completion chunks their text
            parts.append((delta.content if delta is not None else ch.text) or "")
            finish = ch.finish_reason or finish
    return "".join(parts), usage, finish


@pytest.mark.real_model
@pytest.mark.slow
def test_openai_client_gets_the_text_of_generate(live, smollm2):
    import hetero_jax

    ref = hetero_jax.generate(smollm2, QUESTION, max_new_tokens=NEW)
    client = live.client()
    assert [m.id for m in client.models.list().data] == [MODEL]
    msgs = [{"role": "user", "content": QUESTION}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=NEW, temperature=0)
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].finish_reason == ("stop" if ref.stats.stop_reason == "eos" else "length")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (ref.stats.prompt_tokens, len(ref.token_ids))
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    text, usage, finish = _stream_text(client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=NEW, temperature=0, stream=True, stream_options={"include_usage": True}))
    assert text == ref.text and finish == r.choices[0].finish_reason
    assert usage.prompt_tokens == ref.stats.prompt_tokens and usage.prompt_tokens_details.cached_tokens == 0

    # /v1/completions continues raw tokens: the chat prompt's own ids give generate's answer again (and share
    # its compiled shapes)
    ids = smollm2.tokenizer.encode_prompt(QUESTION)
    c = client.completions.create(model=MODEL, prompt=ids, max_tokens=NEW, temperature=0)
    assert c.choices[0].text == ref.text and c.usage.prompt_tokens == len(ids)
    text, _, _ = _stream_text(client.completions.create(model=MODEL, prompt=ids, max_tokens=NEW, temperature=0,
                                                        stream=True))
    assert text == ref.text
    # a stop string inside the answer: the stream never sends what the answer cuts (the library holds back a
    # possible stop's start)
    assert len(ref.text) >= 12
    stop = ref.text[8:12]
    text, _, finish = _stream_text(client.completions.create(model=MODEL, prompt=ids, max_tokens=NEW, temperature=0,
                                                             stream=True, stop=[stop]))
    assert text == ref.text[:ref.text.index(stop)] and finish == "stop"


# short, so that the first request renders to as many tokens as QUESTION and shares its compiled shapes
CONTEXT = "Anna stayed in Lisbon."
QUESTIONS = ["Which city was it?", "Who stayed there?", "Name the city once more."]


@pytest.mark.real_model
@pytest.mark.slow
def test_three_turn_conversation_resumes_and_equals_a_session(live, smollm2):
    from hetero_jax import Session

    ref = Session(smollm2, CONTEXT)
    answers, held = [], []  # held: positions the reference session's cache holds after each turn
    for q in QUESTIONS:
        answers.append(ref.ask(q, max_new_tokens=NEW).text)
        held.append(smollm2.config.max_position_embeddings - ref.engine.positions_left)
    msgs = ref.messages  # the first user message is the context and the first question, as a Session renders it
    assert msgs[0]["content"] == CONTEXT + "\n\n" + QUESTIONS[0] and len(msgs) == 6
    assert len(smollm2.tokenizer.encode_prompt(msgs[0]["content"])) == len(smollm2.tokenizer.encode_prompt(QUESTION))
    client = live.client()
    resumed_before = live.metric("turns_total{kind=\"resumed\"")
    for k in range(3):
        r = client.chat.completions.create(model=MODEL, messages=msgs[: 2 * k + 1], max_tokens=NEW, temperature=0,
                                           user="trip")
        assert r.choices[0].message.content == answers[k], f"turn {k + 1}"
        cached = r.usage.prompt_tokens_details.cached_tokens
        assert cached == (0 if k == 0 else held[k - 1]), f"turn {k + 1} reuses what the cache held after turn {k}"
        assert r.usage.prompt_tokens > cached
    assert live.metric("turns_total{kind=\"resumed\"") == resumed_before + 2


COUNTRIES = ["France", "Spain", "Italy", "Japan"]


def _conversation(client, country, timeout=240):
    """Two turns: a capital, then a follow-up that resumes the conversation. Returns both answers."""
    msgs = [{"role": "user", "content": QUESTION.replace("France", country)}]  # all as long as QUESTION
    out = []
    for follow in ("And its population, roughly?", None):
        r = client.with_options(timeout=timeout).chat.completions.create(
            model=MODEL, messages=msgs, max_tokens=8, temperature=0, user=country)
        out.append((r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens > 0))
        if follow:
            msgs = msgs + [{"role": "assistant", "content": out[-1][0]}, {"role": "user", "content": follow}]
    return out


@pytest.mark.real_model
@pytest.mark.slow
def test_concurrent_clients_get_their_sequential_answers(live):
    import httpx

    client = live.client()
    sequential = {c: _conversation(client, c) for c in COUNTRIES}
    assert all(not first[1] and second[1] for first, second in sequential.values())  # turn 2 resumed
    start = threading.Barrier(len(COUNTRIES))

    def one(country):
        start.wait(timeout=30)
        return _conversation(live.client(), country)

    with concurrent.futures.ThreadPoolExecutor(len(COUNTRIES)) as pool:
        futures = {c: pool.submit(one, c) for c in COUNTRIES}
        together = {c: f.result(timeout=300) for c, f in futures.items()}
    assert together == sequential
    h = httpx.get(live.base + "/health", timeout=30)
    assert h.status_code == 200 and h.json()["status"] == "ok" and h.json()["queue_depth"] == 0
    assert live.metric("requests_total{endpoint=\"/v1/chat/completions\",status=\"500\"") == 0


@pytest.mark.real_model
@pytest.mark.slow
def test_a_client_that_leaves_mid_stream_frees_the_engine_and_leaves_its_conversation(live):
    import httpx

    client = live.client()
    first = [{"role": "user", "content": QUESTION}]
    a1 = client.chat.completions.create(model=MODEL, messages=first, max_tokens=NEW, temperature=0,
                                        user="leaver").choices[0].message.content
    # a question whose answer runs far past the few tokens read before leaving
    second = first + [{"role": "assistant", "content": a1},
                      {"role": "user", "content": "Now write a long story about Paris, in ten paragraphs."}]
    gone_before = live.metric("client_disconnects_total")
    body = {"model": MODEL, "messages": second, "max_tokens": 80, "temperature": 0, "stream": True,
            "user": "leaver"}
    with httpx.stream("POST", live.base + "/v1/chat/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))  # the role chunk
        assert json.loads(next(line for line in lines if line.startswith("data:"))[5:])["choices"]  # first text
    deadline = time.monotonic() + 60
    while live.metric("client_disconnects_total") == gone_before or live.server.worker.running:
        assert time.monotonic() < deadline, "the engine kept answering a client that left"
        time.sleep(0.1)
    # the interrupted turn left the conversation as it was: turn 2 resumes it and answers as a conversation
    # that was never interrupted does
    resumed = client.chat.completions.create(model=MODEL, messages=second, max_tokens=NEW, temperature=0,
                                             user="leaver")
    assert resumed.usage.prompt_tokens_details.cached_tokens > 0
    client.chat.completions.create(model=MODEL, messages=first, max_tokens=NEW, temperature=0, user="fresh")
    fresh = client.chat.completions.create(model=MODEL, messages=second, max_tokens=NEW, temperature=0, user="fresh")
    assert resumed.choices[0].message.content == fresh.choices[0].message.content
    assert resumed.usage.prompt_tokens_details.cached_tokens == fresh.usage.prompt_tokens_details.cached_tokens


@pytest.mark.real_model
@pytest.mark.slow
def test_every_error_case_gets_its_status_and_message(live):
    import httpx
    import openai

    msgs = [{"role": "user", "content": "hi"}]
    cases = [
        (b"{not json", 400, "invalid_json", "not valid JSON"),
        (b"[1, 2]", 400, "invalid_json", "must be a JSON object"),
        (_nested(100_000).encode(), 400, "invalid_json", "too deeply to parse"),
        ({"model": MODEL, "messages": msgs, "policy": "synckv:profile=/etc/passwd"}, 400, "invalid_policy",
         "a request may not name files on the server"),
        ({"model": "gpt-9", "messages": msgs}, 404, "model_not_found", "'gpt-9' does not exist"),
        ({"model": MODEL, "messages": msgs, "temperature": 3}, 400, None, "temperature must be a number in [0, 2]"),
        ({"model": MODEL, "messages": msgs, "top_p": 1.5}, 400, None, "top_p must be a number in (0, 1]"),
        ({"model": MODEL, "messages": msgs, "max_tokens": -1}, 400, None, "max_tokens must be an integer >= 1"),
        ({"model": MODEL, "messages": msgs, "policy": "snapkv:bogus=1"}, 400, "invalid_policy",
         "SnapKV has no option 'bogus'"),
        ({"model": MODEL, "messages": msgs, "policy": "nope"}, 400, "invalid_policy", "unknown policy 'nope'"),
        ({"model": MODEL, "messages": msgs, "policy": "full", "budget": 0.5}, 400, "invalid_budget",
         "the full policy keeps the whole prompt"),
        # refused by the policy's plan on the engine thread, before any compute
        ({"model": MODEL, "messages": msgs, "policy": "contextkeeper", "budget": 0.5}, 400, "invalid_budget",
         "ContextKeeper: budget rho=0.5 cannot be kept"),
        ({"model": MODEL, "messages": [{"role": "user"}]}, 400, None, "messages[0].content must be a string"),
        ({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, 400, None, "messages[0].role"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "word " * 9000}]}, 400, "context_length_exceeded",
         "the model's context is 8192 tokens"),
    ]
    for body, status, code, needle in cases:
        r = live.post("/v1/chat/completions", body)
        err = r.json()["error"]
        assert (r.status_code, err["code"]) == (status, code), (body if isinstance(body, bytes) else body.keys(), err)
        assert needle in err["message"] and set(err) == {"message", "type", "param", "code"}
    r = live.post("/v1/completions", {"model": MODEL, "prompt": "word " * 9000})  # as the chat route answers
    err = r.json()["error"]
    assert r.status_code == 400 and "the model's context is 8192 tokens" in err["message"]
    assert (err["code"], err["param"]) == ("context_length_exceeded", "prompt")
    r = live.post("/v1/completions", {"model": MODEL, "prompt": [10**9]})
    assert r.status_code == 400 and "outside the vocabulary" in r.json()["error"]["message"]
    assert httpx.get(live.base + "/v2/nothing", timeout=30).status_code == 404
    with pytest.raises(openai.NotFoundError, match="does not exist"):  # the client raises its own error type
        live.client().chat.completions.create(model="gpt-9", messages=msgs)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        live.client().chat.completions.create(model=MODEL, messages=msgs, temperature=-1)
    # nothing crashed: still healthy, still answering
    assert httpx.get(live.base + "/health", timeout=30).json()["status"] == "ok"
    assert live.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                                 max_tokens=2, temperature=0).choices[0].message.content


@pytest.mark.real_model
@pytest.mark.slow
@pytest.mark.parametrize("bound", [{"max_sessions": 1}, {"max_device_bytes": 1}])
def test_held_conversations_are_evicted_within_the_bounds(smollm2, bound):
    import httpx

    srv = LiveServer(smollm2, **bound)
    try:
        client = srv.client()
        msgs = [{"role": "user", "content": QUESTION}]
        answers = [client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=NEW, temperature=0,
                                                  user=u).choices[0].message.content for u in ("a", "b")]
        h = httpx.get(srv.base + "/health", timeout=30).json()
        if "max_sessions" in bound:  # a, the least recently used, went; b is held with its KV bytes
            assert (h["sessions"], h["evictions"]) == (1, 1) and h["kv_bytes_device"] > 0
            more = msgs + [{"role": "assistant", "content": answers[1]}, {"role": "user", "content": "And of Spain?"}]
            r = client.chat.completions.create(model=MODEL, messages=more, max_tokens=NEW, temperature=0, user="b")
            assert r.usage.prompt_tokens_details.cached_tokens > 0
        else:  # every conversation's device KV passes a 1-byte bound: none is held
            assert (h["sessions"], h["evictions"], h["kv_bytes_device"]) == (0, 2, 0)
        assert srv.metric("session_evictions_total") == h["evictions"]
    finally:
        srv.close()


def test_a_held_conversation_keeps_the_rows_it_uses_not_what_max_tokens_reserved(tiny_checkpoint):
    """A 'Say hi.' chat with max_tokens 1e6 was held with a tail for the whole context (379 MB on SmolLM2,
    7.4 MB at max_tokens 16): a held conversation is trimmed to the rows it uses, and resumed after the trim it
    answers as one that was never trimmed."""
    import dataclasses

    import hetero_jax
    from hetero_jax.policies import FullKV
    from hetero_jax.serve.schema import Sampling
    from hetero_jax.serve.sessions import Conversations, SessionStore

    model = hetero_jax.load(tiny_checkpoint("llama")[1])
    greedy, msgs = Sampling(None, 0.0, 1.0, 0, ()), (("user", "the quick brown fox"),)
    # the random model never says EOS: make its third greedy token the EOS, so a short answer ends by itself
    third = Conversations(model, SessionStore(4)).answer(msgs, FullKV(), greedy, "u", max_tokens=8).token_ids[2]
    model = dataclasses.replace(model, config=dataclasses.replace(model.config, eos_token_ids=(third,)))
    held = {}
    for max_tokens in (8, 400):
        store = SessionStore(max_sessions=4)
        conv = Conversations(model, store)
        turn = conv.answer(msgs, FullKV(), greedy, "u", max_tokens=max_tokens)
        assert turn.stop_reason == "eos" and len(turn.token_ids) <= 3
        held[max_tokens] = (store.totals()["kv_bytes_device"], conv, turn)
    assert held[400][0] == held[8][0]
    answers = {m: c.answer(msgs + (("assistant", model.tokenizer.decode(t.token_ids)), ("user", "and then?")),
                           FullKV(), greedy, "u", max_tokens=6) for m, (_, c, t) in held.items()}
    assert answers[400].resumed and answers[400].token_ids == answers[8].token_ids


def test_a_resumed_turn_that_fails_is_held_trimmed_and_counted_as_held(tiny_checkpoint):
    """A resumed turn grows the tail for its max_tokens before it starts; when it failed (the client left), the
    conversation was held with that tail while the store counted the trimmed bytes of the turn before (3.4x
    under on the tiny model), so --device-memory was not enforced."""
    import hetero_jax
    from hetero_jax.model.cache import kv_bytes
    from hetero_jax.policies import FullKV
    from hetero_jax.serve.schema import Sampling
    from hetero_jax.serve.sessions import Conversations, SessionStore
    from hetero_jax.serve.worker import ClientGone

    model = hetero_jax.load(tiny_checkpoint("llama")[1])
    greedy, msgs = Sampling(None, 0.0, 1.0, 0, ()), (("user", "the quick brown fox"),)
    store = SessionStore(max_sessions=4)
    conv = Conversations(model, store)
    first = conv.answer(msgs, FullKV(), greedy, "u", max_tokens=4)
    (held,) = store._held.values()
    before = kv_bytes(held.session.engine.cache)
    assert store.totals()["kv_bytes_device"] == before

    def leave(_):
        raise ClientGone("the client disconnected")

    follow = msgs + (("assistant", model.tokenizer.decode(first.token_ids)), ("user", "and then?"))
    with pytest.raises(ClientGone):
        conv.answer(follow, FullKV(), greedy, "u", max_tokens=400, on_token=leave)
    (held,) = store._held.values()
    assert kv_bytes(held.session.engine.cache) == before == store.totals()["kv_bytes_device"]
    again = conv.answer(follow, FullKV(), greedy, "u", max_tokens=4)
    fresh = Conversations(model, SessionStore(4))
    fresh.answer(msgs, FullKV(), greedy, "u", max_tokens=4)
    assert again.resumed and again.token_ids == fresh.answer(follow, FullKV(), greedy, "u", max_tokens=4).token_ids


def test_a_request_the_template_refuses_leaves_the_held_conversation(tiny_checkpoint):
    """Two user messages in a row under a template that requires alternating roles: the request is refused and
    the conversation it would have extended stays held (it was taken out of the store and dropped)."""
    import dataclasses

    import hetero_jax
    from hetero_jax.errors import PromptError
    from hetero_jax.io.tokenizer import Tokenizer
    from hetero_jax.policies import FullKV
    from hetero_jax.serve.schema import Sampling
    from hetero_jax.serve.sessions import Conversations, SessionStore

    model = hetero_jax.load(tiny_checkpoint("llama")[1])
    alternating = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
                   "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}"
                   "{% endif %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                   "{% if add_generation_prompt %}<assistant>{% endif %}")
    tok = model.tokenizer
    model = dataclasses.replace(model, tokenizer=Tokenizer(tok.backend, tokenizer_config=tok.tokenizer_config,
                                                           chat_template=alternating,
                                                           extra_eos_token_ids=tok.eos_token_ids))
    greedy, msgs = Sampling(None, 0.0, 1.0, 0, ()), (("user", "the quick brown fox"),)
    store = SessionStore(max_sessions=4)
    conv = Conversations(model, store)
    first = conv.answer(msgs, FullKV(), greedy, "u", max_tokens=4)
    msgs += (("assistant", model.tokenizer.decode(first.token_ids)),)
    with pytest.raises(PromptError, match="roles must alternate"):
        conv.answer(msgs + (("user", "q2"), ("user", "q3")), FullKV(), greedy, "u", max_tokens=4)
    assert store.totals()["sessions"] == 1
    assert conv.answer(msgs + (("user", "q2"),), FullKV(), greedy, "u", max_tokens=4).resumed


def test_a_prompt_too_short_for_the_servers_budget_is_served_at_the_least_that_fits(tiny_checkpoint):
    """A short chat ('Hi') under `serve --policy freekv` was a 400: every prompt shorter than the method's least
    layout was refused. With the server's own policy the budget rises to the smallest that fits the prompt
    (hand-computed: SnapKV needs its window), or full KV when none does (FreeKV: sinks + window + one page
    exceed the prompt); a request's own budget is still refused; the conversation resumes under the server's
    policy; /metrics counts both ways."""
    from starlette.testclient import TestClient

    import hetero_jax
    from hetero_jax.policies import BudgetError, FreeKV, FullKV, Quest, SnapKV, PolicyError, smallest_rho
    from hetero_jax.serve import ServeConfig, create_app
    from hetero_jax.serve.schema import Sampling
    from hetero_jax.serve.sessions import Conversations, SessionStore

    model = hetero_jax.load(tiny_checkpoint("llama")[1])
    greedy, msgs = Sampling(None, 0.0, 1.0, 0, ()), (("user", "the quick brown fox"),)
    ids = model.tokenizer.encode(Conversations(model, SessionStore(1)).render(msgs), add_special_tokens=False)
    L = len(ids) - 1  # the context the new conversation prefills (its last token is the first step's)
    assert 8 < L < 40
    snap = SnapKV(budget=0.05, window=8)
    with pytest.raises(BudgetError, match="smallest budget that works"):
        Conversations(model, SessionStore(4)).answer(msgs, snap, greedy, "u", max_tokens=5)

    def answer(policy, **kw):
        return Conversations(model, SessionStore(4)).answer(msgs, policy, greedy, "u", max_tokens=5, **kw)

    raised = answer(snap, fit_short=True)
    want = answer(SnapKV(budget=smallest_rho(8, L), window=8))  # the window's 8 rows, by hand
    assert raised.short_prompt == "smallest_budget" and raised.token_ids == want.token_ids
    assert answer(SnapKV(budget=0.5, window=8), fit_short=True).short_prompt == ""  # fits: nothing to raise
    full = answer(FullKV())
    whole = answer(FreeKV(budget=0.5), fit_short=True)  # 4 sinks + 4-token window + a 32-token page > L
    assert whole.short_prompt == "full_kv" and whole.token_ids == full.token_ids
    with pytest.raises(PolicyError, match="full_layers"):  # the policy does not fit the model: not a short prompt
        answer(Quest(budget=0.5, full_layers=99), fit_short=True)

    conv = Conversations(model, SessionStore(4))
    first = conv.answer(msgs, snap, greedy, "u", max_tokens=5, fit_short=True)
    again = conv.answer(msgs + (("assistant", model.tokenizer.decode(first.token_ids)), ("user", "and?")), snap,
                        greedy, "u", max_tokens=5, fit_short=True)
    assert again.resumed  # held under the server's policy, not the raised one

    app = create_app(model, ServeConfig(model_id=MODEL, policy=FreeKV(budget=0.5), policy_name="freekv"))
    with TestClient(app) as client:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "the quick brown fox"}], "max_tokens": 5,
                "temperature": 0}
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == model.tokenizer.decode(
            full.token_ids)
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": "the quick brown fox", "max_tokens": 3})
        assert r.status_code == 200
        r = client.post("/v1/chat/completions", json={**body, "budget": 0.5})  # the request's own: refused
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_budget"
        text = client.get("/metrics").text
    assert 'hetero_jax_short_prompt_requests_total{served="full_kv"} 2' in text
    assert 'hetero_jax_short_prompt_requests_total{served="smallest_budget"} 0' in text


# ------------------------------------------------------------------------------------------- review 90's defects
def test_the_engine_starts_with_its_first_job_and_refuses_jobs_once_stopped():
    """The worker's thread started only in the app's lifespan, which an app mounted in another never runs: every
    request waited forever. After stop() a job was queued behind the end and also waited forever."""
    from hetero_jax.serve.worker import EngineStopped, EngineWorker

    worker = EngineWorker(max_queue=2)
    assert worker.available and not worker.alive
    assert worker.submit(lambda job: "first").future.result(timeout=30) == "first"
    thread = worker._thread
    worker.start()  # the lifespan after a first job: the same thread
    assert worker._thread is thread and worker.alive
    worker.stop()
    assert not worker.available
    for call in (lambda: worker.submit(lambda job: "late"), worker.start):
        with pytest.raises(EngineStopped, match="the engine worker was stopped"):
            call()


def test_a_request_to_an_app_mounted_in_another_is_answered(monkeypatch):
    """Starlette's Mount runs no sub-app lifespan; a chat request to the mounted app hung (no error, no timeout)."""
    import threading
    from types import SimpleNamespace

    from starlette.applications import Starlette
    from starlette.routing import Mount
    from starlette.testclient import TestClient

    from hetero_jax.errors import PromptError
    from hetero_jax.serve import ServeConfig, create_app

    model = SimpleNamespace(tokenizer=None, config=SimpleNamespace(max_position_embeddings=8192))
    app = create_app(model, ServeConfig(model_id=MODEL))

    def refused_on_the_engine(job):
        raise PromptError("the engine ran this job")
    monkeypatch.setattr(app.state.server, "chat_job", lambda req, policy: lambda emit: refused_on_the_engine)
    got = {}
    with TestClient(Starlette(routes=[Mount("/llm", app=app)]), raise_server_exceptions=False) as client:
        assert client.get("/llm/health").status_code == 200
        asking = threading.Thread(target=lambda: got.update(r=client.post("/llm/v1/chat/completions",
                                                                          json=_chat(max_tokens=2))), daemon=True)
        asking.start()
        asking.join(60)
    assert not asking.is_alive(), "the request to the mounted app never answered"
    assert got["r"].status_code == 400 and "the engine ran this job" in got["r"].json()["error"]["message"]
    app.state.server.worker.stop()
    r = TestClient(app, raise_server_exceptions=False).post("/v1/chat/completions", json=_chat(max_tokens=2))
    assert (r.status_code, r.json()["error"]["code"]) == (503, "engine_stopped")


def test_a_request_without_a_seed_draws_its_own():
    """An absent seed was seed 0: every sampled answer to the same messages was the same (OpenAI: a fresh draw)."""
    seeds = {schema.parse_chat(_chat()).sampling.seed for _ in range(4)}
    seeds |= {schema.parse_completion({"model": MODEL, "prompt": "hi"}).sampling.seed for _ in range(4)}
    assert len(seeds) == 8 and all(0 <= s < 2**63 for s in seeds)
    assert schema.parse_chat(_chat(seed=5)).sampling.seed == 5


def test_held_conversations_are_keyed_by_what_tells_policies_apart():
    """HCAttention leaves its codebook keys out of its repr, and conversations were keyed by repr(policy): a
    request under the shipped g=32 codebook resumed one prefilled under the g=16 one."""
    from hetero_jax.policies import HCAttention, make_policy
    from hetero_jax.policies.hcattention.codebook import SHIPPED_CODEBOOKS
    from hetero_jax.profile.shipped import shipped_data_path

    g16, g32 = (HCAttention(budget=0.1, codebook=shipped_data_path({MODEL: f}, MODEL))
                for f in SHIPPED_CODEBOOKS[MODEL])
    assert repr(g16) == repr(g32) and g16 != g32
    msgs = [("user", "q")]
    assert digests(("u", g16), msgs) != digests(("u", g32), msgs)
    same = HCAttention(budget=0.1, codebook=shipped_data_path({MODEL: SHIPPED_CODEBOOKS[MODEL][0]}, MODEL))
    assert digests(("u", g16), msgs) == digests(("u", same), msgs)
    assert digests(("u", make_policy("quest", 0.3)), msgs) == digests(("u", make_policy("quest", 0.3)), msgs)
    assert digests(("u", make_policy("quest", 0.3)), msgs) != digests(("v", make_policy("quest", 0.3)), msgs)


def test_refused_requests_are_answered_without_waiting_for_the_engine(tiny_checkpoint):
    """A conversation longer than the context (or a stop string that can never match) was checked on the engine
    thread: behind a busy engine it waited for the whole queue to get its 400, holding a --max-queue place."""
    import threading

    from starlette.testclient import TestClient

    import hetero_jax
    from hetero_jax.serve import ServeConfig, create_app

    model = hetero_jax.load(tiny_checkpoint("llama")[1])
    app = create_app(model, ServeConfig(model_id=MODEL, max_queue=1))
    release = threading.Event()
    timer = threading.Timer(60, release.set)  # the old code answers only once the engine is free
    with TestClient(app, raise_server_exceptions=False) as client:
        worker = app.state.server.worker
        worker.submit(lambda job: release.wait(120))
        while not worker.running:
            threading.Event().wait(0.01)
        timer.start()
        try:
            long = "word " * model.config.max_position_embeddings
            for path, body, code in (
                    ("/v1/chat/completions", {"messages": [{"role": "user", "content": long}]},
                     "context_length_exceeded"),
                    ("/v1/completions", {"prompt": long}, "context_length_exceeded"),
                    ("/v1/completions", {"prompt": "hi", "stop": ["<|im_end|>x"]}, "PromptError")):
                r = client.post(path, json={"model": MODEL, **body})
                assert not release.is_set(), f"{path} {code}: answered only once the engine was free"
                assert (r.status_code, r.json()["error"]["code"]) == (400, code), r.text[:300]
                assert worker.depth == 0
        finally:
            release.set()
            timer.cancel()


def test_serve_config_takes_a_policy_spec_and_a_full_kv_server_refuses_a_budget_in_the_requests_words():
    """ServeConfig(policy="freekv") crashed create_app with AttributeError 'str' object has no attribute 'bind';
    a budget alone sent to a full-KV server was told to "drop --budget on the command line" (review 94)."""
    from types import SimpleNamespace

    from hetero_jax.policies import Quest
    from hetero_jax.serve import ServeConfig
    from hetero_jax.serve.app import Server

    c = ServeConfig(model_id=MODEL, policy="quest:offload=true,page_size=8")
    assert c.policy == Quest(offload=True, page_size=8) and c.policy_name == "quest"
    with pytest.raises(ConfigError, match="ServeConfig.policy must be a policy .* got int"):
        ServeConfig(model_id=MODEL, policy=3)
    model = SimpleNamespace(tokenizer=None, config=SimpleNamespace(max_position_embeddings=8192))
    with pytest.raises(RequestError) as e:
        Server(model, ServeConfig(model_id=MODEL)).policy_for(None, 0.3)
    assert (e.value.param, e.value.code) == ("budget", "invalid_budget")
    assert 'keeps the whole prompt (full KV), which has no budget: send "policy" with "budget"' in str(e.value)
    assert "command line" not in str(e.value)
