"""Quest: pages chosen at each decode step against a numpy recomputation, logits against a reference cache
holding exactly the chosen tokens (offloaded: the previous step's), rho 1 == full KV, bytes, batches."""

import jax
import numpy as np
import pytest

from hetero_jax.model.cache import capacity_bucket
from hetero_jax.model import transformer as M
from hetero_jax.model.cache import layer_rows
from hetero_jax.runtime import Engine, prefill
from hetero_jax.policies import BudgetError, FullKV, Quest, make_policy
from hetero_jax.policies import speculative
from hetero_jax.policies.pages import page_bucket
from pool_utils import keep_rows
from tiny_model import greedy_with_logits, tiny_model

MODEL = tiny_model()
CFG, PARAMS = MODEL.config, MODEL.params
PS = 8


@pytest.fixture(autouse=True)
def host_recall(monkeypatch):
    """The host's recall between steps (a GPU's and a mesh's path), whose mirror of the slots (``resident``) and
    hooks these tests read; on one CPU device the steps recall their own pages, held to this path by
    tests/test_page_recall_in_step.py."""
    monkeypatch.setattr(speculative, "recall_in_step", lambda cache: False)


def prompt(n, seed=0):
    return np.random.default_rng(seed).integers(3, CFG.vocab_size, size=n).tolist()


def oracle_pages(q, keys, L, k):
    """numpy float64: per KV head the k pages with the largest group-max Quest bound, ascending.
    q [H, G, D]; keys [H, T, D] (the first L valid)."""
    P = L // PS
    pages = keys[:, : P * PS].reshape(keys.shape[0], P, PS, -1).astype(np.float64)
    lo, hi = pages.min(axis=2), pages.max(axis=2)  # [H, P, D]
    qf = q.astype(np.float64)[:, :, None, :]
    u = np.maximum(qf * lo[:, None], qf * hi[:, None]).sum(-1).max(axis=1)  # [H, P]
    return [np.sort(np.argsort(-u[h], kind="stable")[: min(k, P)]) for h in range(u.shape[0])], u


def attended_tokens(pages, L):
    P = L // PS
    return np.concatenate([np.arange(p * PS, (p + 1) * PS) for p in pages] + [np.arange(P * PS, L)])


def spy_extras(eng):
    seen, orig = [], eng.state.after_step

    def after_step(step, extras, cache):
        seen.append([None if e is None else np.array(e) for e in extras])
        orig(step, extras, cache)

    eng.state.after_step = after_step
    return seen


def test_pages_and_logits_equal_an_independent_reference():
    """Layer 2 is sparse (full_layers=2), so its queries equal a full-KV run's for the same tokens. Each step:
    the pages equal the numpy top-k of the bound, and the logits equal a plain decode step over a cache whose
    layer 2 holds exactly the oracle's tokens (selected pages + partial page)."""
    L, rho = 150, 0.3
    ids = prompt(L)
    eng = Engine(MODEL, [ids], Quest(budget=rho, page_size=PS, full_layers=2), tail_capacity=8)
    seen = spy_extras(eng)
    k = (round(rho * L) - L % PS) // PS
    _, full = prefill(PARAMS, CFG, [ids], tail_capacity=8)
    keys = np.asarray(layer_rows(full, 2)[0][0])  # [H, L, D]
    tok = eng.first_tokens(0.0, 1.0)
    compared = 0
    for step in range(4):
        _, nxt_full, qs = M.decode_step_jit(PARAMS, full, jax.numpy.asarray(tok), CFG, return_queries=True)
        q = np.asarray(qs[2][0])  # [H, G, D]
        want_pages, u = oracle_pages(q, keys, L, k)
        # reference: the same cache (tail included), layer 2 reduced to the oracle's tokens, through the
        # default attention (full KV's region row j is prompt position j)
        idx = np.stack([attended_tokens(p, L) for p in want_pages])[None]  # [1, H, S]
        want_logits, _ = M.decode_step_jit(PARAMS, keep_rows(full, 2, idx), jax.numpy.asarray(tok), CFG)
        tok, logits = eng.step_with_logits(tok)
        assert seen[-1][0] is None and seen[-1][1] is None  # full layers select nothing
        pages = np.sort(seen[-1][2], axis=-1)  # a set of pages (the step lists them best first)
        assert pages.shape == (1, CFG.num_kv_heads, k)
        for h in range(CFG.num_kv_heads):
            got = pages[0, h]
            if not np.array_equal(got, want_pages[h]):  # only float near-ties may differ
                thr = np.sort(u[h])[::-1][k - 1]
                assert all(abs(u[h][p] - thr) < 1e-4 for p in set(got) ^ set(want_pages[h]))
                continue
        if all(np.array_equal(pages[0, h], want_pages[h]) for h in range(CFG.num_kv_heads)):
            np.testing.assert_allclose(logits, np.asarray(want_logits), atol=1e-4, rtol=1e-4)
            compared += 1
        full = nxt_full
    assert compared >= 3


