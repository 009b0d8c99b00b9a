"""generate(): batching, stopping, sampling and bad input, on a tiny converted checkpoint."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import hetero_jax
from hetero_jax.model import transformer as M
from hetero_jax.errors import PromptError
from hetero_jax.runtime import prefill, sample
from tiny_model import TinyTokenizer, random_prompts, tiny_model


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    return hetero_jax.load(tiny_checkpoint("llama")[1])


@pytest.fixture(scope="module")
def tiny_qwen2(tiny_checkpoint):
    return hetero_jax.load(tiny_checkpoint("qwen2")[1])


def _prompts(rng, n, vocab, lo=3, hi=60):
    return [rng.integers(3, vocab, size=int(rng.integers(lo, hi))).tolist() for _ in range(n)]


@pytest.mark.parametrize("which", ["tiny", "tiny_qwen2"])
def test_batch_equals_one_by_one_logits(which, request):
    bundle = request.getfixturevalue(which)
    cfg = bundle.config
    rng = np.random.default_rng(0)
    prompts = _prompts(rng, 3, cfg.vocab_size)
    lb, cb = prefill(bundle.params, cfg, prompts, tail_capacity=8)
    toks = np.asarray(jnp.argmax(lb, -1))
    steps_b = [np.asarray(lb)]
    for _ in range(5):
        lg, cb = M.decode_step_jit(bundle.params, cb, jnp.asarray(toks, jnp.int32), cfg)
        steps_b.append(np.asarray(lg))
        toks = np.asarray(jnp.argmax(lg, -1))
    for i, p in enumerate(prompts):
        l1, c1 = prefill(bundle.params, cfg, [p], tail_capacity=8)
        tok = np.asarray(jnp.argmax(l1, -1))
        np.testing.assert_allclose(np.asarray(l1[0]), steps_b[0][i], atol=1e-5, rtol=0)
        for s in range(5):
            lg, c1 = M.decode_step_jit(bundle.params, c1, jnp.asarray(tok, jnp.int32), cfg)
            np.testing.assert_allclose(np.asarray(lg[0]), steps_b[s + 1][i], atol=1e-5, rtol=0)
            tok = np.asarray(jnp.argmax(lg, -1))


def test_engine_step_with_logits_matches_decode_step_and_step(tiny):
    from hetero_jax.runtime import Engine
    from hetero_jax.policies import FullKV

    cfg = tiny.config
    p = _prompts(np.random.default_rng(5), 1, cfg.vocab_size)[0]
    lref, cref = prefill(tiny.params, cfg, [p], tail_capacity=16)
    eng = Engine(tiny, [p], FullKV(), tail_capacity=16)
    other = Engine(tiny, [p], FullKV(), tail_capacity=16)
    tok = np.asarray(jnp.argmax(lref, -1))
    assert int(eng.first_tokens(0.0, 1.0)[0]) == int(other.first_tokens(0.0, 1.0)[0]) == int(tok[0])
    for _ in range(4):
        want, cref = M.decode_step_jit(tiny.params, cref, jnp.asarray(tok, jnp.int32), cfg)
        nxt, logits = eng.step_with_logits(tok)
        assert logits.shape == (1, cfg.vocab_size) and logits.dtype == np.float32
        np.testing.assert_allclose(logits, np.asarray(want), atol=1e-5, rtol=0)
        assert int(nxt[0]) == int(np.argmax(want[0]))  # greedy by default
        assert int(other.step(tok, 0.0, 1.0)[0][0]) == int(nxt[0])  # same step, same token
        tok = nxt
    assert eng.steps == other.steps == 4


@pytest.mark.parametrize("temperature, top_p", [(1.5, 1.0), (0.8, 0.9)])
def test_sampled_steps_follow_the_seeds_key_stream(tiny, temperature, top_p):
    """The engine splits its key inside the decode step; the tokens are those of the host-side stream: key =
    PRNGKey(seed), then ``key, sub = jax.random.split(key)`` before every token, ``sub`` sampling it."""
    from hetero_jax.runtime import Engine
    from hetero_jax.policies import FullKV

    cfg = tiny.config
    p = _prompts(np.random.default_rng(11), 1, cfg.vocab_size)[0]
    lref, cref = prefill(tiny.params, cfg, [p], tail_capacity=16)
    eng = Engine(tiny, [p], FullKV(), tail_capacity=16, seed=4)
    key = jax.random.PRNGKey(4)
    key, sub = jax.random.split(key)
    tok = np.asarray(sample(lref, sub, temperature, top_p))
    assert eng.first_tokens(temperature, top_p).tolist() == tok.tolist()
    drawn = []
    for _ in range(6):
        logits, cref = M.decode_step_jit(tiny.params, cref, jnp.asarray(tok, jnp.int32), cfg)
        key, sub = jax.random.split(key)
        want = np.asarray(sample(logits, sub, temperature, top_p))
        got, _ = eng.step(tok, temperature, top_p)
        assert got.tolist() == want.tolist()
        drawn.append(int(got[0]))
        tok = got
    assert len(set(drawn)) > 1  # sampled, not one repeated greedy token


def test_no_policy_means_full_kv_at_the_front_doors_and_is_refused_below(tiny):
    """``hetero_jax.generate`` / ``hetero_jax.Session`` fill ``policy=None`` with ``FullKV()``; the runtime, below
    policies/, runs the policy object it is given and refuses None (with the fix) before any compute."""
    from hetero_jax import runtime
    from hetero_jax.policies import FullKV

    p = _prompts(np.random.default_rng(7), 1, tiny.config.vocab_size)[0]
    default = hetero_jax.generate(tiny, p, max_new_tokens=4, chat=False)
    full = runtime.generate(tiny, p, FullKV(), max_new_tokens=4, chat=False)
    assert default.token_ids == full.token_ids and default.stats.policy == full.stats.policy == "FullKV(budget=1.0)"
    assert hetero_jax.Session(tiny, p, chat=False, reserve_tokens=8).engine.policy == FullKV()
    for call in (lambda: runtime.generate(tiny, p, None, chat=False), lambda: runtime.Session(tiny, p, chat=False)):
        with pytest.raises(PromptError, match=r"policy is None: .* pass hetero_jax.policies.FullKV\(\)"):
            call()


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), n=st.integers(2, 3))
def test_generate_batch_equals_one_by_one_tokens(tiny, seed, n):
    rng = np.random.default_rng(seed)
    prompts = _prompts(rng, n, tiny.config.vocab_size, hi=40)
    batch = hetero_jax.generate(tiny, prompts, max_new_tokens=6, chat=False)
    assert isinstance(batch, list) and len(batch) == n
    for p, b in zip(prompts, batch):
        assert b.token_ids == hetero_jax.generate(tiny, p, max_new_tokens=6, chat=False).token_ids


def test_prompt_forms_and_result(tiny):
    text = "the quick brown fox"
    r = hetero_jax.generate(tiny, text, max_new_tokens=5, chat=False)
    ids = tiny.tokenizer.encode_prompt(text, chat=False)
    r_ids = hetero_jax.generate(tiny, ids, max_new_tokens=5, chat=False)
    assert r.token_ids == r_ids.token_ids
    assert r.text == tiny.tokenizer.decode(r.token_ids)
    st_ = r.stats
    assert st_.prompt_tokens == len(ids) and st_.generated_tokens == len(r.token_ids)
    assert st_.prefill_seconds > 0 and len(st_.decode_seconds) == max(len(r.token_ids) - 1, 0)
    assert st_.kv_bytes_device == st_.kv_bytes_prompt + st_.kv_bytes_tail > 0
    assert st_.kv_bytes_host == 0
    # chat prompt goes through the checkpoint's template
    rc = hetero_jax.generate(tiny, text, max_new_tokens=3, chat=True)
    assert rc.stats.prompt_tokens == len(tiny.tokenizer.encode_prompt(text, chat=True)) > len(ids)


def test_max_new_tokens_and_streaming(tiny):
    pieces = []
    r = hetero_jax.generate(tiny, [5, 6, 7, 8], max_new_tokens=7, chat=False, on_token=pieces.append)
    assert "".join(pieces) == r.text
    # EOS is not a token of the answer: 7 tokens exactly when the budget stopped it, fewer at EOS
    assert r.stats.stop_reason in ("max_new_tokens", "eos")
    assert (len(r.token_ids) == 7) == (r.stats.stop_reason == "max_new_tokens") and len(r.token_ids) <= 7
    r0 = hetero_jax.generate(tiny, [5, 6, 7, 8], max_new_tokens=0, chat=False)
    assert r0.token_ids == [] and r0.text == ""


def test_stop_string_truncates(tiny):
    r = hetero_jax.generate(tiny, [5, 6, 7, 8, 9], max_new_tokens=12, chat=False)
    if len(r.text) < 3:
        pytest.skip("the random model produced too little text to cut")
    stop = r.text[1:3]
    rs = hetero_jax.generate(tiny, [5, 6, 7, 8, 9], max_new_tokens=12, chat=False, stop=[stop])
    assert rs.stats.stop_reason == "stop"
    assert rs.text == r.text[: r.text.find(stop)]


def test_sampling_is_seeded_and_top_p_tiny_is_greedy(tiny):
    p = [5, 6, 7, 8, 9, 10]
    a = hetero_jax.generate(tiny, p, max_new_tokens=8, chat=False, temperature=1.5, seed=1)
    b = hetero_jax.generate(tiny, p, max_new_tokens=8, chat=False, temperature=1.5, seed=1)
    assert a.token_ids == b.token_ids
    greedy = hetero_jax.generate(tiny, p, max_new_tokens=8, chat=False)
    nucleus = hetero_jax.generate(tiny, p, max_new_tokens=8, chat=False, temperature=1.0, top_p=1e-6, seed=3)
    assert nucleus.token_ids == greedy.token_ids
    # a top_p the step's float32 operand holds as 0 kept no token, and the cut at index -1 masked nothing: the
    # whole distribution was sampled
    for seed in range(3):
        below = hetero_jax.generate(tiny, p, max_new_tokens=8, chat=False, temperature=1.0, top_p=1e-46, seed=seed)
        assert below.token_ids == greedy.token_ids


def test_every_temperature_and_top_p_share_their_modes_executable(tiny):
    """Temperature and top_p were static arguments of the decode step: each new value a server's client sent
    compiled an executable (3-10 s on a CPU, blocking every client) and kept it for the process's life. Now
    one executable per mode (greedy, sample, nucleus), and each step samples what the eager ``sample`` samples
    from its logits with its key (the independent path: Python floats, no executable)."""
    from hetero_jax.policies import FullKV
    from hetero_jax.runtime import Engine
    from hetero_jax.runtime.compile_cache import compile_seconds

    eng = Engine(tiny, [[5, 6, 7, 8, 9]], FullKV(), tail_capacity=16)
    token = eng.first_tokens(0.0, 1.0)
    settings_ = [(0.7, 1.0), (0.0, 1.0), (0.7, 0.9), (0.71, 1.0), (1.3, 1.0), (0.6, 0.8), (0.7, 0.9)]
    compiles = []
    for temperature, top_p in settings_:
        key = eng.key
        before = compile_seconds()
        token, logits = eng.step_with_logits(token, temperature, top_p)
        compiles.append(compile_seconds() > before)
        if temperature > 0:
            want = sample(jnp.asarray(logits), jax.random.split(key)[1], temperature, top_p)
            assert token.tolist() == np.asarray(want).tolist(), (temperature, top_p)
    assert sorted(mode for _, mode in eng._fns) == ["greedy", "nucleus", "sample"]
    assert not any(compiles[3:])  # the first three may find theirs compiled by an earlier test


def test_sample_top_p_keeps_the_nucleus():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]], jnp.float32))
    seen = {int(sample(logits, jax.random.PRNGKey(s), 1.0, 0.7)[0]) for s in range(200)}
    assert seen == {0, 1}  # 0.5 < 0.7 <= 0.5 + 0.3


@pytest.fixture
def no_compute(monkeypatch):
    """Fail if any model compute starts: bad prompts must be rejected before."""
    def boom(*a, **k):
        raise AssertionError("compute started for a prompt that should have been rejected")
    monkeypatch.setattr(M, "prefill", boom)


def test_prompt_longer_than_context_rejected_before_compute(tiny, no_compute):
    n = tiny.config.max_position_embeddings
    with pytest.raises(PromptError, match=rf"\b{n + 5} tokens but the model's context is {n}\b"):
        hetero_jax.generate(tiny, [5] * (n + 5), chat=False)
    with pytest.raises(PromptError, match="context"):
        hetero_jax.generate(tiny, [[5, 6], [5] * n], chat=False)


@pytest.mark.parametrize("prompt", ["", "   \n", [], [[]], [[1, 2], []]])
def test_empty_prompt_rejected(tiny, no_compute, prompt):
    with pytest.raises(PromptError, match="empty prompt"):
        hetero_jax.generate(tiny, prompt, chat=False)


@pytest.mark.parametrize("prompt, what", [("caf\udce9 au lait", "the prompt"),
                                          (["fine", "caf\udce9 au lait"], "prompt 1")])
def test_text_with_a_lone_surrogate_is_refused(tiny, no_compute, prompt, what):
    """A byte that was not UTF-8, as Python reads it with surrogateescape: the tokenizer cannot encode it. In a
    batch the refusal names the prompt (it did not)."""
    with pytest.raises(PromptError, match=re.escape(f"{what} is not valid text: character 3 is the lone "
                                                    "surrogate U+DCE9 (the byte 0xe9)")):
        hetero_jax.generate(tiny, prompt, chat=False)


def test_a_refused_text_of_a_batch_is_named(tiny, no_compute):
    with pytest.raises(PromptError, match="empty prompt: prompt 2's text has no content"):
        hetero_jax.generate(tiny, ["one", "two", "  "], chat=False)
    with pytest.raises(PromptError, match="empty prompt: the prompt's text has no content"):
        hetero_jax.generate(tiny, " ", chat=False)


def test_bad_arguments(tiny, no_compute):
    with pytest.raises(PromptError, match="outside the vocabulary"):
        hetero_jax.generate(tiny, [1, 2, tiny.config.vocab_size], chat=False)
    with pytest.raises(PromptError, match="top_p"):
        hetero_jax.generate(tiny, [1, 2], top_p=0.0, chat=False)
    with pytest.raises(PromptError, match="on_token"):
        hetero_jax.generate(tiny, [[1, 2], [3, 4]], on_token=print, chat=False)
    with pytest.raises(PromptError, match="unsupported prompt type"):
        hetero_jax.generate(tiny, 3.5, chat=False)


def test_compiled_releases_executables_before_the_mapping_limit(monkeypatch):
    """Each CPU executable maps code and data regions until every cache lets it go; ``compiled`` drops the
    caches before a compile once the process holds more than its mapping budget, so a process that meets
    many shapes stays bounded (without it this loop adds a few mappings per shape, without limit)."""
    from hetero_jax.runtime import compile_cache as G

    if G.mapping_count() is None:
        pytest.skip("no /proc/self/maps on this system")
    f = jax.jit(lambda x: jnp.sin(x) * 2.0 + jnp.cumsum(x))
    G.compiled(f, jnp.zeros(3))  # the first executable's one-off mappings
    base = G.mapping_count()
    budget = base + 150
    monkeypatch.setattr(G, "mapping_budget", lambda: budget)
    kept = G.compiled(f, jnp.zeros(2))  # held by the caller like an Engine holds its decode step
    peak = 0
    for n in range(4, 84):
        x = jnp.arange(n, dtype=jnp.float32)
        np.testing.assert_allclose(np.asarray(G.compiled(f, x)(x)), np.sin(np.arange(n)) * 2 + np.cumsum(np.arange(n)),
                                   rtol=1e-5, atol=1e-4)
        peak = max(peak, G.mapping_count())
    assert peak < budget + 100  # one compile's worth above the budget at most
    assert G.cached_executables() < 80  # released at least once
    y = jnp.ones(2)
    np.testing.assert_allclose(np.asarray(kept(y)), np.sin(1.0) * 2 + np.array([1.0, 2.0]), rtol=1e-6)


# ---------------------------------------------------------------- batch rows, streaming, sampling, sessions


@pytest.mark.parametrize("context, max_new, short_seed", [(320, 140, 3), (64, 100, 0)])
def test_batch_rows_keep_their_own_context_room(context, max_new, short_seed):
    """A short prompt batched with one near the end of the context answers as it does alone, stop reason included.
    (320, 140): the short answer outgrows one 128-token tail quantum, which the long prompt's room (10) fits in;
    (64, 100): the short prompt's own room (58) ends it, "context"."""
    model = tiny_model(context)
    long = random_prompts([context - 10], seed=1)[0]
    short = random_prompts([6], seed=short_seed)[0]
    alone = [hetero_jax.generate(model, p, max_new_tokens=max_new, chat=False) for p in (long, short)]
    assert [r.stats.stop_reason for r in alone] == ["context", "max_new_tokens" if max_new < context - 6 else "context"]
    assert [len(r.token_ids) for r in alone] == [10, min(max_new, context - 6)]
    batch = hetero_jax.generate(model, [long, short], max_new_tokens=max_new, chat=False)
    for b, a in zip(batch, alone):
        assert (b.token_ids, b.text, b.stats.stop_reason) == (a.token_ids, a.text, a.stats.stop_reason)


