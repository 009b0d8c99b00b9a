"""FreeKV: pages against a float64 numpy recomputation, logits against a reference cache holding exactly the pages
the previous step's query chose, memory and bytes moved, batches, budget errors."""

import functools
import re

import jax.numpy as jnp
import numpy as np
import pytest

from hetero_jax.model.cache import capacity_bucket
from hetero_jax.model import transformer as M
from hetero_jax.model.cache import layer_rows, prompt_kv_bytes
from hetero_jax.runtime import Engine, prefill
from hetero_jax.policies import BudgetError, FreeKV, PolicyError, make_policy
from hetero_jax.policies import speculative
from hetero_jax.policies.pages import page_bucket
from pool_utils import keep_rows
from tiny_model import greedy_with_logits, tiny_model, random_prompt

MODEL = tiny_model()
CFG, PARAMS = MODEL.config, MODEL.params
H, D = CFG.num_kv_heads, CFG.head_dim
PS, SINKS, WINDOW = 8, 4, 8
L, STEPS = 200, 6
SPARSE = 2  # skip_layers=2: the last layer is the only compressed one, so its queries equal a full-KV run's


@pytest.fixture(autouse=True)
def host_recall(monkeypatch):
    """The host's recall between steps (a GPU's and a mesh's path), whose mirror of the slots (``resident``) and
    hooks these tests read; on one CPU device the steps recall their own pages, held to this path by
    tests/test_page_recall_in_step.py."""
    monkeypatch.setattr(speculative, "recall_in_step", lambda cache: False)




def layout(L):
    """(sinks, window tokens w, pages P) of the explicit S=4, W=8 layout: w = L - S - P*p in [W, W + p)."""
    P = (L - SINKS - WINDOW) // PS
    return SINKS, L - SINKS - P * PS, P


def np_select(q, keys, L, k):
    """numpy float64 MeanS: per query head a softmax of the Quest bound over the selectable pages
    [S, S + P*p), mean over the group, stable top-k per KV head (ascending). q [H, G, D]; keys [H, T, D].
    Returns (pages per head, scores [H, P])."""
    S, _, P = layout(L)
    pages = keys[:, S : S + P * PS].astype(np.float64).reshape(H, P, PS, D)
    lo, hi = pages.min(axis=2), pages.max(axis=2)  # [H, P, D]
    qf = q.astype(np.float64)[:, :, None, :]  # [H, G, 1, D]
    u = np.maximum(qf * lo[:, None], qf * hi[:, None]).sum(-1)  # [H, G, P]
    e = np.exp(u - u.max(-1, keepdims=True))
    score = (e / e.sum(-1, keepdims=True)).mean(axis=1)  # [H, P]
    return [np.sort(np.argsort(-score[h], kind="stable")[:k]) for h in range(H)], score


def same_pages(got, want, score, k):
    """Equal page sets, or different only on float near-ties at the k-th score."""
    if set(got) == set(want):
        return True
    thr = np.sort(score)[::-1][k - 1]
    assert all(abs(score[p] - thr) < 1e-6 for p in set(got) ^ set(want)), (sorted(got), sorted(want))
    return False


@functools.lru_cache(maxsize=None)
def full_run(seed=0):
    """The full-KV greedy run on a 200-token prompt: the tokens fed at each step, the caches they are fed to,
    layer 2's query of every step and of the last prompt token (q_last), layer 2's prompt keys."""
    ids = random_prompt(L, seed)
    logits, cache = prefill(PARAMS, CFG, [ids], tail_capacity=STEPS + 2)
    keys = np.asarray(layer_rows(cache, SPARSE)[0][0])  # [H, L, D]
    _, short = prefill(PARAMS, CFG, [ids[:-1]], tail_capacity=2)  # the last prompt token as a decode step
    _, _, qs = M.decode_step_jit(PARAMS, short, jnp.asarray(ids[-1:], jnp.int32), CFG, return_queries=True)
    q_last = np.asarray(qs[SPARSE][0])
    tok = np.asarray(logits).argmax(-1).astype(np.int32)
    toks, caches, queries = [], [], []
    for _ in range(STEPS):
        toks.append(tok)
        caches.append(cache)
        logits, cache, qs = M.decode_step_jit(PARAMS, cache, jnp.asarray(tok), CFG, return_queries=True)
        queries.append(np.asarray(qs[SPARSE][0]))
        tok = np.asarray(logits).argmax(-1).astype(np.int32)
    return ids, toks, caches, queries, q_last, keys


