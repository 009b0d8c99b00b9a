"""HeteroCache runtime: role budgets, host copies, re-selection per turn, drift checks and recall, sessions."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import pallas_kernels

import hetero_jax
from hetero_jax.runtime import Engine, Session
from hetero_jax.policies import BudgetError, FullKV, HeteroCache
from hetero_jax.model.cache import layer_rows
from hetero_jax.profile.clustering import Role
from hetero_jax.profile import HeadProfile, ProfileError
from pool_utils import dense_attention, step_from_dense
from tiny_model import tiny_model, random_prompt

A, V, P, S = Role.ANCHOR, Role.VOLATILE, Role.PIVOT, Role.SATELLITE

MODEL = tiny_model()
CFG, PARAMS = MODEL.config, MODEL.params


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




def greedy(policy, ids, steps=6):
    eng = Engine(MODEL, [ids], policy, tail_capacity=steps + 2)
    tok = eng.first_tokens(0.0, 1.0)
    toks = [int(tok[0])]
    for _ in range(steps):
        tok, _ = eng.step(tok, 0.0, 1.0)
        toks.append(int(tok[0]))
    return toks, eng


def test_rho_one_and_all_volatile_give_full_kv():
    ids = random_prompt(90)
    full, _ = greedy(FullKV(), ids)
    got, eng = greedy(HeteroCache(profile=PROFILE, budget=1.0), ids)
    assert got == full
    assert eng.achieved_rho[0] == 1.0
    volatile = make_profile([[V, V, V]] * 3, ((), (), ()))
    got, eng = greedy(HeteroCache(profile=volatile, budget=1.0), ids)
    assert got == full and eng.state.host_bytes() == 0
    # with nothing to compress a budget below 1 would run at rho = 1: refused, naming the rho that works
    with pytest.raises(BudgetError, match=re.escape("rho=0.5 cannot be kept: the profile has no compressed heads")
                       + ".*" + re.escape("the smallest rho that works is 1 (use budget=1.0")):
        greedy(HeteroCache(profile=volatile, budget=0.5), ids)


def test_batch_equals_one_by_one():
    """Three prompts of different lengths (L_base 15, 50, 25) in one batch: each sequence's logits at every
    step, its achieved rho, its K_base and each of its drift decisions equal those of the same prompt alone.
    tau 0.3 sits among the checks' median overlaps, so some checks drift and some do not, in one sequence
    and not another (issue 37: K_base and the check used the batch's largest L_base for every sequence)."""
    policy = HeteroCache(profile=PROFILE, budget=0.5, window=2, tau_drift=0.3)
    prompts = [random_prompt(n, seed) for n, seed in ((60, 5), (200, 6), (101, 7))]
    forced = np.random.default_rng(3).integers(3, CFG.vocab_size, size=(3, 6))

    def run(idx):
        eng = Engine(MODEL, [prompts[i] for i in idx], policy, tail_capacity=8, is_batch=len(idx) > 1)
        drifts = []  # per check: [B, Np] drift decisions (the median o'_t against tau)
        eng.state.check_observers.append(lambda li, ov, lens, l_base: drifts.append(
            np.median(np.asarray(ov), axis=-1) < policy.drift_threshold))
        k_base = [np.asarray(lc.state.k_base) for lc in eng.cache.layers if lc.state is not None]
        logits = [np.asarray(eng.logits, np.float32)]
        for s in range(forced.shape[1]):
            logits.append(eng.step_with_logits(forced[idx, s])[1])
        return np.stack(logits, 1), np.stack(drifts, 1), k_base, eng  # [B, steps + 1, V], [B, checks, Np]

    batch, bdrift, bbase, beng = run([0, 1, 2])
    assert beng.state.prefilled.l_base.tolist() == [15, 50, 25]
    assert bdrift.any() and not bdrift.all()
    assert any(bdrift[b].any() != bdrift[b].all() for b in range(3))  # a sequence with both outcomes
    assert any((bdrift[:, c] != bdrift[0, c]).any() for c in range(bdrift.shape[1]))  # a check that splits
    for i in range(3):
        alone, adrift, abase, aeng = run([i])
        np.testing.assert_allclose(batch[i], alone[0], atol=5e-5, rtol=0)
        np.testing.assert_array_equal(bdrift[i], adrift[0])
        assert aeng.achieved_rho[0] == pytest.approx(beng.achieved_rho[i])
        for kb, ka in zip(bbase, abase):  # its own L_base positions, then -1 to the batch's width
            lb = ka.shape[-1]
            np.testing.assert_array_equal(kb[i, :, :lb], ka[0])
            assert (kb[i, :, lb:] == -1).all()
    assert beng.state.stats()["recalls"] > 0


def test_prefill_layout_budgets_reservoir_and_bytes():
    L, rho = 200, 0.5
    policy = HeteroCache(profile=PROFILE, budget=rho)
    eng = Engine(MODEL, [random_prompt(L, 1)], policy, tail_capacity=8)
    grid = PROFILE.budgets(rho, L)
    layout = policy.layout(CFG)
    assert layout.perms == ((1, 0, 2), (1, 0, 2), (2, 0, 1))
    for li, lc in enumerate(eng.cache.layers):
        perm = layout.perms[li]
        lengths = np.asarray(lc.lengths[0])
        assert lengths.tolist() == grid[li, list(perm)].tolist()  # each head's own budget, in layout order
        assert lengths.min() >= 1
    # every compressed head's full prompt KV in pinned host memory, equal to the prompt's own KV
    res = [r for r in eng.state.prefilled.store.k if r is not None]
    assert len(res) == 3 and all(r.sharding.memory_kind == "pinned_host" for r in eng.state.host_arrays())
    assert all(r.shape == (1, 2, L, CFG.head_dim) for r in res)  # two compressed heads in each layer
    head_bytes = 2 * L * CFG.head_dim * 4
    assert eng.state.host_bytes_by_role() == {"satellite": 3 * head_bytes, "anchor": 3 * head_bytes}
    assert eng.state.host_bytes() == 6 * head_bytes
    full = Engine(MODEL, [random_prompt(L, 1)], FullKV(), tail_capacity=8)
    for li in range(CFG.num_layers):
        perm, nf = layout.perms[li], eng.state.prefilled.roles[li].n_full
        want = np.asarray(layer_rows(full.cache, li)[0][0])[list(perm[nf:])]
        np.testing.assert_allclose(np.asarray(eng.state.prefilled.store.k[li][0]), want, atol=1e-5, rtol=1e-5)
    full_bytes = L * CFG.num_kv_heads * CFG.num_layers * 2 * CFG.head_dim * 4
    from hetero_jax.model.cache import prompt_kv_bytes
    assert prompt_kv_bytes(eng.cache) <= rho * full_bytes * 1.05
    # the pool holds exactly each head's budget plus the tail rows of every head, nothing padded per head:
    # regions follow each other (layer after layer, head after head), each its count + tail capacity long
    R = eng.cache.tail_capacity
    offsets = np.concatenate([np.asarray(lc.offsets[0]) for lc in eng.cache.layers])
    sizes = np.concatenate([np.asarray(lc.lengths[0]) for lc in eng.cache.layers]) + R
    np.testing.assert_array_equal(offsets, np.cumsum(sizes) - sizes)
    assert eng.cache.pool.num_rows == -(-int(sizes.sum()) // 128) * 128


def test_budget_too_small_and_missing_profile():
    with pytest.raises(BudgetError, match=re.escape("the smallest rho that works is 0.3400 (L_base = 1 token)")):
        Engine(MODEL, [random_prompt(100)], HeteroCache(profile=PROFILE, budget=0.2), tail_capacity=4)
    with pytest.raises(ProfileError, match="ships none"):
        HeteroCache(budget=0.5).bind(MODEL)
    other = make_profile([[A, A]] * 3, ((), (), ()))
    with pytest.raises(ProfileError, match=re.escape("profile is for llama 3 layers x 2 KV heads x head_dim 16, but "
                                                     "the model is llama 3 layers x 3 KV heads")):
        HeteroCache(profile=other).bind(MODEL)


def _pivot_step(q, step, slots):
    """``attend_step`` of a layer with pivots at ``slots`` and no copy head, its o'_t computed as the step's end
    computes them (``overlaps_at_once``): (out, the pivots' share)."""
    from hetero_jax.policies.heterocache.step import attend_step, overlaps_at_once

    out, share, pointer = attend_step(q, step, slots)
    assert pointer is None
    return out, overlaps_at_once((share,))[0]


def _pivot_logits(q, step, slots):
    """The pivots' logits over their prompt rows from the layer's one attention call: [B, Np, G, T]."""
    flags = np.zeros(q.shape[1], np.int32)
    flags[list(slots)] = 1
    _, _, logits = step.attend(q, score_heads=jnp.asarray(flags), score_len=step.layer.capacity)
    return logits[:, list(slots)]


def _np_pooled_max(q, keys):
    """q [W, G, D], keys [T, D] -> pooled (kernel 5, zero pad) softmax, max over G: [W, T]."""
    return _np_pooled_logits(np.einsum("wgd,td->wgt", q, keys) / np.sqrt(keys.shape[-1]))


def _np_pooled_logits(s):
    """Logits [W, G, T] -> pooled (kernel 5, zero pad) softmax, max over G: [W, T]."""
    s = np.asarray(s, np.float64)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    pad = np.pad(p, ((0, 0), (0, 0), (2, 2)))
    pooled = sum(pad[..., i : i + s.shape[-1]] for i in range(5)) / 5
    return pooled.max(1)


@pytest.mark.parametrize("tau", [-1.0, 1.5])  # below / above any normalised overlap (>= -c / (1 - c), <= 1)
def test_drift_thresholds_and_recall_contents(tau):
    L, W, rho = 160, 3, 0.5
    policy = HeteroCache(profile=PROFILE, budget=rho, window=W, tau_drift=tau)
    eng = Engine(MODEL, [random_prompt(L, 2)], policy, tail_capacity=16)
    ctl = eng.state
    tok = eng.first_tokens(0.0, 1.0)
    seen_q = []
    orig_after = ctl.after_step

    def spy(step, extras, cache):  # keep the pivots' pooled scores (the CPU's steps compute them) for the check
        seen_q.append([None if e is None or e[0] is None else np.asarray(e[0][0]) for e in extras])
        orig_after(step, extras, cache)

    ctl.after_step = spy
    # every pivot layer is checked after step W - 1; its recall is planned before step W and lands before W + 1
    check_step = {0: W - 1, 2: W - 1}
    for _ in range(W + 2):
        tok, _ = eng.step(tok, 0.0, 1.0)
    after_recall = ctl.stats()
    assert ctl.recall_steps == ([] if tau < 0 else [W + 1, W + 1])  # one per drifted layer: check step + 2
    assert list(after_recall) == STAT_KEYS  # what GenerationStats and the benchmarks read, in this order
    assert after_recall["trigger_rate"] == after_recall["drift_triggers"] / after_recall["drift_checks"]
    n_pivots = 2
    assert after_recall["drift_checks"] == n_pivots
    if tau < 0:
        assert after_recall["drift_triggers"] == 0 and after_recall["recalls"] == 0
        return
    assert after_recall["drift_triggers"] == n_pivots  # tau > 1: every check drifts
    assert after_recall["recalls"] == 3  # satellites 0, 2 of layer 0 and 0 of layer 2
    grid = PROFILE.budgets(rho, L)
    layout = policy.layout(CFG)
    for li, pivot, sats in ((0, 1, (0, 2)), (2, 2, (0,))):
        perm = list(layout.perms[li])
        p_pos = perm.index(pivot)  # pivot's position in the layout (inside the full group)
        k_rows, v_rows, pos_rows, lengths = (np.asarray(a) for a in layer_rows(eng.cache, li))
        scores = seen_q[check_step[li]][li][0, p_pos, :L]  # the latest step buffered by its check
        order = np.argsort(-scores, kind="stable")
        res_k = np.asarray(eng.state.prefilled.store.k[li])[0]
        res_v = np.asarray(eng.state.prefilled.store.v[li])[0]
        for s in sats:
            s_pos = perm.index(s) - eng.state.prefilled.roles[li].n_full  # among the compressed heads
            h = perm.index(s)  # its layout slot
            l_s = int(grid[li, s])
            assert int(lengths[0, h]) == l_s  # its budget
            want = np.sort(order[:l_s])
            got = pos_rows[0, h, :l_s]
            if not np.array_equal(got, want):  # only float near-ties may differ
                thr = np.sort(scores)[::-1][l_s - 1]
                assert all(abs(scores[t] - thr) < 1e-6 for t in set(got) ^ set(want))
            np.testing.assert_array_equal(k_rows[0, h, :l_s], res_k[s_pos, got])
            np.testing.assert_array_equal(v_rows[0, h, :l_s], res_v[s_pos, got])


@pytest.mark.parametrize("policy", [FullKV(), HeteroCache(profile=PROFILE, budget=1.0, window=2, tau_drift=1.5)])
def test_session_single_turn_equals_generate(policy):
    """A session's single turn (the question appended after prefill, chunked) answers as ``generate`` over
    the whole token stream with full KV: for full KV, and for HeteroCache at rho 1 (every head keeps the
    whole prompt, so its re-selection after the turn and its recalls, every check drifting, keep it too)."""
    ids = random_prompt(100, 5)
    q = random_prompt(6, 6)
    sess = Session(MODEL, ids, policy, chat=False)
    a = sess.ask(q, max_new_tokens=5)
    g = hetero_jax.generate(MODEL, ids + q, max_new_tokens=5, chat=False)
    assert a.token_ids == g.token_ids and len(a.token_ids) == 5
    if isinstance(policy, HeteroCache):  # the turn did re-select and recall (over the whole prompt)
        st = sess.turns[-1].stats.policy_stats
        assert st["reselections"] == 1 and st["recalls"] > 0


@pytest.mark.parametrize("select_window", [1, 8, 16])
def test_compressed_heads_keep_their_top_tokens_and_pivots_their_last_token_k_base(select_window):
    """Every compressed head keeps its own top-l_i tokens by the pooled attention (GQA max) of the last
    ``select_window`` prompt queries, summed, causal (1 = the paper's last token); each pivot's K_base is
    the top-L_base of the last token's. Recomputed in float64 numpy from each layer's inputs."""
    from test_policies import assert_top_set, np_pool, np_probs, np_queries

    L, rho = 150, 0.5
    policy = HeteroCache(profile=PROFILE, budget=rho, select_window=select_window)
    captured = []
    orig = hetero_jax.policies.heterocache.prefill.HeteroPrefill.build_layer

    def spy(self, li, layer, x_in, k_buf, v_buf, lens):
        captured.append((layer, np.asarray(x_in[0]), np.asarray(k_buf[0])))
        return orig(self, li, layer, x_in, k_buf, v_buf, lens)

    hetero_jax.policies.heterocache.prefill.HeteroPrefill.build_layer = spy
    try:
        eng = Engine(MODEL, [random_prompt(L, 9)], policy, tail_capacity=4)
    finally:
        hetero_jax.policies.heterocache.prefill.HeteroPrefill.build_layer = orig
    grid = PROFILE.budgets(rho, L)
    l_base = eng.state.prefilled.l_base[0]
    for li, (layer, x_in, k_buf) in enumerate(captured):
        lc, r = eng.cache.layers[li], eng.state.prefilled.roles[li]
        perm = list(policy.layout(CFG).perms[li])
        keys = k_buf.astype(np.float64)  # [Hkv, T, D], layout order
        t = np.arange(L)
        last = np_pool(np_probs(np_queries(layer, x_in[[L - 1]], [L - 1], CFG), keys, [L - 1], L)).max(2)[:, 0]
        rows = t[L - select_window:]
        window = np_pool(np_probs(np_queries(layer, x_in[rows], rows, CFG), keys, rows, L).sum(1)).max(1)
        k_rows, _, pos_rows, lengths = (np.asarray(a) for a in layer_rows(eng.cache, li))
        for j in range(CFG.num_kv_heads - r.n_full):  # compressed head j: layout slot h
            h = r.n_full + j
            l_i = int(grid[li, perm[h]])
            assert int(lengths[0, h]) == l_i
            kept = pos_rows[0, h, :l_i]
            assert_top_set(kept, window[h] if select_window > 1 else last[h], np.zeros(L, bool), l_i)
            np.testing.assert_array_equal(k_rows[0, h, :l_i], k_buf[h, kept])
        for p in r.pivots:
            k_base = np.asarray(lc.state.k_base[0, p])
            k_base = np.sort(k_base[k_base >= 0])  # its own L_base; -1 pads the row to K_base's bucketed width
            assert_top_set(k_base, last[p], np.zeros(L, bool), l_base)


def test_select_window_must_be_a_positive_int():
    for bad in (0, -3, 2.5, True, np.int64(0)):
        with pytest.raises(ValueError, match=r"select_window must be an integer >= 1 prompt query\b"):
            HeteroCache(profile=PROFILE, select_window=bad)
    assert HeteroCache(profile=PROFILE, select_window=np.int64(8)).select_window == 8  # a numpy sweep's value


def test_drain_waits_for_the_dispatched_drift_check_and_the_recall_in_flight():
    policy = HeteroCache(profile=PROFILE, budget=0.5, window=2, tau_drift=1.5)
    eng = Engine(MODEL, [random_prompt(100, 11)], policy, tail_capacity=8)
    tok = eng.first_tokens(0.0, 1.0)
    for _ in range(2):
        tok, _ = eng.step(tok, 0.0, 1.0)
    _, outs = eng.state.pending  # dispatched after the second step, not yet applied
    assert eng.drain() >= 0.0
    assert len(outs) == 3 and all(a.is_ready() for a in jax.tree.leaves(outs))
    assert eng.state.pending is not None  # drain waits; the recall is still planned before the next step
    tok, _ = eng.step(tok, 0.0, 1.0)  # planned (tau 1.5: it drifted), its rows sent in the background
    rec = eng.state.recall
    assert eng.state.in_flight()[1] is rec and rec.future is not None
    assert eng.drain() >= 0.0 and rec.future.done()
    assert all(a.is_ready() for a in jax.tree.leaves(rec.future.result()[0]))  # the transfers too
    assert eng.state.recall is rec and eng.state.recall_steps == []  # drained, not landed: that is the next step's
    eng.step(tok, 0.0, 1.0)
    assert eng.state.recall is None and eng.state.recall_steps == [3, 3] and eng.state.stats()["recalls"] > 0
    full = Engine(MODEL, [random_prompt(100, 11)], FullKV(), tail_capacity=8)
    assert full.drain() >= 0.0  # no controller: nothing to wait for


def test_every_step_through_a_recall_passes_arguments_committed_alike():
    """The step's executable keeps its fast path only while each argument's committedness is the same: across
    a check, the plan that places new K_base rows and the landing that scatters the recalled rows, every
    argument of every step is committed (the engine commits its inputs; before, K_base came back committed
    and the rest was not, and each such step took the slow path)."""
    eng = Engine(MODEL, [random_prompt(100, 11)], HeteroCache(profile=PROFILE, budget=0.5, window=2, tau_drift=1.5),
                 tail_capacity=8)
    seen, before = [], eng.state.before_step

    def spy(step, cache):
        cache = before(step, cache)
        leaves = jax.tree.leaves((eng.params, cache, eng.key, eng.state.host_operands()))
        seen.append({bool(x.committed) for x in leaves if isinstance(x, jax.Array)})
        return cache

    eng.state.before_step = spy
    tok = eng.first_tokens(0.0, 1.0)
    for _ in range(6):
        tok, _ = eng.step(tok, 0.0, 1.0)
    assert eng.state.stats()["recalls"] > 0 and eng.state.recall_steps  # a recall was planned and landed
    assert seen == [{True}] * 6, seen


def test_a_recall_lands_two_steps_after_its_check_with_the_host_rows_it_planned(monkeypatch):
    """A check after step t (tau 1.5: every pivot drifts) is planned before step t + 1, K_base moving on at
    once, while the satellites keep their rows through step t + 1; before step t + 2 each planned row is in
    its slot: the host copy's K/V at the planned prompt position (numpy views of the pinned store), and
    ``recall_steps`` says t + 2. ``fresh()`` waits for the send and starts without it. A session checkpoint
    taken with the recall in flight, restored after it landed, lands it again (sent anew: its lane moved
    on) with the same rows and token. Same setting as test_drift_thresholds_and_recall_contents (its compiles)."""
    from hetero_jax.policies.heterocache import inflight

    L, W, rho = 160, 3, 0.5
    eng = Engine(MODEL, [random_prompt(L, 2)], HeteroCache(profile=PROFILE, budget=rho, window=W, tau_drift=1.5),
                 tail_capacity=16)
    ctl, sent, real_send = eng.state, [], inflight.send
    monkeypatch.setattr(inflight, "send", lambda *a, **k: sent.append((k["step"], a[4])) or real_send(*a, **k))
    rows_at = lambda: [tuple(map(np.asarray, layer_rows(eng.cache, li))) for li in range(CFG.num_layers)]  # noqa: E731
    base_at = lambda: {li: np.asarray(eng.cache.layers[li].state.k_base) for li in (0, 2)}  # noqa: E731
    prefill_rows, prefill_base = rows_at(), base_at()
    tok = eng.first_tokens(0.0, 1.0)
    for _ in range(W):  # steps 0 .. W - 1: the check is dispatched after step W - 1
        tok, _ = eng.step(tok, 0.0, 1.0)
    assert ctl.pending[0] == W - 1 and not sent
    tok, _ = eng.step(tok, 0.0, 1.0)  # step W: planned before it, sent while it runs, not landed
    assert [s for s, _ in sent] == [W] and ctl.recall is not None and ctl.recall_steps == []
    assert all(not np.array_equal(base_at()[li], prefill_base[li]) for li in (0, 2))  # K_base moved on at once
    for got, want in zip(rows_at(), prefill_rows):  # no row landed yet
        for a, b in zip(got[:3], want[:3]):
            np.testing.assert_array_equal(a, b)
    rec, ck = ctl.recall, eng.checkpoint()
    twin = ctl.fresh()
    assert rec.future.done() and twin.recall is None and twin.lane is not ctl.lane and ctl.recall is rec
    nxt, _ = eng.step(tok, 0.0, 1.0)  # step W + 1: landed before it
    assert ctl.recall is None and ctl.recall_steps == [W + 1, W + 1] and ctl.stats()["recall_wait_s"] >= 0.0
    items = sent[0][1]
    assert len(items) == ctl.stats()["recalls"] == 3  # satellites 0, 2 of layer 0 and 0 of layer 2
    rows = rows_at()
    for li, b, j, slots, positions in items:
        host_k, host_v = ctl.prefilled.store.view(li)
        k_rows, v_rows, pos_rows, _ = rows[li]
        h = ctl.prefilled.roles[li].comp_slots[j]
        idx = ctl.prefilled.store.head_index(li, [h])[0]
        assert len(slots) == int(ctl.prefilled.counts[li][b, j]) and len(set(positions.tolist())) == len(slots)
        np.testing.assert_array_equal(pos_rows[b, h, slots], positions)
        np.testing.assert_array_equal(k_rows[b, h, slots], host_k[b, idx, positions])
        np.testing.assert_array_equal(v_rows[b, h, slots], host_v[b, idx, positions])
    recalled = sum(2 * len(it[4]) * host_k.shape[-1] * host_k.itemsize for it in items)
    assert ctl.stats()["bytes_recalled"] == recalled and ctl.stats()["bytes_copied"] == 0
    # the roofline's read per step: the pool, the state records and the recalled rows over the W + 2 steps,
    # counted twice (read from the host, written into the pool)
    f = eng.stats_fields()
    assert f["kv_bytes_read_per_step"] == int(f["kv_bytes_device"] + f["kv_bytes_index"] + 2 * recalled / (W + 2))
    assert eng.restore(ck) and ctl.recall is rec and ctl.recall_steps == []
    again, _ = eng.step(tok, 0.0, 1.0)
    np.testing.assert_array_equal(again, nxt)
    assert ctl.recall_steps == [W + 1, W + 1] and len(sent) == 1  # sent again by write_rows, not in the background
    for got, want in zip(rows_at(), rows):
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("tau,n_top", [(1.5, 7), (-1.0, 7), (1.5, 0), (0.05, 7)])
def test_drift_check_from_the_buffered_steps(tau, n_top):
    """The check every W steps from what each step's attention wrote (the pivots' logits over their prompt
    rows, one kernel pass), by either schedule: the statistics computed in each step (``pivot_statistics``,
    the CPU's) or all at the check (the buffered logits, a GPU's), over two layers at once (``drift_check``).
    Both give its median o'_t equal to the check by the definition over the buffered queries and the pivots'
    keys (``drift_check_reference``: lax.top_k of every step); drift iff below tau; the recall sets are the
    top-size positions of the latest query's pooled scores (numpy, ascending) when some pivot drifted, -1 when
    none did, none when the recall reads none (n_top 0); each layer's K_base after the check is a drifted
    pivot's top-L_base positions, any other pivot's old K_base.
    The two sequences have their own L_base (6 and 4, the second's K_base padded with -1): each is checked
    and re-based as it would be alone."""
    from hetero_jax.policies.heterocache import drift_check
    from hetero_jax.policies.heterocache.step import PivotBase, pivot_statistics

    rng = np.random.default_rng(5)
    B, Np, W, G, D, T, l_base = 2, 2, 3, 2, 8, 40, 6
    q_buf = rng.standard_normal((B, Np, W, G, D)).astype(np.float32)
    keys = rng.standard_normal((B, Np, T, D)).astype(np.float32)
    k_base = np.stack([rng.permutation(T)[:l_base] for _ in range(B * Np)]).reshape(B, Np, l_base).astype(np.int32)
    own = [l_base, 4]  # each sequence's L_base
    k_base[1, :, own[1]:] = -1
    lengths = np.array([[T, T], [T - 9, T - 9]], np.int32)
    # the pivots as a layer's full heads in the pool, values and a one-token tail beside them
    vals = rng.standard_normal((B, Np, T, D)).astype(np.float32)
    tail_k, tail_v = (rng.standard_normal((B, Np, 4, D)).astype(np.float32) for _ in range(2))
    step = step_from_dense(keys, vals, lengths, tail_k, tail_v, np.ones(B, np.int32),
                           state=PivotBase(k_base=jnp.asarray(k_base)))
    logits = tuple(_pivot_logits(jnp.asarray(q_buf[:, :, w]), step, (0, 1)) for w in range(W))
    stats = tuple(pivot_statistics(lg, jnp.asarray(lengths), jnp.asarray(k_base)) for lg in logits)
    # per pivot two sets (a satellite's l_s and l_s - w, as with a copy window), differing per sequence
    sizes = np.array([[[n_top, n_top - 2]] * Np, [[n_top - 1, 4]] * Np], np.int32)[..., : 2 if n_top else 0]
    K0 = sizes.shape[-1]
    args = lambda shares: ((shares, shares), (jnp.asarray(lengths),) * 2, (jnp.asarray(k_base),) * 2,  # noqa: E731
                           (jnp.asarray(sizes), jnp.pad(jnp.asarray(sizes), ((0, 0), (0, 0), (0, 1)))))
    static = dict(pivot_slots=((0, 1), (0, 1)), l_base=l_base, tau=tau, cap=max(1, n_top))

    def check(shares):  # two layers of the same pivots, the second's sets padded to more: per layer
        drift_all, bases, sets_all, over_all = drift_check(*args(shares), **static)
        assert len(bases) == 2 and all(b.dtype == jnp.int32 for b in bases)  # one K_base per pivot layer
        return tuple((drift_all[:, a:a + Np], base, sets_all[:, a:a + Np, :K], over_all[:, a:a + Np])
                     for a, K, base in ((0, K0, bases[0]), (Np, K0 + 1, bases[1])))

    runs = [check(logits), check(stats)]
    jax.clear_caches()  # how the sets are ranked is chosen at trace time
    try:
        with pallas_kernels.use_kernels("pallas"):  # a GPU's: ranked whether or not a pivot drifted, no cond
            runs.append(check(stats))
            txt = drift_check.trace(*args(stats), **static).lower(lowering_platforms=("cuda",)).as_text()
            assert "stablehlo.case" not in txt and "stablehlo.if" not in txt
    finally:
        jax.clear_caches()
    (drift, new_base, top, overlaps), again = runs[0]
    for got in (again, *runs[1], *runs[2]):  # the same check, whatever the schedule, the target or the layer
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(drift))
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(new_base))
        np.testing.assert_array_equal(np.asarray(got[2])[..., :K0, :], np.asarray(top))
        np.testing.assert_allclose(np.asarray(got[3]), np.asarray(overlaps), atol=1e-6)
    # the definition, each sequence alone with its own L_base
    ref_overlap = np.concatenate([np.asarray(pallas_kernels.drift_check_reference(
        q_buf[b : b + 1], keys[b : b + 1], k_base[b : b + 1, :, : own[b]], own[b], tau, lengths[b : b + 1])[1])
        for b in range(B)])
    np.testing.assert_allclose(np.median(np.asarray(overlaps), axis=-1), np.asarray(ref_overlap), atol=1e-6)
    drift, top, new_base = np.asarray(drift), np.asarray(top), np.asarray(new_base)
    np.testing.assert_array_equal(drift, np.asarray(ref_overlap) < tau)
    if tau == 0.05:
        assert drift.any() and not drift.all()  # the case the two constant thresholds cannot show
    else:  # tau 1.5 is above any normalised overlap, -1 below any
        assert bool(drift.all()) == (tau > 1) and bool(drift.any()) == (tau > 1)
    assert top.shape == (B, Np, sizes.shape[-1], max(1, n_top)) and new_base.shape == (B, Np, l_base)
    for b in range(B):
        for p in range(Np):
            scores = _np_pooled_max(q_buf[b, p, -1][None], keys[b, p, : lengths[b, p]])[0]
            np.testing.assert_allclose(np.asarray(stats[-1][0][b, p, : lengths[b, p]]), scores, rtol=1e-5, atol=1e-7)
            order = np.argsort(-scores, kind="stable")
            if drift[b, p]:  # a drifted pivot's K_base moves on, any other's stays
                np.testing.assert_array_equal(new_base[b, p], np.r_[np.sort(order[: own[b]]),
                                                                     np.full(l_base - own[b], -1)])
            else:
                np.testing.assert_array_equal(new_base[b, p], k_base[b, p])
            for j, size in enumerate(sizes[b, p]):
                want = np.sort(order[:size]) if drift.any() else []
                np.testing.assert_array_equal(top[b, p, j], np.r_[want, np.full(max(1, n_top) - len(want), -1)])