class SplitCharTokenizer(TinyTokenizer):
    """Every third token opens a 4-byte character whose last two bytes come with the next token, so a decode
    that stops between them ends in U+FFFD, as a byte-level tokenizer's does inside an emoji."""
    CHARS = "🦒🦑€漢"  # the last two are 3 bytes: split 2 + 1

    def decode(self, ids):
        out = b""
        for j, t in enumerate(ids):
            if j % 3 == 0:
                out += bytes([97 + t % 26])
            else:
                char = self.CHARS[(ids[j - 1] if j % 3 == 2 else t) % len(self.CHARS)].encode()
                out += char[:2] if j % 3 == 1 else char[2:]
        return out.decode("utf-8", errors="replace")


def test_streamed_chunks_join_to_the_text_across_split_characters():
    import dataclasses

    model = dataclasses.replace(tiny_model(512), tokenizer=SplitCharTokenizer())
    p = random_prompts([9], seed=3)[0]
    chunks = []
    r = hetero_jax.generate(model, p, max_new_tokens=14, chat=False, on_token=chunks.append)
    assert len(r.token_ids) >= 3 and r.text == SplitCharTokenizer().decode(r.token_ids)
    assert any(c in r.text for c in SplitCharTokenizer.CHARS)  # a character spanning two tokens was generated
    assert "".join(chunks) == r.text
    assert not any("\ufffd" in c for c in chunks[:-1])  # a split character is sent whole, once complete


