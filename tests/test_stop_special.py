"""A stop string that is a special token's text ("<|im_end|>"): decoding leaves special tokens out of the answer's
text, so it stops at that token (left out of the answer, stop reason "stop") in generate, Session.ask and the
CLI; one that holds such a token's text among other text is refused before any compute."""

import dataclasses

import pytest

import hetero_jax
from hetero_jax.cli import main
from hetero_jax.errors import PromptError
from hetero_jax.io.tokenizer import Tokenizer
from tiny_model import random_prompt, tiny_model

PROMPT = [5, 6, 7, 8, 9]
MIXED = ("the stop string 'x<|im_end|>' holds the special token '<|im_end|>' among other text; decoding leaves "
         "special tokens out of the answer's text, so it cannot match when the model generates '<|im_end|>'; pass "
         "'<|im_end|>' alone as a stop string: it stops at that token")


def _with_tokens(model, special: dict, plain: dict | None = None, **config):
    """``model`` with a word-level tokenizer: id i is "w{i}", except the added tokens ``special`` (text -> id,
    skipped by decoding) and ``plain`` (decoded as their text); ``config``: tokenizer_config.json entries."""
    from tokenizers import AddedToken, Tokenizer as Backend, models, pre_tokenizers

    plain = plain or {}
    named = {i: text for text, i in {**special, **plain}.items()}
    vocab = {named.get(i, f"w{i}"): i for i in range(model.config.vocab_size)}
    backend = Backend(models.WordLevel(vocab, unk_token=next(w for w in vocab if w.startswith("w"))))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens([AddedToken(t, special=True) for t in special])
    backend.add_tokens([AddedToken(t, special=False) for t in plain])
    return dataclasses.replace(model, tokenizer=Tokenizer(backend, tokenizer_config=config))


def _words(ids) -> str:
    return " ".join(f"w{i}" for i in ids)


@pytest.fixture(scope="module")
def tiny():
    return tiny_model()


@pytest.fixture(scope="module")
def ref(tiny):
    """The greedy answer to PROMPT without a stop, and an index k >= 2 whose token comes there first."""
    ids = hetero_jax.generate(tiny, PROMPT, max_new_tokens=10, chat=False).token_ids
    assert len(ids) == 10  # no EOS: every token a stop can be put on
    return ids, next(k for k in range(2, 10) if ids[k] not in ids[:k])


@pytest.mark.parametrize("stop", ["<|im_end|>", ["zz", "<|im_end|>"]])
def test_generate_stops_at_the_special_token_a_stop_string_names(tiny, ref, stop):
    ids, k = ref
    model = _with_tokens(tiny, {"<|im_end|>": ids[k]})
    chunks = []
    r = hetero_jax.generate(model, PROMPT, max_new_tokens=10, chat=False, stop=stop, on_token=chunks.append)
    assert r.stats.stop_reason == "stop"
    assert r.token_ids == ids[:k] and r.text == _words(ids[:k]) == "".join(chunks)


def test_a_stop_naming_the_eos_token_ends_at_eos(tiny, ref):
    ids, k = ref
    model = _with_tokens(tiny, {"<|im_end|>": ids[k]}, eos_token="<|im_end|>")
    r = hetero_jax.generate(model, PROMPT, max_new_tokens=10, chat=False, stop="<|im_end|>")
    assert (r.token_ids, r.text, r.stats.stop_reason) == (ids[:k], _words(ids[:k]), "eos")


def test_a_plain_added_token_is_matched_as_text(tiny, ref):
    """An added token that is not special decodes to its text: its stop cuts the text, the token stays."""
    ids, k = ref
    model = _with_tokens(tiny, {}, plain={"<tool>": ids[k]})
    r = hetero_jax.generate(model, PROMPT, max_new_tokens=10, chat=False, stop="<tool>")
    assert r.stats.stop_reason == "stop" and r.token_ids == ids[:k + 1] and r.text == _words(ids[:k]) + " "


def test_session_stops_at_the_special_token_and_feeds_nothing_past_it(tiny):
    ctx, q1, q2 = random_prompt(20, seed=1), [7, 8, 9], [10, 11]
    ans = hetero_jax.Session(tiny, ctx, chat=False).ask(q1, max_new_tokens=10).token_ids
    assert len(ans) == 10
    k = next(k for k in range(2, 10) if ans[k] not in ans[:k])
    s = hetero_jax.Session(_with_tokens(tiny, {"<|im_end|>": ans[k]}), ctx, chat=False)
    r = s.ask(q1, max_new_tokens=10, stop="<|im_end|>")
    assert (r.token_ids, r.text, r.stats.stop_reason) == (ans[:k], _words(ans[:k]), "stop")
    # as at EOS, the cache holds every answer token and not the stop token: the next turn is its question alone,
    # answered as a session whose context is everything before it
    r2 = s.ask(q2, max_new_tokens=4)
    assert r2.stats.turn_tokens == len(q2)
    assert r2.token_ids == hetero_jax.Session(tiny, ctx + q1 + ans[:k], chat=False).ask(q2, max_new_tokens=4).token_ids