def _np_f32(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def _np_overlap(scores, k_base, length):
    """o'_t of one pivot by the definition (Eq. 9, normalised): its own L_base (K_base's entries >= 0), the top-L_base
    prompt positions of ``scores`` (distinct values here), chance c = L_base / L."""
    base = {int(i) for i in k_base if 0 <= i < length}
    l_base = int((np.asarray(k_base) >= 0).sum())
    top = set(np.argsort(-np.asarray(scores[:length], np.float64), kind="stable")[:l_base].tolist())
    c = l_base / length
    return (len(top & base) / l_base - c) / (1 - c)


def test_every_pivot_layers_overlap_at_once_equals_the_definition_layer_by_layer():
    """``overlaps_at_once``: pivot layers of 2, 1 and 3 pivots, prompt widths 40, 40 and 33, K_base widths 6, 4 and 6
    (padded rows -1), two sequences of their own lengths, and a layer without pivots between them: each layer's
    o'_t is its own pivots' by the definition (numpy), the scores pass through, other entries are untouched."""
    from hetero_jax.policies.heterocache.step import PivotScores, overlaps_at_once

    rng = np.random.default_rng(3)
    layers, want = [], []
    for n_p, T, K, lens in ((2, 40, 6, (40, 31)), (1, 40, 4, (40, 25)), (3, 33, 6, (33, 20))):
        lengths = np.tile(np.asarray(lens, np.int32)[:, None], (1, n_p))
        scores = rng.permutation(2 * n_p * T).reshape(2, n_p, T).astype(np.float32) / (2 * n_p * T)
        scores = np.where(np.arange(T) < lengths[..., None], scores, pallas_kernels.MASK_VALUE).astype(np.float32)
        k_base = np.full((2, n_p, K), -1, np.int32)
        for b in range(2):
            for p in range(n_p):
                own = K - b  # the second sequence's L_base one smaller: its row padded with -1
                k_base[b, p, :own] = rng.permutation(lens[b])[:own]
        layers.append(PivotScores(scores=jnp.asarray(scores), lengths=jnp.asarray(lengths), k_base=jnp.asarray(k_base)))
        want.append(np.array([[_np_overlap(scores[b, p], k_base[b, p], lens[b]) for p in range(n_p)]
                              for b in range(2)]))
    other = jnp.arange(5, dtype=jnp.int32)  # another layer's extra: passed through
    got = jax.jit(overlaps_at_once)((layers[0], None, layers[1], other, layers[2]))
    assert got[1] is None and np.asarray(got[3]).tolist() == list(range(5))
    for g, layer, w in zip((got[0], got[2], got[4]), layers, want):
        np.testing.assert_array_equal(np.asarray(g[0]), np.asarray(layer.scores))
        np.testing.assert_allclose(np.asarray(g[1]), w, atol=1e-6)


def _lowered_cpu_step(backend):
    """The tiny profile's decode step (two pivot layers of one pivot each) lowered for the CPU with ``backend``."""
    eng = Engine(MODEL, [random_prompt(120, 4)], HeteroCache(profile=PROFILE, budget=0.5), tail_capacity=8)
    assert sum(1 for r in eng.policy.layer_roles(CFG) if r.pivots) == 2
    from hetero_jax.runtime.engine import decode_step_jit

    args = (eng.params, eng.cache, jnp.zeros((1,), jnp.int32), jax.random.PRNGKey(0), eng.state.host_operands())
    jax.clear_caches()  # the backend is read at trace time: a trace cached under the other one would be reused
    with pallas_kernels.use_kernels(backend):
        return decode_step_jit.trace(*args, cfg=CFG, policy=eng.policy, mode="greedy").lower().as_text()


def test_cpu_decode_step_ranks_every_pivot_layer_in_one_loop():
    """Without the native kernels the step computes its pivots' o'_t itself; the two pivot layers share one
    bisection loop over both pivots' sortable keys [B, 2, 1, T], not one loop each over [B, 1, 1, T]."""
    txt = _lowered_cpu_step("reference")
    from hetero_jax.model.cache import capacity_bucket

    width = capacity_bucket(120)  # the scores' static width: the prompt's 120 rows, bucketed
    loops = re.findall(rf"stablehlo\.while\(.*?\) : tensor<1x(\d+)x1x{width}xui32>", txt)  # the keys carried first
    assert loops == ["2"], loops


def test_native_cpu_decode_step_computes_statistics_in_the_attention_call_of_each_pivot_layer():
    """With the native kernels each pivot layer's attention, scores and o'_t are one custom call (the logits
    never leave it), the other layers' attention one plain call each, and no bisection loop is left."""
    from pallas_kernels import native

    txt = _lowered_cpu_step("native")
    assert len(re.findall(rf"custom_call @{native.ATTENTION_STATISTICS_TARGET}\(", txt)) == 2
    assert len(re.findall(rf"custom_call @{native.TARGET}\(", txt)) == CFG.num_layers - 2
    assert len(re.findall(rf"custom_call @{native.STATISTICS_TARGET}\(", txt)) == 0
    assert "stablehlo.while" not in txt


@pytest.mark.parametrize("backend", ["reference", "native", "interpret"])
def test_attend_step_pivots_beside_volatiles_and_ragged_heads(backend, monkeypatch):
    """A pivot layer of 2 pivots, a volatile head and two compressed heads of ragged lengths, all in one pool
    with every other row NaN: the step's attention (one call over every head) equals plain attention of
    each head over its own rows and the tail (numpy), and the scores are the pivots' own pooled scores
    (numpy, masked beyond each pivot's length) with their chance-normalised overlaps against K_base by the
    definition, from the same pass: the logits the check pools are each pivot's own q.k over its prompt rows."""
    from hetero_jax.policies.heterocache.step import PivotBase

    rng = np.random.default_rng(11)
    B, G, D, T, R, l_base = 2, 3, 16, 48, 6, 7
    lengths = np.array([[T, T, T, 20, 13], [T - 5, T - 5, T - 5, 9, 20]], np.int32)
    k, v = _np_f32(rng, B, 5, T, D), _np_f32(rng, B, 5, T, D)
    tail_k, tail_v = _np_f32(rng, B, 5, R, D), _np_f32(rng, B, 5, R, D)
    tail_lens = np.array([2, 4], np.int32)
    k_base = np.stack([rng.permutation(T - 5)[:l_base] for _ in range(B * 2)]).reshape(B, 2, l_base)
    step = step_from_dense(k, v, lengths, tail_k, tail_v, tail_lens,
                           state=PivotBase(k_base=jnp.asarray(k_base, jnp.int32)))
    q = jnp.asarray(_np_f32(rng, B, 5, G, D))
    from hetero_jax.policies.heterocache import step as traced

    with pallas_kernels.use_kernels(backend):
        out, share = _pivot_step(q, step, (0, 1))
        logits = _pivot_logits(q, step, (0, 1))
        monkeypatch.setattr(traced, "spread_checks", lambda: False)  # a GPU's schedule: the logits themselves
        _, gpu_share = _pivot_step(q, step, (0, 1))
    want = dense_attention(q, k, v, lengths, tail_k, tail_v, tail_lens)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5)
    assert logits.shape == (B, 2, G, T)
    valid = np.arange(T)[None, None, None, :] < lengths[:, :2, None, None]
    np.testing.assert_array_equal(np.where(valid, np.asarray(gpu_share), 0), np.where(valid, np.asarray(logits), 0))
    scores = pallas_kernels.pivot_pooled_scores(logits, jnp.asarray(lengths[:, :2]))
    want_scores, want_overlap = traced.pivot_statistics(logits, jnp.asarray(lengths[:, :2]), jnp.asarray(k_base))
    np.testing.assert_allclose(np.asarray(share[0]), np.asarray(want_scores), rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(np.asarray(share[1]), np.asarray(want_overlap), atol=1e-6)
    for b in range(B):
        for p in range(2):
            n = lengths[b, p]
            want = np.asarray(q[b, p], np.float64) @ k[b, p, :n].T.astype(np.float64) / np.sqrt(D)
            np.testing.assert_allclose(np.asarray(logits[b, p, :, :n]), want, rtol=1e-5, atol=1e-5)
            want = _np_pooled_max(np.asarray(q[b, p])[None], k[b, p, :n])[0]
            np.testing.assert_allclose(np.asarray(scores[b, p, :n]), want, rtol=1e-5, atol=1e-7)
            assert (np.asarray(scores[b, p, n:]) == pallas_kernels.MASK_VALUE).all()


@pytest.mark.parametrize("backend", ["reference", "native"])
def test_attend_step_copy_heads_point_at_their_most_attended_prompt_row(backend):
    """A layer of pivots (0, 1) and a copy head (3): each copy head's pointer is the argmax of its own pooled
    scores over its prompt rows (numpy, from its q.k), beside the pivots' statistics of the same call; the
    native step computes them inside its attention call, the reference from the returned logits."""
    from hetero_jax.policies.heterocache import step as traced

    rng = np.random.default_rng(5)
    B, G, D, T, R, l_base = 2, 3, 16, 40, 4, 6
    lengths = np.array([[T, T, 11, T, 17], [T - 3, T - 3, 8, T - 9, 30]], np.int32)
    k, v = _np_f32(rng, B, 5, T, D), _np_f32(rng, B, 5, T, D)
    tail_k, tail_v = _np_f32(rng, B, 5, R, D), _np_f32(rng, B, 5, R, D)
    k_base = np.stack([rng.permutation(T - 3)[:l_base] for _ in range(B * 2)]).reshape(B, 2, l_base)
    step = step_from_dense(k, v, lengths, tail_k, tail_v, np.array([1, 3], np.int32),
                           state=traced.PivotBase(k_base=jnp.asarray(k_base, jnp.int32)))
    q = jnp.asarray(_np_f32(rng, B, 5, G, D))
    with pallas_kernels.use_kernels(backend):
        _, share, pointer = jax.jit(lambda q, s: traced.attend_step(q, s, (0, 1), (3,)))(q, step)
    share = traced.overlaps_at_once((share,))[0]
    for b in range(B):
        n = lengths[b, 3]
        want = _np_pooled_max(np.asarray(q[b, 3])[None], k[b, 3, :n])[0]
        assert int(pointer[b, 0]) == int(np.argmax(want))
        for p in range(2):
            n = lengths[b, p]
            want = _np_pooled_max(np.asarray(q[b, p])[None], k[b, p, :n])[0]
            np.testing.assert_allclose(np.asarray(share[0][b, p, :n]), want, rtol=1e-5, atol=1e-7)


def _spy_turns(sess):
    """Record (event, step, numpy turn queries) as the session's controller sees a turn."""
    ctl, log = sess.engine.state, []
    orig_ext, orig_step = ctl.after_extend, ctl.after_step

    def after_extend(queries, cache):
        log.append(("extend", sess.engine.steps, [np.asarray(q) for q in queries]))
        return orig_ext(queries, cache)

    def after_step(step, queries, cache):
        log.append(("step", step, None))
        orig_step(step, queries, cache)

    ctl.after_extend, ctl.after_step = after_extend, after_step
    return log


def test_each_turn_reselects_every_compressed_head_from_the_turn_queries():
    """After each question every compressed head (anchors too) holds its top-l_i positions of the pooled
    attention of the question's queries (summed over all of them, GQA max), recomputed in float64 numpy
    against its prompt keys; rows are the host copy's at those positions, in position order; each pivot's
    K_base is the top-L_base of the question's last query. Budgets and device bytes do not change."""
    from test_policies import assert_top_set, np_pool

    from hetero_jax.model.cache import prompt_kv_bytes

    L, rho = 150, 0.5
    policy = HeteroCache(profile=PROFILE, budget=rho, window=4, tau_drift=0.0)
    sess = Session(MODEL, random_prompt(L, 4), policy, chat=False, reserve_tokens=8)
    eng = sess.engine
    log = _spy_turns(sess)
    grid = PROFILE.budgets(rho, L)
    l_base = int(eng.state.prefilled.l_base[0])
    full_bytes = L * CFG.num_kv_heads * CFG.num_layers * 2 * CFG.head_dim * 4
    bytes_before = prompt_kv_bytes(eng.cache)
    for turn, n_q in enumerate((9, 23)):
        q = random_prompt(n_q, 30 + turn)
        sess.ask(q, max_new_tokens=4)
        ext = [e for e in log if e[0] == "extend"]
        assert len(ext) == turn + 1
        _, _, turn_q = ext[-1]
        n_turn = turn_q[0].shape[2]
        assert n_turn == n_q - 1 + (1 if turn else 0)  # all but the last token; the previous answer's last opens it
        for li, lc in enumerate(eng.cache.layers):
            r = eng.state.prefilled.roles[li]
            perm = list(policy.layout(CFG).perms[li])
            k_rows, v_rows, pos_rows, lengths = (np.asarray(a) for a in layer_rows(eng.cache, li))
            host_k, host_v = (np.asarray(a[0], np.float64) for a in (eng.state.prefilled.store.k[li], eng.state.prefilled.store.v[li]))
            for j in range(CFG.num_kv_heads - r.n_full):
                rows = turn_q[li][0, r.n_full + j].astype(np.float64)  # [n, G, D]
                s = np.einsum("ngd,td->ngt", rows, host_k[j]) / np.sqrt(CFG.head_dim)
                p = np.exp(s - s.max(-1, keepdims=True))
                p /= p.sum(-1, keepdims=True)
                scores = np_pool(p.sum(0)).max(0)  # [L]
                l_i = int(grid[li, perm[r.n_full + j]])
                h = r.comp_slots[j]  # its layout slot
                assert int(lengths[0, h]) == l_i
                kept = pos_rows[0, h, :l_i]
                assert_top_set(kept, scores, np.zeros(L, bool), l_i)
                np.testing.assert_allclose(k_rows[0, h, :l_i], host_k[j, kept], rtol=0, atol=0)
                np.testing.assert_allclose(v_rows[0, h, :l_i], host_v[j, kept], rtol=0, atol=0)
            for pv in r.pivots:
                keys = k_rows[0, pv, :L].astype(np.float64)
                last = _np_pooled_max(turn_q[li][0, pv, -1:].astype(np.float64), keys)[0]
                base = np.asarray(lc.state.k_base[0, pv])
                assert_top_set(np.sort(base[base >= 0]), last, np.zeros(L, bool), l_base)  # -1 pads to the width
        assert prompt_kv_bytes(eng.cache) == bytes_before <= rho * full_bytes * 1.05
    st = sess.turns[-1].stats
    assert st.policy_stats["reselections"] == 2 and st.policy_stats["bytes_reselected"] > 0
    assert st.kv_bytes_host_by_role["anchor"] > 0 and st.kv_bytes_host_by_role["satellite"] > 0


def test_reselection_lands_before_the_answer_and_drops_a_stale_check():
    """The turn's re-selection runs before the decode step of its last token (whose logits give the
    answer's first token); a drift check pending from the previous answer is dropped, not applied over
    the new rows, and so is a recall in flight (planned, not landed); the next check comes W steps into the
    answer, on the answer's queries."""
    W = 3
    policy = HeteroCache(profile=PROFILE, budget=0.5, window=W, tau_drift=1.5)
    sess = Session(MODEL, random_prompt(120, 7), policy, chat=False, reserve_tokens=32)
    log = _spy_turns(sess)
    ctl = sess.engine.state
    dispatched = []
    orig = ctl._dispatch_check
    ctl._dispatch_check = lambda step, cache: (dispatched.append(step), orig(step, cache))
    # W steps (the question's last token and W - 1 more): the check dispatched after the last one is pending
    first = sess.ask(random_prompt(8, 8), max_new_tokens=W, stop=None)
    assert [e[0] for e in log[:2]] == ["extend", "step"]  # re-selected, then the question's last token
    assert ctl.pending is not None and dispatched == [W - 1]
    assert ctl.stats()["recalls"] == 0  # tau 1.5: applied, the pending check would recall every satellite
    # W + 1 steps into the next answer: its own check, planned before the last step, is in flight
    second = sess.ask(random_prompt(5, 9), max_new_tokens=W + 1, stop=None)
    assert ctl.pending is None and ctl.stats()["recalls"] == 0  # dropped by the re-selection: no recall from it
    steps = [e[1] for e in log if e[0] == "step"]
    assert dispatched[0] == steps[0] + W - 1  # W decode steps after the re-selection: the first check
    assert dispatched[1] == steps[W] + W - 1 and ctl.recall is not None and ctl.recall.step == steps[W] + W
    sess.ask(random_prompt(4, 10), max_new_tokens=1)
    assert ctl.recall is None and ctl.stats()["recalls"] == 0 and ctl.recall_steps == []  # dropped, never landed
    assert len(first.token_ids) == W and len(second.token_ids) == W + 1


def test_a_turn_is_encoded_again_over_its_reselected_rows():
    """The turn's first pass ran over the rows selected before it; after re-selecting from its queries the
    engine appends it again, so its tail K/V and logits equal one decode step per token over the
    re-selected cache (independent path, within 1e-4), and differ from the first pass's."""
    import jax.numpy as jnp

    from hetero_jax.model import transformer as M

    n = 13
    eng = Engine(MODEL, [random_prompt(150, 21)], HeteroCache(profile=PROFILE, budget=0.4), tail_capacity=32)
    turn = random_prompt(n, 22)
    first_pass = {}
    orig = eng.state.after_extend

    def spy(queries, cache):
        first_pass["tail_k"] = [_tail_keys(cache, li, n) for li in range(len(cache.layers))]
        return orig(queries, cache)

    eng.state.after_extend = spy
    logits = eng.extend(turn)
    assert int(eng.cache.seq_lens[0]) == 150 + n and int(eng.cache.tail_lens[0]) == n
    assert eng.state.stats()["reselections"] == 1
    # reference: the re-selected cache with the turn taken back, then one decode step per token
    ref = eng.cache.replace(seq_lens=eng.cache.seq_lens - n, tail_lens=eng.cache.tail_lens - n)
    for t in turn:
        want, ref, _ = M.decode_step_jit(eng.params, ref, jnp.asarray([t], jnp.int32), CFG, policy=eng.policy)
    np.testing.assert_allclose(logits, np.asarray(want), atol=1e-4, rtol=1e-4)
    moved = 0.0
    for li, lf in enumerate(first_pass["tail_k"]):
        got = _tail_keys(eng.cache, li, n)
        np.testing.assert_allclose(got, _tail_keys(ref, li, n), atol=1e-4, rtol=1e-4)
        moved = max(moved, float(np.abs(got - lf).max()))
    assert moved > 1e-3  # the re-selection moved rows, so the second pass differs from the first


def _tail_keys(cache, li, n):
    """The first ``n`` tail rows' keys of every head of layer ``li``: [B, H, n, D] (each head's rows right
    after its prompt rows in the pool)."""
    lc = cache.layers[li]
    k, _, _, lengths = (np.asarray(a) for a in layer_rows(cache.replace(tail_lens=cache.tail_lens * 0 + n), li,
                                                           with_tail=True))
    prompt = np.asarray(lc.lengths)
    B, H = prompt.shape
    return np.stack([np.stack([k[b, h, prompt[b, h] : prompt[b, h] + n] for h in range(H)]) for b in range(B)])


def test_session_turn_with_a_long_pasted_document_is_chunked():
    """A turn of hundreds of tokens goes through a few chunked passes (no decode step per token) and
    answers like full KV would when the policy keeps everything (rho 1)."""
    ctx, doc = random_prompt(60, 12), random_prompt(300, 13)
    a = Session(MODEL, ctx, FullKV(), chat=False, reserve_tokens=8)
    b = Session(MODEL, ctx, HeteroCache(profile=PROFILE, budget=1.0), chat=False, reserve_tokens=8)
    ra, rb = a.ask(doc, max_new_tokens=6), b.ask(doc, max_new_tokens=6)
    assert ra.token_ids == rb.token_ids
    assert a.engine.steps == len(ra.token_ids)  # the question's last token + the answer's steps, nothing else
    g = hetero_jax.generate(MODEL, ctx + doc, max_new_tokens=6, chat=False)
    assert ra.token_ids == g.token_ids


def test_layout_orders_each_layer_by_role():
    """One device: each layer's heads in layout order are its pivots, its volatiles (copy heads first), its
    satellites, then its anchors; no head is cut into groups (the pool holds each at its own length)."""
    policy = HeteroCache(profile=COPY_PROFILE, budget=0.5, copy_window=16).bind(MODEL)
    layout = policy.layout(CFG)
    roles = COPY_PROFILE.roles
    order = {P: 0, V: 1, S: 2, A: 3}
    for li, perm in enumerate(layout.perms):
        assert sorted(perm) == [0, 1, 2]
        assert [order[int(roles[li, h])] for h in perm] == sorted(order[int(roles[li, h])] for h in perm)
    assert layout.perms[2] == (2, 1, 0)  # pivot 2, then the copy head 1, then satellite 0


# ------------------------------------------------------------------ copy window
def _copy_profile():
    """PROFILE's roles with copy heads: layer 1's volatile (head 1) and, in layer 2, a volatile head 1
    beside pivot 2 (copy scores 0.5 >= tau_copy 0.3); every other head scores 0."""
    from hetero_jax.profile import ProfileSettings

    base = make_profile([[S, P, S], [A, V, A], [S, V, P]], (((1, (0, 2)),), (), ((2, (0,)),)))
    copy = np.zeros((3, 3))
    copy[1, 1] = copy[2, 1] = 0.5
    return HeadProfile(roles=base.roles, clusters=base.clusters, weights=base.weights, copy_score=copy,
                       architecture="llama", head_dim=CFG.head_dim, settings=ProfileSettings(tau_copy=0.3))


COPY_PROFILE = _copy_profile()


def test_window_slots_and_copy_rows_by_hand():
    from hetero_jax.policies.heterocache.copy_window import copy_rows, window_slots

    kept = np.array([[[0.5, 0.1, 0.9, 0.1, 0.3, 0.7, 0.2, 0.8, -9.0]]])  # slot 8 is past the head's count
    # w = min(4, 8 // 4) = 2: the two least-scored kept rows, ties to the lower slot
    np.testing.assert_array_equal(window_slots(kept, np.array([[8]]), 4), [[[1, 3, -1, -1]]])
    np.testing.assert_array_equal(window_slots(kept, np.array([[3]]), 4), [[[-1, -1, -1, -1]]])  # 3 // 4 = 0
    # forward from the start, skipping the head's other rows; at the prompt's end, back from start - 1
    np.testing.assert_array_equal(copy_rows(5, 4, np.array([6, 8, 2]), 20), [5, 7, 9, 10])
    np.testing.assert_array_equal(copy_rows(16, 6, np.array([17, 3, 14]), 20), [12, 13, 15, 16, 18, 19])
    np.testing.assert_array_equal(copy_rows(-3, 2, np.array([0]), 20), [1, 2])


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_copy_rows_are_the_nearest_free_rows(data):
    """copy_rows (two-stage numpy search) equals the set-difference definition on random cases."""
    from hetero_jax.policies.heterocache.copy_window import copy_rows

    T = data.draw(st.integers(1, 80))
    held = np.asarray(data.draw(st.lists(st.integers(0, T - 1), unique=True, max_size=T - 1)), np.int64)
    w = data.draw(st.integers(1, T - len(held)))
    start = data.draw(st.integers(-3, T + 3))
    np.testing.assert_array_equal(copy_rows(start, w, held, T), _np_copy_rows(min(max(0, start), T), w, held, T))


def test_copy_slots_follow_the_profile():
    p = HeteroCache(profile=COPY_PROFILE, copy_window=16).bind(MODEL)
    assert [p.copy_slots(li) for li in range(3)] == [(), (0,), (1,)]  # after the pivots, volatiles copy-first
    off = HeteroCache(profile=COPY_PROFILE).bind(MODEL)  # the default: no window
    assert off.copy_window == 0 and [off.copy_slots(li) for li in range(3)] == [(), (), ()]
    no_rule = HeteroCache(profile=PROFILE, copy_window=16).bind(MODEL)
    assert [no_rule.copy_slots(li) for li in range(3)] == [(), (), ()]


@pytest.mark.parametrize("backend", ["reference", "native", "interpret"])
def test_attend_reports_the_copy_heads_pointer(backend):
    """Layer 2 of COPY_PROFILE (pivot, copy head, one satellite): ``HeteroCache.attend`` (then ``finish_step``)
    gives plain attention, the pivot's share as ``attend_step`` without copy heads, and as the pointer the copy
    head's most attended
    prompt position by numpy's pooled scores (GQA max)."""
    from hetero_jax.policies.heterocache.step import PivotBase

    p = HeteroCache(profile=COPY_PROFILE, copy_window=16).bind(MODEL)
    rng = np.random.default_rng(5)
    B, G, D, T, S, R, l_base = 2, 3, 16, 40, 12, 4, 6
    lengths = np.array([[T, T, S], [T - 7, T - 7, 9]], np.int32)
    k, v = _np_f32(rng, B, 3, T, D), _np_f32(rng, B, 3, T, D)
    tail_k, tail_v = _np_f32(rng, B, 3, R, D), _np_f32(rng, B, 3, R, D)
    tail_lens = np.array([1, 3], np.int32)
    k_base = jnp.asarray(np.stack([rng.permutation(T - 7)[:l_base] for _ in range(B)])[:, None], jnp.int32)
    step = step_from_dense(k, v, lengths, tail_k, tail_v, tail_lens, state=PivotBase(k_base=k_base))
    q = jnp.asarray(_np_f32(rng, B, 3, G, D))
    with pallas_kernels.use_kernels(backend):
        out, _, extra = p.attend(2, q, step)
        ((pivot, pointer),) = p.finish_step((extra,))  # the step's o'_t, every pivot layer's at once
        _, want_share = _pivot_step(q, step, (0,))
    want = dense_attention(q, k, v, lengths, tail_k, tail_v, tail_lens)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5)
    for a, b in zip(pivot, want_share):  # the pivot's share is attend_step's without copy heads
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert pointer.shape == (B, 1) and pointer.dtype == jnp.int32
    for b in range(B):
        pooled = _np_pooled_max(np.asarray(q[b, 1])[None], k[b, 1, : lengths[b, 1]])[0]
        assert int(pointer[b, 0]) == int(np.argmax(pooled))


