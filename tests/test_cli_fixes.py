"""hetero-jax generate end to end (review of the CLI): a top_p float32 holds as 0, prompt and turns files read as
the shell passes text, an empty --turns, policy names as make_policy spells them, a closed stdout, the stats
line of a session turn and --max-new-tokens 0."""

import io
import subprocess
import sys
import textwrap
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hetero_jax
from hetero_jax import cli
from hetero_jax.cli import main
from hetero_jax.runtime import GenerationStats, sample


# ------------------------------------------------------------------ 1: a top_p that float32 holds as 0
@pytest.mark.parametrize("top_p", [0.0, 1e-46, 1e-39])
def test_a_top_p_too_small_for_float32_keeps_only_the_top_token(top_p):
    """float32(1e-46) is 0 (1e-39 a subnormal XLA may flush): no prefix was "below" it, n_keep was 0 and the
    cut at index -1 was the smallest logit, so nothing was masked and the whole distribution was sampled."""
    assert np.float32(1e-46) == 0.0
    logits = np.random.default_rng(0).normal(size=(2, 64)).astype(np.float32)
    want = logits.argmax(-1).tolist()
    step = jax.jit(lambda lg, key, t, p: sample(lg, key, t, p, mode="nucleus"))  # operands, as a decode step's
    for s in range(40):
        key = jax.random.PRNGKey(s)
        assert np.asarray(sample(jnp.asarray(logits), key, 1.0, top_p)).tolist() == want
        assert np.asarray(step(jnp.asarray(logits), key, jnp.float32(1.0), jnp.float32(top_p))).tolist() == want


# ------------------------------------------------------------------ stubs: no model is loaded or run
class Stopped(Exception):
    pass


@pytest.fixture
def seen(monkeypatch):
    """Stub the model load and the run: records what generate or the Session was handed."""
    from hetero_jax.runtime import session

    got = {}
    monkeypatch.setattr(hetero_jax, "load", lambda *a, **k: "MODEL")
    monkeypatch.setattr(cli, "enable_compilation_cache", lambda: False)

    def generate(model, prompt, policy, **kw):
        got["prompt"] = prompt
        return types.SimpleNamespace(text="ANSWER", stats=types.SimpleNamespace(summary=lambda: "STATS"))

    class FakeSession:
        def __init__(self, model, context, policy, **kw):
            got["context"] = context

        def ask(self, q, **kw):
            got.setdefault("questions", []).append(q)
            return types.SimpleNamespace(text="A", stats=types.SimpleNamespace(summary=lambda: "S"))
    monkeypatch.setattr(hetero_jax, "generate", generate)
    monkeypatch.setattr(session, "Session", FakeSession)
    monkeypatch.setattr(session, "check_turns_fit", lambda *a, **k: None)
    return got


@pytest.fixture
def no_load(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("model loaded for input that should have been refused")
    monkeypatch.setattr(hetero_jax, "load", boom)


def _stdin(monkeypatch, data: bytes):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))


# ------------------------------------------------------------------ 2 + 3: a file and stdin give $(cat FILE)
@pytest.mark.parametrize("data, want", [
    (b"What is it?\n", "What is it?"),  # echo's or an editor's final newline
    (b"What is it?", "What is it?"),
    (b"What is it?\n\n\n", "What is it?"),  # $(...) drops every final line break
    (b"What is it?\r\nIn one word.\r\n", "What is it?\nIn one word."),  # CRLF as LF, from a file and stdin alike
    (b"\xef\xbb\xbfWhat is it?\r\n", "What is it?"),  # a leading BOM dropped
    (b"  one\r\n\r\n\ttwo  \n", "  one\n\n\ttwo  "),  # inner text kept: blank lines, spaces, tabs
    (b"a \xef\xbb\xbf b\n", "a \ufeff b"),  # a BOM inside the text is text
])
@pytest.mark.parametrize("source", ["file", "stdin"])
def test_a_prompt_file_and_stdin_pass_the_text_as_the_shell_does(tmp_path, monkeypatch, capsys, seen, data, want,
                                                                 source):
    f = tmp_path / "q.txt"
    f.write_bytes(data)
    if source == "stdin":
        _stdin(monkeypatch, data)
    assert main(["generate", "--prompt-file", "-" if source == "stdin" else str(f), "--no-stream"]) == 0
    assert seen["prompt"] == want
    if b"\r" not in data and b"\xef\xbb\xbf" not in data:  # the shell itself as the reference
        shell = subprocess.run(["bash", "-c", 'printf %s "$(cat "$1")"', "_", str(f)], capture_output=True,
                               check=True).stdout.decode()
        assert seen["prompt"] == shell


