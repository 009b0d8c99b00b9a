"""Role-balanced head placement: hand-computed cases, brute force on small grids, and invariants."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetero_jax.policies.placement import (balanced_placement, contiguous_placement, padded_tokens_per_shard,
                                  placement_report, role_grouped_order, shard_tokens)


def test_hand_computed_two_layers_two_shards():
    # every layer: one full head (10 tokens) and three compressed ones (1 token)
    b = np.array([[10, 1, 1, 1], [10, 1, 1, 1]])
    naive = contiguous_placement(2, 4, 2)
    assert naive.tolist() == [[0, 0, 1, 1], [0, 0, 1, 1]]
    assert shard_tokens(b, naive, 2).tolist() == [22, 4]
    bal = balanced_placement(b, 2)
    assert shard_tokens(b, bal, 2).tolist() == [13, 13]
    # the two big heads on different shards, each shard 2 heads per layer
    assert bal[0, 0] != bal[1, 0]
    assert all(np.bincount(row, minlength=2).tolist() == [2, 2] for row in bal)
    # rows (10, 1) and (1, 1) per layer: capacities 10 + 1 per layer, 22 per shard
    assert padded_tokens_per_shard(b, bal, 2) == 22
    # naive: shard 0 holds (10, 1), shard 1 holds (1, 1): slot 0 capacity 10, slot 1 capacity 1
    assert padded_tokens_per_shard(b, naive, 2) == 22
    role = contiguous_placement(2, 4, 2, role_grouped_order(b))
    assert shard_tokens(b, role, 2).tolist() == [22, 4]


def test_role_grouped_order_is_largest_first_and_stable():
    assert role_grouped_order(np.array([[1, 5, 5, 2]])).tolist() == [[1, 2, 3, 0]]


def _all_placements(H, tp):
    n_local = H // tp
    base = [s for s in range(tp) for _ in range(n_local)]
    return sorted(set(itertools.permutations(base)))


@pytest.mark.parametrize("seed", range(4))
def test_brute_force_small_grids(seed):
    rng = np.random.default_rng(seed)
    L, H, tp = 2, 4, 2
    b = rng.integers(1, 50, (L, H))
    b[:, 0] = 100  # a full head per layer
    layer_options = _all_placements(H, tp)
    best_max, best_pad = None, None
    for combo in itertools.product(layer_options, repeat=L):
        p = np.array(combo)
        m = shard_tokens(b, p, tp).max()
        pad = padded_tokens_per_shard(b, p, tp)
        best_max = m if best_max is None else min(best_max, m)
        best_pad = pad if best_pad is None else min(best_pad, pad)
    bal = balanced_placement(b, tp)
    # the padding is the least any placement allows; the largest shard is within one head of the optimum
    assert padded_tokens_per_shard(b, bal, tp) == best_pad
    assert shard_tokens(b, bal, tp).max() <= best_max + b.max(initial=0) - b.min()
    assert shard_tokens(b, bal, tp).max() <= shard_tokens(b, contiguous_placement(L, H, tp), tp).max()


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.sampled_from([(4, 2), (8, 4), (8, 8), (6, 3), (3, 3)]), st.integers(0, 2**31 - 1))
def test_invariants(L, shape, seed):
    H, tp = shape
    rng = np.random.default_rng(seed)
    b = rng.integers(1, 1000, (L, H))
    b[np.arange(L), rng.integers(0, H, L)] = 4000
    bal = balanced_placement(b, tp)
    for row in bal:  # every shard gets exactly H / tp heads of every layer
        assert np.bincount(row, minlength=tp).tolist() == [H // tp] * tp
    assert shard_tokens(b, bal, tp).sum() == b.sum()
    for naive in (contiguous_placement(L, H, tp), contiguous_placement(L, H, tp, role_grouped_order(b))):
        assert shard_tokens(b, bal, tp).max() <= shard_tokens(b, naive, tp).max()
        assert padded_tokens_per_shard(b, bal, tp) <= padded_tokens_per_shard(b, naive, tp)


def test_report_rows():
    b = np.array([[10, 1, 1, 1], [10, 1, 1, 1]])
    rows = placement_report(b, 2, bytes_per_token=4)
    assert [r["placement"] for r in rows] == ["contiguous (checkpoint order)", "contiguous (role-grouped layout)",
                                              "role-balanced"]
    assert rows[0]["kept_max"] == 22 * 4 and rows[0]["kept_mean"] == 13 * 4
    assert rows[2]["imbalance"] == 1.0 and rows[2]["padded"] == 22 * 4
    with pytest.raises(ValueError, match="tp=3 must divide the 4 KV heads"):
        balanced_placement(b, 3)