def spy(eng):
    """Record per step: the resident pages before and after the host recall (before_step), the extras (Sel(q_t))
    and the resident pages the step left. Copies, taken before the next step donates."""
    rec = {"before": [], "recalled": [], "extras": [], "after": []}
    comp = [li for li, lc in enumerate(eng.cache.layers) if lc.state is not None]
    res = lambda cache: {li: eng.state.resident[li].copy() for li in comp}  # noqa: E731  (the host's, the only copy)
    before, after = eng.state.before_step, eng.state.after_step

    def before_step(step, cache):
        rec["before"].append(res(cache))
        cache = before(step, cache)
        rec["recalled"].append(res(cache))
        return cache

    def after_step(step, extras, cache):
        rec["extras"].append({li: np.array(extras[li]) for li in comp})
        rec["after"].append(res(cache))
        after(step, extras, cache)

    eng.state.before_step, eng.state.after_step = before_step, after_step
    return rec


@functools.lru_cache(maxsize=None)
def sparse_run():
    """FreeKV (layer 2 compressed) teacher-forced on the full run's tokens: (engine, record, logits per step)."""
    ids, toks, *_ = full_run()
    pol = FreeKV(budget=0.8, page_size=PS, sinks=SINKS, window=WINDOW, skip_layers=SPARSE)
    eng = Engine(MODEL, [ids], pol, tail_capacity=STEPS + 2)
    prefilled = eng.state.resident[SPARSE][0].copy()
    rec = spy(eng)
    logits = [eng.step_with_logits(t)[1] for t in toks]
    return eng, rec, logits, prefilled


def k_pages():
    return FreeKV(budget=0.8, page_size=PS, sinks=SINKS, window=WINDOW, skip_layers=SPARSE).plan_pages(CFG, L)[3]


def test_pages_equal_a_numpy_meanS_selection_at_prefill_and_every_step():
    """After prefill the page slots hold Sel(q_last); each step's Sel(q_t) (the extra) equals the float64
    numpy MeanS top-k of the same query over the same keys."""
    _, _, _, queries, q_last, keys = full_run()
    k = k_pages()
    assert 1 < k < layout(L)[2]  # a real choice among the pages
    _, rec, _, prefilled = sparse_run()
    want, score = np_select(q_last, keys, L, k)
    for h in range(H):
        same_pages(prefilled[h, :k], want[h], score[h], k)
    exact = 0
    for t, q in enumerate(queries):
        sel = rec["extras"][t][SPARSE]
        assert sel.shape == (1, H, page_bucket(k))  # the bucketed slots: the first k are the sequence's
        want, score = np_select(q, keys, L, k)
        exact += all(same_pages(sel[0, h, :k], want[h], score[h], k) for h in range(H))
    assert exact >= STEPS - 1


def reference_logits(cache, tok, pages):
    """A plain decode step over ``cache`` (full KV: region row j = prompt position j) whose layer 2 holds
    exactly sinks + the given pages + the window."""
    S, w, P = layout(L)
    rows = [np.concatenate([np.arange(S)] + [S + p * PS + np.arange(PS) for p in pages[h]]
                           + [np.arange(L - w, L)]) for h in range(H)]
    ref = keep_rows(cache, SPARSE, np.stack(rows)[None])  # [1, H, n]
    return np.asarray(M.decode_step_jit(PARAMS, ref, jnp.asarray(tok), CFG)[0])


