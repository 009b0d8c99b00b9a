"""HeteroCache runtime: role budgets, pinned-host reservoir, drift checks and recall, sessions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hetero_jax
from hetero_jax import spec
from hetero_jax.config import ModelConfig
from hetero_jax.generate import Engine, Session
from hetero_jax.hub import Model
from hetero_jax.policies import BudgetError, FullKV, HeteroCache
from hetero_jax.profile.clustering import Role
from hetero_jax.profile.format import HeadProfile, ProfileError

A, V, P, S = Role.ANCHOR, Role.VOLATILE, Role.PIVOT, Role.SATELLITE

CFG = ModelConfig(architecture="llama", vocab_size=101, hidden_size=48, intermediate_size=64, num_layers=3,
                  num_heads=9, num_kv_heads=3, head_dim=16, rms_norm_eps=1e-5, max_position_embeddings=1024,
                  eos_token_ids=(0,))
PARAMS = jax.tree.map(jnp.asarray, spec.init_params(CFG, seed=6, scale=0.3))


class _Tok:
    """Enough of a tokenizer for token-id prompts."""
    eos_token_ids = (0,)

    def decode(self, ids):
        return " ".join(map(str, ids))


MODEL = Model(config=CFG, params=PARAMS, tokenizer=_Tok(), path="", name="tiny")


def make_profile(roles, clusters, weights=None):
    roles = np.asarray(roles, np.int8)
    if weights is None:
        weights = np.where(np.isin(roles, [A, S]), 1.0, np.nan)
        comp = np.isin(roles, [A, S])
        rng = np.random.default_rng(0)
        if comp.any():
            weights[comp] = rng.uniform(0.6, 1.4, comp.sum())
            weights[comp] /= weights[comp].mean()
    return HeadProfile(roles=roles, clusters=clusters, weights=np.asarray(weights, np.float64),
                       architecture="llama", head_dim=CFG.head_dim)


# layer 0: pivot 1 with satellites 0, 2; layer 1: anchor, volatile, anchor; layer 2: satellite 0 of pivot 2, anchor 1
PROFILE = make_profile([[S, P, S], [A, V, A], [S, A, P]], (((1, (0, 2)),), (), ((2, (0,)),)))


def prompt(n, seed=0):
    return np.random.default_rng(seed).integers(3, CFG.vocab_size, size=n).tolist()


def greedy(policy, ids, steps=6):
    eng = Engine(MODEL, [ids], policy, tail_capacity=steps + 2)
    tok = eng.first_tokens(0.0, 1.0)
    toks = [int(tok[0])]
    for _ in range(steps):
        tok, _ = eng.step(tok, 0.0, 1.0)
        toks.append(int(tok[0]))
    return toks, eng


def test_rho_one_and_all_volatile_give_full_kv():
    ids = prompt(90)
    full, _ = greedy(FullKV(), ids)
    got, eng = greedy(HeteroCache(profile=PROFILE, budget=1.0), ids)
    assert got == full
    assert eng.achieved_rho[0] == 1.0
    volatile = make_profile([[V, V, V]] * 3, ((), (), ()))
    got, eng = greedy(HeteroCache(profile=volatile, budget=1.0), ids)
    assert got == full and eng.plan.host_bytes() == 0
    # with nothing to compress a budget below 1 would run at rho = 1: refused, naming the rho that works
    with pytest.raises(BudgetError, match=r"rho=0.5 cannot be kept: the profile has no compressed heads.*"
                                          r"smallest rho that works is 1"):
        greedy(HeteroCache(profile=volatile, budget=0.5), ids)


def test_prefill_layout_budgets_reservoir_and_bytes():
    L, rho = 200, 0.5
    policy = HeteroCache(profile=PROFILE, budget=rho)
    eng = Engine(MODEL, [prompt(L, 1)], policy, tail_capacity=8)
    grid = PROFILE.budgets(rho, L)
    layout = policy.layout(CFG)
    assert layout.perms == ((1, 0, 2), (1, 0, 2), (2, 0, 1))
    for li, lc in enumerate(eng.cache.layers):
        perm = layout.perms[li]
        lengths = np.concatenate([np.asarray(g.lengths[0]) for g in lc.groups])
        assert lengths.tolist() == grid[li, list(perm)].tolist()  # each head's own budget, in layout order
        assert lengths.min() >= 1
    # satellites' full prompt KV in pinned host memory
    res = [r for r in eng.plan.reservoir_k if r is not None]
    assert len(res) == 2 and all(r.sharding.memory_kind == "pinned_host" for r in res)
    assert res[0].shape == (1, 2, L, CFG.head_dim) and res[1].shape == (1, 1, L, CFG.head_dim)
    assert eng.plan.host_bytes() == sum(2 * r.nbytes for r in res)
    full_bytes = L * CFG.num_kv_heads * CFG.num_layers * 2 * CFG.head_dim * 4
    from hetero_jax.cache import prompt_kv_bytes
    assert prompt_kv_bytes(eng.cache) <= rho * full_bytes * 1.05
    # compressed heads are their own groups, exactly their budget long
    for li, lc in enumerate(eng.cache.layers):
        for g in lc.groups:
            assert g.capacity == int(np.asarray(g.lengths).max())


def test_budget_too_small_and_missing_profile():
    with pytest.raises(BudgetError, match="smallest rho that works is 0.3"):
        Engine(MODEL, [prompt(100)], HeteroCache(profile=PROFILE, budget=0.2), tail_capacity=4)
    with pytest.raises(ProfileError, match="ships none"):
        HeteroCache(budget=0.5).bind(MODEL)
    other = make_profile([[A, A]] * 3, ((), (), ()))
    with pytest.raises(ProfileError, match="3 KV heads"):
        HeteroCache(profile=other).bind(MODEL)


def _np_pooled_max(q, keys):
    """q [W, G, D], keys [T, D] -> pooled (kernel 5, zero pad) softmax, max over G: [W, T]."""
    s = np.einsum("wgd,td->wgt", q, keys) / np.sqrt(keys.shape[-1])
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    pad = np.pad(p, ((0, 0), (0, 0), (2, 2)))
    pooled = sum(pad[..., i : i + keys.shape[0]] for i in range(5)) / 5
    return pooled.max(1)


@pytest.mark.parametrize("tau", [0.0, 1.5])
def test_drift_thresholds_and_recall_contents(tau):
    L, W, rho = 160, 3, 0.5
    policy = HeteroCache(profile=PROFILE, budget=rho, window=W, tau_drift=tau, stagger_checks=True)
    eng = Engine(MODEL, [prompt(L, 2)], policy, tail_capacity=16)
    ctl = eng.controller
    tok = eng.first_tokens(0.0, 1.0)
    seen_q = []
    orig_after = ctl.after_step

    def spy(step, queries, cache):  # keep the pivot queries for the independent check
        seen_q.append([np.asarray(q) for q in queries])
        orig_after(step, queries, cache)

    ctl.after_step = spy
    # staggered checks: layer 0's pivot is checked after step W - 1 (phase 0), layer 2's after step W
    # (phase 1); each recall lands before the step that follows its check
    assert ctl.phase[[0, 2]].tolist() == [0, 1]
    check_step = {0: W - 1, 2: W}
    for _ in range(W + 2):
        tok, _ = eng.step(tok, 0.0, 1.0)
    after_recall = ctl.stats()
    n_pivots = 2
    assert after_recall["drift_checks"] == n_pivots
    if tau == 0.0:
        assert after_recall["drift_triggers"] == 0 and after_recall["recalls"] == 0
        return
    assert after_recall["drift_triggers"] == n_pivots  # tau > 1: every check drifts
    assert after_recall["recalls"] == 3  # satellites 0, 2 of layer 0 and 0 of layer 2
    grid = PROFILE.budgets(rho, L)
    layout = policy.layout(CFG)
    for li, pivot, sats in ((0, 1, (0, 2)), (2, 2, (0,))):
        perm = list(layout.perms[li])
        p_pos = perm.index(pivot)  # pivot's position in the layout (inside the full group)
        keys = np.asarray(eng.cache.layers[li].groups[0].k[0, p_pos, :L])  # full heads never change
        q_last = seen_q[check_step[li]][li][0, p_pos]  # the latest step buffered by its check: [G, D]
        scores = _np_pooled_max(q_last[None], keys)[0]
        order = np.argsort(-scores, kind="stable")
        groups = eng.cache.layers[li].groups
        res_k = np.asarray(eng.plan.reservoir_k[li])[0]
        res_v = np.asarray(eng.plan.reservoir_v[li])[0]
        for s in sats:
            s_pos = perm.index(s) - eng.plan.roles[li].n_full  # among the compressed heads
            comp = groups[1 + s_pos]  # each compressed head is its own group, after the full group
            l_s = int(grid[li, s])
            assert comp.capacity == l_s  # exactly its budget: no padding
            want = np.sort(order[:l_s])
            got = np.asarray(comp.positions[0, 0, :l_s])
            if not np.array_equal(got, want):  # only float near-ties may differ
                thr = np.sort(scores)[::-1][l_s - 1]
                assert all(abs(scores[t] - thr) < 1e-6 for t in set(got) ^ set(want))
            res_idx = eng.plan.roles[li].satellites.index(s_pos)
            np.testing.assert_array_equal(np.asarray(comp.k[0, 0, :l_s]), res_k[res_idx, got])
            np.testing.assert_array_equal(np.asarray(comp.v[0, 0, :l_s]), res_v[res_idx, got])
            assert int(comp.lengths[0, 0]) == l_s


def test_anchors_never_change_and_session_turns():
    policy = HeteroCache(profile=PROFILE, budget=0.5, window=2, tau_drift=1.5)
    sess = Session(MODEL, prompt(120, 4), policy, chat=False, reserve_tokens=8)
    anchors = lambda: [np.asarray(g.k) for g in sess.engine.cache.layers[1].groups[1:]]  # noqa: E731
    anchors_before = anchors()
    for turn in range(3):
        res = sess.ask(prompt(7, 10 + turn), max_new_tokens=5)
        assert len(res.token_ids) >= 1
    assert res.stats.recall["recalls"] > 0  # drift detected across turns (tau > 1)
    for a, b in zip(anchors(), anchors_before):
        np.testing.assert_array_equal(a, b)
    assert sess.engine.cache.tail_capacity >= int(np.asarray(sess.engine.cache.tail_lens)[0])


def test_check_at_the_end_of_each_question():
    """window 50 > any question + answer here: the only checks are the ones at the end of each question,
    one per pivot (2 pivots), each recalling (tau > 1) before the answer's second token."""
    policy = HeteroCache(profile=PROFILE, budget=0.5, window=50, tau_drift=1.5)
    sess = Session(MODEL, prompt(120, 4), policy, chat=False, reserve_tokens=8)
    steps = 0
    for turn in range(2):
        q = prompt(6, 20 + turn)
        res = sess.ask(q, max_new_tokens=3)
        st = res.stats.recall
        assert (st["drift_checks"], st["drift_triggers"]) == (2 * (turn + 1), 2 * (turn + 1))
        # the check follows the question's last step (steps - 1); its recall is applied before the next
        # step, the one that appends the answer's first token
        steps += len(q) + (1 if turn else 0)  # the previous answer's last token opens this turn
        assert sess.engine.controller.recall_steps[-1] == steps
        steps += len(res.token_ids) - 1
    assert st["recalls"] == 2 * 3  # 3 satellites per check