def _assert_rows_are_the_host_copy(eng):
    """Every compressed head holds distinct prompt positions, its budget of them, and at each the host copy's
    K/V row; returns per layer the [B, Hc, cap] positions, as the decode state's mirror says."""
    st = eng.state
    out = []
    for li, r in enumerate(st.prefilled.roles):
        counts = st.prefilled.counts[li]
        if not counts.shape[1]:
            out.append(None)
            continue
        host_k, host_v = st.prefilled.store.view(li)
        k_rows, v_rows, pos_rows, lengths = (np.asarray(a) for a in layer_rows(eng.cache, li))
        for b in range(counts.shape[0]):
            for j in range(counts.shape[1]):
                h = r.comp_slots[j]
                c = int(counts[b, j])
                assert int(lengths[b, h]) == c
                pos = pos_rows[b, h, :c]
                assert len(set(pos.tolist())) == c and pos.min() >= 0
                np.testing.assert_array_equal(st.held[li][b, j, :c], pos)  # the mirror is the device's
                np.testing.assert_array_equal(k_rows[b, h, :c], host_k[b, j, pos])
                np.testing.assert_array_equal(v_rows[b, h, :c], host_v[b, j, pos])
        out.append(st.held[li].copy())
    return out


def _np_copy_rows(start, w, others, T):
    """copy_rows by a set difference: the w positions nearest after ``start`` (then before it) not held."""
    free = [t for t in range(T) if t not in set(others.tolist())]
    order = sorted(free, key=lambda t: (t < start, t if t >= start else -t))
    return np.sort(np.asarray(order[:w]))


