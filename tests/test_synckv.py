"""SyncKV: k-means head groups, R-head token choice at prefill, anticipations every m steps, budgets, sessions.

Every check recomputes what SyncKV keeps or fetches in float64 numpy from the model's own inputs (captured
x_in, queries handed to the decode hooks, prompt keys) and compares sets, rows and bytes.
"""

import dataclasses
import itertools
import re

import numpy as np
import pytest

import hetero_jax
from hetero_jax.model.cache import capacity_bucket
from hetero_jax.model.cache import layer_rows, prompt_kv_bytes
from hetero_jax.runtime import Engine, Session
from hetero_jax.policies import BudgetError, FullKV, HeteroCache, SyncKV, make_policy
from hetero_jax.policies.synckv import SyncPrefill
from hetero_jax.profile.calibrate import calibrate_tokens
from hetero_jax.profile.clustering import Role, kmeans_rows, smallest_working_rho, synckv_roles
from hetero_jax.profile import HeadProfile, ProfileError, build_synckv_profile, load_profile
from tiny_model import greedy_with_logits, tiny_model

V, P, S, A = Role.VOLATILE, Role.PIVOT, Role.SATELLITE, Role.ANCHOR
MODEL = tiny_model()
CFG = MODEL.config
H, G, D = CFG.num_kv_heads, CFG.group_size, CFG.head_dim


def sync_profile(roles, clusters):
    roles = np.asarray(roles, np.int8)
    return HeadProfile(roles=roles, clusters=clusters, weights=np.where(roles == S, 1.0, np.nan),
                       architecture="llama", head_dim=D)


# layer 0: R=1 with NR 0, 2; layer 1: R=0 with NR 1, 2; layer 2: R=2 with NR 0, 1 (PEERS.md 2.4)
PROFILE = sync_profile([[S, P, S], [P, S, S], [S, S, P]], (((1, (0, 2)),), ((0, (1, 2)),), ((2, (0, 1)),)))
N_R, N_NR = 3, 6


def prompt(n, seed=0):
    return np.random.default_rng(seed).integers(3, CFG.vocab_size, size=n).tolist()


# ------------------------------------------------------------------ numpy references
def np_probs_max(q, keys):
    """q [G, D], keys [T, D] (float64) -> softmax(q k / sqrt(D)) per query head, max over G: [T]."""
    s = np.einsum("gd,td->gt", np.asarray(q, np.float64), np.asarray(keys, np.float64)) / np.sqrt(D)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)).max(0)


def assert_same_set(got, scores, want_order, n, excluded=()):
    """``got`` (positions) is the top-``n`` of ``scores`` outside ``excluded``; float near-ties may differ."""
    got = set(int(x) for x in got)
    want = set(int(x) for x in want_order[:n])
    assert len(got) == n and not got & set(int(x) for x in excluded)
    if got != want:
        thr = np.sort(np.delete(scores, list(excluded)) if len(excluded) else scores)[::-1][n - 1]
        for t in got ^ want:
            assert abs(scores[t] - thr) <= 1e-6 * max(1.0, thr), (t, scores[t], thr)


def top_order(scores, excluded=()):
    s = np.asarray(scores, np.float64).copy()
    s[list(excluded)] = -np.inf
    return np.argsort(-s, kind="stable")


# ------------------------------------------------------------------ k-means / grouping
def brute_force_kmeans(x, n):
    """Lowest-inertia partition of the rows of x into n non-empty clusters, by enumeration."""
    best = None
    for lab in itertools.product(range(n), repeat=len(x)):
        lab = np.array(lab)
        if len(set(lab.tolist())) < n or lab[0] != 0:  # every cluster used; fix the first label (symmetry)
            continue
        inertia = sum(((x[lab == j] - x[lab == j].mean(0)) ** 2).sum() for j in range(n))
        if best is None or inertia < best[0] - 1e-12:
            best = (inertia, lab)
    return best