@pytest.mark.parametrize("policy", [FullKV(), HeteroCache(profile=PROFILE, budget=0.6)])
def test_session_single_turn_equals_generate(policy):
    ids = prompt(100, 5)
    q = prompt(6, 6)
    sess = Session(MODEL, ids, policy, chat=False)
    a = sess.ask(q, max_new_tokens=5)
    # the same tokens through generate: the question is appended after prefill in the session,
    # so compare against a session-free run of the same token stream with full KV
    if isinstance(policy, FullKV):
        g = hetero_jax.generate(MODEL, ids + q, max_new_tokens=5, chat=False)
        assert a.token_ids == g.token_ids


def test_own_recall_gives_each_satellite_its_own_top_rows():
    """recall="own": after a forced drift each satellite holds the reservoir rows at the top-l_s of
    its own latest query scored against its own prompt keys (numpy, float64)."""
    L, W, rho = 160, 3, 0.5
    policy = HeteroCache(profile=PROFILE, budget=rho, window=W, tau_drift=1.5, recall="own", stagger_checks=True)
    eng = Engine(MODEL, [prompt(L, 3)], policy, tail_capacity=16)
    ctl = eng.controller
    tok = eng.first_tokens(0.0, 1.0)
    seen_q = []
    orig_after = ctl.after_step

    def spy(step, queries, cache):
        seen_q.append([np.asarray(q) for q in queries])
        orig_after(step, queries, cache)

    ctl.after_step = spy
    check_step = {0: W - 1, 2: W}  # staggered: see test_drift_thresholds_and_recall_contents
    for _ in range(W + 2):
        tok, _ = eng.step(tok, 0.0, 1.0)
    assert ctl.stats()["recalls"] == 3 and ctl.stats()["bytes_scored_on_host"] > 0
    grid = PROFILE.budgets(rho, L)
    layout = policy.layout(CFG)
    for li, sats in ((0, (0, 2)), (2, (0,))):
        perm = list(layout.perms[li])
        groups = eng.cache.layers[li].groups
        res_k = np.asarray(eng.plan.reservoir_k[li])[0]
        for s in sats:
            h_pos = perm.index(s)  # satellite's position in the layer's layout
            s_pos = h_pos - eng.plan.roles[li].n_full
            res_idx = eng.plan.roles[li].satellites.index(s_pos)
            q_last = seen_q[check_step[li]][li][0, h_pos].astype(np.float64)  # [G, D] at the check step
            scores = _np_pooled_max(q_last[None], res_k[res_idx, :L].astype(np.float64))[0]
            l_s = int(grid[li, s])
            want = np.sort(np.argsort(-scores, kind="stable")[:l_s])
            comp = groups[1 + s_pos]
            got = np.asarray(comp.positions[0, 0, :l_s])
            if not np.array_equal(got, want):  # only float near-ties may differ
                thr = np.sort(scores)[::-1][l_s - 1]
                assert all(abs(scores[t] - thr) < 1e-6 for t in set(got) ^ set(want))
            np.testing.assert_array_equal(np.asarray(comp.k[0, 0, :l_s]), res_k[res_idx, got])