def test_copy_window_follows_a_copy_pointer():
    """Prefill and the first steps equal copy_window=0's (the window only moves on a copy); a pointer one
    token ahead of the step before moves every compressed head's window slots, its least-scored kept rows,
    to the prompt rows from two tokens before the pointer that the head does not hold, from the host copy;
    its other rows, lengths and shapes stay. A recall then refills a satellite's window (tau 1.5 drifts)."""
    L, rho, W = 160, 0.5, 8
    ids = random_prompt(L, 3)
    off = Engine(MODEL, [ids], HeteroCache(profile=COPY_PROFILE, budget=rho, copy_window=0), tail_capacity=16)
    eng = Engine(MODEL, [ids], HeteroCache(profile=COPY_PROFILE, budget=rho, copy_window=W, window=2,
                                           tau_drift=1.5), tail_capacity=16)
    np.testing.assert_array_equal(np.asarray(eng.logits), np.asarray(off.logits))
    for a, b in zip(jax_leaves(eng.cache), jax_leaves(off.cache)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    st = eng.state
    before = _assert_rows_are_the_host_copy(eng)
    shapes = [np.shape(a) for a in jax_leaves(eng.cache)]
    ptr = 100
    st.pointer_prev, st.pointer_pending = np.array([[40]]), np.array([[ptr]])  # jumped: no copy
    eng.cache = st.before_step(0, eng.cache)
    assert st.counters.copy_moves == 0 and st.window_start[0] == -1
    st.pointer_prev, st.pointer_pending = np.array([[ptr - 1]]), np.array([[ptr]])  # one token on: a copy
    eng.cache = st.before_step(0, eng.cache)
    assert st.counters.copy_moves == 1 and st.window_start[0] == ptr - 2 and st.counters.bytes_copied > 0
    after = _assert_rows_are_the_host_copy(eng)
    assert [np.shape(a) for a in jax_leaves(eng.cache)] == shapes
    for li, j, c, slots in _each_window(st):
        assert len(slots) == min(W, c // 4) > 0
        others = np.delete(before[li][0, j, :c], slots)
        np.testing.assert_array_equal(np.delete(after[li][0, j, :c], slots), others)  # the rest unchanged
        np.testing.assert_array_equal(np.sort(after[li][0, j, slots]), _np_copy_rows(ptr - 2, len(slots), others, L))
    # the pointer stays inside the window's first half: no move; past it: the window moves on
    st.pointer_prev, st.pointer_pending = np.array([[ptr]]), np.array([[ptr + 1]])
    eng.cache = st.before_step(0, eng.cache)
    assert st.counters.copy_moves == 1
    st.pointer_prev, st.pointer_pending = np.array([[ptr + W // 2]]), np.array([[ptr + W // 2 + 1]])
    eng.cache = st.before_step(0, eng.cache)
    assert st.counters.copy_moves == 2 and st.window_start[0] == ptr + W // 2 - 1
    # decode on: drift checks recall satellites every 2 steps and the open window is refilled after them
    tok = eng.first_tokens(0.0, 1.0)
    for _ in range(5):
        tok, _ = eng.step(tok, 0.0, 1.0)
    assert st.stats()["recalls"] > 0
    final = _assert_rows_are_the_host_copy(eng)
    for li, j, c, slots in _each_window(st):
        others = np.delete(final[li][0, j, :c], slots)
        np.testing.assert_array_equal(np.sort(final[li][0, j, slots]),
                                      _np_copy_rows(int(st.window_start[0]), len(slots), others, L))


def _each_window(st):
    """(layer, compressed head, its count, its window slots) of sequence 0, for every head with a window."""
    for li, win in enumerate(st.win):
        if win is None:
            continue
        for j in range(win.shape[1]):
            slots = win[0, j]
            yield li, j, int(st.prefilled.counts[li][0, j]), slots[slots >= 0]


def jax_leaves(tree):
    import jax

    return jax.tree.leaves(tree)


STAT_KEYS = ["drift_checks", "drift_triggers", "trigger_rate", "recalls", "bytes_recalled", "reselections",
             "bytes_reselected", "recall_failures", "recall_wait_s", "copy_moves", "bytes_copied", "copy_failures",
             "reselect_failures"]


def test_counters_are_a_frozen_record_whose_asdict_is_the_stats():
    """``Counters.add`` returns a new record (the old one, kept by a failed hook or a session checkpoint, is
    unchanged); its ``asdict`` has the stats' keys in order, the trigger rate following the counts."""
    import dataclasses

    from hetero_jax.policies.heterocache import Counters

    zero = Counters()
    assert dataclasses.asdict(zero) == dict.fromkeys(STAT_KEYS, 0) and zero.trigger_rate == 0.0
    c = zero.add(drift_checks=8, drift_triggers=2).add(drift_checks=4, recalls=3, bytes_recalled=96)
    assert list(dataclasses.asdict(c)) == STAT_KEYS
    assert (c.drift_checks, c.drift_triggers, c.trigger_rate, c.recalls, c.bytes_recalled) == (12, 2, 2 / 12, 3, 96)
    assert dataclasses.asdict(zero) == dict.fromkeys(STAT_KEYS, 0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.recalls = 0


def test_the_wing_imports_run_one_way_in_the_order_its_docstring_writes():
    """Each module of policies/heterocache/ imports only wing modules listed before it in the package docstring
    (the order docs/architecture.md describes), and no module of it is missing from that list."""
    import ast
    import pathlib

    import hetero_jax.policies.heterocache as wing

    order = re.findall(r"^- ``(\w+)``", wing.__doc__, flags=re.M)
    folder = pathlib.Path(wing.__file__).parent
    assert sorted(order) == sorted(p.stem for p in folder.glob("*.py") if p.stem != "__init__")
    prefix = "hetero_jax.policies.heterocache."
    for i, name in enumerate(order):
        tree = ast.parse((folder / f"{name}.py").read_text())
        used = {n.module[len(prefix):] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                and (n.module or "").startswith(prefix)}
        assert used <= set(order[:i]), (name, used - set(order[:i]))