@pytest.mark.parametrize("h,f,n", [(7, 3, 2), (6, 6, 3), (8, 2, 4)])
def test_kmeans_rows_finds_the_brute_force_optimum_and_nearest_representatives(h, f, n):
    x = np.random.default_rng(h * 10 + n).standard_normal((h, f))
    got = kmeans_rows(x, n)
    inertia, lab = brute_force_kmeans(x, n)
    assert got.inertia == pytest.approx(inertia, rel=1e-12, abs=1e-12)
    as_sets = lambda labels: sorted(tuple(np.flatnonzero(labels == j)) for j in range(n))  # noqa: E731
    assert as_sets(got.labels) == as_sets(lab)
    for j in range(n):
        members = np.flatnonzero(got.labels == j)
        c = x[members].mean(0)
        np.testing.assert_allclose(got.centroids[j], c, rtol=1e-12, atol=1e-12)
        d = np.sqrt(((x[members] - c) ** 2).sum(-1))
        assert got.representatives[j] == members[np.argmin(d)]  # nearest member, ties to the lower index
    assert list(got.representatives) == sorted(got.representatives)  # clusters numbered by representative
    again = kmeans_rows(x, n)
    assert np.array_equal(again.labels, got.labels) and again.inertia == got.inertia


def test_kmeans_rows_restart_path_is_deterministic_and_a_lloyd_fixed_point():
    """C(12, 5) = 792 > 256 initialisations: 32 k-means++ restarts with seed 0; the result is a fixed point
    of Lloyd (each point at its nearest centroid, each centroid its members' mean) and repeatable."""
    x = np.random.default_rng(3).standard_normal((12, 4))
    a, b = kmeans_rows(x, 5), kmeans_rows(x, 5)
    assert np.array_equal(a.labels, b.labels) and a.inertia == b.inertia
    d = ((x[:, None] - a.centroids[None]) ** 2).sum(-1)
    assert np.array_equal(np.argmin(d, 1), a.labels)
    for j in range(5):
        np.testing.assert_allclose(a.centroids[j], x[a.labels == j].mean(0), atol=1e-12)
    assert set(a.labels.tolist()) == set(range(5))
    one = kmeans_rows(x, 12)
    assert sorted(one.labels.tolist()) == list(range(12)) and one.inertia == 0.0


def test_synckv_roles_cluster_rows_of_the_distance_and_make_singletons_volatile():
    # heads 0-2 attend alike, head 3 elsewhere; 2 clusters: {0, 1, 2} and the singleton {3}
    s = np.array([[1.0, 0.8, 0.7, 0.1], [0.8, 1.0, 0.75, 0.15], [0.7, 0.75, 1.0, 0.2], [0.1, 0.15, 0.2, 1.0]])
    ra = synckv_roles(s[None], 2)
    d = s.max() - s
    inertia, lab = brute_force_kmeans(d, 2)
    big = np.flatnonzero(lab == lab[0]) if (lab == lab[0]).sum() == 3 else np.flatnonzero(lab != lab[0])
    c = d[big].mean(0)
    rep = int(big[np.argmin(np.sqrt(((d[big] - c) ** 2).sum(-1)))])
    assert big.tolist() == [0, 1, 2] and rep == 1
    assert ra.roles[0].tolist() == [S, P, S, V]
    assert ra.clusters == (((1, (0, 2)),),)
    prof = build_synckv_profile(s[None], 2, architecture="llama", head_dim=D)
    assert prof.settings.method == "synckv" and prof.settings.n_clusters == 2
    assert np.isnan(prof.weights[0, [1, 3]]).all() and (prof.weights[0, [0, 2]] == 1.0).all()