def test_a_turns_context_from_a_file_and_its_questions(tmp_path, monkeypatch, capsys, seen):
    """The context's final newline went into the first user message; the questions were split by
    str.splitlines (U+2028, form feeds ... broke a question in two) and a BOM stayed on the first."""
    ctx, turns = tmp_path / "ctx.txt", tmp_path / "turns.txt"
    ctx.write_bytes(b"\xef\xbb\xbfAlice owns a red bicycle.\r\n\r\nBob owns a car.\r\n")
    turns.write_bytes("\ufeffWho owns a car?\r\n\r\n  Which\u2028colour\x0cis it?  \r\nWhat\x85else?\n".encode())
    assert main(["generate", "--prompt-file", str(ctx), "--turns", str(turns)]) == 0
    assert seen["context"] == "Alice owns a red bicycle.\n\nBob owns a car."
    assert seen["questions"] == ["Who owns a car?", "Which\u2028colour\x0cis it?", "What\x85else?"]


def test_turns_dash_reads_the_questions_from_stdin(monkeypatch, capsys, seen):
    _stdin(monkeypatch, b"first?\r\nsecond?\n")
    assert main(["generate", "--prompt", "the context", "--turns", "-"]) == 0
    assert seen["context"] == "the context" and seen["questions"] == ["first?", "second?"]