def test_streamed_chunks_never_hold_a_stop_string():
    model = tiny_model(512)
    p = random_prompts([9], seed=5)[0]
    full = hetero_jax.generate(model, p, max_new_tokens=12, chat=False)
    assert len(full.token_ids) >= 6
    stop = full.text[full.text.index(" ", 6) - 2:][:5]  # spans a token boundary (TinyTokenizer joins with spaces)
    chunks = []
    r = hetero_jax.generate(model, p, max_new_tokens=12, chat=False, stop=stop, on_token=chunks.append)
    assert r.stats.stop_reason == "stop" and r.text == full.text[: full.text.index(stop)]
    assert "".join(chunks) == r.text


def test_answer_stream_holds_back_stop_prefixes_and_incomplete_characters():
    from hetero_jax.runtime.streaming import AnswerStream

    s = AnswerStream([" Paris", "<end>"])
    assert s.update("The capital is") == "The capital is"
    assert s.update("The capital is P") == ""  # " P" is held: it could still become " Paris"
    s = AnswerStream([" Paris"])
    assert [s.update(t) for t in ("A", "A P", "A Pa", "A Pb", "A Pb\ufffd", "A Pb🦒")] == ["A", "", "", " Pb", "", "🦒"]
    assert [s.update(t) for t in ("A Pb🦒 Par", "A Pb🦒 Paris x")] == ["", ""] and s.stopped and s.text == "A Pb🦒"
    s = AnswerStream([" Paris"])
    assert s.update("x Par") == "x" and s.flush() == " Par"  # EOS: what was held back is the answer's end
    s = AnswerStream(["cd", "b"])  # two stops appear in one token: the earlier cut wins
    assert s.update("abcd") == "a" and s.text == "a"