# ------------------------------------------------------------------ prefill
def test_prefill_keeps_the_r_heads_last_token_top_k_split_static_dynamic():
    L, rho = 160, 0.6
    policy = SyncKV(profile=PROFILE, budget=rho, m=3)
    captured = []
    orig = SyncPrefill.build_layer

    def spy(self, li, layer, x_in, k_buf, v_buf, lens):
        captured.append((layer, np.asarray(x_in[0]), np.asarray(k_buf[0]), np.asarray(v_buf[0])))
        return orig(self, li, layer, x_in, k_buf, v_buf, lens)

    SyncPrefill.build_layer = spy
    try:
        eng = Engine(MODEL, [prompt(L, 1)], policy, tail_capacity=8)
    finally:
        SyncPrefill.build_layer = orig
    from test_policies import np_queries

    k = int(np.floor((rho * 9 - N_R) * L / N_NR))  # the B1 rule (Eq. 7 with weights 1)
    k_dyn = k // 2
    k_s = k - k_dyn
    st = eng.state
    assert st.prefilled.k.tolist() == [k] and st.prefilled.k_dyn.tolist() == [k_dyn]
    for li, (layer, x_in, k_buf, v_buf) in enumerate(captured):
        lc = eng.cache.layers[li]
        # the R-head (layout slot 0) keeps its whole prompt, each NR head (slots 1, 2) exactly k rows
        assert lc.capacity == capacity_bucket(L) and np.asarray(lc.lengths).tolist() == [[L, k, k]]
        rows_k, rows_v, rows_pos, _ = (np.asarray(a) for a in layer_rows(eng.cache, li))
        np.testing.assert_array_equal(rows_pos[0, 0], np.arange(L))
        np.testing.assert_array_equal(rows_k[0, 0], k_buf[0, :L])
        assert np.all(rows_pos[0, 1:, k:] == -1)  # nothing past an NR head's k rows
        q = np_queries(layer, x_in[[L - 1]], [L - 1], CFG)[0, 0]  # R-head = layout position 0: [G, D]
        scores = np_probs_max(q, k_buf[0, :L])
        order = top_order(scores)
        pos = rows_pos[0, 1:, :k]
        for j in range(2):  # both NR heads hold the R-head's positions, their own rows
            assert np.array_equal(pos[j], pos[0])
            np.testing.assert_array_equal(rows_k[0, 1 + j, :k], k_buf[1 + j, pos[j]])
            np.testing.assert_array_equal(rows_v[0, 1 + j, :k], v_buf[1 + j, pos[j]])
        static, dyn = pos[0, :k_s], pos[0, k_s:]
        assert np.all(np.diff(static) > 0) and np.all(np.diff(dyn) > 0)  # each part in position order
        assert_same_set(static, scores, order, k_s)
        assert_same_set(np.concatenate([static, dyn]), scores, order, k)
        np.testing.assert_array_equal(np.asarray(lc.state.static_idx[0, 0]), static)
        # the host store holds the NR heads' full prompt KV
        np.testing.assert_array_equal(np.asarray(st.prefilled.store.k[li][0]), k_buf[1:, :L])
        np.testing.assert_array_equal(np.asarray(st.prefilled.store.v[li][0]), v_buf[1:, :L])
    assert all(a.sharding.memory_kind == "pinned_host" for a in st.host_arrays())
    head_bytes = 2 * L * D * 4
    assert st.host_bytes() == N_NR * head_bytes == st.host_bytes_by_role()["satellite"]
    full_bytes = L * H * CFG.num_layers * 2 * D * 4
    device = prompt_kv_bytes(eng.cache) + st.index_bytes(eng.cache)
    assert device == (N_R * L + N_NR * k) * 2 * D * 4 + CFG.num_layers * k_s * 4
    assert device <= rho * full_bytes * 1.02
    assert st.stats()["bytes_rho"] == pytest.approx(device / full_bytes)
    assert eng.achieved_rho[0] == pytest.approx((N_R * L + N_NR * k) / (9 * L))


@pytest.mark.parametrize("rho", [0.45, 0.8])
def test_device_bytes_stay_within_rho(rho):
    L = 200
    eng = Engine(MODEL, [prompt(L, 2)], SyncKV(profile=PROFILE, budget=rho), tail_capacity=4)
    full_bytes = L * H * CFG.num_layers * 2 * D * 4
    assert prompt_kv_bytes(eng.cache) + eng.state.index_bytes(eng.cache) <= rho * full_bytes * 1.05
    assert eng.achieved_rho[0] <= rho


