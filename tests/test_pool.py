"""The row pool's layout: the slack rule, regions per shard under tensor parallelism, the role-balanced
placement of HeteroCache's heads, against numpy and hand-computed cases (one device: the shapes the mesh
tests split over 'model')."""

import dataclasses

import numpy as np
import pytest

from hetero_jax.model.cache import pool_offsets
from hetero_jax.model.layout import HeadLayout
from hetero_jax.policies.placement import balanced_placement, balanced_rows, pooled_tokens_per_shard, role_grouped_order
from hetero_jax.policies import HeteroCache
from test_heterocache import CFG, PROFILE


def test_layout_from_rows_puts_row_j_of_shard_s_in_slot_s_times_n_local_plus_j():
    # one layer, 4 heads, tp 2: row 0 = (3, 0), row 1 = (1, 2)
    layout = HeadLayout.from_rows([[[3, 0], [1, 2]]], 2)
    assert layout.perms == ((3, 1, 0, 2),) and layout.tp == 2
    with pytest.raises(ValueError, match="tp=2 does not divide the 3 KV heads"):
        HeadLayout(((0, 1, 2),), 2).check(dataclasses.replace(CFG, num_layers=1))


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
    # every layer one full head (10 tokens) and three of 1; tp 2: the big heads on different shards, so each
    # shard's pool holds 10 + 1 + 1 + 1 rows (a region per head, nothing padded)
    b = np.array([[10, 1, 1, 1], [10, 1, 1, 1]])
    bal = balanced_placement(b, 2)
    assert bal[0, 0] != bal[1, 0]
    assert pooled_tokens_per_shard(b, bal, 2) == 13


@pytest.mark.parametrize("rho", [0.5, 0.8])
def test_heterocache_regions_per_shard_are_disjoint_and_inside_the_pool(rho):
    """Under tensor parallelism (tp 3: one head per shard per layer) each head's region (its budget + the
    tail rows) lies in its slot's shard, regions of a shard are disjoint and inside the pool, and a
    shard's prompt rows sum to what its heads keep (Eq. 7-8)."""
    policy = HeteroCache(profile=PROFILE, budget=rho)
    object.__setattr__(policy, "head_tp", 3)  # what bind() sets on a 3-way model axis
    object.__setattr__(policy, "row_pivot_slots", tuple(tuple(r.pivot_slots()) for r in policy.layer_roles(CFG)))
    lens, R = [150, 97], 8
    plan = policy.make_prefill(CFG, lens)
    layout = plan.layout
    assert layout.tp == 3
    counts = plan.prompt_counts()  # [L, B, H] layout order
    offsets, rows = pool_offsets(counts, R, 3)
    for b, L in enumerate(lens):
        grid = PROFILE.budgets(rho, L)
        spans = {s: [] for s in range(3)}
        for li in range(CFG.num_layers):
            perm = np.asarray(layout.perms[li])
            assert counts[li, b].tolist() == grid[li, perm].tolist()
            for slot in range(3):  # n_local = 1: slot s lives on shard s
                off = int(offsets[li, b, slot])
                spans[slot].append((off, off + int(counts[li, b, slot]) + R))
        for s, sp in spans.items():
            sp.sort()
            assert all(a[1] <= c[0] for a, c in zip(sp, sp[1:])) and sp[-1][1] <= rows
            assert sum(e - a - R for a, e in sp) == int(sum(grid[li, np.asarray(layout.perms[li])[s]]
                                                            for li in range(CFG.num_layers)))