@pytest.mark.parametrize("stop, message", [
    ("x<|im_end|>", MIXED),
    (["ok", "<|im_start|>\n<|im_end|>"], "the stop string '<|im_start|>\\n<|im_end|>' holds the special token "
                                         "'<|im_start|>' among other text"),
])
def test_a_stop_holding_a_special_token_among_text_is_refused(tiny, no_compute, stop, message):
    model = _with_tokens(tiny, {"<|im_end|>": 3, "<|im_start|>": 4})
    with pytest.raises(PromptError) as e:
        hetero_jax.generate(model, PROMPT, max_new_tokens=10, chat=False, stop=stop)
    assert str(e.value).startswith(message)
    assert str(e.value).endswith("alone as a stop string: it stops at that token")


def test_session_refuses_it_before_the_turn(tiny):
    s = hetero_jax.Session(_with_tokens(tiny, {"<|im_end|>": 3}), random_prompt(20, seed=1), chat=False)
    left = s.engine.positions_left
    with pytest.raises(PromptError) as e:
        s.ask([7, 8, 9], stop="x<|im_end|>")
    assert str(e.value) == MIXED
    assert (s.engine.steps, s.engine.positions_left, s.turns) == (0, left, [])  # nothing was fed


@pytest.fixture
def cli_model(tiny, ref, monkeypatch):
    """``hetero-jax generate --model ANY`` loads the tiny model with "<|im_end|>" at the reference's k-th token."""
    ids, k = ref
    model = _with_tokens(tiny, {"<|im_end|>": ids[k]})
    monkeypatch.setattr(hetero_jax, "load", lambda *a, **kw: model)
    return ids[:k]


def test_cli_stop_at_a_special_token(cli_model, capsys):
    argv = ["generate", "--prompt", _words(PROMPT), "--no-chat", "--max-new-tokens", "10", "--stop", "<|im_end|>"]
    assert main(argv) == 0
    text, stats = capsys.readouterr().out.rstrip("\n").split("\n")
    assert text == _words(cli_model) and stats.endswith("stop: stop")


@pytest.mark.parametrize("turns", [False, True])
def test_cli_refuses_a_mixed_stop_before_compute(cli_model, tmp_path, capsys, no_compute, turns):
    argv = ["generate", "--prompt", _words(PROMPT), "--no-chat", "--stop", "x<|im_end|>"]
    if turns:  # a session prefills its context before the first question: the stop is checked before that
        (tmp_path / "q.txt").write_text("w7 w8\n")
        argv += ["--turns", str(tmp_path / "q.txt")]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert (out, err) == ("", f"error: {MIXED}\n")


def test_the_server_holds_a_conversation_stopped_at_a_special_token_as_one_ended_at_eos(tiny):
    """The server's held conversation after a stop token: nothing left to feed, as after EOS at the same token
    (it counted the stop token's turn as one token short of the cache: a wrong prompt_tokens next turn)."""
    from hetero_jax.policies import FullKV
    from hetero_jax.serve.schema import Sampling
    from hetero_jax.serve.sessions import Conversations, SessionStore

    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    msgs = (("user", _words(PROMPT)),)
    plain = Sampling(None, 0.0, 1.0, 0, ())
    ids = Conversations(_with_tokens(tiny, {}, chat_template=template), SessionStore(4)).answer(
        msgs, FullKV(), plain, "u", max_tokens=10).token_ids
    k = next(k for k in range(2, 10) if ids[k] not in ids[:k])
    turns = {}
    for how, config, sampling in (("stop", {}, dataclasses.replace(plain, stop=("<|im_end|>",))),
                                  ("eos", {"eos_token": "<|im_end|>"}, plain)):
        conv = Conversations(_with_tokens(tiny, {"<|im_end|>": ids[k]}, chat_template=template, **config),
                             SessionStore(4))
        first = conv.answer(msgs, FullKV(), sampling, "u", max_tokens=10)
        assert (first.stop_reason, first.token_ids) == (how, tuple(ids[:k]))
        more = msgs + (("assistant", first.text), ("user", "w10 w11"))
        turns[how] = conv.answer(more, FullKV(), plain, "u", max_tokens=4)
    stop, eos = turns["stop"], turns["eos"]
    assert stop.resumed and eos.resumed
    assert (stop.prompt_tokens, stop.cached_tokens, stop.token_ids) == (eos.prompt_tokens, eos.cached_tokens,
                                                                          eos.token_ids)


def test_the_server_refuses_a_mixed_stop_before_it_prefills_a_new_conversation(tiny, monkeypatch):
    from hetero_jax.policies import FullKV
    from hetero_jax.serve import sessions
    from hetero_jax.serve.schema import Sampling

    def boom(*a, **k):
        raise AssertionError("a session was prefilled")

    monkeypatch.setattr(sessions, "Session", boom)
    conv = sessions.Conversations(_with_tokens(tiny, {"<|im_end|>": 57}, chat_template="{{ messages[0]['content'] }}"),
                                  sessions.SessionStore(4))
    with pytest.raises(PromptError) as ei:
        conv.answer((("user", _words(PROMPT)),), FullKV(), Sampling(None, 0.0, 1.0, 0, ("x<|im_end|>",)), "u",
                    max_tokens=4)
    assert str(ei.value) == MIXED