def test_sampled_batch_rows_draw_as_each_prompt_alone(tiny):
    prompts = _prompts(np.random.default_rng(8), 3, tiny.config.vocab_size, hi=20)
    kw = dict(max_new_tokens=8, chat=False, temperature=1.3, top_p=0.95, seed=2)
    batch = hetero_jax.generate(tiny, prompts + [prompts[1]], **kw)
    alone = [hetero_jax.generate(tiny, p, **kw) for p in prompts]
    assert [b.token_ids for b in batch] == [a.token_ids for a in alone] + [alone[1].token_ids]
    assert alone[1].token_ids != hetero_jax.generate(tiny, prompts[1], **{**kw, "temperature": 0.0}).token_ids


def test_each_session_turn_reports_its_own_compiles():
    from hetero_jax.runtime.compile_cache import compile_seconds

    model = tiny_model(333)  # a context no other test uses: its executables are compiled here
    context, question = random_prompts([40, 5], seed=2)
    t0 = compile_seconds()
    sess = hetero_jax.Session(model, context, chat=False, reserve_tokens=64)
    first = sess.ask(question, max_new_tokens=6)
    t1 = compile_seconds()
    second = sess.ask(question, max_new_tokens=6)
    t2 = compile_seconds()
    assert t1 - t0 > 0
    assert first.stats.compile_seconds == pytest.approx(t1 - t0, abs=1e-9)  # with the context's prefill
    # its own compiles only (few or none: the first turn compiled most shapes), not the session's total
    assert second.stats.compile_seconds == pytest.approx(t2 - t1, abs=1e-9)


