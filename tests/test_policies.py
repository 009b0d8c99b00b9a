"""KV-cache policies: budgets, selection against independent numpy scores, rho = 1, batching, layouts; every
token scorer composed with every budget allocator."""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import hetero_jax
from hetero_jax.model import transformer as M
from hetero_jax.model import spec
from hetero_jax.model.cache import layer_rows, prompt_kv_bytes
from hetero_jax.model.config import ModelConfig
from hetero_jax.runtime import compiled, prefill
from hetero_jax.model.layout import HeadLayout, permute_params
from hetero_jax.policies import (
    CAKE, H2O, REGISTRY, BudgetError, Composed, FullKV, PolicyError, ProfiledSnapKV, PyramidKV, SnapKV, StreamingLLM,
    achieved_rho, describe_policies, make_policy, smallest_rho, tokens_for,
)
from hetero_jax.policies.allocators import Cascade, ProfileBudgets, Pyramid, Uniform, distribute
from hetero_jax.policies.scorers import HeavyHitters, SinksRecent, WindowMeanVar, WindowVotes
from hetero_jax.profile.clustering import Role
from hetero_jax.profile import HeadProfile, ProfileError
from tiny_model import random_prompts

COMPRESSING = [StreamingLLM, SnapKV, PyramidKV, H2O, CAKE]


def tiny_cfg(num_heads=6, num_kv_heads=2, layers=3, head_dim=8, **kw) -> ModelConfig:
    return ModelConfig(
        architecture="llama", vocab_size=101, hidden_size=48, intermediate_size=64, num_layers=layers,
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, rms_norm_eps=1e-5,
        max_position_embeddings=1024, **kw,
    )


CFG = tiny_cfg()
PARAMS = jax.tree.map(jnp.asarray, spec.init_params(CFG, seed=4, scale=0.3))


def run(policy, prompts, params=PARAMS, cfg=CFG, steps=3, capture=None):
    """Prefill with ``policy`` then ``steps`` greedy decode steps -> (list of logits arrays, cache, plan)."""
    lens = [len(p) for p in prompts]
    plan = policy.make_prefill(cfg, lens, compile_fn=compiled)
    def observe(li, layer, x_in, k_buf, v_buf, lens_):
        if capture is not None:
            capture.append((np.asarray(x_in), np.asarray(k_buf)))

    logits, cache = prefill(params, cfg, prompts, tail_capacity=steps + 1, plan=plan, observe=observe)
    cache, _ = plan.finish(cache)
    out = [np.asarray(logits)]
    tok = jnp.argmax(logits, -1).astype(jnp.int32)
    for _ in range(steps):
        lg, cache = M.decode_step_jit(params, cache, tok, cfg)
        out.append(np.asarray(lg))
        tok = jnp.argmax(lg, -1).astype(jnp.int32)
    return out, cache, plan


# --------------------------------------------------------------- numpy scores
def np_rms(x, w, eps):
    return w * (x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps))


def np_queries(layer, x_rows, positions, cfg):
    """Queries after RoPE for rows of a layer's input: x_rows [n, H] -> [Hkv, n, G, D] (float64)."""
    lp = {k: np.asarray(v, np.float64) for k, v in layer.items()}
    h = np_rms(np.asarray(x_rows, np.float64), lp["attn_norm"], cfg.rms_norm_eps)
    q = (h @ lp["q_proj"]).reshape(len(x_rows), cfg.num_heads, cfg.head_dim)
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, cfg.head_dim, 2) / cfg.head_dim))
    ang = np.asarray(positions)[:, None] * inv[None]
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))
    half = cfg.head_dim // 2
    q = q * cos[:, None] + np.concatenate([-q[..., half:], q[..., :half]], -1) * sin[:, None]
    return q.reshape(len(x_rows), cfg.num_kv_heads, cfg.group_size, cfg.head_dim).transpose(1, 0, 2, 3)