def test_unknown_recall_mode_is_refused():
    with pytest.raises(ValueError, match="recall must be one of pivot, own"):
        HeteroCache(profile=PROFILE, recall="satellite")


def test_check_phases_balance_pivots_over_the_window():
    from hetero_jax.policies.heterocache import check_phases

    # pivots per layer 2, 0, 1, 1, 3, 1 over W = 3: layer 0 -> phase 0 (load 2,0,0), layer 2 -> 1 (2,1,0),
    # layer 3 -> 2 (2,1,1), layer 4 -> 1 (2,4,1), layer 5 -> 2 (2,4,2); layer 1 has no pivot
    assert check_phases([2, 0, 1, 1, 3, 1], 3, True).tolist() == [0, 0, 1, 2, 1, 2]
    assert check_phases([2, 0, 1, 1, 3, 1], 3, False).tolist() == [0] * 6
    assert check_phases([1, 1], 1, True).tolist() == [0, 0]


@pytest.mark.parametrize("stagger", [True, False])
def test_staggered_checks_keep_every_pivot_on_a_window_period(stagger):
    """Each pivot layer is checked every W steps on W buffered queries; staggering spreads the layers over
    the steps (never two layers on one step here), without it they all go on the same steps. A session's
    question is followed by a check of every layer at its end and W steps later, both on one step; then
    each layer goes back to its phase."""
    W = 3
    prof = make_profile([[S, P, A], [P, A, S], [A, S, P]], (((1, (0,)),), ((0, (2,)),), ((2, (1,)),)))
    policy = HeteroCache(profile=prof, budget=0.6, window=W, tau_drift=0.0, stagger_checks=stagger)
    sess = Session(MODEL, prompt(120, 7), policy, chat=False, reserve_tokens=32)
    ctl = sess.engine.controller
    log = []  # (step, layers, buffered steps)
    orig = ctl._dispatch_check

    def spy(step, cache, layers):
        log.append((step, tuple(layers), len(ctl.buffer)))
        orig(step, cache, layers)

    ctl._dispatch_check = spy
    q = prompt(8, 8)
    res = sess.ask(q, max_new_tokens=16)
    assert len(res.token_ids) >= 2 * W + 3  # the answer spans the re-check and one check of every layer
    want_phase = [0, 1, 2] if stagger else [0, 0, 0]
    assert ctl.phase.tolist() == want_phase
    q_end = len(q) - 1  # the step that appends the question's last token
    # the question's end: every layer checked at that step (by the schedule or by end_of_chunk)
    assert sorted(sum((ls for st, ls, _ in log if st == q_end), ())) == [0, 1, 2]
    resync = q_end + W
    assert [ls for st, ls, _ in log if st == resync] == [(0, 1, 2)]
    regular = [(st, ls, n) for st, ls, n in log if st != q_end]
    for li in range(3):
        steps = [st for st, ls, _ in regular if li in ls]
        before = [st for st in steps if st < q_end]
        after = [st for st in steps if st > resync]
        assert before == [W - 1 + want_phase[li] + k * W for k in range(len(before))] and before
        assert after == [resync + W + want_phase[li] + k * W for k in range(len(after))] and after
    if stagger:
        assert all(len(ls) == 1 for st, ls, _ in regular if st != resync)
    else:
        assert all(len(ls) == 3 for _, ls, _ in regular)
    assert all(n == W for _, _, n in regular)  # every scheduled check sees W buffered queries