@pytest.mark.parametrize("temperature", [1e-40, 1e-30, 1e-6])
def test_a_temperature_too_small_to_divide_by_is_greedy(tiny, temperature):
    logits = jnp.asarray([[1.0, 3.0, 2.0, -1.0]], jnp.float32)
    assert int(sample(logits, jax.random.PRNGKey(0), temperature, 1.0)[0]) == 1
    p = [5, 6, 7, 8, 9, 10]
    greedy = hetero_jax.generate(tiny, p, max_new_tokens=6, chat=False)
    assert hetero_jax.generate(tiny, p, max_new_tokens=6, chat=False, temperature=temperature,
                               seed=1).token_ids == greedy.token_ids


def test_the_top_level_functions_show_their_options():
    """help(hetero_jax.generate) showed (model, prompt, policy=None, **options), not the documented options."""
    import inspect

    from hetero_jax import runtime

    assert inspect.signature(hetero_jax.generate) == inspect.signature(runtime.generate)
    assert "max_new_tokens" in inspect.signature(hetero_jax.generate).parameters
    assert inspect.signature(hetero_jax.Session) == inspect.signature(runtime.Session)
    assert "reserve_tokens" in inspect.signature(hetero_jax.Session).parameters


def test_the_stats_line_of_an_answer_without_decode_steps_says_so():
    """`decode nan ms/tok` was printed when the answer took no decode step (max_new_tokens 0 or 1)."""
    from hetero_jax.runtime import GenerationStats

    stats = GenerationStats(prompt_tokens=5, generated_tokens=1, prefill_seconds=0.1, decode_seconds=[],
                            kv_bytes_device=0, kv_bytes_used=0, kv_bytes_host=0, kv_bytes_host_by_role={},
                            kv_bytes_index=0, kv_bytes_read_per_step=0, kv_bytes_prompt=0, kv_bytes_tail=0,
                            stop_reason="max_new_tokens")
    assert "decode no steps |" in stats.summary() and "nan" not in stats.summary()