# ------------------------------------------------------------------ decode
def test_anticipation_every_m_steps_lags_one_step_and_fetches_the_non_static_top_k():
    L, rho, m = 160, 0.6, 3
    eng = Engine(MODEL, [prompt(L, 3)], SyncKV(profile=PROFILE, budget=rho, m=m), tail_capacity=16)
    st = eng.state
    k_s, k_dyn = int(st.prefilled.k_s[0]), int(st.prefilled.k_dyn[0])
    seen = []
    orig_after = st.after_step

    def spy(step, extras, cache):
        seen.append([None if e is None else np.asarray(e) for e in extras])
        orig_after(step, extras, cache)

    st.after_step = spy
    k = int(st.prefilled.k[0])
    # the NR heads' (layout slots 1, 2) prompt rows: k, v [B, 2, k, D], positions [B, 2, k]
    snap = lambda: [tuple(np.asarray(a)[:, 1:, :k].copy() for a in layer_rows(eng.cache, li)[:3])  # noqa: E731
                    for li in range(CFG.num_layers)]
    before = snap()
    tok = eng.first_tokens(0.0, 1.0)
    after = []
    for _ in range(2 * m + 1):
        tok, _ = eng.step(tok, 0.0, 1.0)
        after.append(snap())
    same = lambda a, b: all(np.array_equal(x, y) for la, lb in zip(a, b) for x, y in zip(la, lb))  # noqa: E731
    # steps 0 .. m-1 run on the prefill rows (the anticipation after step m-1 lands before step m)
    assert all(same(before, after[s]) for s in range(m))
    assert not same(after[m - 1], after[m])
    assert same(after[m], after[m + 1]) and same(after[m + 1], after[2 * m - 1])  # suspension: no I/O
    assert not same(after[2 * m - 1], after[2 * m])
    for li in range(CFG.num_layers):
        keys = np.asarray(layer_rows(eng.cache, li)[0][0, 0, :L])  # the R-head's prompt keys (never change)
        static = before[li][2][0, 0, :k_s]
        res_k, res_v = (np.asarray(a[li][0]) for a in (st.prefilled.store.k, st.prefilled.store.v))
        for step, snapshot in ((m - 1, after[m]), (2 * m - 1, after[2 * m])):
            scores = np_probs_max(seen[step][li][0, 0], keys)
            order = top_order(scores, static)
            k_nr, v_nr, pos = snapshot[li]
            for j in range(2):
                np.testing.assert_array_equal(pos[0, j, :k_s], static)  # the static part never moves
                dyn = pos[0, j, k_s:]
                assert_same_set(dyn, scores, order, k_dyn, excluded=static)
                np.testing.assert_array_equal(k_nr[0, j], res_k[j, pos[0, j]])
                np.testing.assert_array_equal(v_nr[0, j], res_v[j, pos[0, j]])
    s = st.stats()
    assert s["anticipations"] == 2 and s["layer_anticipations"] == 2 * CFG.num_layers
    # the steps live on the state (as HeteroCache's): in the stats every turn's result copied the growing list
    assert st.recall_steps == [m, 2 * m] and "recall_steps" not in s
    assert s["rows_requested"] == 2 * CFG.num_layers * 2 * k_dyn
    assert 0 < s["rows_recalled"] <= s["rows_requested"]
    assert s["bytes_recalled"] == s["rows_recalled"] * 2 * D * 4
    moved = [(set(a[li][2][0, j]) ^ set(b[li][2][0, j])) for a, b in ((before, after[m]), (after[m], after[2 * m]))
             for li in range(CFG.num_layers) for j in range(2)]
    assert s["rows_recalled"] == sum(len(x) for x in moved) // 2  # each moved row swaps one position for another
    assert s["recalls"] == sum(bool(x) for x in moved)
    # the roofline's read per step: the pool, the state records and the moved rows over the 2m + 1 steps,
    # counted twice (read from the host, written into the pool)
    f = eng.stats_fields()
    assert f["kv_bytes_read_per_step"] == int(f["kv_bytes_device"] + f["kv_bytes_index"]
                                              + 2 * s["rows_recalled"] * 2 * D * 4 / (2 * m + 1))