def np_probs(q, keys, q_pos, L):
    """q [Hkv, n, G, D], keys [Hkv, T, D] -> causal softmax [Hkv, n, G, L] over the first L keys."""
    s = np.einsum("hngd,htd->hngt", q, keys[:, :L]) / math.sqrt(q.shape[-1])
    t = np.arange(L)
    s = np.where(t[None, None, None, :] <= np.asarray(q_pos)[None, :, None, None], s, -np.inf)
    s = s - s.max(-1, keepdims=True)
    e = np.exp(s)
    return e / e.sum(-1, keepdims=True)


def np_pool(x, k=5):
    out = np.zeros_like(x)
    for i in range(x.shape[-1]):
        lo, hi = max(0, i - k // 2), min(x.shape[-1], i + k // 2 + 1)
        out[..., i] = x[..., lo:hi].sum(-1) / k
    return out


def np_policy_scores(policy, layer, x_in, k_buf, L, cfg):
    """(scores [Hkv, L] float64, forced mask [L]) for one sequence, computed from scratch."""
    return np_scorer_scores(policy.scorer, layer, x_in, k_buf, L, cfg)


def np_window_probs(scorer, layer, x_in, keys, L, cfg):
    """The last W prompt queries' attention [Hkv, W, G, L], zero on the window, and the window mask [L]."""
    W = min(scorer.window, L)
    forced = np.arange(L) >= L - W
    rows = np.arange(L - W, L)
    p = np_probs(np_queries(layer, x_in[rows], rows, cfg), keys, rows, L)
    return np.where(forced[None, None, None, :], 0.0, p), forced


def np_scorer_scores(scorer, layer, x_in, k_buf, L, cfg):
    """(scores [Hkv, L] float64, forced mask [L]) of one sequence under a token scorer, from scratch."""
    keys = np.asarray(k_buf, np.float64)
    t = np.arange(L)
    if isinstance(scorer, SinksRecent):
        return np.broadcast_to(t.astype(float), (cfg.num_kv_heads, L)), t < scorer.sinks
    if isinstance(scorer, HeavyHitters):
        q = np_queries(layer, x_in[:L], t, cfg)
        votes = np_probs(q, keys, t, L).sum(1)  # [Hkv, G, L]
        return votes.max(1), t >= L - min(scorer.window, L)
    p, forced = np_window_probs(scorer, layer, x_in, keys, L, cfg)
    if isinstance(scorer, WindowMeanVar):
        mean, var = p.mean(1), p.var(1)
        return np_pool(mean + scorer.gamma * var).max(1), forced
    assert type(scorer) is WindowVotes
    return np_pool(p.sum(1)).max(1), forced


def np_cake_preference(cascade, layer, x_in, k_buf, L, cfg):
    """CAKE's layer preference of one sequence: entropy x variance of the window's mean attention, per head and
    query, averaged (tau1 = tau2 = 1)."""
    p, _ = np_window_probs(cascade, layer, x_in, np.asarray(k_buf, np.float64), L, cfg)
    mean, var = p.mean(1), p.var(1)  # [Hkv, G, L]
    dist = mean / mean.sum(-1, keepdims=True)
    entropy = -(dist * np.log(np.maximum(dist, 1e-300))).sum(-1)
    return float((entropy * var.sum(-1)).mean())


def assert_top_set(kept, scores, forced, count):
    """kept (sorted positions) is the forced set plus the top-scored rest; near-ties tolerated."""
    kept = np.asarray(kept)
    assert len(kept) == count and np.all(np.diff(kept) > 0)
    n_forced = int(forced.sum())
    assert np.all(np.isin(np.flatnonzero(forced), kept)) or n_forced > count
    rest = np.where(forced, -np.inf, scores)
    order = np.argsort(-rest, kind="stable")
    want = set(np.flatnonzero(forced)) | set(order[: count - n_forced].tolist())
    got = set(kept.tolist())
    if got != want:  # only float near-ties may differ
        thr = np.sort(rest)[::-1][count - n_forced - 1]
        for tok in got ^ want:
            assert abs(rest[tok] - thr) <= 1e-6 * max(1.0, abs(thr)), (tok, rest[tok], thr)


# -------------------------------------------------------------------- tests
@pytest.mark.parametrize("cls", COMPRESSING)
def test_rho_one_reproduces_full_kv_exactly(cls):
    prompts = random_prompts([70, 45])
    full, _, _ = run(FullKV(), prompts)
    got, cache, _ = run(cls(budget=1.0), prompts)
    for a, b in zip(full, got):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(achieved_rho(cache, CFG), [1.0, 1.0])


@pytest.mark.parametrize("cls", COMPRESSING)
def test_kept_tokens_are_the_top_scored_under_the_policys_own_score(cls):
    policy = cls(budget=0.4)
    L = 90
    prompts = random_prompts([L], seed=3)
    captured = []
    _, cache, plan = run(policy, prompts, steps=0, capture=captured)
    total = 0
    for li, (lc, (x_in, k_buf)) in enumerate(zip(cache.layers, captured)):
        k_kept, _, pos, lengths = (np.asarray(a) for a in layer_rows(cache, li))
        lengths = lengths[0]
        count = int(plan.counts[li][0][0])
        assert np.all(lengths == count) and count >= 1  # per-head budget exact, the same for every head, never zero
        scores, forced = np_policy_scores(policy, PARAMS["layers"][li], x_in[0], k_buf[0], L, CFG)
        pos = pos[0]
        for h in range(CFG.num_kv_heads):
            assert_top_set(pos[h, :count], scores[h], forced, count)
            # the kept keys are the prompt keys at those positions
            np.testing.assert_array_equal(k_kept[0, h, :count], k_buf[0, h, pos[h, :count]])
        total += count * CFG.num_kv_heads
    n = tokens_for(0.4, L)
    if cls is CAKE:
        assert total <= n * CFG.num_kv_heads * CFG.num_layers
    else:  # per-layer budgets sum exactly to the uniform total
        assert total == n * CFG.num_kv_heads * CFG.num_layers
    assert achieved_rho(cache, CFG)[0] == pytest.approx(total / (L * CFG.num_kv_heads * CFG.num_layers))


def test_pyramid_budgets_fall_with_depth_and_keep_the_total():
    cfg = tiny_cfg(layers=8)
    grid = PyramidKV(budget=0.3).head_budgets(cfg, 1000)  # [layers, Hkv]
    assert np.all(grid == grid[:, :1])  # every head of a layer alike
    counts = grid[:, 0]
    n = tokens_for(0.3, 1000)
    assert counts.sum() == n * 8
    assert np.all(np.diff(counts) <= 0) and counts[0] > counts[-1] >= 32
    # hand-computed targets: window 32, sel 268, min 13.4, max 522.6
    targets = 32 + 522.6 - (522.6 - 13.4) * np.arange(8) / 7
    assert np.all(np.abs(counts - targets) <= 1)


def test_cake_cascade_hand_computed():
    cascade = CAKE(budget=0.5, window=2).allocator  # floor: the 2-token window
    # 3 layers, n = 10 per layer on average, prompt 40: step shares by preference
    own, final = cascade.shares(np.log([1.0, 3.0, 1.0]), n=10, prompt_len=40, floor=2)  # log preferences
    # step 0: layer0 gets 10; step 1: 20 split 1:3 -> 5, 15; step 2: 30 split 1:3:1 -> 6, 18, 6
    assert own.tolist() == [10, 15, 6]
    assert final.tolist() == [5, 15, 6]
    # rho = 1: everything everywhere
    own, final = cascade.shares(np.log([1.0, 5.0, 0.1]), n=40, prompt_len=40, floor=2)
    assert own.tolist() == final.tolist() == [40, 40, 40]


def test_cake_small_temperatures_neither_overflow_nor_hang():
    """P = entropy^(1/tau1) x variance^(1/tau2) overflowed float32 for tau1 = 0.01 (prefill then hung in the
    rounding loop) and made NaN shares for 1e-3: in log space the shares are P's ratios, whatever its size."""
    cascade = CAKE(budget=0.5, window=2).allocator
    # preferences of 1e-3000 : 1e-2999 : 1e-3000 (no float holds them) split as 1 : 10 : 1
    own, final = cascade.shares(np.log(10.0) * np.array([-3000.0, -2999.0, -3000.0]), n=12, prompt_len=40, floor=2)
    assert own.tolist() == [12, 22, 3] and final.tolist() == [2, 22, 3]
    with pytest.raises(ValueError, match="weights must be finite"):
        distribute(np.array([1.0, np.inf]), 10, 0, 10)
    layers = full_prompt_kv(90)
    for tau1, tau2 in ((0.01, 1.0), (1e-3, 1e-3)):
        plan = CAKE(budget=0.5, tau1=tau1, tau2=tau2).make_prefill(CFG, [90], compile_fn=compiled)
        blocks, _ = plan.cut([plan.build_layer(li, *layer) for li, layer in enumerate(layers)])
        assert np.isfinite(np.array([float(p[0]) for p in plan.prefs])).all()
        kept = [int(np.asarray(b.blocks[0].lengths).sum()) for b in blocks]
        assert sum(kept) <= 0.5 * 90 * CFG.num_kv_heads * CFG.num_layers + CFG.num_layers * CFG.num_kv_heads


@pytest.mark.parametrize("cls", COMPRESSING)
def test_batched_equals_one_by_one(cls):
    policy = cls(budget=0.5)
    prompts = random_prompts([120, 80, 101], seed=5)
    batch, bcache, _ = run(policy, prompts)
    for i, p in enumerate(prompts):
        alone, acache, _ = run(policy, [p])
        for a, b in zip(alone, batch):
            np.testing.assert_allclose(a[0], b[i], atol=5e-5, rtol=0)  # logits of size ~5
        assert achieved_rho(acache, CFG)[0] == pytest.approx(achieved_rho(bcache, CFG)[i])


@pytest.mark.parametrize("cls", COMPRESSING)
def test_device_bytes_are_real(cls):
    L, rho = 200, 0.3
    _, cache, _ = run(cls(budget=rho), random_prompts([L]), steps=0)
    full_bytes = L * CFG.num_kv_heads * CFG.num_layers * 2 * CFG.head_dim * 4
    assert prompt_kv_bytes(cache) <= rho * full_bytes * 1.05


def test_budget_errors_name_the_smallest_budget_that_works():
    L = 100
    with pytest.raises(BudgetError,
                       match=r"needs at least 32 .*smallest budget that works for this prompt is rho=0\.315$"):
        SnapKV(budget=0.2).head_budgets(CFG, L)
    assert np.all(SnapKV(budget=0.315).head_budgets(CFG, L) == 32)  # the named rho works
    assert smallest_rho(32, L) == 0.315
    with pytest.raises(BudgetError, match=r"at least 5 .*\b4 sinks"):
        StreamingLLM(budget=0.01).head_budgets(CFG, L)
    with pytest.raises(BudgetError, match="smallest budget that works"):
        run(H2O(budget=0.05), random_prompts([100]), steps=0)  # before any compute
    for bad in (0.0, -0.1, 1.5, float("nan")):
        with pytest.raises(BudgetError, match=r"out of range.*\(0, 1\]"):
            SnapKV(budget=bad)
    with pytest.raises(BudgetError):
        FullKV(budget=0.5)


def test_generate_with_policies_and_registry(tiny_checkpoint):
    bundle = hetero_jax.load(tiny_checkpoint("llama")[1])
    prompt = random_prompts([120], seed=9, vocab=bundle.config.vocab_size)[0]
    full = hetero_jax.generate(bundle, prompt, max_new_tokens=4, chat=False)
    for name in REGISTRY:
        if name in ("heterocache", "contextkeeper", "synckv", "profiledsnapkv"):  # need an offline profile /
            continue  # ranking for this model: tests/test_heterocache.py, test_contextkeeper.py, test_synckv.py, below
        if name in ("quest", "freekv"):  # decode-time retrieval, other budget rules: tests/test_<name>.py
            continue
        pol = make_policy(name, None if name == "full" else 0.5)
        r = hetero_jax.generate(bundle, prompt, pol, max_new_tokens=4, chat=False)
        assert r.stats.policy == repr(pol)
        expect = 1.0 if name == "full" else 0.5
        assert r.stats.achieved_rho == pytest.approx(expect, abs=0.02 if name != "cake" else 0.5)
        assert r.stats.kv_bytes_prompt < full.stats.kv_bytes_prompt or name == "full"
    assert set(describe_policies().split()) >= set(REGISTRY)
    with pytest.raises(KeyError, match="known policies"):
        make_policy("nope", 0.3)
    with pytest.raises(hetero_jax.PromptError, match="policy must be"):
        hetero_jax.generate(bundle, prompt, "snapkv", chat=False)


def test_head_permutation_leaves_outputs_unchanged():
    cfg = tiny_cfg(num_heads=9, num_kv_heads=3, qkv_bias=True)
    params = jax.tree.map(jnp.asarray, spec.init_params(cfg, seed=8, scale=0.3))
    layout = HeadLayout.from_orders([[2, 0, 1], [1, 0, 2], [0, 1, 2]])
    permuted = permute_params(params, cfg, layout)
    prompts = random_prompts([33, 21], seed=2)
    a, ca, _ = run(FullKV(), prompts, params=params, cfg=cfg)
    b, cb, _ = run(FullKV(), prompts, params=permuted, cfg=cfg)
    for x, y in zip(a, b):
        # permuted heads reorder o_proj's float32 sum over heads: logits of size ~5 move by ~1e-5;
        # a wrong permutation moves them by O(1)
        np.testing.assert_allclose(x, y, atol=1e-4, rtol=0)
        assert np.array_equal(x.argmax(-1), y.argmax(-1))
    # the cache holds the same heads, in layout order
    for li, perm in enumerate(layout.perms):
        ka, kb = np.asarray(layer_rows(ca, li)[0]), np.asarray(layer_rows(cb, li)[0])
        np.testing.assert_allclose(kb, ka[:, list(perm)], atol=1e-5)
    with pytest.raises(ValueError, match="not a permutation"):
        HeadLayout.from_orders([[0, 0, 1]] * 3).check(cfg)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kv=st.integers(1, 3), group=st.sampled_from([1, 2, 3, 5]), L=st.integers(40, 160),
    frac=st.floats(0.0, 1.0), which=st.sampled_from(["snapkv", "streamingllm", "pyramidkv"]),
)
def test_budget_properties(kv, group, L, frac, which):
    cfg = tiny_cfg(num_heads=kv * group, num_kv_heads=kv, layers=2)
    params = jax.tree.map(jnp.asarray, spec.init_params(cfg, seed=kv + group, scale=0.3))
    cls = REGISTRY[which]
    lo = smallest_rho(min(cls(budget=1.0).scorer.min_tokens().tokens, L), L)
    rho = round(lo + (1.0 - lo) * frac, 4)
    policy = cls(budget=rho)
    _, cache, plan = run(policy, random_prompts([L], seed=L), params=params, cfg=cfg, steps=1)
    n = tokens_for(rho, L)
    total = 0
    for li, lc in enumerate(cache.layers):
        _, _, pos, lengths = (np.asarray(a) for a in layer_rows(cache, li))
        lengths, pos = lengths[0], pos[0]
        assert np.all(lengths == plan.counts[li][0]) and lengths.min() >= 1  # [Hkv] each
        for h in range(kv):
            kept = pos[h, : lengths[h]]
            assert np.all(np.diff(kept) > 0) and kept.min() >= 0 and kept.max() < L
            assert L - 1 in kept  # the last prompt token (inside every window) is always kept
        total += int(lengths.sum())
    assert total == n * kv * cfg.num_layers


