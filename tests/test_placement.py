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
    # a shard holds one head of each of a layer's rows, at most each row's largest: never more than the
    # contiguous split of the largest-first order, whose first shard holds each layer's n_local largest
    grouped = contiguous_placement(L, H, tp, role_grouped_order(b))
    assert shard_tokens(b, bal, tp).max() <= shard_tokens(b, grouped, tp).max()
    for naive in (contiguous_placement(L, H, tp), grouped):
        assert padded_tokens_per_shard(b, bal, tp) <= padded_tokens_per_shard(b, naive, tp)


def test_rows_can_leave_a_larger_shard_than_the_head_order_split():
    # keeping heads of similar size in one row (the least padding) is a constraint: here the best placement
    # by rows leaves 9,580 tokens on a shard where splitting each layer by head index leaves 8,902 (found by
    # test_invariants); balanced_placement finds that best by rows (every row's two orientations tried)
    b = np.array([[473, 4000, 755, 950], [35, 145, 823, 4000], [249, 4000, 869, 423]])
    bal = balanced_placement(b, 2)
    assert shard_tokens(b, bal, 2).max() == 9580
    assert shard_tokens(b, contiguous_placement(3, 4, 2), 2).max() == 8902
    assert padded_tokens_per_shard(b, bal, 2) < padded_tokens_per_shard(b, contiguous_placement(3, 4, 2), 2)
    rows = role_grouped_order(b).reshape(3, 2, 2)  # [layer, row, the row's two heads]
    by_rows = [np.array(p) for p in itertools.product(_all_placements(4, 2), repeat=3)
               if all(p[l][h0] != p[l][h1] for l in range(3) for h0, h1 in rows[l])]
    assert len(by_rows) == 2**6 and min(shard_tokens(b, p, 2).max() for p in by_rows) == 9580


def test_report_rows():
    b = np.array([[10, 1, 1, 1], [10, 1, 1, 1]])
    rows = placement_report(b, 2, bytes_per_token=4)
    assert [r["placement"] for r in rows] == ["contiguous (checkpoint order)", "contiguous (role-grouped layout)",
                                              "role-balanced"]
    assert rows[0]["kept_max"] == 22 * 4 and rows[0]["kept_mean"] == 13 * 4
    assert rows[2]["imbalance"] == 1.0 and rows[2]["padded"] == 22 * 4
    with pytest.raises(ValueError, match="tp=3 must divide the 4 KV heads"):
        balanced_placement(b, 3)
