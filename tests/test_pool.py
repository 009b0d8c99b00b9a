"""Head groups under tensor parallelism: the row slicing of a layer's heads, the per-shard prompt pool and
HeteroCache's pool plan, against numpy (one device: the shapes the mesh tests split over 'model')."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from hetero_jax.model.cache import HeadGroup, LayerCache, PooledGroup, PromptPool, join_heads, materialize, take_heads
from hetero_jax.model.layout import HeadLayout
from hetero_jax.policies.placement import balanced_placement, balanced_rows, pooled_tokens_per_shard, role_grouped_order
from hetero_jax.policies import HeteroCache
from test_heterocache import CFG, PROFILE


@pytest.mark.parametrize("tp,sizes", [(1, (1, 2)), (2, (2, 4)), (3, (3, 6, 3))])
def test_take_and_join_heads_are_the_row_slices(tp, sizes):
    H = sum(sizes)
    n_local = H // tp
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, H, 5)), jnp.float32)
    parts, o = [], 0
    for size in sizes:
        m = size // tp
        got = take_heads(x, o, m, tp)
        want = np.asarray(x)[:, [s * n_local + o + i for s in range(tp) for i in range(m)]]
        np.testing.assert_array_equal(np.asarray(got), want)
        parts.append(got)
        o += m
    np.testing.assert_array_equal(np.asarray(join_heads(parts, tp)), np.asarray(x))


def test_layout_from_rows_puts_row_j_of_shard_s_in_slot_s_times_n_local_plus_j():
    # one layer, 4 heads, tp 2: group 0 = row (3, 0), group 1 = row (1, 2)
    layout = HeadLayout.from_rows([[[[3, 0]], [[1, 2]]]], 2)
    assert layout.perms == ((3, 1, 0, 2),) and layout.group_sizes == ((2, 2),) and layout.tp == 2
    with pytest.raises(ValueError, match="multiples of tp=2"):
        HeadLayout(((0, 1, 2),), ((1, 2),), 2).check(dataclasses.replace(CFG, num_layers=1))


def test_balanced_rows_put_one_head_per_shard_largest_rows_first():
    rng = np.random.default_rng(3)
    b = rng.integers(1, 500, (5, 8))
    b[:, 0] = 4000
    for tp in (2, 4, 8):
        rows = balanced_rows(b, tp)
        place = balanced_placement(b, tp)
        order = role_grouped_order(b)
        for l in range(5):
            assert [sorted(r) for r in rows[l]] == [sorted(order[l, j * tp:(j + 1) * tp].tolist())
                                                   for j in range(8 // tp)]
            for row in rows[l]:
                assert [int(place[l, h]) for h in row] == list(range(tp))


def test_pool_tokens_hand_computed():
    # every layer one full head (10 tokens) and three of 1; tp 2: the big heads on different shards, rows
    # (10, 1) and (1, 1). Shard walks: 10 | 1 | [1 + window of 10] | 1 -> the third window ends at 11 + 10
    b = np.array([[10, 1, 1, 1], [10, 1, 1, 1]])
    bal = balanced_placement(b, 2)
    assert bal[0, 0] != bal[1, 0]
    assert pooled_tokens_per_shard(b, bal, 2) == 21


def test_materialize_reads_each_heads_window_from_its_shard():
    rng = np.random.default_rng(1)
    B, tp, P, D, m, S = 2, 3, 40, 4, 2, 6
    pool = PromptPool(k=jnp.asarray(rng.normal(size=(B, tp, P, D)), jnp.float32),
                      v=jnp.asarray(rng.normal(size=(B, tp, P, D)), jnp.float32),
                      positions=jnp.asarray(rng.integers(0, 99, (B, tp, P)), jnp.int32))
    offsets = rng.integers(0, P - S, (B, tp * m))
    lengths = rng.integers(1, S + 1, (B, tp * m))
    pooled = PooledGroup(offsets=jnp.asarray(offsets, jnp.int32), lengths=jnp.asarray(lengths, jnp.int32), capacity=S)
    H = tp * m
    lc = LayerCache(groups=(pooled,), tail_k=jnp.zeros((B, H, 1, D)), tail_v=jnp.zeros((B, H, 1, D)), head_tp=tp)
    (g,) = materialize(lc, pool).groups
    assert isinstance(g, HeadGroup) and g.k.shape == (B, H, S, D)
    for b in range(B):
        for h in range(H):
            sl = slice(offsets[b, h], offsets[b, h] + S)
            np.testing.assert_array_equal(np.asarray(g.k[b, h]), np.asarray(pool.k[b, h // m, sl]))
            np.testing.assert_array_equal(np.asarray(g.v[b, h]), np.asarray(pool.v[b, h // m, sl]))
            np.testing.assert_array_equal(np.asarray(g.positions[b, h]), np.asarray(pool.positions[b, h // m, sl]))
    np.testing.assert_array_equal(np.asarray(g.lengths), lengths)
    assert materialize(lc, None) is lc


@pytest.mark.parametrize("rho", [0.5, 0.8])
def test_heterocache_pool_plan_windows_are_disjoint_and_inside_the_pool(rho):
    """Each shard's heads get disjoint windows for their own rows, every window (a row's capacity) fits
    the pool, and a shard's rows sum to what its heads keep (Eq. 7-8)."""
    policy = HeteroCache(profile=PROFILE, budget=rho)
    object.__setattr__(policy, "head_tp", 3)  # what bind() sets on a 3-way model axis
    object.__setattr__(policy, "row_pivot_slots", tuple(tuple(r.pivot_slots()) for r in policy.layer_roles(CFG)))
    lens = [150, 97]
    plan = policy.make_prefill(CFG, lens)
    layout = plan.layout
    assert layout.tp == 3 and all(sum(s) == 3 for s in layout.group_sizes)
    n_local = 1
    for b, L in enumerate(lens):
        grid = PROFILE.budgets(rho, L)
        used = {s: [] for s in range(3)}
        for li in range(CFG.num_layers):
            perm = np.asarray(layout.perms[li])
            cap = int(plan.grid[:, li, perm].max())  # one row per layer here
            for slot in range(3):
                off = int(plan.pool_offsets[li][b, slot])
                n = int(grid[li, perm[slot]])
                used[slot // n_local].append((off, off + n))
                assert off + cap <= plan.pool_slots
        for s, spans in used.items():
            spans.sort()
            assert all(a[1] <= c[0] for a, c in zip(spans, spans[1:]))
            assert sum(e - a for a, e in spans) == int(sum(grid[li, np.asarray(layout.perms[li])[s]]
                                                           for li in range(CFG.num_layers)))

    rep = plan._placement()  # what the stats report: the same totals, split evenly vs contiguous
    grid_total = sum(PROFILE.budgets(rho, L).sum() for L in lens)
    assert sum(rep["kept_tokens_per_shard"]) == sum(rep["contiguous_kept_tokens_per_shard"]) == grid_total
    assert rep["kept_max_over_mean"] <= rep["contiguous_kept_max_over_mean"]
    assert rep["allocated_tokens_per_shard"] == plan.pool_slots * len(lens)