@pytest.mark.parametrize("select_window", [1, 8, 16])
def test_compressed_heads_keep_their_top_tokens_and_pivots_their_last_token_k_base(select_window):
    """Every compressed head keeps its own top-l_i tokens by the pooled attention (GQA max) of the last
    ``select_window`` prompt queries, summed, causal (1 = the paper's last token); each pivot's K_base is
    the top-L_base of the last token's. Recomputed in float64 numpy from each layer's inputs."""
    from test_policies import assert_top_set, np_pool, np_probs, np_queries

    L, rho = 150, 0.5
    policy = HeteroCache(profile=PROFILE, budget=rho, select_window=select_window)
    captured = []
    orig = hetero_jax.policies.heterocache.HeteroPrefill.build_layer

    def spy(self, li, layer, x_in, k_buf, v_buf, lens):
        captured.append((layer, np.asarray(x_in[0]), np.asarray(k_buf[0])))
        return orig(self, li, layer, x_in, k_buf, v_buf, lens)

    hetero_jax.policies.heterocache.HeteroPrefill.build_layer = spy
    try:
        eng = Engine(MODEL, [prompt(L, 9)], policy, tail_capacity=4)
    finally:
        hetero_jax.policies.heterocache.HeteroPrefill.build_layer = orig
    grid = PROFILE.budgets(rho, L)
    l_base = eng.plan.l_base[0]
    for li, (layer, x_in, k_buf) in enumerate(captured):
        lc, r = eng.cache.layers[li], eng.plan.roles[li]
        perm = list(policy.layout(CFG).perms[li])
        keys = k_buf.astype(np.float64)  # [Hkv, T, D], layout order
        t = np.arange(L)
        last = np_pool(np_probs(np_queries(layer, x_in[[L - 1]], [L - 1], CFG), keys, [L - 1], L)).max(2)[:, 0]
        rows = t[L - select_window:]
        window = np_pool(np_probs(np_queries(layer, x_in[rows], rows, CFG), keys, rows, L).sum(1)).max(1)
        for j in range(CFG.num_kv_heads - r.n_full):  # compressed head j: its own group
            h = r.n_full + j
            l_i = int(grid[li, perm[h]])
            g = lc.groups[(1 if r.n_full else 0) + j]
            assert int(g.lengths[0, 0]) == l_i
            kept = np.asarray(g.positions[0, 0, :l_i])
            assert_top_set(kept, window[h] if select_window > 1 else last[h], np.zeros(L, bool), l_i)
            np.testing.assert_array_equal(np.asarray(g.k[0, 0, :l_i]), k_buf[h, kept])
        for p in r.pivots:
            k_base = np.sort(np.asarray(lc.aux["k_base"][0, p]))
            assert_top_set(k_base, last[p], np.zeros(L, bool), l_base)