# ------------------------------------------------------ scorers x allocators
S, P, A, V = Role.SATELLITE, Role.PIVOT, Role.ANCHOR, Role.VOLATILE
# CFG's 3 layers x 2 KV heads: 2 full heads (a pivot, a volatile), 4 compressed ones of mean-1 weights
PROF = HeadProfile(roles=np.array([[P, S], [A, A], [A, V]], np.int8), clusters=(((0, (1,)),), (), ()),
                   weights=np.array([[np.nan, 0.8], [1.2, 0.9], [1.1, np.nan]]), architecture="llama",
                   head_dim=CFG.head_dim)
SCORERS = [SinksRecent(), WindowVotes(window=8), WindowMeanVar(window=8), HeavyHitters(window=8)]
ALLOCATORS = [Uniform(), Pyramid(beta=2.0), Cascade(window=8), ProfileBudgets(PROF)]


def np_budgets(allocator, rho, L, floor, prefs=None):
    """Tokens per head [layers, Hkv] from the allocators' definitions (no capping at these budgets)."""
    n_layers, H = CFG.num_layers, CFG.num_kv_heads
    n = int(np.floor(rho * L + 0.5))
    if isinstance(allocator, Uniform):
        return np.full((n_layers, H), n)
    if isinstance(allocator, Pyramid):  # linear from top to bottom share, rounded by largest remainder
        sel = n - floor
        lo, hi = sel / allocator.beta, 2 * sel - sel / allocator.beta
        t = floor + hi - (hi - lo) * np.arange(n_layers) / (n_layers - 1)
        assert t.max() <= L and abs(t.sum() - n * n_layers) < 1e-9  # no cap: the targets keep the total
        out = np.floor(t).astype(int)
        rem = t - out
        for j in sorted(range(n_layers), key=lambda j: (-rem[j], j))[: n * n_layers - out.sum()]:
            out[j] += 1
        return np.repeat(out[:, None], H, axis=1)
    if isinstance(allocator, Cascade):  # the smallest share each layer is given (shares: by hand above)
        return np.repeat(allocator.shares(prefs, n, L, floor)[1][:, None], H, axis=1)
    comp = np.isin(PROF.roles, [S, A])  # Eq. 7: L_base = (rho N - N_full) L / N_comp; Eq. 8: floor(L_base w)
    l_base = (rho * comp.size - (~comp).sum()) * L / comp.sum()
    return np.where(comp, np.floor(l_base * np.nan_to_num(PROF.weights)), L).astype(int)


