"""Sessions, chat templates and boolean settings (issue 37): a failed turn, whatever failed, leaves the
session as it was; a second thread is refused while one asks; malformed chat templates, non-bool flags, a
reserve past the context and a non-boolean HETERO_JAX_GC_FREEZE are the project's errors, before any compute."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import threading

import jax
import numpy as np
import pytest

import hetero_jax
from hetero_jax.errors import ConfigError, PromptError, SessionBusyError, SessionError, env_flag
from hetero_jax.io.tokenizer import Tokenizer
from hetero_jax.policies import FullKV, HeteroCache
from hetero_jax.profile.clustering import Role
from hetero_jax.profile import HeadProfile
from hetero_jax import Session
from hetero_jax.runtime.session import check_turns_fit
from tiny_model import random_prompt, tiny_model

MODEL = tiny_model(256)
A, V, P, S = Role.ANCHOR, Role.VOLATILE, Role.PIVOT, Role.SATELLITE
# pivots with satellites in layers 0 and 2: drift checks and recalls rewrite prompt rows of the pool
PROFILE = HeadProfile(roles=np.asarray([[S, P, S], [A, V, A], [S, A, P]], np.int8),
                      clusters=(((1, (0, 2)),), (), ((2, (0,)),)),
                      weights=np.where(np.isin([[S, P, S], [A, V, A], [S, A, P]], [A, S]), 1.0, np.nan),
                      architecture="llama", head_dim=MODEL.config.head_dim)


class Boom(Exception):
    pass


def raise_on(n: int, exc=Boom):
    """An on_token that raises ``exc`` at its ``n``-th call (the answer half decoded)."""
    calls = [0]

    def on_token(_text):
        calls[0] += 1
        if calls[0] == n:
            raise exc("stop here")
    return on_token


def state(sess):
    """What a turn may change, as plain values."""
    c = sess.engine.cache
    return dict(messages=sess.messages, rendered=sess._rendered, unfed=sess._unfed, turns=len(sess.turns),
                steps=sess.engine.steps, seq=np.asarray(c.seq_lens).tolist(), tail=np.asarray(c.tail_lens).tolist(),
                tail_capacity=c.tail_capacity, pool_rows=c.pool.k.shape,
                stats=sess.engine.state.stats(), key=np.asarray(sess.engine.key).tolist())


@pytest.fixture(scope="module")
def chat_model(tiny_checkpoint):
    pytest.importorskip("transformers")
    return hetero_jax.load(tiny_checkpoint("llama")[1])


# ---------------------------------------------- a session's first turn is generate's prompt, token for token
QUESTION = "What is the secret code?"
ENDINGS = ["The secret code is 4817.", "The secret code is 4817. ", "The secret code is 4817.\n",
           "the code: 4817 \n\n", "a\t", "x"]


def _whitespace_bpe(tok: Tokenizer, llama3: bool) -> Tokenizer:
    """A byte-level BPE trained on text whose whitespace runs merge (' \\n\\n', '.\\n\\n'), with GPT-2's
    pre-tokenizer regex or Llama 3's (whose punctuation takes the newlines after it); ``tok``'s specials and
    chat template."""
    from tokenizers import Regex, Tokenizer as Backend, models, pre_tokenizers, trainers

    from hetero_jax.io.gguf import _LLAMA3_SPLIT

    backend = Backend(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=not llama3)
    backend.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), "isolated"),
                                                      byte_level]) if llama3 else byte_level)
    text = ("Alice owns the red bicycle. The secret code is 4817. \n\nWhat is the code: 4817 \n\n a\t"
            "x.\n\n") * 50
    backend.train_from_iterator([text], trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    return Tokenizer(backend, tokenizer_config=tok.tokenizer_config)


@pytest.mark.parametrize("ending", ENDINGS)
@pytest.mark.parametrize("chat, llama3, long", [(True, False, False), (False, False, False), (True, True, False),
                                                (True, False, True)])
def test_a_first_turn_tokenises_as_the_whole_prompt(chat_model, ending, chat, llama3, long):
    """The context was encoded alone and the question after it, so a context ending in a space or a newline
    (a document read from a file) gave other tokens than the whole text (' \\n\\n' is one token in it, and
    Llama 3's regex puts '.\\n\\n' in one piece): with full KV, SmolLM2 answered another question. The
    context's last pre-tokens now wait for the first turn."""
    from hetero_jax.runtime.session import open_context

    tok = _whitespace_bpe(chat_model.tokenizer, llama3)
    # long: past the 4,096 characters at the end that settled_length looks at
    context = "Alice owns the red bicycle. " * (200 if long else 1) + ending
    ids, t = open_context(tok, context, chat)
    turn, _ = t.ask(tok, chat_model.config, QUESTION)
    assert ids + turn == tok.encode_prompt(context + "\n\n" + QUESTION, chat=chat)
    assert len(ids) > 0


# ------------------------------------------------------------------ a failed turn changes nothing
CONTEXT = "the quick brown fox jumps over the lazy dog. " * 6


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("exc", [Boom, KeyboardInterrupt])
def test_a_turn_whose_on_token_raises_leaves_the_chat_session_as_it_was(chat_model, chat, exc):
    """The reported case: with chat=True a raising on_token left every later question refused ('the chat
    template does not render turns incrementally'). Now turn 2 asked again answers as in a session that never
    failed, and so does turn 3."""
    s, twin = Session(chat_model, CONTEXT, chat=chat), Session(chat_model, CONTEXT, chat=chat)
    assert s.ask("who jumps?", max_new_tokens=4).token_ids == twin.ask("who jumps?", max_new_tokens=4).token_ids
    before = state(s)
    with pytest.raises(exc, match="stop here"):
        s.ask("and the dog?", max_new_tokens=6, on_token=raise_on(2, exc))
    assert state(s) == before
    for q in ("and the dog?", "what colour is the fox?"):
        got, want = s.ask(q, max_new_tokens=6), twin.ask(q, max_new_tokens=6)
        assert got.token_ids == want.token_ids and got.text == want.text
    assert s.messages == twin.messages and s._rendered == twin._rendered


POLICIES = {
    "full": lambda: FullKV(),  # only the tail grows: the lengths undo a turn
    "heterocache": lambda: HeteroCache(profile=PROFILE, budget=0.6, window=2, tau_drift=1.5),  # recalls: pool copied
}


@pytest.mark.parametrize("name", sorted(POLICIES))
@pytest.mark.parametrize("where", ["on_token", "step", "extend"])
def test_a_failed_turn_is_undone_for_a_policy_that_rewrites_prompt_rows_and_one_that_does_not(name, where,
                                                                                             monkeypatch):
    make = POLICIES[name]
    ctx, q1, q2 = random_prompt(150, 1), random_prompt(12, 2), random_prompt(9, 3)
    s = Session(MODEL, ctx, make(), chat=False, reserve_tokens=8)
    twin = Session(MODEL, ctx, make(), chat=False, reserve_tokens=8)
    assert s.ask(q1, max_new_tokens=7).token_ids == twin.ask(q1, max_new_tokens=7).token_ids
    assert s.engine.state.writes_prompt_rows == (name == "heterocache")
    before = state(s)
    at_failure = {}
    kw = {}
    if where == "on_token":
        on_token = raise_on(5)

        def watched(text):
            at_failure.update(state(s))
            on_token(text)
        kw["on_token"] = watched
    else:  # a failure inside the engine (a policy hook, a device call) after the turn changed the cache
        real, calls = getattr(s.engine, where), [0]

        def failing(*a, **k):
            out = real(*a, **k)
            calls[0] += 1
            if calls[0] == 3 or where == "extend":
                at_failure.update(state(s))
                raise Boom("stop here")
            return out
        monkeypatch.setattr(s.engine, where, failing)
    with pytest.raises(Boom, match="stop here"):
        s.ask(q2, max_new_tokens=8, **kw)
    monkeypatch.undo()
    assert at_failure["tail"] != before["tail"]  # the turn had changed the cache when it failed
    if name == "heterocache":  # and the policy's state: checks, recalls or the turn's re-selection
        assert at_failure["stats"] != before["stats"]
    assert state(s) == before
    if name == "heterocache":
        assert twin.ask(q2, max_new_tokens=8).stats.policy_stats["recalls"] > before["stats"]["recalls"]
    else:
        twin.ask(q2, max_new_tokens=8)
    assert s.ask(q2, max_new_tokens=8).token_ids == twin.turns[-1].token_ids
    assert s.ask(q1, max_new_tokens=5).token_ids == twin.ask(q1, max_new_tokens=5).token_ids


def test_a_turn_that_loses_the_donated_pool_marks_the_session_lost(monkeypatch):
    """A failure inside a device call after it took the (donated) pool: a policy whose pool was not copied
    cannot be put back; the session says so on every later question instead of 'Array has been deleted'."""
    s = Session(MODEL, random_prompt(150, 1), FullKV(), chat=False, reserve_tokens=8)
    s.ask(random_prompt(5, 2), max_new_tokens=3)
    eng, real = s.engine, s.engine.step

    def interrupted(*a, **k):
        real(*a, **k)
        jax.tree.map(lambda a: a.delete(), eng.cache.pool)
        raise KeyboardInterrupt
    monkeypatch.setattr(eng, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        s.ask(random_prompt(5, 3), max_new_tokens=3)
    monkeypatch.undo()
    for _ in range(2):
        with pytest.raises(SessionError, match=re.escape("this Session's cache was lost when a turn failed inside "
                                                         "a device call") + ".*open a new Session"):
            s.ask(random_prompt(5, 3), max_new_tokens=3)


# ------------------------------------------------------------------ one question at a time
def test_a_second_thread_is_refused_while_the_first_answers_and_the_session_survives():
    ctx, q1, q2 = random_prompt(150, 1), random_prompt(12, 2), random_prompt(9, 3)
    s = Session(MODEL, ctx, FullKV(), chat=False, reserve_tokens=8)
    twin = Session(MODEL, ctx, FullKV(), chat=False, reserve_tokens=8)
    inside, release = threading.Event(), threading.Event()
    result, errors = {}, []

    def wait_inside(_text):
        inside.set()
        if not release.wait(60):
            raise AssertionError("never released")

    def first():
        try:
            result["res"] = s.ask(q1, max_new_tokens=5, on_token=wait_inside)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    t = threading.Thread(target=first)
    t.start()
    try:
        assert inside.wait(120), "the first question never reached its answer"
        with pytest.raises(SessionBusyError, match=re.escape(
                "this Session is answering another question in another thread; wait for that answer or open a "
                "second Session")):
            s.ask(q2, max_new_tokens=5)
    finally:
        release.set()
        t.join(120)
    assert not errors and not t.is_alive()
    assert isinstance(SessionBusyError("x"), hetero_jax.HeteroJaxError)
    assert result["res"].token_ids == twin.ask(q1, max_new_tokens=5).token_ids
    assert len(s.turns) == 1
    assert s.ask(q2, max_new_tokens=5).token_ids == twin.ask(q2, max_new_tokens=5).token_ids


def test_an_ask_from_inside_its_own_on_token_is_refused_and_the_outer_answer_stands():
    ctx, q1 = random_prompt(150, 1), random_prompt(12, 2)
    s = Session(MODEL, ctx, FullKV(), chat=False, reserve_tokens=8)
    twin = Session(MODEL, ctx, FullKV(), chat=False, reserve_tokens=8)
    refusals = []

    def nested(_text):
        try:
            s.ask(q1, max_new_tokens=2)
        except SessionBusyError as e:
            refusals.append(str(e))
    assert s.ask(q1, max_new_tokens=4, on_token=nested).token_ids == twin.ask(q1, max_new_tokens=4).token_ids
    assert len(refusals) == 4 and set(refusals) == {
        "Session.ask was called from this Session's own on_token while it answers; ask the next question after "
        "ask returns"}


def test_each_turn_reports_its_own_tokens_and_the_context_keeps_its_prefill():
    """The stats of every turn repeated the context's prompt_tokens and prefill_seconds (as serve reads them)
    and did not say what the turn itself appended, so the CLI's line showed the context's prefill per turn."""
    ctx, q1, q2 = random_prompt(150, 1), random_prompt(12, 2), random_prompt(9, 3)
    s = Session(MODEL, ctx, FullKV(), chat=False, reserve_tokens=8)
    first, second = s.ask(q1, max_new_tokens=4), s.ask(q2, max_new_tokens=4)
    a, b = first.stats, second.stats
    assert (a.turn, a.turn_tokens) == (1, 12)  # token ids are fed as they are
    # the first answer's last token, sampled but not yet in the cache unless it was EOS, opens turn 2
    assert (b.turn, b.turn_tokens) == (2, 9 + (a.stop_reason != "eos"))
    assert a.prompt_tokens == b.prompt_tokens == 150 and a.prefill_seconds == b.prefill_seconds > 0
    assert a.extend_seconds > 0 and b.extend_seconds > 0
    assert a.summary().startswith(f"context 150 tok, prefill {a.prefill_seconds:.2f} s (")
    assert f"| turn 1: 12 tok, extend {a.extend_seconds:.2f} s | generated {a.generated_tokens} tok" in a.summary()
    assert b.summary().startswith(f"context 150 tok (prefilled once, before turn 1) | turn 2: {b.turn_tokens} tok, "
                                  f"extend {b.extend_seconds:.2f} s | generated {b.generated_tokens} tok")


# ------------------------------------------------------------------ scripted turns checked up front
def test_check_turns_fit_refuses_a_later_turn_before_any_compute(chat_model, no_compute):
    total = chat_model.config.max_position_embeddings
    long_line = "tell me about the dog " * 200
    for chat in (True, False):
        with pytest.raises(PromptError) as ei:
            check_turns_fit(chat_model, CONTEXT, ["who jumps?", long_line], chat=chat)
        msg = str(ei.value)
        assert re.match(r"turn 2 \(\d+ tokens\) does not fit: the context \(\d+ tokens\) and turns 1-1 \(\d+ tokens, "
                        r"answers not counted\) leave \d+ positions of the model's " + str(total) + "-token context",
                        msg), msg
        assert msg.endswith("shorten or drop that question (nothing was computed)")
        check_turns_fit(chat_model, CONTEXT, ["who jumps?", "and the dog?"], chat=chat)  # these fit
    with pytest.raises(PromptError, match=r"^turn 1 \(\d+ tokens\) does not fit: the context \(\d+ tokens\) "
                                         r"leaves \d+ positions"):
        check_turns_fit(chat_model, CONTEXT, [long_line], chat=True)


def test_check_turns_fit_follows_the_sessions_own_rule(chat_model):
    """The last question the check accepts is one the session answers; one token more is refused by both."""
    total = chat_model.config.max_position_embeddings
    ctx = [5] * 100
    fits, over = [7] * (total - 101), [7] * (total - 100)  # the answer needs one position
    check_turns_fit(chat_model, ctx, [fits], chat=False)
    with pytest.raises(PromptError, match=r"^turn 1 \(" + str(total - 100) + r" tokens\) does not fit"):
        check_turns_fit(chat_model, ctx, [over], chat=False)
    s = Session(chat_model, ctx, chat=False, reserve_tokens=8)
    with pytest.raises(PromptError, match="does not fit"):
        s.ask(over, max_new_tokens=1)
    assert len(s.ask(fits, max_new_tokens=1).token_ids) <= 1


# ------------------------------------------------------------------ chat templates
BAD_TEMPLATES = [
    ("{% for m in messages %}{{ m['content'] }", "is not valid Jinja (line 1: "),
    ("{{ raise_exception('Conversation roles must alternate user/assistant') }}",
     "refused the conversation (TemplateError: Conversation roles must alternate user/assistant)"),
    ("{% for m in messages %}{{ m['content'][:5] }}{% endfor %}", "leaves the user's message out of the prompt "
                                                                   "(truncated or dropped: "),
    ("{% for m in messages %}<|im_start|>{{ m['role'] }}<|im_end|>{% endfor %}",
     "leaves the user's message out of the prompt (truncated or dropped: "),
    ("{{ messages[0]['content'].split(1) }}", "failed while rendering (TypeError: "),
]
FIX = ("; pass chat=False (CLI: --no-chat) to use the raw prompt, or fix chat_template in the checkpoint's "
       "tokenizer_config.json (or chat_template.jinja)")


def _with_template(chat_model, template: str):
    tok = chat_model.tokenizer
    bad = Tokenizer(tok.backend, tokenizer_config={**tok.tokenizer_config, "chat_template": template})
    return dataclasses.replace(chat_model, tokenizer=bad)


@pytest.mark.parametrize("template, needle", BAD_TEMPLATES)
def test_a_malformed_chat_template_is_a_prompt_error_before_compute(chat_model, template, needle, no_compute):
    model = _with_template(chat_model, template)
    for call in (lambda: hetero_jax.generate(model, "the quick brown fox, the lazy dog"),
                 lambda: Session(model, "the quick brown fox, the lazy dog")):
        with pytest.raises(PromptError) as ei:
            call()
        msg = str(ei.value)
        assert msg.startswith("the checkpoint's chat template " + needle), msg
        assert msg.endswith(FIX), msg
    # the way out the message names: without the template the prompt encodes
    assert model.tokenizer.encode_prompt("the quick brown fox", chat=False)


def test_templates_that_trim_the_content_are_not_refused(chat_model):
    """Llama-3's template trims each message: whitespace around the text is not a truncation."""
    model = _with_template(chat_model, "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}"
                                       "<|im_end|>\n{% endfor %}<|im_start|>assistant\n")
    assert "hello there" in model.tokenizer.apply_chat_template([{"role": "user", "content": "  hello there \n"}])


def test_a_turn_whose_template_fails_leaves_the_session_as_it_was(chat_model, monkeypatch):
    """The template refuses the second turn (raise_exception on the history): the session is unchanged and
    the next turn, once the template accepts it, answers as in a session that never saw the failure."""
    s, twin = Session(chat_model, CONTEXT), Session(chat_model, CONTEXT)
    s.ask("who jumps?", max_new_tokens=4)
    twin.ask("who jumps?", max_new_tokens=4)
    before = state(s)
    real = s.model.tokenizer.apply_chat_template

    def refusing(messages, *a, **k):
        if len(messages) > 1:
            from hetero_jax.io.tokenizer import template_error
            raise template_error("refused the conversation (TemplateError: no follow-ups)")
        return real(messages, *a, **k)
    monkeypatch.setattr(s.model.tokenizer, "apply_chat_template", refusing)
    with pytest.raises(PromptError, match=re.escape("refused the conversation (TemplateError: no follow-ups)")):
        s.ask("and the dog?", max_new_tokens=4)
    monkeypatch.undo()
    assert state(s) == before
    assert s.ask("and the dog?", max_new_tokens=4).token_ids == twin.ask("and the dog?", max_new_tokens=4).token_ids


# ------------------------------------------------------------------ flags and sizes
@pytest.mark.parametrize("value", ["no", "False", 0, 1, None, [True]])
def test_chat_must_be_a_bool(value, no_compute):
    needle = f"chat must be True or False, got {value!r}"
    with pytest.raises(PromptError, match=re.escape(needle)):
        hetero_jax.generate(MODEL, random_prompt(10), chat=value)
    with pytest.raises(PromptError, match=re.escape(needle)):
        Session(MODEL, random_prompt(10), chat=value)


@pytest.mark.parametrize("reserve", [237, 256, 10**9])
def test_a_reserve_past_the_context_is_refused_before_allocating(reserve, no_compute):
    with pytest.raises(PromptError) as ei:
        Session(MODEL, random_prompt(20), chat=False, reserve_tokens=reserve)
    assert str(ei.value) == (
        f"reserve_tokens={reserve} is more than the context leaves: the model's context is 256 tokens and the "
        "session's context takes 20, so at most 236 tokens of turns and answers follow it; pass reserve_tokens <= "
        "236 or leave it unset")


def test_a_sessions_tail_grows_by_doubling_and_answers_as_one_reserved_up_front():
    """Once its first rows were used, a Session grew its tail by one quantum a turn, and each new capacity
    compiled decode and extend again (5.5 s a turn on SmolLM2 against 2.6 s of decoding): the tail now at
    least doubles, capped at the rows the context can still use."""
    model = tiny_model(2048)
    ctx = random_prompt(40, 3)
    grown = Session(model, ctx, FullKV(), chat=False, reserve_tokens=8)
    ahead = Session(model, ctx, FullKV(), chat=False, reserve_tokens=2000)
    caps = [grown.engine.cache.tail_capacity]
    for turn in range(12):
        q = random_prompt(70, 10 + turn)[1:]
        a, b = grown.ask(q, max_new_tokens=40), ahead.ask(q, max_new_tokens=40)
        assert a.token_ids == b.token_ids
        if grown.engine.cache.tail_capacity != caps[-1]:
            caps.append(grown.engine.cache.tail_capacity)
    # 12 turns of up to 110 rows each, reached in doublings (a quantum of 128 rows a turn took 11 capacities); the
    # last is the 2,008 rows the context leaves, rounded up to the quantum
    assert caps == [8, 128, 256, 512, 1024, 2048], caps


@pytest.mark.parametrize("n", [255, 256, 300])
def test_a_context_that_leaves_no_room_for_a_question_is_refused_before_the_prefill(n, no_compute):
    """255 of 256 tokens was prefilled whole and every ask then failed; a longer one was called a 'prompt'."""
    with pytest.raises(PromptError) as e:
        Session(MODEL, random_prompt(n), chat=False)
    assert str(e.value) == (f"the context has {n} tokens but the model's context is 256 tokens, and a question "
                            "and its answer need at least two more positions; shorten the context")


TRIMMING = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] | trim }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def test_a_template_that_trims_the_last_answers_whitespace_still_takes_the_next_turn(tmp_path):
    """Llama 3's template trims every message: once an answer that ended in a line break (cut by max_new_tokens
    after '1. Banana\n') was history, every later ask was refused as 'not incremental'. The cache keeps the
    answer as generated; the turn feeds what the template writes after the trimmed text."""
    from hf_fixtures import make_tokenizer_files

    from hetero_jax.runtime.session import open_context

    make_tokenizer_files(tmp_path)
    tc = json.loads((tmp_path / "tokenizer_config.json").read_text())
    tc["chat_template"] = TRIMMING
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tc))
    tok = Tokenizer.from_dir(tmp_path)
    ids, t = open_context(tok, "fruit: banana, apple", chat=True)
    q1, t = t.ask(tok, MODEL.config, "list them")
    answer = tok.encode("1. Banana\n")
    t = t.answered(tok, answer, all_fed=False)  # cut by max_new_tokens: its last token opens the next turn
    q2, t2 = t.ask(tok, MODEL.config, "which is yellow?")
    held = "<user>fruit: banana, apple\n\nlist them</s><assistant>"
    assert tok.decode(ids + q1) == held
    # the cache: the answer as generated ('\n' included, fed first), then the template's text after '1. Banana'
    assert q2 == [answer[-1]] + tok.encode("</s><user>which is yellow?</s><assistant>")
    assert t2.rendered == held + "1. Banana</s><user>which is yellow?</s><assistant>"
    t2 = t2.answered(tok, tok.encode("The banana."), all_fed=True)
    q3, _ = t2.ask(tok, MODEL.config, "and red?")  # the turn after goes on as usual
    assert q3 == tok.encode("</s><user>and red?</s><assistant>")
    # a template that changes an earlier message otherwise is still refused
    t3 = dataclasses.replace(t2, messages=t2.messages[:1] + ({"role": "user", "content": "changed"},) +
                             t2.messages[2:])
    with pytest.raises(PromptError, match="does not render turns incrementally"):
        t3.ask(tok, MODEL.config, "and red?")