def test_a_failed_anticipation_keeps_the_rows_and_the_next_one_lands(monkeypatch):
    """A host -> device transfer that fails while an anticipation is applied leaves every pool row, the host
    mirror and the counters as they were (RuntimeWarning); the next anticipation moves the rows."""
    import warnings

    import jax

    L, m = 160, 2
    eng = Engine(MODEL, [prompt(L, 3)], SyncKV(profile=PROFILE, budget=0.6, m=m), tail_capacity=8)
    st = eng.state
    failing, real_put = [False], jax.device_put

    def flaky(x, *a, **k):
        if failing[0] and isinstance(x, np.ndarray):
            raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: injected transfer failure")
        return real_put(x, *a, **k)

    monkeypatch.setattr(jax, "device_put", flaky)
    rows = lambda: [np.asarray(a) for li in range(CFG.num_layers) for a in layer_rows(eng.cache, li)]  # noqa: E731
    tok = eng.first_tokens(0.0, 1.0)
    for _ in range(m):
        tok, _ = eng.step(tok, 0.0, 1.0)
    assert st.pending is not None  # dispatched after step m - 1, applied before step m
    before, mirror = rows(), {li: d.copy() for li, d in st.dyn.items()}
    failing[0] = True
    with pytest.warns(RuntimeWarning, match=r"anticipation before decode step 2 failed \(JaxRuntimeError: RESOURCE"):
        eng.cache = st.before_step(m, eng.cache)
    failing[0] = False
    assert all(np.array_equal(a, b) for a, b in zip(before, rows()))
    assert all(np.array_equal(st.dyn[li], mirror[li]) for li in mirror)
    s = st.stats()
    assert s["recall_failures"] == 1 and s["anticipations"] == 0 and s["rows_recalled"] == 0
    assert s["layer_anticipations"] == 0 and s["rows_requested"] == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(m):
            tok, _ = eng.step(tok, 0.0, 1.0)
        eng.cache = st.before_step(eng.steps, eng.cache)
    s = st.stats()
    assert s["anticipations"] == 1 and s["rows_recalled"] > 0 and s["layer_anticipations"] == CFG.num_layers
    assert not all(np.array_equal(a, b) for a, b in zip(before, rows()))


def test_rho_one_equals_full_kv():
    ids = prompt(120, 4)
    t_full, l_full, _ = greedy_with_logits(MODEL, FullKV(), [ids], steps=8)
    for ratio in (0.5, 0.0, 1.0):
        t, lg, eng = greedy_with_logits(MODEL, SyncKV(profile=PROFILE, budget=1.0, m=3, static_ratio=ratio), [ids],
                                        steps=8)
        np.testing.assert_allclose(lg, l_full, atol=1e-4, rtol=0)
        assert np.array_equal(t, t_full) and eng.achieved_rho[0] == 1.0
        assert eng.state.stats()["anticipations"] == (2 if ratio < 1 else 0)


def test_batch_equals_one_by_one():
    prompts = [prompt(150, 5), prompt(97, 6)]
    policy = SyncKV(profile=PROFILE, budget=0.6, m=3)
    tb, lb, eb = greedy_with_logits(MODEL, policy, prompts, steps=7)
    for i, p in enumerate(prompts):
        t1, l1, e1 = greedy_with_logits(MODEL, policy, [p], steps=7)
        np.testing.assert_allclose(lb[i], l1[0], atol=1e-4, rtol=0)
        assert np.array_equal(tb[i], t1[0])
        assert eb.achieved_rho[i] == pytest.approx(e1.achieved_rho[0])
        k = int(e1.state.prefilled.k[0])
        for li, lb_c in enumerate(eb.cache.layers):
            got = np.asarray(layer_rows(eb.cache, li)[2][i, 1:, :k])  # the NR heads' rows
            want = np.asarray(layer_rows(e1.cache, li)[2][0, 1:, :k])
            assert np.array_equal(np.sort(got, -1), np.sort(want, -1))
            assert np.asarray(lb_c.lengths[i, 1:]).tolist() == [k, k]