def test_every_bit_of_a_64_bit_seed_changes_the_samples(tiny):
    """jax's PRNGKey keeps a seed's low 32 bits with x64 off: seed 2**32 sampled as seed 0. The key is the seed's
    two words (PRNGKey's own key below 2**32)."""
    from hetero_jax.runtime.engine import seed_key

    for s in (0, 5, 2**32 - 1):
        np.testing.assert_array_equal(np.asarray(seed_key(s)), np.asarray(jax.random.PRNGKey(s)))
    assert np.asarray(seed_key(2**32 + 5)).tolist() == [1, 5] and np.asarray(seed_key(-1)).tolist() == [2**32 - 1] * 2
    prompt = random_prompts([20], seed=3)[0]
    draw = {s: hetero_jax.generate(tiny, prompt, max_new_tokens=12, temperature=5.0, seed=s, chat=False).token_ids
            for s in (0, 2**32, -1, 2**63 - 1)}
    assert draw[0] != draw[2**32] and draw[-1] != draw[2**63 - 1]


def test_a_seed_samples_the_same_tokens_under_another_default_prng(tiny_checkpoint):
    """The key is threefry's raw [2] words; under JAX_DEFAULT_PRNG_IMPL=rbg (4-word keys, common on TPUs) every
    sampled answer failed with a jax TypeError after the prefill."""
    import json
    import os
    import subprocess
    import sys

    code = ("import sys, json, hetero_jax; m = hetero_jax.load(sys.argv[1]); print(json.dumps([hetero_jax.generate("
            "m, [5, 9, 14, 3, 7], max_new_tokens=8, temperature=t, top_p=p, seed=3, chat=False).token_ids "
            "for t, p in ((1.0, 1.0), (0.8, 0.9))]))")
    runs = {}
    for impl in ("threefry2x32", "rbg"):
        out = subprocess.run([sys.executable, "-c", code, tiny_checkpoint("llama")[1]], capture_output=True,
                             text=True, timeout=300, env={**os.environ, "JAX_DEFAULT_PRNG_IMPL": impl})
        assert out.returncode == 0, out.stderr[-2000:]
        runs[impl] = json.loads(out.stdout.strip().splitlines()[-1])
    assert runs["rbg"] == runs["threefry2x32"]