def test_help_says_a_files_final_line_break_is_dropped_and_turns_take_stdin(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "its final line break(s) and a leading BOM are dropped" in text
    assert "('-' for stdin, when the prompt is not read from it)" in text


def _refused(capsys, argv, message):
    assert main(argv) == 2
    assert capsys.readouterr().err == f"error: {message}\n"


def test_turns_and_prompt_file_both_from_stdin_is_refused(monkeypatch, capsys, no_load):
    _stdin(monkeypatch, b"text\n")
    _refused(capsys, ["generate", "--prompt-file", "-", "--turns", "-"],
             "--turns - and --prompt-file - both read stdin; give the questions or the prompt as a file")


def test_turns_from_stdin_that_holds_no_question(monkeypatch, capsys, no_load):
    _stdin(monkeypatch, b"\r\n  \n")
    _refused(capsys, ["generate", "--prompt", "hi", "--turns", "-"], "stdin holds no questions (one per line)")


# ------------------------------------------------------------------ 4: --turns "" (an unset shell variable)
def test_an_empty_turns_path_is_refused(capsys, no_load):
    _refused(capsys, ["generate", "--prompt", "hi", "--turns", ""],
             "turns file not found: '' (--turns takes a UTF-8 text file)")


def test_an_empty_prompt_file_path_is_refused(capsys, no_load):
    _refused(capsys, ["generate", "--prompt-file", ""], "prompt file not found: '' (--prompt-file takes a UTF-8 "
             "text file)")


# ------------------------------------------------------------------ 5: policy names as make_policy spells them
@pytest.mark.parametrize("name", ["Hetero-Cache", "hetero_cache", "HETEROCACHE"])
def test_heterocache_flags_reach_a_heterocache_spelled_as_make_policy_takes_it(monkeypatch, capsys, name):
    from hetero_jax import policies
    from hetero_jax.policies import HeteroCache

    built = []
    make = policies.make_policy
    monkeypatch.setattr(policies, "make_policy", lambda *a, **k: built.append(make(*a, **k)) or built[-1])

    def stop(*a, **k):
        raise Stopped
    monkeypatch.setattr(hetero_jax, "load", stop)
    with pytest.raises(Stopped):
        main(["generate", "--policy", name, "--budget", "0.5", "--window", "3", "--select-window", "2",
              "--prompt", "hi"])
    assert isinstance(built[0], HeteroCache) and (built[0].window, built[0].select_window) == (3, 2)
    assert capsys.readouterr().err == ""


def test_a_flag_for_another_policy_names_the_policy_by_its_key(capsys, no_load):
    _refused(capsys, ["generate", "--policy", "Snap_KV", "--window", "3", "--prompt", "hi"],
             "--window applies to --policy heterocache; give --policy snapkv's options as --option KEY=VALUE "
             "(hetero-jax generate --policy list names them)")


# ------------------------------------------------------------------ 6: stdout closed by its reader
class ClosedAfter(io.StringIO):
    """A stdout whose reader goes away after ``n`` writes."""

    def __init__(self, n):
        super().__init__()
        self.n, self.writes = n, 0

    def write(self, s):
        self.writes += bool(s)  # print(..., end="") also writes the empty end
        if self.writes > self.n:
            raise BrokenPipeError(32, "Broken pipe")
        return super().write(s)

    def fileno(self):
        raise io.UnsupportedOperation("fileno")


def test_a_closed_stdout_stops_the_answer_at_the_failed_write(tiny_checkpoint, monkeypatch, capsys):
    """`generate ... | head -c 20` printed a 20-line traceback and exit 1, after decoding until the write failed."""
    _, ours = tiny_checkpoint("llama")
    steps = []
    from hetero_jax.runtime import engine

    for name in ("step", "dispatch"):  # generate pipelines its steps (dispatch); a session steps
        real = getattr(engine.Engine, name)
        monkeypatch.setattr(engine.Engine, name, lambda self, *a, _real=real, **k: steps.append(1) or _real(
            self, *a, **k))
    out = ClosedAfter(2)
    monkeypatch.setattr(sys, "stdout", out)
    assert main(["generate", "--model", ours, "--prompt", "the quick brown fox", "--max-new-tokens", "40",
                 "--no-chat"]) == cli.STDOUT_CLOSED == 141
    assert out.writes == 3  # two tokens written, the third write failed and nothing was written after it
    assert len(steps) < 10  # the decode stopped there (a pipelined step or so in flight), not at 40 tokens
    assert capsys.readouterr().err == ""


def test_a_closed_stdout_exits_141_without_a_traceback():
    """The console script, its stdout a pipe the reader closes: no traceback, no 'Exception ignored' at exit."""
    code = textwrap.dedent("""
        import sys
        import hetero_jax
        from hetero_jax import cli

        hetero_jax.load = lambda *a, **k: "MODEL"
        cli.enable_compilation_cache = lambda: False

        def generate(model, prompt, policy, on_token=None, **kw):
            for i in range(10**6):
                on_token("token ")
            raise AssertionError("the closed stdout went unnoticed")
        hetero_jax.generate = generate
        sys.argv = ["hetero-jax", "generate", "--prompt", "hi"]
        cli.console_main()
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert p.stdout.read(20) == b"token token token to"
        p.stdout.close()
        err = p.stderr.read().decode()
        assert p.wait(timeout=120) == 141, err
    finally:
        if p.poll() is None:
            p.kill()
    assert "Traceback" not in err and "Exception ignored" not in err and "Broken pipe" not in err, err


# ------------------------------------------------------------------ 7: the stats line of a session turn
def _stats(**kw):
    return GenerationStats(prompt_tokens=111, generated_tokens=6, prefill_seconds=0.5, decode_seconds=[0.032],
                           kv_bytes_device=0, kv_bytes_used=0, kv_bytes_host=0, kv_bytes_host_by_role={},
                           kv_bytes_index=0, kv_bytes_read_per_step=0, kv_bytes_prompt=0, kv_bytes_tail=0,
                           stop_reason="eos", extend_seconds=0.274, **kw)


def test_a_session_turns_stats_line_gives_the_context_once_and_the_turns_own_work():
    """Every turn said 'prompt 111 tok, prefill 0.50 s (222 tok/s)': the context's, done once before turn 1;
    the turn's own tokens and extend time were not printed."""
    head = " | generated 6 tok, decode 32.0 ms/tok | KV device"
    assert _stats().summary().startswith("prompt 111 tok, prefill 0.50 s (222 tok/s)" + head)  # generate
    assert _stats(turn=1, turn_tokens=14).summary().startswith(
        "context 111 tok, prefill 0.50 s (222 tok/s) | turn 1: 14 tok, extend 0.27 s" + head)
    assert _stats(turn=2, turn_tokens=9).summary().startswith(
        "context 111 tok (prefilled once, before turn 1) | turn 2: 9 tok, extend 0.27 s" + head)


# ------------------------------------------------------------------ 8: --max-new-tokens below 1
@pytest.mark.parametrize("n", ["0", "-3"])
def test_max_new_tokens_below_one_is_refused_before_loading(capsys, no_load, n):
    _refused(capsys, ["generate", "--prompt", "hi", "--max-new-tokens", n],
             f"--max-new-tokens must be >= 1 (the answer's length limit in tokens), got {n}")


def test_a_boolean_option_message_says_the_command_line_words():
    from hetero_jax.policies import PolicyError, make_policy

    with pytest.raises(PolicyError) as e:
        make_policy("quest", 0.3, offload=1)
    assert "offload must be True or False, got 1 (on the command line: offload=true or offload=false)" in str(e.value)


def test_an_empty_profile_path_is_visible_in_the_message():
    from hetero_jax.profile import ProfileError, load_profile

    with pytest.raises(ProfileError, match="profile file not found: '';"):
        load_profile("")


@pytest.mark.parametrize("argv, usage", [(["generate", "--promt", "hi"], "usage: hetero-jax generate"),
                                         (["models", "--x"], "usage: hetero-jax models"),
                                         (["--bogus"], "usage: hetero-jax [-h] COMMAND")])
def test_a_mistyped_flag_shows_its_commands_usage(argv, usage, capsys, no_load):
    """A mistyped generate flag printed the top-level usage (the list of commands), not generate's (review 94)."""
    from hetero_jax.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(usage) and f"unrecognized arguments: {' '.join(argv[1:] or argv)}" \
        in err
