"""FreeKV and offloaded Quest on one CPU device: each step recalls its own pages (``speculative.recall_in_step``)
and gives what the host recall between steps gives (the path of a GPU and of a mesh, which tests/test_freekv.py
and tests/test_quest.py hold to numpy): the same tokens and logits, the same pages in the same slots with the
host store's rows, the same counters; over a batch of different lengths and over session turns."""

import contextlib

import jax
import numpy as np
import pytest

from hetero_jax.model.cache import layer_rows
from hetero_jax.policies import FreeKV, Quest, speculative
from hetero_jax.runtime import Session
from tiny_model import greedy_with_logits, random_prompt, random_prompts, tiny_model

MODEL = tiny_model()
CFG = MODEL.config
PS = 8
POLICIES = {"freekv": FreeKV(budget=0.55, page_size=PS, sinks=4, window=8),
            "quest-offload": Quest(budget=0.75, page_size=PS, full_layers=1, offload=True)}


@contextlib.contextmanager
def host_recall(on: bool):
    """The host's recall between steps (on) or the step's own (off: this CPU's default)."""
    with pytest.MonkeyPatch.context() as mp:
        if on:
            mp.setattr(speculative, "recall_in_step", lambda cache: False)
        yield


def slots(eng, li):
    """[B, H, k] the page in each slot of layer li: the step's record, or the host's mirror."""
    held = eng.cache.layers[li].state.slots
    return np.asarray(held[:, :, 0]) if held is not None else eng.state.resident[li]


def check_slots(eng, li):
    """Each head's page slots hold the rows of the pages ``slots`` names, and every prompt row of the region is
    the host store's row at its position."""
    st = eng.cache.layers[li].state
    rk, rv, rpos, lengths = (np.asarray(a) for a in layer_rows(eng.cache, li))
    hk, hv = eng.state.store.view(li)
    res, k_sel = slots(eng, li), np.asarray(st.k_sel)
    for b in range(rk.shape[0]):
        s0 = int(eng.state.start[b])
        for h in range(rk.shape[1]):
            n = int(lengths[b, h])
            for j in range(int(k_sel[b])):
                got = rpos[b, h, s0 + j * PS : s0 + (j + 1) * PS]
                np.testing.assert_array_equal(got, s0 + res[b, h, j] * PS + np.arange(PS))
            p = rpos[b, h, :n]
            np.testing.assert_array_equal(rk[b, h, :n], hk[b, h, p])
            np.testing.assert_array_equal(rv[b, h, :n], hv[b, h, p])


@pytest.mark.parametrize("name", list(POLICIES))
def test_a_batch_decodes_as_with_the_host_recall(name):
    prompts = random_prompts([230, 170, 201], seed=3)
    out = {}
    for on in (True, False):
        with host_recall(on):
            toks, logits, eng = greedy_with_logits(MODEL, POLICIES[name], prompts, steps=8)
        assert eng.state.in_step == (not on)
        assert (eng.state.host_operands() != ()) == (not on)
        comp = [li for li, lc in enumerate(eng.cache.layers) if lc.state is not None]
        assert comp
        for li in comp:
            check_slots(eng, li)
        out[on] = toks, logits, {li: slots(eng, li) for li in comp}, eng.state.stats()
    (t_host, l_host, s_host, st_host), (t_step, l_step, s_step, st_step) = out[True], out[False]
    np.testing.assert_array_equal(t_step, t_host)
    np.testing.assert_allclose(l_step, l_host, rtol=1e-5, atol=1e-5)
    for li in s_host:
        np.testing.assert_array_equal(s_step[li], s_host[li])
    assert st_host["pages_recalled"] > 0
    for key in ("steps", "pages_recalled", "bytes_recalled", "pages_per_step"):
        assert st_step[key] == st_host[key], key


@pytest.mark.parametrize("name", list(POLICIES))
def test_session_turns_reselect_as_with_the_host_recall(name):
    """Two turns, the second outgrowing the tail rows (the pool is repacked and the regions move): the answers,
    the slots after each turn and the counters equal the host recall's."""
    ctx, q1, q2 = random_prompt(210, 31), random_prompt(60, 32), random_prompt(20, 33)
    out = {}
    for on in (True, False):
        with host_recall(on):
            sess = Session(MODEL, ctx, POLICIES[name], chat=False, reserve_tokens=8)
            answers, seen = [], []
            for q in (q1, q2):
                answers.append(sess.ask(q, max_new_tokens=5).token_ids)
                comp = [li for li, lc in enumerate(sess.engine.cache.layers) if lc.state is not None]
                for li in comp:
                    check_slots(sess.engine, li)
                seen.append({li: slots(sess.engine, li).copy() for li in comp})
            out[on] = answers, seen, sess.engine.state.stats()
    assert out[False][0] == out[True][0]
    for a, b in zip(out[False][1], out[True][1]):
        for li in a:
            np.testing.assert_array_equal(a[li], b[li])
    for key in ("pages_recalled", "bytes_recalled", "turn_reselections"):
        assert out[False][2][key] == out[True][2][key], key


@pytest.mark.parametrize("name", list(POLICIES))
def test_a_compressed_layer_hands_the_step_four_arrays(name):
    """Each cache leaf is an operand the CPU step takes, donates and returns (microseconds of dispatch each, per
    layer and step): a compressed layer's state is the two page summaries, one [B, 6] array of per-sequence
    counters and, where the step recalls, one [B, H, 2, k] array of resident and pending pages, whose columns are
    the counters prefill planned."""
    prompts = random_prompts([230, 170], seed=5)
    for on in (True, False):
        with host_recall(on):
            _, _, eng = greedy_with_logits(MODEL, POLICIES[name], prompts, steps=6)
        comp = [lc.state for lc in eng.cache.layers if lc.state is not None]
        assert comp
        for st in comp:
            assert len(jax.tree.leaves(st)) == (3 if on else 4)
            assert st.seq.shape == (2, speculative.SEQ_FIELDS) and st.seq.dtype == np.int32
            np.testing.assert_array_equal(np.asarray(st.k_sel), eng.state.k_sel)
            np.testing.assert_array_equal(np.asarray(st.start), eng.state.start)
            np.testing.assert_array_equal(np.asarray(st.prompt_lens), [230, 170])
            if not on:
                assert st.slots.shape[:3] == (2, CFG.num_kv_heads, 2)
        if not on:  # the running counts in the counters' column are what the stats report
            moved = sum(int(np.asarray(st.moved).sum()) for st in comp)
            assert moved == eng.state.stats()["pages_recalled"] > 0