@functools.lru_cache(maxsize=None)
def full_prompt_kv(L: int = 90):
    """Each layer's (params, x_in, k_buf, v_buf, lens) of one L-token prompt, captured from a full-KV prefill,
    so that every composition below runs only its own plan on them."""
    captured = []

    def observe(li, layer, x_in, k_buf, v_buf, lens):
        captured.append((layer, x_in, k_buf, v_buf, lens))

    prefill(PARAMS, CFG, random_prompts([L], seed=3), tail_capacity=1, plan=FullKV().make_prefill(CFG, [L]),
            observe=observe)
    return captured


@pytest.mark.parametrize("allocator", ALLOCATORS, ids=lambda a: type(a).__name__)
@pytest.mark.parametrize("scorer", SCORERS, ids=lambda s: type(s).__name__)
def test_every_scorer_with_every_allocator(scorer, allocator):
    """Each head keeps exactly its allocator's budget, and its scorer's top tokens (numpy references)."""
    rho, L = 0.6, 90
    policy = Composed(budget=rho, scorer=scorer, allocator=allocator)
    assert hash(policy) == hash(Composed(budget=rho, scorer=scorer, allocator=allocator))  # a static jit argument
    layers = full_prompt_kv(L)
    plan = policy.make_prefill(CFG, [L], compile_fn=compiled)
    blocks = [plan.build_layer(li, *layer) for li, layer in enumerate(layers)]
    prefs = None
    if isinstance(allocator, Cascade):
        blocks, _ = plan.cut(blocks)
        prefs = np.array([float(p[0]) for p in plan.prefs])
        want = [np_cake_preference(allocator, layer, x[0], k[0], L, CFG) for layer, x, k, _, _ in layers]
        np.testing.assert_allclose(np.exp(prefs), want, rtol=1e-3)  # carried as log P
    budgets = np_budgets(allocator, rho, L, scorer.min_tokens().tokens, prefs)
    for li, ((layer, x_in, k_buf, _, _), out) in enumerate(zip(layers, blocks)):
        (block,) = out.blocks
        lengths, pos = np.asarray(block.lengths)[0], np.asarray(block.positions)[0]
        np.testing.assert_array_equal(lengths, budgets[li])
        scores, forced = np_scorer_scores(scorer, layer, np.asarray(x_in)[0], np.asarray(k_buf)[0], L, CFG)
        for h in range(CFG.num_kv_heads):
            assert_top_set(pos[h, : budgets[li, h]], scores[h], forced, budgets[li, h])
            np.testing.assert_array_equal(np.asarray(block.k)[0, h, : budgets[li, h]],
                                          np.asarray(k_buf)[0, h, pos[h, : budgets[li, h]]])