def greedy(policy, prompts, steps=5):
    return greedy_with_logits(MODEL, policy, prompts, steps)


def test_a_budget_covering_the_prompt_is_full_kv():
    ids = prompt(150, 1)
    want_toks, want_logits, _ = greedy(FullKV(), [ids])
    toks, logits, eng = greedy(Quest(budget=1.0, page_size=PS, full_layers=1), [ids])
    np.testing.assert_array_equal(toks, want_toks)
    np.testing.assert_allclose(logits, want_logits, atol=1e-4, rtol=1e-4)
    assert eng.stats_fields()["policy_stats"]["attended_fraction"] == 1.0


def test_offloaded_step_attends_the_pages_the_previous_query_chose():
    """Offloaded, layer 2 sparse (its queries equal a full-KV run's): step 0 attends the numpy top-k pages of the
    last prompt token's query, step i those of step i-1's query (recalled between the steps), plus the partial
    page; the logits equal a plain decode step over a cache whose layer 2 holds exactly those tokens, and each
    step's selection (its extra) is the numpy top-k of its own query."""
    L, rho = 150, 0.85
    ids = prompt(L, 2)
    pol = Quest(budget=rho, page_size=PS, full_layers=2, offload=True)
    k = pol.plan_pages(CFG, L)[2]
    assert 1 < k < L // PS  # a real choice
    eng = Engine(MODEL, [ids], pol, tail_capacity=8)
    seen = spy_extras(eng)
    _, full = prefill(PARAMS, CFG, [ids], tail_capacity=8)
    keys = np.asarray(layer_rows(full, 2)[0][0])
    _, short = prefill(PARAMS, CFG, [ids[:-1]], tail_capacity=2)  # the last prompt token as a decode step
    _, _, qs = M.decode_step_jit(PARAMS, short, jax.numpy.asarray(ids[-1:], jax.numpy.int32), CFG,
                                 return_queries=True)
    prev = oracle_pages(np.asarray(qs[2][0]), keys, L, k)
    tok = eng.first_tokens(0.0, 1.0)
    compared = 0
    for step in range(5):
        _, nxt_full, qs = M.decode_step_jit(PARAMS, full, jax.numpy.asarray(tok), CFG, return_queries=True)
        now = oracle_pages(np.asarray(qs[2][0]), keys, L, k)
        idx = np.stack([attended_tokens(p, L) for p in prev[0]])[None]
        want_logits, _ = M.decode_step_jit(PARAMS, keep_rows(full, 2, idx), jax.numpy.asarray(tok), CFG)
        tok, logits = eng.step_with_logits(tok)
        resident = eng.state.resident[2][0].copy()  # what the step attended (recalled before it)
        sel = seen[-1][2][0]
        # the slots past k are the bucketed shape's (``pages.page_bucket``), unused
        exact = all(sorted(sel[h][:k]) == sorted(now[0][h]) for h in range(CFG.num_kv_heads))
        held = all(sorted(resident[h][:k]) == sorted(prev[0][h]) for h in range(CFG.num_kv_heads))
        if exact and held:  # a float near-tie at the k-th bound may pick another page
            np.testing.assert_allclose(logits, np.asarray(want_logits), atol=1e-4, rtol=1e-4)
            compared += 1
        prev, full = now, nxt_full
    assert compared >= 4
    assert eng.state.stats()["pages_recalled"] > 0


