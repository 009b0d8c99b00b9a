"""HCAttention: one layer's attend against a numpy float64 recomputation (codes, look-up-table scores, mass
set, host weighted sum, tail merge; both normalisations), tau 1 with exact keys or a codebook holding them
== full KV, memory placement and byte rho, batch == one by one, session turns, codebook file and k-means."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from hetero_jax.model.cache import PoolBuilder, layer_rows
from hetero_jax.model.pool import LayerStep, append
from hetero_jax.runtime import Engine, Session, prefill
from hetero_jax.policies import BudgetError, FullKV, HCAttention, make_policy
from hetero_jax.policies.hcattention import decode as hc_decode
from hetero_jax.policies.hcattention.codebook import (KeyCodebook, kmeans_pp, load_codebook, minibatch_kmeans,
                                                     nearest, train_codebook)
from hetero_jax.profile import ProfileError
from tiny_model import greedy_with_logits, tiny_model, random_prompt

MODEL = tiny_model()
CFG, PARAMS = MODEL.config, MODEL.params
D, H, G = CFG.head_dim, CFG.num_kv_heads, CFG.group_size
TAU = 0.9




def matching_budget(policy, cfg, lens, with_codebook: bool) -> float:
    """A budget within 5% of the wanted point for every length (the points' mean rho)."""
    rhos = [policy.operating_points(cfg, L)[1 if with_codebook else 0].rho for L in lens]
    return float(np.mean(rhos))


# ------------------------------------------------------------------ numpy oracle (float64)
def np_codes(keys, cents):
    """[N, g] nearest centroid of each d-dim sub-vector (direct squared distances; ties: lower index)."""
    d = cents.shape[1]
    sub = keys.astype(np.float64).reshape(len(keys), -1, 1, d)
    dist = ((sub - cents.astype(np.float64)[None, None]) ** 2).sum(-1)  # [N, g, c]
    return dist.argmin(-1), dist


def np_prompt_part(q, keys_or_codes, cents, V, tau, renormalize):
    """q [Q, D] over one head's L prompt tokens. Returns (y [Q, D], lse [Q], kept sets, boundary margins)."""
    q = q.astype(np.float64)
    if cents is None:
        z = q @ keys_or_codes.astype(np.float64).T
    else:
        d = cents.shape[1]
        table = np.einsum("qid,cd->qic", q.reshape(len(q), -1, d), cents.astype(np.float64))  # the paper's T
        z = sum(table[:, i, keys_or_codes[:, i]] for i in range(keys_or_codes.shape[1]))  # Eq. 3
    s = z / np.sqrt(q.shape[-1])
    m = s.max(-1, keepdims=True)
    a = np.exp(s - m)
    lse = m[:, 0] + np.log(a.sum(-1))
    a /= a.sum(-1, keepdims=True)
    ys, lses, sets, margins = [], [], [], []
    for r in range(len(q)):
        order = np.argsort(-a[r], kind="stable")
        cum = np.cumsum(a[r][order])
        k = len(order) if tau >= 1 else int(np.searchsorted(cum, tau) + 1)  # min{k : cum_k >= tau}
        k = min(k, len(order))
        kept = order[:k]
        w = a[r][kept]
        y = w @ V[kept].astype(np.float64)
        mass = w.sum()
        ys.append(y / mass if renormalize else y)
        lses.append(lse[r] + np.log(mass) if renormalize else lse[r])
        sets.append(set(kept.tolist()))
        margins.append(np.abs(cum - tau).min())
    return np.array(ys), np.array(lses), sets, np.array(margins)


def np_merge(y, lse, q, tk, tv):
    """Merge a prompt part with exact attention over the tail keys tk / values tv [R, D] (float64)."""
    s = q.astype(np.float64) @ tk.astype(np.float64).T / np.sqrt(q.shape[-1])
    m = s.max(-1, keepdims=True)
    p = np.exp(s - m)
    lse_t = m[:, 0] + np.log(p.sum(-1))
    out_t = p @ tv.astype(np.float64) / p.sum(-1, keepdims=True)
    top = np.maximum(lse, lse_t)
    wa, wb = np.exp(lse - top), np.exp(lse_t - top)
    return (wa[:, None] * y + wb[:, None] * out_t) / (wa + wb)[:, None]


def one_layer(policy, lens, Tp=64, R=8, seed=0):
    """A one-layer cache built by the policy's own prefill plan from random K/V (garbage past each length), its
    pool built as prefill builds it (``PoolBuilder``, from the plan's prompt counts) and R random tail rows
    appended to every head's region."""
    rng = np.random.default_rng(seed)
    cfg1 = dataclasses.replace(CFG, num_layers=1)
    B = len(lens)
    k = rng.normal(size=(B, H, Tp, D)).astype(np.float32)
    v = rng.normal(size=(B, H, Tp, D)).astype(np.float32)
    tk = rng.normal(size=(B, H, R, D)).astype(np.float32)
    tv = rng.normal(size=(B, H, R, D)).astype(np.float32)
    plan = policy.make_prefill(cfg1, lens)
    lens_d = jnp.asarray(lens, jnp.int32)
    builder = PoolBuilder(plan, lens, cfg1, R, jnp.float32)
    builder.add(0, plan.build_layer(0, None, None, jnp.asarray(k), jnp.asarray(v), lens_d))
    cache = builder.cache(lens_d)
    pool = append(cache.pool, cache.layers[0], jnp.zeros(B, jnp.int32), jnp.asarray(tk), jnp.asarray(tv), R)
    cache, state = plan.finish(cache.replace(pool=pool))
    return cfg1, cache, state, (k, v, tk, tv)


def layer_step(cache, tail_lens, host=None):
    """Layer 0's ``LayerStep`` with ``tail_lens`` [B] tail rows visible (what the decode step hands ``attend``) and
    the layer's host operands ``host`` (None: the host sums are a callback)."""
    return LayerStep(pool=cache.pool, layer=cache.layers[0], tail_lens=jnp.asarray(tail_lens, jnp.int32),
                     seq_lens=cache.seq_lens, host=host, tail_capacity=cache.tail_capacity)


@pytest.fixture(params=["in_step", "callback"])
def host_sums(request, monkeypatch):
    """Where the host sums run: in the step's graph (a CPU backend's way, the default here) or through the host
    callback a GPU backend uses (``host_store.sums_in_step`` faked False)."""
    if request.param == "callback":
        monkeypatch.setattr(hc_decode, "sums_in_step", lambda: False)
    return request.param


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("mode", ["values", "codebook"])
def test_attend_equals_a_numpy_float64_recomputation(mode, renormalize, host_sums):
    """Codes, look-up-table scores, the tau mass set (k*), the host weighted sum (in the step or by the callback)
    and its log-sum-exp merge with the tail, for a batch of two lengths, against numpy float64 (c=16, g=4, D=16)."""
    lens, tail_lens = [50, 37], np.array([3, 6])
    rng = np.random.default_rng(1)
    cb = KeyCodebook(rng.normal(size=(1, 16, 4)).astype(np.float32)) if mode == "codebook" else None
    probe = HCAttention(budget=0.5, codebook=cb, kv_itemsize=4)
    cfg1 = dataclasses.replace(CFG, num_layers=1)
    budget = matching_budget(probe, cfg1, lens, mode == "codebook")
    pol = HCAttention(budget=budget, tau=TAU, renormalize=renormalize, codebook=cb, kv_itemsize=4)
    cfg1, cache, state, (k, v, tk, tv) = one_layer(pol, lens)
    lc = cache.layers[0]
    assert lc.capacity == 0 and int(lc.lengths.sum()) == 0  # no prompt row in the pool: the regions hold tails
    st = lc.state
    q = (2.0 * rng.normal(size=(2, H, G, D))).astype(np.float32)
    attend = jax.jit(functools.partial(pol.attend, 0))
    host = state.host_operands()
    assert len(host) == (1 if host_sums == "in_step" else 0)
    out, _, (kstar, trunc) = attend(jnp.asarray(q), layer_step(cache, tail_lens, host[0] if host else None))
    out, kstar = np.asarray(out), np.asarray(kstar)
    assert not np.asarray(trunc).any()
    for b, L in enumerate(lens):
        for h in range(H):
            if cb is None:
                src, cents = k[b, h, :L], None
            else:
                want_codes, dist = np_codes(k[b, h, :L], cb.centroids[0])
                got_codes = np.asarray(st.codes[b, h, :L])
                srt = np.sort(dist, -1)
                tie = (srt[..., 1] - srt[..., 0]) < 1e-5  # a float32 near-tie may pick either
                assert np.array_equal(got_codes[~tie], want_codes[~tie])
                assert (np.asarray(st.codes[b, h, L:]) == 0).all()  # padding slots masked
                src, cents = got_codes, cb.centroids[0]
            y, lse, sets, margin = np_prompt_part(q[b, h], src, cents, v[b, h, :L], TAU, renormalize)
            assert (margin > 1e-6).all()  # no row sits on the tau boundary (else float32 may differ by one)
            np.testing.assert_array_equal(kstar[b, h], [len(s) for s in sets])
            want = np_merge(y, lse, q[b, h], tk[b, h, : tail_lens[b]], tv[b, h, : tail_lens[b]])
            np.testing.assert_allclose(out[b, h], want, atol=1e-5, rtol=1e-5)
    assert (kstar < np.array(lens)[:, None, None]).all() and (kstar >= 1).all()  # tau 0.9 drops tokens


def test_k_cap_truncates_and_counts():
    """k_cap_fraction < 1: a row keeps at most k_cap tokens (its top ones) and is flagged when they hold less than
    tau; the output is the oracle's over the top k_cap (renormalised)."""
    lens = [50, 37]
    pol = HCAttention(budget=0.5, tau=TAU, k_cap_fraction=0.1, kv_itemsize=4)
    _, cache, _, (k, v, tk, tv) = one_layer(pol, lens, seed=2)
    q = (0.5 * np.random.default_rng(3).normal(size=(2, H, G, D))).astype(np.float32)  # flat attention
    out, _, (kstar, trunc) = jax.jit(functools.partial(pol.attend, 0))(jnp.asarray(q), layer_step(cache, [2, 2]))
    kstar, trunc, out = np.asarray(kstar), np.asarray(trunc), np.asarray(out)
    assert trunc.any()
    for b, L in enumerate(lens):
        cap = {50: 5, 37: 4}[L]  # ceil(0.1 x L): each sequence's own prompt
        assert (kstar[b] <= cap).all()
        for h in range(H):
            y, lse, sets, _ = np_prompt_part(q[b, h], k[b, h, :L], None, v[b, h, :L], TAU, True)
            full_k = np.array([len(s) for s in sets])
            np.testing.assert_array_equal(trunc[b, h], full_k > cap)
            np.testing.assert_array_equal(kstar[b, h], np.minimum(full_k, cap))
            s = q[b, h].astype(np.float64) @ k[b, h, :L].astype(np.float64).T / np.sqrt(D)
            for r in range(G):
                kept = np.argsort(-s[r], kind="stable")[: kstar[b, h, r]]
                p = np.exp(s[r] - s[r].max())
                yr = p[kept] @ v[b, h, kept].astype(np.float64) / p[kept].sum()
                lse_r = s[r].max() + np.log(p[kept].sum())
                want = np_merge(yr[None], np.array([lse_r]), q[b, h, r : r + 1], tk[b, h, :2], tv[b, h, :2])
                np.testing.assert_allclose(out[b, h, r], want[0], atol=1e-5, rtol=1e-5)


def exact_codebook(ids):
    """A codebook whose layer-l centroids are layer l's prompt keys (g = 1, d = D): every key quantizes exactly."""
    _, full = prefill(PARAMS, CFG, [ids], tail_capacity=2)
    return KeyCodebook(np.stack([np.asarray(layer_rows(full, li)[0][0], np.float32).reshape(-1, D)
                                 for li in range(CFG.num_layers)]))


@pytest.mark.parametrize("mode", ["values", "codebook"])
def test_tau_one_with_exact_keys_is_full_kv(mode):
    """tau = 1 keeps every token: exact keys (values on host) or a codebook holding every key give full KV's greedy
    tokens and logits; with the codebook the device holds codes + codebook only, within rho x 1.05."""
    ids = random_prompt(60, 1)
    want_toks, want_logits, _ = greedy_with_logits(MODEL, FullKV(), [ids])
    cb = exact_codebook(ids) if mode == "codebook" else None
    probe = HCAttention(codebook=cb, kv_itemsize=4)
    budget = matching_budget(probe, CFG, [60], mode == "codebook")
    toks, logits, eng = greedy_with_logits(MODEL, HCAttention(budget=budget, tau=1.0, codebook=cb), [ids])
    np.testing.assert_array_equal(toks, want_toks)
    np.testing.assert_allclose(logits, want_logits, atol=1e-4, rtol=1e-4)
    # memory: no prompt row on the device, values (only) pinned on the host, bytes = keys or codes + codebook
    f = eng.stats_fields()
    assert f["kv_bytes_prompt"] == 0
    assert all(lc.capacity == 0 and not np.asarray(lc.lengths).any() for lc in eng.cache.layers)
    assert f["kv_bytes_tail"] == f["kv_bytes_device"]  # the pool holds the tails only
    store = eng.state.store
    assert all(a is None for a in store.k)
    assert [a.shape for a in store.v] == [(1, H, 60, D)] * CFG.num_layers
    assert all(a.sharding.memory_kind == "pinned_host" for a in eng.state.host_arrays())
    assert f["kv_bytes_host"] == CFG.num_layers * H * 60 * D * 4
    full = 60 * H * CFG.num_layers * 2 * D * 4
    if cb is None:
        held = sum(lc.state.keys.nbytes for lc in eng.cache.layers)
        assert all(lc.state.codes is None and lc.state.codebook is None for lc in eng.cache.layers)
        assert held == full // 2 and eng.achieved_rho[0] == 0.5
    else:
        held = sum(lc.state.codes.nbytes + lc.state.codebook.nbytes for lc in eng.cache.layers)
        assert all(lc.state.codes.dtype == jnp.int16 and lc.state.keys is None for lc in eng.cache.layers)
        assert eng.achieved_rho[0] == pytest.approx(held / full)
    assert held <= budget * full * 1.05
    assert f["kv_bytes_index"] - held < 64  # beside them only the prompt lengths and the store handle
    # a step reads the pool (the tails), the state records and the host rows of the kept values
    host = eng.state.stats()["host_value_bytes_read_per_step"]
    assert host > 0 and f["kv_bytes_read_per_step"] == int(f["kv_bytes_device"] + f["kv_bytes_index"] + host)


@functools.lru_cache(maxsize=None)
def tiny_codebook():
    samples = [random_prompt(100, 11), random_prompt(100, 12)]
    return train_codebook(MODEL, samples, sub_dim=4, size=32, batch=500, steps=20)


def test_batch_equals_one_by_one_and_stats(host_sums):
    """Two prompts of different lengths batched decode as each alone (trained codebook, tau 0.9), with the host sums
    in the step or by callback; the stats' selection ratio is the mean k*/L of the extras, and the host bytes are
    every value row (in the step) or the kept ones (the callback)."""
    cb = tiny_codebook()
    a, b = random_prompt(150, 3), random_prompt(97, 4)
    pol = HCAttention(budget=matching_budget(HCAttention(codebook=cb, kv_itemsize=4), CFG, [150, 97], True),
                      codebook=cb)
    seen = []
    toks, logits, eng = greedy_with_logits(MODEL, pol, [a, b], 5, extras=seen)
    for i, ids in enumerate((a, b)):
        t1, l1, e1 = greedy_with_logits(MODEL, pol, [ids])
        np.testing.assert_array_equal(toks[i], t1[0])
        np.testing.assert_allclose(logits[i], l1[0], atol=1e-4, rtol=1e-4)
        assert e1.achieved_rho[0] == pytest.approx(eng.achieved_rho[i])
    st = eng.stats_fields()["policy_stats"]
    L = np.array([150, 97], np.float64)[:, None, None]
    ratio = np.mean([[(k / L).mean() for k in step] for step in seen], axis=0)  # per layer
    np.testing.assert_allclose(st["selection_ratio_by_layer"], ratio, rtol=1e-9)
    assert st["mode"] == "codebook_g4" and st["steps"] == 5 and st["truncations"] == 0
    assert st["host_sums"] == host_sums
    every_row = 2 * 150 * H * CFG.num_layers * D * 4  # the store: both prompts padded to 150 rows
    if host_sums == "in_step":  # nothing crosses; one product over every stored row
        assert st["bytes_from_host_per_step"] == st["bytes_to_host_per_step"] == st["callback_ms_per_step"] == 0
        assert st["host_value_bytes_read_per_step"] == every_row
    else:  # each query row's weights over the prompt out, its sum back; the kept rows read
        assert st["bytes_from_host_per_step"] == 2 * CFG.num_heads * CFG.num_layers * D * 4
        assert st["bytes_to_host_per_step"] == 2 * CFG.num_heads * CFG.num_layers * 150 * 4
        assert 0 < st["host_value_bytes_read_per_step"] <= every_row and st["callback_ms_per_step"] > 0


def test_a_token_cap_is_each_sequences_own_fraction_of_its_prompt():
    """k_cap_fraction 0.2: a 5-token prompt keeps at most ceil(0.2 * 5) = 1 token per query row alone and in a
    batch beside a 40-token one (the cap came from the batch's longest prompt, 8 tokens: its tokens changed,
    logits by up to 7.4)."""
    pol = HCAttention(budget=0.5, tau=0.9, k_cap_fraction=0.2)
    prompts = [random_prompt(5, 9), random_prompt(40, 10)]
    seen = []
    toks, logits, _ = greedy_with_logits(MODEL, pol, prompts, 5, extras=seen)
    kstar = np.stack([np.stack(step) for step in seen])  # [steps, layers, B, H, G]
    assert kstar[:, :, 0].max() == 1 and kstar[:, :, 1].max() <= 8  # ceil(0.2 * 5), ceil(0.2 * 40)
    for i, ids in enumerate(prompts):
        t1, l1, _ = greedy_with_logits(MODEL, pol, [ids])
        np.testing.assert_array_equal(toks[i], t1[0])
        np.testing.assert_allclose(logits[i], l1[0], atol=1e-4, rtol=1e-4)


def test_a_turn_equals_decoding_its_tokens(host_sums):
    """A session turn (chunked, each query its own mass set) gives the logits of feeding the turn token by token
    (host sums in the step or by callback); with tau 1 and exact keys a two-turn session answers as full KV does."""
    ctx, turn = random_prompt(80, 5), random_prompt(7, 6)
    pol = HCAttention(budget=0.5, tau=TAU)
    e1 = Engine(MODEL, [ctx], pol, tail_capacity=16)
    got = e1.extend(turn)
    e2 = Engine(MODEL, [ctx], pol, tail_capacity=16)
    for t in turn:
        _, want = e2.step_with_logits(np.array([t]))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    assert e1.state.stats()["turn_callbacks"] == (CFG.num_layers if host_sums == "callback" else 0)
    q1, q2 = random_prompt(12, 7), random_prompt(5, 8)
    answers = []
    for p in (FullKV(), HCAttention(budget=0.5, tau=1.0)):
        sess = Session(MODEL, ctx, p, chat=False, reserve_tokens=8)
        answers.append([sess.ask(q, max_new_tokens=4).token_ids for q in (q1, q2)])
    assert answers[0] == answers[1]


def test_budgets_must_match_an_operating_point():
    ids = random_prompt(60, 9)
    with pytest.raises(BudgetError, match=re.escape("values on host, exact keys: rho=0.5 (no key codebook")
                       + ".*hetero-jax profile --method"):
        Engine(MODEL, [ids], HCAttention(budget=0.3), tail_capacity=4)
    cb = tiny_codebook()
    with pytest.raises(BudgetError,
                       match=re.escape("codebook g=4 (d=4, c=32): rho=0.07361. Pass one of those rho values")):
        Engine(MODEL, [ids], HCAttention(budget=0.3, codebook=cb), tail_capacity=4)
    Engine(MODEL, [ids], HCAttention(budget=0.52), tail_capacity=4)  # within 5% of 0.5
    with pytest.raises(BudgetError):
        HCAttention(budget=0.3).make_prefill(CFG, [60])


def test_codebook_file_and_model_checks(tmp_path):
    cb = tiny_codebook()
    assert cb.centroids.shape == (CFG.num_layers, 32, 4) and cb.centroids.dtype == np.float16
    path = tmp_path / "cb.npz"
    cb.save(path)
    back = load_codebook(path)
    np.testing.assert_array_equal(back.centroids, cb.centroids)
    assert back.key() == cb.key() and back.weights_fingerprint == cb.weights_fingerprint
    assert HCAttention(codebook=str(path)) == HCAttention(codebook=cb)
    assert HCAttention(codebook=cb) != HCAttention(codebook=exact_codebook(random_prompt(10)))
    other = tiny_model(seed=7)  # same shape, other weights: the fingerprint refuses it
    with pytest.raises(ProfileError, match="another model.*fingerprint"):
        HCAttention(codebook=cb).bind(other)
    HCAttention(codebook=cb).bind(MODEL)
    with pytest.raises(ProfileError, match=r"\b2 layers"):
        KeyCodebook(cb.centroids[:2]).check_compatible(CFG)
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    with pytest.raises(ProfileError,
                       match=re.escape("bad.npz' is not an .npz archive; HCAttention(codebook=...) takes the .npz")):
        load_codebook(tmp_path / "bad.npz")
    with pytest.raises(ProfileError, match="does not exist"):
        load_codebook(tmp_path / "missing.npz")


def test_kmeans_finds_separated_clusters_and_nearest_breaks_ties_low():
    rng = np.random.default_rng(0)
    centers = np.array([[0, 0], [10, 0], [0, 10], [10, 10]], np.float64)
    x = (centers[rng.integers(4, size=4000)] + 0.1 * rng.normal(size=(4000, 2))).astype(np.float32)
    got = minibatch_kmeans(x, 4, batch=500, steps=30, seed=0)
    assert np.abs(np.sort(got.round(), axis=0) - np.sort(centers, axis=0)).max() < 0.5
    assert len({tuple(r) for r in got.round()}) == 4
    np.testing.assert_array_equal(nearest(np.array([[1.0, 0.0]]), np.array([[0.0, 0.0], [2.0, 0.0]])), [0])
    seeds = kmeans_pp(x, 4, np.random.default_rng(0))
    assert len({tuple(r) for r in np.round(seeds / 10)}) == 4  # k-means++ spreads its seeds over the clusters


def test_registry_and_options():
    p = make_policy("hcattention:tau=0.5,renormalize=false", 0.5)
    assert p == HCAttention(budget=0.5, tau=0.5, renormalize=False)
    with pytest.raises(BudgetError):
        HCAttention(tau=0.0)
    with pytest.raises(BudgetError):
        HCAttention(k_cap_fraction=1.5)


def test_shipped_smollm2_codebooks_fit_its_shape():
    """The shipped codebooks load, fit SmolLM2-135M's shape and give the documented points at 4K tokens (fp32)."""
    from hetero_jax.model.config import ModelConfig
    from hetero_jax.policies.hcattention.codebook import SHIPPED_CODEBOOKS
    from hetero_jax.profile import shipped_data_path

    cfg = ModelConfig(architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                      num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, max_position_embeddings=8192)
    cbs = [load_codebook(shipped_data_path({"m": f}, "m")) for f in SHIPPED_CODEBOOKS["smollm2-135m"]]
    pol = HCAttention(codebook=tuple(cbs), kv_itemsize=4)
    pts = pol.operating_points(cfg, 4096)
    assert [round(p.rho, 3) for p in pts] == [0.5, 0.063, 0.125]
    assert [p.codebook.groups(64) for p in pts[1:]] == [16, 32]


# ------------------------------------------------------------------ the mass set without a sort
def np_mass_set(a, tau, k_cap):
    """float64 numpy Eq. 4 by a stable sort: the k* largest (ties to the lower index), k* = min(k_cap, min{k :
    sum of the k largest >= tau}); tau >= 1 keeps k_cap."""
    keep = np.zeros(a.shape, bool)
    for r in np.ndindex(a.shape[:-1]):
        order = np.argsort(-a[r], kind="stable")
        before = np.concatenate([[0.0], np.cumsum(a[r][order].astype(np.float64))[:-1]])
        k = len(order) if tau >= 1 else int((before < tau).sum())
        keep[r][order[: min(k, k_cap)]] = True
    return keep


@settings(max_examples=60, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**16), T=st.integers(1, 70), tau=st.sampled_from([0.3, 0.5, 0.9, 0.99, 1.0]),
       cap_frac=st.sampled_from([1.0, 0.5, 0.1]), ties=st.booleans(), by_sort=st.booleans())