def test_the_largest_reserve_and_the_default_fit_the_context():
    s = Session(MODEL, random_prompt(20), chat=False, reserve_tokens=236)
    assert s.engine.cache.tail_capacity >= 236
    d = Session(MODEL, random_prompt(200), chat=False)  # the default 512 would not fit: the 56 positions left
    assert 56 <= d.engine.cache.tail_capacity < 512
    assert len(d.ask(random_prompt(5, 1), max_new_tokens=3).token_ids) == 3


# ------------------------------------------------------------------ boolean environment variables
@pytest.mark.parametrize("raw, want", [("1", True), ("true", True), (" Yes ", True), ("ON", True),
                                       ("0", False), ("false", False), (" 0", False), ("Off\n", False), ("NO", False),
                                       ("", True), ("  ", True)])
def test_env_flag_reads_the_usual_words(monkeypatch, raw, want):
    monkeypatch.setenv("HETERO_JAX_TEST_FLAG", raw)
    assert env_flag("HETERO_JAX_TEST_FLAG", True) is want


@pytest.mark.parametrize("raw", ["maybe", "2", "enabled", "tru"])
def test_env_flag_refuses_other_values(monkeypatch, raw):
    monkeypatch.setenv("HETERO_JAX_TEST_FLAG", raw)
    with pytest.raises(ConfigError) as ei:
        env_flag("HETERO_JAX_TEST_FLAG", True)
    assert str(ei.value) == (f"environment variable HETERO_JAX_TEST_FLAG={raw!r} is not a boolean: use one of "
                             "1/true/yes/on (on) or 0/false/no/off (off), or unset it (default: on)")