def test_budget_below_the_r_heads_names_the_smallest_rho():
    """One R-head of 3 KV heads per layer (SmolLM2's shape): the R-heads alone hold 1/3 of the KV, so rho 0.3
    is refused, naming the smallest rho, (N_R + N_NR / L) / N rounded up; that rho runs with k = 1."""
    L = 160
    need = smallest_working_rho(9, N_R, N_NR, L)
    assert need == pytest.approx((N_R + N_NR / L) / 9, abs=1e-4) and need > 1 / 3
    with pytest.raises(BudgetError, match=re.escape("SyncKV: rho=0.3 is too small") + ".*"
                       + re.escape(f"smallest rho that works is {need:.4f} ")):
        Engine(MODEL, [prompt(L)], SyncKV(profile=PROFILE, budget=0.3), tail_capacity=4)
    eng = Engine(MODEL, [prompt(L)], SyncKV(profile=PROFILE, budget=need), tail_capacity=4)
    assert eng.state.prefilled.k.tolist() == [1] and eng.state.prefilled.k_dyn.tolist() == [0]


def test_bad_profiles_and_options():
    hetero = HeadProfile(roles=np.array([[A, P, S]] * 3, np.int8), clusters=(((1, (2,)),),) * 3,
                         weights=np.array([[1.0, np.nan, 1.0]] * 3), architecture="llama", head_dim=D)
    with pytest.raises(ProfileError, match="anchor.*--method synckv"):
        SyncKV(profile=hetero)
    with pytest.raises(ProfileError, match="ships none.*--method synckv"):
        SyncKV().bind(MODEL)
    with pytest.raises(ValueError, match=r"m must be an integer >= 1\b"):
        SyncKV(profile=PROFILE, m=0)
    with pytest.raises(ValueError, match="static_ratio"):
        SyncKV(profile=PROFILE, static_ratio=1.5)
    pol = make_policy("synckv:m=4,static_ratio=0.25", 0.7)
    assert (pol.m, pol.static_ratio, pol.budget) == (4, 0.25, 0.7) and pol.split(10) == (3, 7)


# ------------------------------------------------------------------ sessions
def test_a_session_turn_anticipates_from_its_last_query():
    L, rho = 140, 0.6
    sess = Session(MODEL, prompt(L, 7), SyncKV(profile=PROFILE, budget=rho, m=50), chat=False, reserve_tokens=8)
    st = sess.engine.state
    k_s, k_dyn, k = int(st.prefilled.k_s[0]), int(st.prefilled.k_dyn[0]), int(st.prefilled.k[0])
    turns = []
    orig = st.after_extend
    st.after_extend = lambda q, cache: (turns.append([np.asarray(x) for x in q]), orig(q, cache))[1]
    full = Session(MODEL, prompt(L, 7), FullKV(), chat=False, reserve_tokens=8)
    for t, n_q in enumerate((9, 14)):
        q = prompt(n_q, 40 + t)
        a = sess.ask(q, max_new_tokens=4)
        full.ask(q, max_new_tokens=4)
        assert len(a.token_ids) >= 1 and st.stats()["turn_anticipations"] == t + 1
        # the first turn outgrows the 8 reserved tail rows: the pool is repacked (every head's offset moves,
        # ``pool_moved``) and the rows below are written and read at the new offsets
        assert sess.engine.cache.tail_capacity > 8
        for li in range(CFG.num_layers):
            rows_k, _, rows_pos, _ = (np.asarray(a) for a in layer_rows(sess.engine.cache, li))
            keys = rows_k[0, 0, :L]
            scores = np_probs_max(turns[-1][li][0, 0, -1], keys)  # the R-head's last turn query
            pos = rows_pos[0, 1:, :k]  # the NR heads' (layout slots 1, 2) rows
            static = pos[0, :k_s]
            order = top_order(scores, static)
            for j in range(2):
                assert_same_set(pos[j, k_s:], scores, order, k_dyn, excluded=static)
                np.testing.assert_array_equal(rows_k[0, 1 + j, :k], np.asarray(st.prefilled.store.k[li][0, j])[pos[j]])
    assert st.stats()["anticipations"] == 0  # m = 50: no decode-time anticipation in these short answers
    # rho 1: a session turn equals full KV
    s1 = Session(MODEL, prompt(L, 7), SyncKV(profile=PROFILE, budget=1.0, m=2), chat=False, reserve_tokens=8)
    f1 = Session(MODEL, prompt(L, 7), FullKV(), chat=False, reserve_tokens=8)
    q = prompt(9, 50)
    assert s1.ask(q, max_new_tokens=6).token_ids == f1.ask(q, max_new_tokens=6).token_ids