def test_each_step_attends_the_pages_the_previous_query_chose():
    """Step t attends Sel(q_{t-1}) (Sel(q_last) at step 0), recalled by the host before the step: the logits equal
    a plain decode step over a cache holding exactly sinks + those pages + window."""
    eng, rec, logits, _ = sparse_run()
    _, toks, caches, queries, q_last, keys = full_run()
    k = k_pages()
    prev, compared = np_select(q_last, keys, L, k), 0
    for t, q in enumerate(queries):
        held = rec["after"][t][SPARSE][0]  # the page slots the step attended
        np.testing.assert_array_equal(held, rec["recalled"][t][SPARSE][0])  # the step itself moves no page
        if all(same_pages(held[h, :k], prev[0][h], prev[1][h], k) for h in range(H)):
            np.testing.assert_allclose(logits[t], reference_logits(caches[t], toks[t], prev[0]), atol=1e-4,
                                       rtol=1e-4)
            compared += 1
        prev = np_select(q, keys, L, k)
    assert compared >= STEPS - 1
    assert eng.state.stats()["pages_recalled"] > 0
    check_group(eng, SPARSE, k)  # what the recalls wrote


def check_group(eng, li, k):
    """Each head's prompt rows of layer li in the pool are sinks + the pages its ``resident`` names (slot order)
    + window, and every row is the host store's row at its position."""
    S, w, _ = layout(L)
    rk, rv, rpos, lengths = (np.asarray(a) for a in layer_rows(eng.cache, li))
    hk, hv = eng.state.store.view(li)
    res = eng.state.resident[li][0]
    assert (lengths == S + k * PS + w).all()
    for h in range(H):
        length = int(lengths[0, h])
        p = rpos[0, h, :length]
        want = np.concatenate([np.arange(S)] + [S + r * PS + np.arange(PS) for r in res[h, :k]]
                              + [np.arange(L - w, L)])
        np.testing.assert_array_equal(p, want)
        np.testing.assert_array_equal(rk[0, h, :length], hk[0, h, p])
        np.testing.assert_array_equal(rv[0, h, :length], hv[0, h, p])


def test_memory_and_bytes_moved():
    """Device: the prompt rows in the pool (sinks + k pages + window per compressed head) plus summaries and page
    ids stay within rho of the full prompt KV (5% slack for the ids); host: the compressed
    layers' whole prompt, pinned; the pool's rows are the host rows of their positions; bytes_recalled counts
    the rows that moved."""
    ids, rho = random_prompt(L, 1), 0.6
    pol = FreeKV(budget=rho, page_size=PS, sinks=SINKS, window=WINDOW)
    S, w, P, k = pol.plan_pages(CFG, L)
    eng = Engine(MODEL, [ids], pol, tail_capacity=STEPS + 2)
    rec = spy(eng)
    tok = eng.first_tokens(0.0, 1.0)
    for _ in range(STEPS):
        tok, _ = eng.step_with_logits(tok)
    s = eng.stats_fields()
    full_bytes = 2 * L * H * CFG.num_layers * D * 4
    assert [lc.capacity for lc in eng.cache.layers] == [capacity_bucket(n) for n in (L, S + k * PS + w, S + k * PS + w)]
    assert [np.asarray(lc.lengths).tolist() for lc in eng.cache.layers] == \
        [[[L] * H], [[S + k * PS + w] * H], [[S + k * PS + w] * H]]
    assert prompt_kv_bytes(eng.cache) == s["kv_bytes_prompt"] == (L + 2 * (S + k * PS + w)) * H * 2 * D * 4
    assert prompt_kv_bytes(eng.cache) + s["kv_bytes_index"] <= rho * full_bytes * 1.05
    assert s["kv_bytes_index"] >= 2 * 2 * H * P * D * 4  # the summaries are counted
    # achieved rho counts them as the budget does, a page's kmin + kmax as one token's K + V
    rows = L + 2 * (S + k * PS + w + page_bucket(P))  # the summaries allocated (a bucketed page count)
    assert eng.achieved_rho[0] == pytest.approx(rows / (L * CFG.num_layers)) and eng.achieved_rho[0] <= rho
    # host: layers 1 and 2, the whole prompt, pinned
    _, full = prefill(PARAMS, CFG, [ids], tail_capacity=2)
    store = eng.state.store
    assert all(a.sharding.memory_kind == "pinned_host" for a in eng.state.host_arrays())
    # a CPU step recalls from the store in its graph: its rows are bucketed as a key bound (256 for 200 tokens)
    W = capacity_bucket(L)
    assert W == 256 and s["kv_bytes_host"] == 2 * 2 * W * H * D * 4
    for li in (1, 2):
        hk, hv = store.view(li)
        fk, fv, _, _ = layer_rows(full, li)
        np.testing.assert_allclose(hk[:, :, :L], np.asarray(fk), atol=1e-6)
        np.testing.assert_allclose(hv[:, :, :L], np.asarray(fv), atol=1e-6)
        check_group(eng, li, k)
    # the recall's bytes: pages that entered the slots (per head) x p rows x K and V
    moved = sum(len(set(a[li][0, h, :k]) - set(z[li][0, h, :k]))
                for z, a in zip(rec["before"], rec["recalled"]) for li in (1, 2) for h in range(H))
    st = s["policy_stats"]
    assert moved > 0 and st["pages_recalled"] == moved
    assert st["bytes_recalled"] == moved * PS * 2 * D * 4
    # the per-step read: the pool as allocated, the state records and the recalled pages per step, counted
    # twice (read from the host store, written into the pool)
    assert st["steps"] == STEPS
    assert s["kv_bytes_read_per_step"] == int(s["kv_bytes_device"] + s["kv_bytes_index"]
                                              + 2 * moved * PS * 2 * D * 4 / STEPS)
    # a twin state starts from the prefill's pages with zero counters
    twin = eng.state.fresh()
    assert twin.stats()["steps"] == twin.stats()["pages_recalled"] == 0
    assert all(np.array_equal(twin.resident[li], rec["before"][0][li]) for li in (1, 2))