@pytest.mark.parametrize("policy", ["full", "quest-offload"])
def test_the_tail_grows_with_the_answer_and_the_tokens_are_those_of_a_whole_budget_tail(policy, monkeypatch):
    """generate sized the tail for max_new_tokens up front: a 7-token answer with max_new_tokens 8000 held
    356 MiB on SmolLM2 (7.5 MiB at 48). The tail starts at TAIL_START tokens and doubles while the answer runs:
    here TAIL_START 128 and a 300-token answer grows it twice (256, then 384 rows, the steps left), and the
    tokens and logits equal a run whose tail held the whole budget from the start."""
    from hetero_jax.policies import FullKV, Quest
    from hetero_jax.runtime import _generate, engine as E

    model = tiny_model(max_position_embeddings=1024)
    pol = FullKV() if policy == "full" else Quest(budget=0.5, page_size=8, full_layers=1, offload=True)
    prompt = random_prompts([64], seed=11)[0]
    eos_free = dataclasses.replace(model, config=dataclasses.replace(model.config, eos_token_ids=()))
    eos_free.tokenizer.eos_token_ids = ()
    whole = hetero_jax.generate(eos_free, prompt, pol, max_new_tokens=300, chat=False)
    sizes = []
    orig = E.resize_tail
    monkeypatch.setattr(E, "resize_tail", lambda c, n: (sizes.append(n), orig(c, n))[1])
    monkeypatch.setattr(_generate, "TAIL_START", 128)
    grown = hetero_jax.generate(eos_free, prompt, pol, max_new_tokens=300, chat=False)
    assert grown.token_ids == whole.token_ids and len(grown.token_ids) == 300
    assert sizes == [256, 384]


def test_an_answer_far_shorter_than_its_budget_holds_only_the_starting_tail():
    from hetero_jax.runtime.compile_cache import TAIL_START

    model = tiny_model(max_position_embeddings=2048)
    prompt = random_prompts([30], seed=12)[0]
    third = hetero_jax.generate(model, prompt, max_new_tokens=3, chat=False).token_ids[2]
    model.tokenizer.eos_token_ids = (third,)  # the answer ends at its third token
    big = hetero_jax.generate(model, prompt, max_new_tokens=1900, chat=False)
    ref = hetero_jax.generate(model, prompt, max_new_tokens=TAIL_START, chat=False)
    assert big.stats.stop_reason == "eos" and big.token_ids == ref.token_ids
    assert big.stats.kv_bytes_device == ref.stats.kv_bytes_device  # TAIL_START rows, not 1,900


@pytest.mark.parametrize("policy", ["full", "snapkv", "pyramidkv", "streamingllm", "heterocache", "quest", "synckv",
                                    "freekv"])
def test_nearby_prompt_lengths_share_the_decode_executable(policy):
    """Each new prompt length compiled the decode step again (a layer's exact prompt rows, the pool's rows and
    HeteroCache's K_base width were static: ~4 s a length on SmolLM2); lengths 100, 101 and 103 (one bucket of
    each) now share the step and HeteroCache's drift check. Quest's page summaries and page slots followed the
    page count (a compile per page of length); 101, 103 and 107 (25, 25 and 26 pages) now share its step.
    SyncKV's static set (a decode-step operand) and its anticipation's dynamic set were as wide as the prompt's
    split; 104, 108 and 111 tokens (13 and 14 static tokens) now share both. Prefill's writer of whole-prompt
    row blocks (``write_blocks``) was compiled per length too; the blocks are ``block_width`` rows now. FreeKV's
    prefill selection was compiled per length (its row block as wide as the most rows a head keeps); 101, 103 and
    107 tokens (their windows and page counts differ) share it now, and the decode step."""
    from hetero_jax.policies import FreeKV, HeteroCache, Quest, SyncKV, make_policy
    from hetero_jax.runtime import compile_cache
    from test_heterocache import MODEL, PROFILE  # a tiny profile with every role

    lengths = (100, 101, 103)
    if policy == "heterocache":
        pol = HeteroCache(profile=PROFILE, budget=0.5, window=2)
    elif policy == "quest":
        pol, lengths = Quest(budget=0.5, page_size=4), (101, 103, 107)
        assert len({pol.plan_pages(MODEL.config, n)[0] for n in lengths}) == 2  # the page count changes
    elif policy == "freekv":  # on a CPU the step recalls pages from the host store, an operand of the step
        pol, lengths = FreeKV(budget=0.8, page_size=4), (101, 103, 107)
        assert len({pol.plan_pages(MODEL.config, n)[1:3] for n in lengths}) == 3  # the window and page count move
    elif policy == "synckv":  # anticipating at every step; its static and dynamic sets grow with the prompt
        from test_synckv import PROFILE as SYNC_PROFILE

        pol, lengths = SyncKV(profile=SYNC_PROFILE, budget=0.5, m=1), (104, 108, 111)
        assert {pol.split(pol.nr_tokens(n)) for n in lengths} == {(13, 13), (14, 13)}  # static tokens 13, 14
    else:
        pol = make_policy(policy, None if policy == "full" else 0.5)

    def decode_executables():
        return sum(1 for k in compile_cache._COMPILED
                   if any(f in repr(k) for f in ("decode_step_jit", "drift_check", "_anticipate", "write_blocks",
                                                 "_prefill_layer")))

    counts = []
    for n in lengths:
        hetero_jax.generate(MODEL, random_prompts([n], seed=n)[0], pol, max_new_tokens=6, chat=False)
        counts.append(decode_executables())
    assert counts[1:] == [counts[0]] * 2, counts