def test_select_window_must_be_a_positive_int():
    for bad in (0, -3, 2.5):
        with pytest.raises(ValueError, match="select_window must be an int >= 1"):
            HeteroCache(profile=PROFILE, select_window=bad)


def test_drain_waits_for_the_dispatched_drift_check():
    policy = HeteroCache(profile=PROFILE, budget=0.5, window=2, tau_drift=1.5, stagger_checks=False)
    eng = Engine(MODEL, [prompt(100, 11)], policy, tail_capacity=8)
    tok = eng.first_tokens(0.0, 1.0)
    for _ in range(2):
        tok, _ = eng.step(tok, 0.0, 1.0)
    _, outs, _ = eng.controller.pending  # dispatched after the second step, not yet applied
    assert eng.drain() >= 0.0
    assert all(a.is_ready() for out in outs if out is not None for a in out)
    assert eng.controller.pending is not None  # drain waits; the recall still lands before the next step
    full = Engine(MODEL, [prompt(100, 11)], FullKV(), tail_capacity=8)
    assert full.drain() >= 0.0  # no controller: nothing to wait for


@pytest.mark.parametrize("tau,n_top", [(1.5, 7), (0.0, 7), (1.5, 0)])
def test_drift_layer_ranks_the_latest_query_only_when_a_pivot_drifted(tau, n_top):
    """_drift_layer's recall rows: the top-n_top positions of the latest query's pooled scores (numpy
    reference, best first) when some pivot drifted (tau 1.5 > any overlap), zeros when none did
    (tau 0) or when the recall does not use them (n_top 0)."""
    from hetero_jax.policies.heterocache import _drift_layer, host_pooled_scores

    rng = np.random.default_rng(5)
    B, Np, W, G, D, T, l_base = 2, 2, 3, 2, 8, 40, 6
    q_buf = rng.standard_normal((B, Np, W, G, D)).astype(np.float32)
    keys = rng.standard_normal((B, Np, T, D)).astype(np.float32)
    k_base = np.stack([rng.permutation(T)[:l_base] for _ in range(B * Np)]).reshape(B, Np, l_base).astype(np.int32)
    lengths = np.array([[T, T], [T - 9, T - 9]], np.int32)
    drift, _, top = _drift_layer(q_buf, keys, k_base, lengths, l_base=l_base, tau=tau, n_top=n_top)
    top = np.asarray(top)
    assert top.shape == (B, Np, n_top)
    assert bool(np.asarray(drift).all()) == (tau > 1) and bool(np.asarray(drift).any()) == (tau > 1)
    for b in range(B):
        for p in range(Np):
            if tau > 1 and n_top:
                scores = host_pooled_scores(q_buf[b, p, -1], keys[b, p], int(lengths[b, p]))
                np.testing.assert_array_equal(top[b, p], np.argsort(-scores, kind="stable")[:n_top])
            else:
                assert not top[b, p].any()