def test_mass_set_equals_a_sorted_cut(seed, T, tau, cap_frac, ties, by_sort):
    """``mass_set`` (the CPU's two bisections over the float bits, or the GPU's sort) keeps exactly the tokens a
    stable numpy sort and an exclusive float64 prefix sum keep, ties (values drawn from a few levels) and zeros
    included; compared only where no prefix lies within 1e-6 of tau (a float32 sum may fall on the other
    side)."""
    from hetero_jax.policies.hcattention import mass_set

    rng = np.random.default_rng(seed)
    x = rng.choice([0.0, 1.0, 2.0, 4.0], size=(2, 3, T)) if ties else rng.exponential(size=(2, 3, T)) ** 3
    a = (x / np.maximum(x.sum(-1, keepdims=True), 1e-30)).astype(np.float32)
    k_cap = max(1, min(T, int(np.ceil(cap_frac * T))))
    got = np.asarray(jax.jit(mass_set, static_argnums=(1, 2, 3))(jnp.asarray(a), tau, k_cap, by_sort))
    want = np_mass_set(a, tau, k_cap)
    for r in np.ndindex(a.shape[:-1]):
        prefix = np.cumsum(np.sort(a[r].astype(np.float64))[::-1])
        if tau < 1 and np.abs(prefix - tau).min() < 1e-6:
            continue
        np.testing.assert_array_equal(got[r], want[r], err_msg=f"row {r}: a={a[r]}")
    assert got.sum(-1).max() <= k_cap


@pytest.mark.parametrize("by_sort", [False, True])
def test_mass_set_with_a_cap_per_sequence_equals_each_row_capped_alone(by_sort):
    """Caps as int32 [B, 1, 1] (one per sequence): every row keeps what the numpy cut keeps at its own cap."""
    from hetero_jax.policies.hcattention import mass_set

    rng = np.random.default_rng(5)
    x = rng.exponential(size=(3, 2, 40)) ** 3
    a = (x / x.sum(-1, keepdims=True)).astype(np.float32)
    caps = np.array([1, 7, 40], np.int32)
    got = np.asarray(jax.jit(mass_set, static_argnums=(1, 3))(jnp.asarray(a), 0.95, jnp.asarray(caps)[:, None, None],
                                                               by_sort))
    for b, cap in enumerate(caps):
        np.testing.assert_array_equal(got[b], np_mass_set(a[b], 0.95, int(cap)))
    assert got[0].sum(-1).max() == 1 and got[1].sum(-1).max() <= 7