def test_named_policies_are_their_compositions():
    """PyramidKV, CAKE and ProfiledSnapKV are SnapKV's options with another allocator (CAKE: and its own
    scorer); their options and registry names stay as they were."""
    p = make_policy("pyramidkv:window=8,beta=2", 0.6)
    assert p.scorer == WindowVotes(window=8) and p.allocator == Pyramid(beta=2.0)
    c = CAKE(budget=0.6, window=8, gamma=50.0, tau1=2.0)
    assert c.scorer == WindowMeanVar(window=8, gamma=50.0) and c.allocator == Cascade(window=8, tau1=2.0)
    a = make_policy("profiledsnapkv", 0.6, window=8, profile=PROF)
    assert type(a) is ProfiledSnapKV and a.scorer == WindowVotes(window=8)
    assert a.allocator == ProfileBudgets(PROF) and "profiledsnapkv" in describe_policies()
    np.testing.assert_array_equal(a.head_budgets(CFG, 90), np_budgets(ProfileBudgets(PROF), 0.6, 90, 8))
    with pytest.raises(ProfileError, match="no profile yet"):
        ProfiledSnapKV(budget=0.6).make_prefill(CFG, [90])
    with pytest.raises(PolicyError, match="scorer must be a Scorer"):
        Composed(budget=0.5, scorer="snapkv")
    with pytest.raises(PolicyError, match="WindowVotes: pool_kernel must be odd"):
        WindowVotes(pool_kernel=4)