# ------------------------------------------------------------------ incremental decoding of an answer
def _byte_level_tokenizer():
    """GPT-2 style: byte-level pieces, so a 4-byte character can split over tokens."""
    from tokenizers import AddedToken, Tokenizer as Backend, decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for piece in ["Ġthe", "Ġcat", "ðŁ", "¦Ĵ", "æ¼"]:
        vocab[piece] = len(vocab)
    backend = Backend(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken("<|end|>", special=True)])
    return backend


def _metaspace_tokenizer():
    """Llama-2 style: metaspace pieces, byte fallback, and the decoder's strip of the text's first space."""
    from tokenizers import AddedToken, Tokenizer as Backend, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ["▁", "▁the", "▁cat", "a", "b", "é", "漢", "▁▁"]:
        vocab[piece] = len(vocab)
    backend = Backend(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    backend.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    return backend


@pytest.mark.parametrize("make", [_byte_level_tokenizer, _metaspace_tokenizer])
def test_an_answer_decoded_a_window_at_a_time_is_the_whole_decode(make):
    """Every answer token decoded the whole answer again (time growing with the answer); ``AnswerText`` decodes
    the last tokens only. Wherever the whole decode's characters are complete the two texts are equal, over
    texts of emoji, CJK, accents, runs of spaces and a special token, split as the tokenizer splits them."""
    from hetero_jax.io.tokenizer import Tokenizer
    from hetero_jax.runtime.streaming import AnswerText

    tok = Tokenizer(make())
    assert tok.suffix_decodable
    pool = list("ab é漢 🦒€ the cat\n  x") + ["the", " cat", "🦑"]
    special = tok._tok.get_vocab_size() - 1
    compared = 0
    for seed in range(120):
        rng = np.random.default_rng(seed)
        ids = tok._tok.encode("".join(rng.choice(pool, 30)), add_special_tokens=False).ids
        if seed % 4 == 0:
            ids.insert(int(rng.integers(len(ids))), special)  # decoded to nothing
        text = AnswerText(tok)
        for j, t in enumerate(ids):
            got, want = text.add(t), tok.decode(ids[: j + 1])
            if "\ufffd" not in want:  # (a byte-fallback run shows U+FFFD for all its bytes until it is valid)
                assert got == want, (seed, j)
                compared += 1
    assert compared > 2000


def test_streaming_decodes_a_window_of_the_answer_per_token_not_the_whole_answer():
    import dataclasses

    decoded = []

    class Counting(TinyTokenizer):  # " ".join of the ids: decoding ids[i:] gives the text from token i on
        suffix_decodable = True

        def decode(self, ids):
            decoded.append(len(ids))
            return super().decode(ids)

    model = dataclasses.replace(tiny_model(512), tokenizer=Counting())
    chunks = []
    r = hetero_jax.generate(model, random_prompts([9], seed=3)[0], max_new_tokens=48, chat=False,
                            on_token=chunks.append)
    n = len(r.token_ids)
    assert n >= 40 and r.text == TinyTokenizer().decode(r.token_ids) == "".join(chunks)
    assert sum(decoded) <= 6 * n  # the whole answer each time: n (n + 1) / 2 ids


def test_an_answer_cut_among_invalid_bytes_keeps_the_whole_decode_as_its_text():
    """A byte-fallback tokenizer (Llama-2 style) shows U+FFFD for a whole byte run until it is valid UTF-8: an
    answer cut inside such a run had a text that was not its tokens' decode (and the server then dropped the
    conversation it holds). The final text is the whole decode."""
    import dataclasses

    from hetero_jax.io.tokenizer import Tokenizer

    inner = Tokenizer(_metaspace_tokenizer())

    class Bytes:  # the tiny model's ids as UTF-8 lead bytes, continuation bytes and ASCII letters
        suffix_decodable, eos_token_ids = True, (0,)

        def decode(self, ids):
            return inner.decode([3 + (0xF0, 0x9F, 0xA6, 0x92, 0x61 + t % 26)[t % 5] for t in ids])

    model = dataclasses.replace(tiny_model(512), tokenizer=Bytes())
    for seed in range(6):
        for n in (5, 9, 14):
            r = hetero_jax.generate(model, random_prompts([9], seed=seed)[0], max_new_tokens=n, chat=False)
            assert r.text == Bytes().decode(r.token_ids), (seed, n)