def _run(code: str, value: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HETERO_JAX_GC_FREEZE": value, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=120)


def test_gc_freeze_reads_false_words_as_off_and_refuses_a_typo():
    """A typo was refused while importing hetero_jax: every command, --help too, printed a traceback and exited
    1. Now `import hetero_jax` works, the first engine refuses it, and the command line says it in one line."""
    off = _run("from hetero_jax.runtime import heap; print(heap.flags()['freeze'])", " off")
    assert off.returncode == 0 and off.stdout.strip() == "False", off.stderr
    bad = _run("import hetero_jax; from hetero_jax.runtime import heap; heap.flags()", "disable")
    assert bad.returncode != 0
    assert ("ConfigError: environment variable HETERO_JAX_GC_FREEZE='disable' is not a boolean: use one of "
            "1/true/yes/on (on) or 0/false/no/off (off)") in bad.stderr
    assert _run("import hetero_jax; print('imported')", "disable").stdout.strip() == "imported"
    cli = "import sys; from hetero_jax.cli import main; sys.exit(main(sys.argv[1:]))"
    assert _run(cli, "disable", "--help").returncode == 0
    refused = _run(cli, "disable", "models")
    assert refused.returncode == 2 and refused.stderr.startswith(
        "error: environment variable HETERO_JAX_GC_FREEZE='disable' is not a boolean") and "Traceback" not in \
        refused.stderr


def test_a_session_cannot_be_copied(no_compute):
    """copy.copy shared the donated cache and the history lists: asking the copy changed the original's next
    answer; copy.deepcopy failed in the chat template's Template. Both are refused by name."""
    import copy

    sess = Session.__new__(Session)  # no prefill needed: copying is refused before looking inside
    for fn in (copy.copy, copy.deepcopy):
        with pytest.raises(SessionError, match="a Session cannot be copied.*Open a second Session"):
            fn(sess)


@pytest.mark.parametrize("name", ["full", "snapkv", "heterocache", "quest", "quest-offload", "freekv", "synckv",
                                  "contextkeeper", "hcattention", "cake"])
def test_a_trimmed_tail_gives_the_answers_of_one_never_grown(name):
    """A server holds a conversation with the tail its answer reserved (max_tokens 1e6: 379 MB for 'Say hi.');
    Engine.trim gives the rows back. Trimmed after a turn, then grown again by the next, every policy answers as
    a session whose tail never moved, and holds the bytes of one that never grew."""
    from hetero_jax.model.cache import kv_bytes
    from test_batch_property import MODEL as BIG
    from test_smallest_budget import MAKE

    context, q1, q2 = random_prompt(200, 21), random_prompt(5, 22), random_prompt(4, 23)
    rho = 0.5 if name == "hcattention" else max(0.6, MAKE[name](0.6).smallest_budget(BIG, 200))
    trimmed, twin = (Session(BIG, context, MAKE[name](rho), chat=False, reserve_tokens=8) for _ in range(2))
    assert trimmed.ask(q1, max_new_tokens=4).token_ids == twin.ask(q1, max_new_tokens=4).token_ids
    trimmed.engine.reserve(250)  # what a long max_tokens reserves
    assert trimmed.engine.cache.tail_capacity == 384
    trimmed.engine.trim(1)
    assert trimmed.engine.cache.tail_capacity == twin.engine.cache.tail_capacity == 128
    assert kv_bytes(trimmed.engine.cache) == kv_bytes(twin.engine.cache)
    for s in (trimmed, twin):  # the next long answer grows it again
        s.engine.reserve(250)
    assert trimmed.ask(q2, max_new_tokens=6).token_ids == twin.ask(q2, max_new_tokens=6).token_ids


def test_a_chat_session_refuses_questions_its_template_cannot_render_and_stays_usable(chat_model):
    """A token-id question in a chat Session over text dropped the user turn from the history and every later
    text question was refused blaming the template; a text question in a chat Session over token ids was glued
    onto the context with no template. Both are refused before any compute; chat=False takes either."""
    tok = chat_model.tokenizer
    s = Session(chat_model, CONTEXT)
    before = state(s)
    with pytest.raises(PromptError, match="takes text questions.*chat=False"):
        s.ask(tok.encode("who jumps?", add_special_tokens=False), max_new_tokens=4)
    assert state(s) == before
    ids = Session(chat_model, tok.encode(CONTEXT, add_special_tokens=False))
    with pytest.raises(PromptError, match="chat template needs the context's text"):
        ids.ask("who jumps?", max_new_tokens=4)


def test_the_refused_chat_session_answers_its_text_question_as_a_fresh_one(chat_model):
    s, twin = Session(chat_model, CONTEXT), Session(chat_model, CONTEXT)
    with pytest.raises(PromptError):
        s.ask(chat_model.tokenizer.encode("who jumps?", add_special_tokens=False), max_new_tokens=4)
    assert s.ask("who jumps?", max_new_tokens=4).token_ids == twin.ask("who jumps?", max_new_tokens=4).token_ids
    ids = chat_model.tokenizer.encode(CONTEXT, add_special_tokens=False)
    q = chat_model.tokenizer.encode("who jumps?", add_special_tokens=False)  # chat=False: the text as it is
    got = Session(chat_model, ids, chat=False).ask("who jumps?", max_new_tokens=3).token_ids
    assert got == hetero_jax.generate(chat_model, ids + q, max_new_tokens=3, chat=False).token_ids


def test_a_session_at_the_end_of_its_context_says_so():
    """An answer cut by the context leaves its last token unfed: the next one-token question was refused as
    'the question (2 tokens) does not fit ... ask a shorter question', which no question could satisfy."""
    small = tiny_model(32)
    s = Session(small, random_prompt(20, 1), chat=False)
    res = s.ask(random_prompt(5, 2), max_new_tokens=100)
    assert res.stats.stop_reason == "context" and s.engine.positions_left == 1
    with pytest.raises(PromptError, match=r"reached the end of the model's 32-token context \(1 position\(s\) left, "
                                          r"one of them for the last answer's final token\): no question fits"):
        s.ask([7], max_new_tokens=1)
    s2 = Session(small, random_prompt(20, 1), chat=False)
    with pytest.raises(PromptError, match=r"the question \(12 tokens\) does not fit: 12 positions are left"):
        s2.ask(random_prompt(12, 3), max_new_tokens=1)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_failed_turn_gives_back_the_tail_rows_it_reserved(name):
    """A turn whose answer needed more tail rows grew the tail before it began; when it failed, the session
    kept the larger tail (and pool) it no longer needs. Now the tail and pool are as before the turn."""
    s = Session(MODEL, random_prompt(150, 1), POLICIES[name](), chat=False, reserve_tokens=8)
    before = state(s)
    with pytest.raises(Boom, match="stop here"):
        s.ask(random_prompt(9, 3), max_new_tokens=200, on_token=raise_on(2))
    assert state(s) == before
    s.ask(random_prompt(9, 3), max_new_tokens=200)
    assert s.engine.cache.tail_capacity > before["tail_capacity"]  # the turn does grow the tail


def test_a_failed_one_token_turn_leaves_no_steps_awaiting_the_drift_check():
    """HeteroCache keeps the steps awaiting its drift check in a deque, which the turn's checkpoint did not copy:
    after a failed turn the buffer still held that turn's steps, and the same one-token question asked again
    (no chunk, so no re-selection to clear it) recalled at other steps and answered otherwise (review 87)."""
    pol = HeteroCache(profile=PROFILE, budget=0.5, window=4, tau_drift=1.5)  # every check drifts
    ctx = random_prompt(150, 3)
    fresh = Session(MODEL, ctx, pol, chat=False)
    want = fresh.ask([9], max_new_tokens=8)
    s = Session(MODEL, ctx, pol, chat=False)
    with pytest.raises(Boom):
        s.ask([9], max_new_tokens=8, on_token=raise_on(3))
    assert len(s.engine.state.buffer) == 0
    got = s.ask([9], max_new_tokens=8)
    assert got.token_ids == want.token_ids
    assert s.engine.state.recall_steps == fresh.engine.state.recall_steps and want.stats.policy_stats["recalls"] > 0