# ------------------------------------------------------------------ calibration
@dataclasses.dataclass(frozen=True)
class _FullWithQueries(FullKV):
    """Full KV whose decode step hands every layer's query to the hooks (to recompute the calibration)."""

    def attend(self, li, q, step):
        return step.attend(q)[0], step, q


def test_synckv_calibration_averages_per_step_top_k_overlaps_and_clusters_them():
    rng = np.random.default_rng(11)
    samples = [rng.integers(3, CFG.vocab_size, size=80).tolist() for _ in range(2)]
    steps, top_k = 4, 8
    prof, stats = calibrate_tokens(CFG, MODEL.params, samples, decode_steps=steps, top_k=top_k, progress=False,
                                   scoring="synckv", n_r=1, return_stats=True)
    assert stats.similarity_steps.shape == (2, steps, CFG.num_layers, H, H)
    for n, ids in enumerate(samples):  # recompute every step's overlaps from the queries full KV sees
        eng = Engine(MODEL, [ids], _FullWithQueries(), tail_capacity=steps + 2)
        seen = []
        eng.state.after_step = lambda step, extras, cache: seen.append([np.asarray(e) for e in extras])
        tok = eng.first_tokens(0.0, 1.0)
        for s in range(steps):
            assert int(tok[0]) == stats.generated[n, s]
            tok, _ = eng.step(tok, 0.0, 1.0)
        for s in range(steps):
            for li in range(CFG.num_layers):
                keys = np.asarray(layer_rows(eng.cache, li)[0][0])
                sets = [set(top_order(np_probs_max(seen[s][li][0, h], keys[h, :80]))[:top_k].tolist())
                        for h in range(H)]
                want = np.array([[len(a & b) / top_k for b in sets] for a in sets])
                np.testing.assert_allclose(stats.similarity_steps[n, s, li], want, atol=1.01 / top_k)
                assert np.abs(stats.similarity_steps[n, s, li] - want).mean() <= 0.5 / top_k
    mean = stats.similarity_steps.mean(axis=(0, 1))
    np.testing.assert_allclose(prof.similarity_matrix, mean, rtol=1e-12)
    for li in range(CFG.num_layers):  # n_r = 1: the R-head is the row of D nearest the mean row
        d = mean[li].max() - mean[li]
        rep = int(np.argmin(np.sqrt(((d - d.mean(0)) ** 2).sum(-1))))
        assert prof.roles[li].tolist() == [P if h == rep else S for h in range(H)]
    assert prof.settings.method == "synckv" and prof.settings.top_k == top_k
    SyncKV(profile=prof).bind(MODEL)  # a calibrated profile runs


def test_shipped_smollm2_profile_is_a_synckv_grouping_of_its_own_similarities():
    from hetero_jax.profile import SHIPPED_SYNCKV_PROFILES, shipped_data_path

    prof = load_profile(shipped_data_path(SHIPPED_SYNCKV_PROFILES, "smollm2-135m"))
    assert prof.settings.method == "synckv" and prof.roles.shape == (30, 3)
    rebuilt = build_synckv_profile(prof.similarity_matrix, prof.settings.n_clusters)
    assert np.array_equal(rebuilt.roles, prof.roles) and rebuilt.clusters == prof.clusters
    assert prof.role_counts()["pivot"] == 30 and prof.role_counts()["satellite"] == 60
    with pytest.raises(BudgetError, match=re.escape("smallest rho that works is 0.3340 ")):
        SyncKV(profile=prof, budget=0.3).check_budget(1000)
    assert hetero_jax.policies.REGISTRY["synckv"] is SyncKV
    # the same file format, but not HeteroCache's roles: refused (it kept the R-heads whole as pivots)
    with pytest.raises(ProfileError, match="HeteroCache needs a HeteroCache role profile, but this profile is a "
                                           "SyncKV head grouping"):
        HeteroCache(profile=prof)