def test_every_cache_array_declares_its_axes_and_sharding_reads_them():
    """Every array of a policy's cache (the pool, each layer's offsets / lengths, each policy's state record)
    has declared logical axes (``spec.tree_axes``), which the sharding reads; an array field without a
    declaration is an error naming it, never a guess."""
    import jax
    from flax import struct

    from hetero_jax.model.sharding import make_mesh, tree_shardings
    from hetero_jax.model.spec import tree_axes
    from hetero_jax.policies import FreeKV, Quest, SnapKV, SyncKV
    from hetero_jax.runtime import Engine
    from test_heterocache import MODEL
    from tiny_model import random_prompt

    caches = []
    for policy in (SnapKV(budget=0.5), HeteroCache(profile=PROFILE, budget=0.5), Quest(budget=0.5),
                   Quest(budget=0.8, offload=True), FreeKV(budget=0.9)):
        caches.append(Engine(MODEL, [random_prompt(150, 1)], policy, tail_capacity=8).cache)
    from test_synckv import PROFILE as SYNC_PROFILE

    synckv = SyncKV(profile=SYNC_PROFILE, budget=0.6)
    caches.append(Engine(MODEL, [random_prompt(150, 1)], synckv, tail_capacity=8).cache)
    mesh = make_mesh(1, 1)
    for cache in caches:
        axes = tree_axes(cache)
        leaves = jax.tree.leaves(cache)
        assert len(axes) == len(leaves) and all(len(a) == leaf.ndim for a, leaf in zip(axes, leaves))
        assert axes[:3] == [("batch", "kv_heads", "pool_rows", "head_dim")] * 2 + [("batch", "kv_heads", "pool_rows")]
        assert len(jax.tree.leaves(tree_shardings(cache, mesh))) == len(leaves)
    hetero = caches[1]
    assert tree_axes(hetero.layers[0].state) == [("batch", "pivots", "slots")]  # K_base

    @struct.dataclass
    class Undeclared:
        x: jax.Array

    with pytest.raises(ValueError, match=r"Undeclared.x: an array without declared logical axes"):
        tree_axes(Undeclared(x=np.zeros((2, 3))))


def test_selected_blocks_are_written_at_their_bucket_and_the_pool_keeps_only_counted_rows(monkeypatch):
    """PyramidKV's three layers keep different budgets. Each layer's selected block reaches the pool write at
    its 64-slot bucket (the smallest multiple of 64 at or above the layer's budget), not sliced to the budget
    (an eager slice compiled per size); the padding past each head's count is dropped by the write, so every
    head's region holds exactly its counted rows, each a distinct prompt position."""
    from hetero_jax.model import cache as cache_mod
    from hetero_jax.policies import PyramidKV
    from hetero_jax.runtime import Engine
    from tiny_model import random_prompts, tiny_model

    model = tiny_model(1024)
    seen = []
    write = cache_mod.PoolBuilder._write

    def spy(self, li, blocks):
        seen.append(([b.k.shape[2] for b in blocks], int(self.counts[li].max())))
        return write(self, li, blocks)

    monkeypatch.setattr(cache_mod.PoolBuilder, "_write", spy)
    eng = Engine(model, random_prompts([700], seed=3, vocab=model.config.vocab_size), PyramidKV(budget=0.5, window=8),
                 tail_capacity=4)
    assert len(seen) == 3 and len({cap for _, cap in seen}) == 3, seen  # three budgets
    assert [sizes for sizes, _ in seen] == [[-(-cap // 64) * 64] for _, cap in seen]
    assert any(sizes[0] != cap for sizes, cap in seen)  # some layer's block carries padding
    cache = eng.cache
    positions = np.asarray(cache.pool.positions)  # [B, shards, rows]
    for layer, (_, cap) in zip(cache.layers, seen):
        offsets, lengths = np.asarray(layer.offsets)[0], np.asarray(layer.lengths)[0]
        assert lengths.max() == cap
        for h in range(len(offsets)):
            rows = positions[0, 0, offsets[h] : offsets[h] + lengths[h]]
            assert len(set(rows.tolist())) == lengths[h] and rows.min() >= 0 and rows.max() < 700


def test_a_step_past_the_tails_capacity_gives_nan_logits_not_another_heads_rows():
    """Past a full tail the new rows are not written and the attention read the next head's region: plausible,
    wrong logits. Now those sequences' logits are NaN; the others' are as before."""
    import jax.numpy as jnp

    from hetero_jax.model import transformer as M
    from hetero_jax.runtime import prefill
    from tiny_model import random_prompts, tiny_model

    model = tiny_model()
    params, cfg = model.params, model.config
    prompts = random_prompts([12, 15], seed=4)
    _, cache = prefill(params, cfg, prompts, tail_capacity=2)
    logits, cache, _ = M.extend_jit(params, cache, jnp.asarray([[5, 6, 7], [5, 0, 0]], jnp.int32),
                                    jnp.asarray([3, 1], jnp.int32), cfg)  # 3 rows into a 2-row tail, then 1
    assert np.isnan(np.asarray(logits[0])).all() and np.isfinite(np.asarray(logits[1])).all()
    _, cache = prefill(params, cfg, prompts, tail_capacity=2)
    for step in range(3):
        logits, cache = M.decode_step_jit(params, cache, jnp.asarray([8, 9], jnp.int32), cfg)
        got = np.asarray(logits)
        assert np.isnan(got).all() if step == 2 else np.isfinite(got).all()  # the third row has no room