def test_offloaded_memory_rows_and_bytes():
    """Each head of a sparse layer holds k pages + the partial page in its region of the pool, each row the host
    copy's row at its position and the pages those ``resident`` names; the prompt is on the pinned host; device
    bytes within rho; bytes_recalled counts the pages that entered the slots."""
    L = 150
    ids = prompt(L, 2)
    off = Quest(budget=0.5, page_size=PS, full_layers=1, offload=True)
    k = off.plan_pages(CFG, L)[2]
    toks, _, e_off = greedy(off, [ids])
    s = e_off.stats_fields()
    held = k * PS + L % PS
    assert held <= (k + 1) * PS
    assert all(a.sharding.memory_kind == "pinned_host" for a in e_off.state.host_arrays())
    assert [np.asarray(lc.lengths).tolist() for lc in e_off.cache.layers] == \
        [[[L] * CFG.num_kv_heads], [[held] * CFG.num_kv_heads], [[held] * CFG.num_kv_heads]]
    assert [lc.capacity for lc in e_off.cache.layers] == [capacity_bucket(n) for n in (L, held, held)]
    for li in (1, 2):
        bk, bv, bpos, _ = (np.asarray(a) for a in layer_rows(e_off.cache, li))
        hk, hv = e_off.state.store.view(li)
        resident = e_off.state.resident[li][0]
        for h in range(CFG.num_kv_heads):
            p = bpos[0, h, :held]
            want = np.concatenate([r * PS + np.arange(PS) for r in resident[h][:k]] + [np.arange(L // PS * PS, L)])
            np.testing.assert_array_equal(p, want)  # slot order: page slot j holds resident[j]
            np.testing.assert_array_equal(bk[0, h, :held], hk[0, h, p])
            np.testing.assert_array_equal(bv[0, h, :held], hv[0, h, p])
    full_prompt = 2 * L * CFG.num_kv_heads * CFG.num_layers * CFG.head_dim * 4
    summaries = sum(lc.state.kmin.nbytes + lc.state.kmax.nbytes for lc in e_off.cache.layers if lc.state is not None)
    kept = 2 * 4 * CFG.head_dim * int(sum(np.asarray(lc.lengths).sum() for lc in e_off.cache.layers))
    assert kept == s["kv_bytes_prompt"] and kept + summaries <= 0.5 * full_prompt
    # achieved rho as the budget counts: rows + the summaries (a page's kmin + kmax as one token's K + V)
    rows = L + 2 * (held + page_bucket(L // PS))  # the summaries allocated (a bucketed page count)
    assert e_off.achieved_rho[0] == pytest.approx(rows / (L * CFG.num_layers)) and e_off.achieved_rho[0] <= 0.5
    # two sparse layers; on a CPU the store's rows are bucketed (256 for 150 tokens): the step reads it in its graph
    assert capacity_bucket(L) == 256
    assert s["kv_bytes_host"] == 2 * 2 * capacity_bucket(L) * CFG.num_kv_heads * CFG.head_dim * 4
    st = s["policy_stats"]
    assert st["pages_per_step"] == 2 * CFG.num_kv_heads * k
    assert st["bytes_recalled"] == st["pages_recalled"] * PS * 2 * CFG.head_dim * 4
    # a step reads what the device holds (pool and state records) and the pages it recalled, counted twice
    # (read from the host store, written into the pool)
    assert st["steps"] == 5 and st["pages_recalled"] > 0
    assert s["kv_bytes_read_per_step"] == int(s["kv_bytes_device"] + s["kv_bytes_index"]
                                              + 2 * st["pages_recalled"] * PS * 2 * CFG.head_dim * 4 / 5)
    dev = Quest(budget=0.5, page_size=PS, full_layers=1)
    d = greedy(dev, [ids])[2].stats_fields()
    row = 2 * CFG.head_dim * 4
    attended = 2 * CFG.num_kv_heads * (dev.plan_pages(CFG, L)[2] * PS + L % PS) * row  # two sparse layers
    layer0 = L * CFG.num_kv_heads * row
    assert d["kv_bytes_prompt"] == L * CFG.num_kv_heads * CFG.num_layers * row  # in-device: every prompt row
    assert d["kv_bytes_tail"] == d["kv_bytes_device"] - d["kv_bytes_prompt"]
    assert d["kv_bytes_read_per_step"] == layer0 + attended + d["kv_bytes_index"] + d["kv_bytes_tail"]


@pytest.mark.parametrize("offload", [False, True])
def test_batch_equals_one_by_one(offload):
    a, b = prompt(150, 3), prompt(97, 4)
    pol = Quest(budget=0.6, page_size=PS, full_layers=1, offload=offload)
    toks, logits, _ = greedy(pol, [a, b])
    for i, ids in enumerate((a, b)):
        t1, l1, _ = greedy(pol, [ids])
        np.testing.assert_array_equal(toks[i], t1[0])
        np.testing.assert_allclose(logits[i], l1[0], atol=1e-4, rtol=1e-4)


def test_prompts_shorter_than_a_page_run_alone_as_in_a_batch():
    """Prompts shorter than a page have no page to select: alone (the page axis empty: the step's selection
    failed with "n_select must be in [1, 0]" after prefill) they attend their partial page and the tail,
    as full KV does and as they do beside a longer prompt in a batch."""
    short, other, longer = prompt(5, 7), prompt(3, 8), prompt(60, 9)
    pol = Quest(budget=0.4, page_size=PS, full_layers=1)
    t_full, l_full, _ = greedy(FullKV(), [short])
    t_one, l_one, _ = greedy(pol, [short])
    np.testing.assert_allclose(l_one, l_full, atol=1e-4, rtol=0)
    np.testing.assert_array_equal(t_one, t_full)
    t_b, l_b, _ = greedy(pol, [short, other])  # a batch of short prompts: the same empty page axis
    t_m, l_m, _ = greedy(pol, [longer, short])  # beside a prompt with pages
    for t, lg in ((t_b[0], l_b[0]), (t_m[1], l_m[1])):
        np.testing.assert_allclose(lg, l_one[0], atol=1e-4, rtol=0)
        np.testing.assert_array_equal(t, t_one[0])


def test_offloaded_budget_too_small_names_the_smallest_rho_that_runs():
    ids = prompt(150, 5)
    with pytest.raises(BudgetError, match=r"smallest budget that works for this prompt is rho=([0-9.]+)") as e:
        Engine(MODEL, [ids], Quest(budget=0.35, page_size=PS, full_layers=1, offload=True), tail_capacity=4)
    rho = float(e.value.args[0].rsplit("rho=", 1)[1].split()[0].rstrip(";."))
    assert Quest(budget=rho, page_size=PS, full_layers=1, offload=True).plan_pages(CFG, 150)[2] == 1
    with pytest.raises(BudgetError):
        Quest(budget=round(rho - 1e-4, 4), page_size=PS, full_layers=1, offload=True).plan_pages(CFG, 150)


def test_registry_and_options():
    p = make_policy("quest", 0.2, offload=True, page_size=32)
    assert p == Quest(budget=0.2, offload=True, page_size=32)
    assert make_policy("Quest:offload=true,page-size=32", 0.2) == p  # the spec form of benchmark grids
    assert make_policy("quest:page_size=8", 0.2, offload=True) == Quest(budget=0.2, page_size=8, offload=True)
    with pytest.raises(BudgetError):
        Quest(page_size=0)


def test_session_turn_offloaded_reselects_from_its_last_query():
    """A turn is appended in chunks attending the whole prompt (dense, as Quest's prefill, read from the host
    store); then each sparse layer's page slots hold the numpy top-k pages of the turn's last query. Dense
    Quest (rho 1) answers turns as full KV does."""
    from hetero_jax.runtime import Session

    L = 150
    ctx, q1, q2 = prompt(L, 6), prompt(20, 7), prompt(9, 8)
    off = Quest(budget=0.85, page_size=PS, full_layers=2, offload=True)
    k = off.plan_pages(CFG, L)[2]
    sess = Session(MODEL, ctx, off, chat=False, reserve_tokens=8)
    state, seen = sess.engine.state, []
    orig = state.after_extend

    def spy(turn_queries, cache):
        out = orig(turn_queries, cache)
        seen.append((np.array(turn_queries[2][0, :, -1]), state.resident[2][0].copy()))
        return out

    state.after_extend = spy
    sess.ask(q1, max_new_tokens=3)
    (q_turn, resident), = seen
    keys = np.asarray(layer_rows(prefill(PARAMS, CFG, [ctx], tail_capacity=2)[1], 2)[0][0])
    want, u = oracle_pages(q_turn, keys, L, k)
    for h in range(CFG.num_kv_heads):
        if sorted(resident[h]) != sorted(want[h]):  # only float near-ties may differ
            thr = np.sort(u[h])[::-1][k - 1]
            assert all(abs(u[h][p] - thr) < 1e-4 for p in set(resident[h]) ^ set(want[h]))
    assert state.stats()["turn_reselections"] == 1
    full = Session(MODEL, ctx, FullKV(), chat=False, reserve_tokens=8)
    dense = Session(MODEL, ctx, Quest(budget=1.0, page_size=PS, full_layers=1), chat=False, reserve_tokens=8)
    assert [full.ask(q, max_new_tokens=4).token_ids for q in (q1, q2)] == \
        [dense.ask(q, max_new_tokens=4).token_ids for q in (q1, q2)]


def test_in_device_pages_through_the_pallas_kernel_equal_the_reference(monkeypatch):
    """With 16-token pages the in-device step attends its pages, partial page and tail in place through the
    Pallas pool kernel (interpret mode here), one paged call per sparse layer and step; its logits equal the
    plain-JAX reference's on a batch of two prompts of different lengths."""
    import pallas_kernels
    from hetero_jax.runtime.compile_cache import release_executables

    pol = Quest(budget=0.4, page_size=16, full_layers=1)
    prompts = [prompt(150, seed=3), prompt(97, seed=4)]
    paged_calls = []
    kernel = pallas_kernels.pool_attention_pallas

    def spy(*a, **kw):
        paged_calls.append(len(a) > 6 and a[6] is not None)
        return kernel(*a, **kw)

    monkeypatch.setattr(pallas_kernels, "pool_attention_pallas", spy)
    runs = {}
    for mode in ("reference", "interpret"):
        release_executables()  # the kernel choice is read at trace time
        try:
            with pallas_kernels.use_kernels(mode):
                runs[mode] = greedy_with_logits(MODEL, pol, prompts, steps=4)[:2]
        finally:
            release_executables()
    assert sum(paged_calls) == CFG.num_layers - 1  # traced once: every sparse layer of the step, paged
    np.testing.assert_array_equal(runs["interpret"][0], runs["reference"][0])
    np.testing.assert_allclose(runs["interpret"][1], runs["reference"][1], atol=1e-4, rtol=1e-4)