def test_profile_budgets_below_the_scorers_floor_name_the_smallest_rho():
    L = 90
    policy = ProfiledSnapKV(budget=0.4, profile=PROF)  # a 32-token window: L_base = 9, too few
    with pytest.raises(BudgetError, match=r"needs at least 32 .*observation window.*rho=(0\.\d+)$") as e:
        policy.make_prefill(CFG, [L])  # before any compute
    rho = float(str(e.value).rsplit("rho=", 1)[1])
    # the lightest compressed head (weight 0.8) reaches 32 tokens: floor(0.8 * (6 rho - 2) * 90 / 4) >= 32
    assert rho == math.ceil((40 / 22.5 + 2) / 6 * 1e4) / 1e4
    assert dataclasses.replace(policy, budget=rho).head_budgets(CFG, L).min() == 32
    with pytest.raises(BudgetError):
        dataclasses.replace(policy, budget=round(rho - 1e-4, 4)).head_budgets(CFG, L)


def test_recall_steps_keep_the_most_recent_entries_and_stay_bounded():
    from hetero_jax.policies.base import RECENT_RECALLS, note_recall_steps
    steps: list[int] = []
    for step in range(3 * RECENT_RECALLS):
        note_recall_steps(steps, step, n=2)  # two layers recalled on each step
    assert RECENT_RECALLS <= len(steps) <= 2 * RECENT_RECALLS
    want = [s for s in range(3 * RECENT_RECALLS) for _ in range(2)][-len(steps):]
    assert steps == want  # the newest entries, in order, none lost between trims
    note_recall_steps(steps, 10**6)
    assert steps[-1] == 10**6
