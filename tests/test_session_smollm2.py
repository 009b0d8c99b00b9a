"""Multi-turn sessions on the real SmolLM2-135M: three unrelated facts far apart in one context."""

import pydoc_data.topics
import pytest

import hetero_jax
from hetero_jax import Session
from hetero_jax.policies import HeteroCache

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

FACTS = ["The secret code of the blue door is 4821.", "Marta's favourite fruit is the mango.",
         "The meeting with the lawyer is on Friday."]
QUESTIONS = ["What is the secret code of the blue door?", "What is Marta's favourite fruit?",
             "On which day is the meeting with the lawyer?"]
ANSWERS = ["4821", "mango", "friday"]


def three_fact_context(tokenizer, n_tokens=1500):
    """Real text (pydoc topics) in three parts, each with one fact in its middle."""
    hay = " ".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    ids = tokenizer.encode(hay)
    part = n_tokens // 3
    ctx = ""
    for i, fact in enumerate(FACTS):
        seg = tokenizer.decode(ids[20000 + i * part : 20000 + (i + 1) * part - 15])
        cut = len(seg) // 2
        ctx += seg[:cut] + " " + fact + " " + seg[cut:] + "\n"
    return ctx


def test_full_kv_session_answers_each_fact_in_turn(smollm2):
    ctx = three_fact_context(smollm2.tokenizer)
    sess = Session(smollm2, ctx)
    assert 1400 < sess.context_tokens < 1700
    for q, a in zip(QUESTIONS, ANSWERS):
        assert a in sess.ask(q, max_new_tokens=16).text.lower()


def test_heterocache_half_budget_answers_each_fact_single_turn(smollm2):
    ctx = three_fact_context(smollm2.tokenizer)
    # one batch (batched equals one by one: tests/test_heterocache.py), so one prefill compile, not three
    results = hetero_jax.generate(smollm2, [ctx + "\n\n" + q for q in QUESTIONS], HeteroCache(budget=0.5),
                                  max_new_tokens=16)
    for res, a in zip(results, ANSWERS):
        assert a in res.text.lower(), res.text
        assert res.stats.achieved_rho <= 0.5 and res.stats.kv_bytes_host > 0


def test_heterocache_half_budget_session_answers_each_fact_in_turn(smollm2):
    """Multi-turn at rho 0.5 with HeteroCache's defaults: each question re-selects every compressed head
    from its host copy by the question's own queries before the answer, within the same device bytes."""
    from hetero_jax.model.cache import prompt_kv_bytes

    sess = Session(smollm2, three_fact_context(smollm2.tokenizer), HeteroCache(budget=0.5))
    cfg = smollm2.config
    full_bytes = sess.context_tokens * cfg.num_kv_heads * cfg.num_layers * 2 * cfg.head_dim * 4
    for q, a in zip(QUESTIONS, ANSWERS):
        res = sess.ask(q, max_new_tokens=16)
        assert a in res.text.lower(), (q, res.text)
        assert prompt_kv_bytes(sess.engine.cache) <= 0.5 * full_bytes * 1.05
    st = res.stats
    assert st.achieved_rho <= 0.5 and st.policy_stats["reselections"] == 3
    assert st.kv_bytes_host_by_role["anchor"] > 0 and st.kv_bytes_host_by_role["satellite"] > 0


@pytest.mark.parametrize("ending", [" ", "\n"])
def test_a_context_ending_in_whitespace_is_answered_as_generate_answers(smollm2, ending):
    """The Session tokenised such a context apart from the question (' ' and '\\n\\n' are one token together):
    with full KV it answered 'To solve this puzzle, ...' where generate said 'The secret code is 4817.'."""
    context = "Alice owns the red bicycle. The secret code is 4817." + ending
    question = "What is the secret code?"
    got = Session(smollm2, context).ask(question, max_new_tokens=12)
    want = hetero_jax.generate(smollm2, context + "\n\n" + question, max_new_tokens=12)
    assert got.token_ids == want.token_ids