def greedy(policy, prompts, steps=5):
    return greedy_with_logits(MODEL, policy, prompts, steps)


@pytest.mark.parametrize("lens, kw", [
    ((200, 150), dict(sinks=SINKS, window=WINDOW)),
    ((400, 150), dict()),  # default sinks/window differ per sequence
])
def test_batch_equals_one_by_one(lens, kw):
    a, b = random_prompt(lens[0], 3), random_prompt(lens[1], 4)
    pol = FreeKV(budget=0.6, page_size=PS, **kw)
    plans = [pol.plan_pages(CFG, n) for n in lens]
    assert plans[0][3] != plans[1][3]  # different k per sequence
    if "sinks" not in kw:
        assert plans[0][0] != plans[1][0]  # different sinks per sequence
    toks, logits, eng = greedy(pol, [a, b])
    st = eng.stats_fields()["policy_stats"]
    assert st["pages_recalled"] > 0
    for i, ids in enumerate((a, b)):
        t1, l1, _ = greedy(pol, [ids])
        np.testing.assert_array_equal(toks[i], t1[0])
        np.testing.assert_allclose(logits[i], l1[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kw", [dict(sinks=SINKS, window=WINDOW), dict()])
def test_too_small_a_budget_names_the_smallest_rho_that_runs(kw):
    ids = random_prompt(L, 5)
    with pytest.raises(BudgetError, match=r"smallest budget that works for this prompt is rho=([0-9.]+)") as e:
        Engine(MODEL, [ids], FreeKV(budget=0.4, page_size=PS, **kw), tail_capacity=4)
    rho = float(re.search(r"is rho=([0-9.]+[0-9])", str(e.value)).group(1))
    pol = FreeKV(budget=rho, page_size=PS, **kw)
    assert pol.plan_pages(CFG, L)[3] == 1
    with pytest.raises(BudgetError):
        FreeKV(budget=round(rho - 1e-4, 4), page_size=PS, **kw).plan_pages(CFG, L)
    if kw:
        greedy(pol, [ids], steps=2)  # it runs


def test_default_sinks_and_window_are_lowered_until_a_page_fits():
    """Defaults scale with B_c (B_c / 16 rounded to 4) but give way to the page: at 4104 tokens and 32-token
    pages, 4 sinks and a 4-token window leave 128 pages (8 + 128 summaries + one page = 168 rows a head), the
    rule's 12 at the smallest rho only 127 (12 + 28 + 127 + 32 = 199 rows): the named rho is 4's own."""
    pol = FreeKV(budget=0.05)
    with pytest.raises(BudgetError, match="smallest budget") as e:
        pol.plan_pages(CFG, 4104)
    rho = float(re.search(r"is rho=([0-9.]+[0-9])", str(e.value)).group(1))
    n_comp = CFG.num_layers - 1
    assert rho == np.ceil((4104 + n_comp * 168) / (CFG.num_layers * 4104) * 1e4) / 1e4
    assert FreeKV(budget=rho).sinks_window(CFG, 4104) == (4, 4) and FreeKV(budget=rho).plan_pages(CFG, 4104) == \
        (4, 4, 128, 1)
    with pytest.raises(BudgetError):
        FreeKV(budget=round(rho - 1e-4, 4)).plan_pages(CFG, 4104)
    # where the rule's own value leaves room for a page, it is kept: B_c / 16 = 4104 * (0.5 * NL - 1) / (NL - 1)
    b_c = 4104 * (0.5 * CFG.num_layers - 1) / n_comp
    auto = 4 * int(np.floor(b_c / 64 + 0.5))
    assert auto > 4 and FreeKV(budget=0.5).sinks_window(CFG, 4104) == (auto, auto)


def test_registry_and_options():
    assert make_policy("freekv:page_size=16", 0.3) == FreeKV(budget=0.3, page_size=16)
    with pytest.raises(PolicyError, match="tau"):  # the in-step correction's threshold is gone (module docstring)
        make_policy("freekv", 0.3, tau=0.9)
    for bad, name in [(dict(page_size=0), "page_size"), (dict(sinks=-1), "sinks"),
                      (dict(window=1.5), "window"), (dict(skip_layers=True), "skip_layers")]:
        with pytest.raises(PolicyError, match=name):
            FreeKV(**bad)
    with pytest.raises(PolicyError, match="skip_layers"):
        FreeKV(skip_layers=3).plan_pages(CFG, L)
    with pytest.raises(BudgetError, match="too short"):
        FreeKV(budget=1.0, page_size=PS, sinks=SINKS, window=WINDOW).plan_pages(CFG, 19)


def test_a_session_turn_reselects_from_its_last_query_and_attends_the_prompt_densely():
    """After a turn is appended (its chunks attend the whole prompt from the host, as prefill), the page slots
    hold Sel(q) of the turn's last query (numpy MeanS) and the page slots of each head's region in the pool hold
    those pages' tokens (the host rows)."""
    from hetero_jax.runtime import Session

    ctx, question = random_prompt(L, 11), random_prompt(12, 12)
    pol = FreeKV(budget=0.85, page_size=PS, sinks=SINKS, window=WINDOW, skip_layers=SPARSE)
    sess = Session(MODEL, ctx, pol, chat=False, reserve_tokens=8)
    state, seen = sess.engine.state, []
    orig = state.after_extend

    def spy(turn_queries, cache):
        out = orig(turn_queries, cache)
        rk, _, rpos, _ = layer_rows(out, SPARSE)
        seen.append((np.array(turn_queries[SPARSE][0, :, -1]), state.resident[SPARSE][0].copy(),
                     np.array(rpos[0]), np.array(rk[0])))  # copies: the next step donates the cache
        return out

    state.after_extend = spy
    sess.ask(question, max_new_tokens=3)
    (q_last, resident, pos, rows), = seen
    k = resident.shape[-1]
    keys = np.asarray(layer_rows(prefill(PARAMS, CFG, [ctx], tail_capacity=2)[1], SPARSE)[0][0])
    want, score = np_select(q_last, keys, L, k)
    for h in range(H):
        same_pages(resident[h], want[h], score[h], k)
    S, _, _ = layout(L)
    # the page slots hold exactly the resident pages' tokens, slot by slot, and their rows are the host's
    hk, _ = sess.engine.state.store.view(SPARSE)
    for h in range(H):
        got_pages = sorted({(int(t) - S) // PS for t in pos[h, S : S + k * PS]})
        assert got_pages == sorted(resident[h].tolist())
        for j, r in enumerate(resident[h]):
            np.testing.assert_array_equal(pos[h, S + j * PS : S + (j + 1) * PS], S + r * PS + np.arange(PS))
        np.testing.assert_array_equal(rows[h, : S + k * PS], hk[0, h, pos[h, : S + k * PS]])
    assert state.stats()["turn_reselections"] == 1


def test_a_session_whose_tail_outgrows_its_rows_recalls_into_the_moved_regions():
    """A long turn outgrows the tail rows (the pool is repacked, every head's offset moves, ``pool_moved``): the
    recalls after it write into the heads' new regions, so the answers equal a session whose tail never grew, and
    every compressed head's page slots still hold the pages ``resident`` names, with the host's rows."""
    from hetero_jax.runtime import Session

    ctx, q1, q2 = random_prompt(L, 21), random_prompt(150, 22), random_prompt(20, 23)
    pol = FreeKV(budget=0.8, page_size=PS, sinks=SINKS, window=WINDOW)
    answers = []
    for reserve in (8, 600):
        sess = Session(MODEL, ctx, pol, chat=False, reserve_tokens=reserve)
        before = sess.engine.cache.tail_capacity
        answers.append([sess.ask(q, max_new_tokens=6).token_ids for q in (q1, q2)])
        grew = sess.engine.cache.tail_capacity > before
        assert grew == (reserve == 8)
        if grew:
            grown = sess
    assert answers[0] == answers[1]
    assert grown.engine.state.stats()["pages_recalled"] > 0
    k = pol.plan_pages(CFG, L)[3]
    for li in (1, 2):
        check_group(grown.engine, li, k)


@pytest.mark.parametrize("policy, host_call", [
    (FreeKV(budget=0.8, page_size=PS, sinks=SINKS, window=WINDOW), False),
    ("quest-offload", False),
    ("hcattention", False),  # on a CPU backend its host sums read the values in the step's own graph
    ("hcattention-callback", True),  # elsewhere (a GPU) its value sums are host reads by design: a callback
])
def test_no_host_round_trip_inside_the_decode_step(policy, host_call, monkeypatch):
    """FreeKV's and offloaded Quest's page fetches happen between steps: the jitted decode step they run, with the
    engine's host operands, holds no host callback; nor does HCAttention's on a CPU backend (its values are a step
    operand there). Where the values stay behind the device (a GPU; faked here) its host sums are a callback."""
    import jax

    from hetero_jax.policies import HCAttention, Quest

    from hetero_jax.policies.hcattention import decode as hc_decode

    if policy == "hcattention-callback":
        monkeypatch.setattr(hc_decode, "sums_in_step", lambda: False)
    policy = {"quest-offload": Quest(budget=0.7, page_size=PS, full_layers=1, offload=True),
              "hcattention": HCAttention(budget=0.5), "hcattention-callback": HCAttention(budget=0.5)}.get(policy, policy)
    eng = Engine(MODEL, [random_prompt(L, 31)], policy, tail_capacity=4)
    tok = jnp.zeros((1,), jnp.int32)
    host = eng.state.host_operands()
    assert bool(host) == (isinstance(policy, HCAttention) and not host_call)
    jaxpr = jax.make_jaxpr(functools.partial(M.decode_step, cfg=CFG, policy=eng.policy))(PARAMS, eng.cache, tok,
                                                                                         host=host)
    assert ("pure_callback" in str(jaxpr)) == host_call  # the printed jaxpr holds every nested one


def test_not_resident_over_stacked_layers_is_each_heads_set_difference():
    """The recall's membership test (every layer at once, by sorting) against a per-head python set difference,
    within each sequence's k_sel slots: random selections with some slots replaced, page ids up to 3k."""
    from hetero_jax.policies.speculative import not_resident

    rng = np.random.default_rng(3)
    for _ in range(40):
        NL, B, Hh, k = (int(x) for x in rng.integers(1, 5, 3).tolist() + [rng.integers(1, 12)])
        k_sel = rng.integers(1, k + 1, B)
        perms = np.array([[[rng.permutation(3 * k) for _ in range(Hh)] for _ in range(B)] for _ in range(NL)])
        sel, held = perms[..., :k], perms[..., :k].copy()
        swap = rng.random(sel.shape) < 0.3
        held[swap] = perms[..., k:2 * k][swap]
        got = not_resident(sel, held, k_sel)
        want = np.zeros_like(got)
        for li, b, h in np.ndindex(NL, B, Hh):
            kept = set(held[li, b, h, :k_sel[b]].tolist())
            want[li, b, h, :k_sel[b]] = [p not in kept for p in sel[li, b, h, :k_sel[b]]]
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(not_resident(sel[0], held[0], k_sel), want[0])  # one layer, as before
