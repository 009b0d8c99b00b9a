"""Set metrics of the head profile (HeteroCache Eq. 1-3) on hand-built sets."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetero_jax.profile.metrics import (indices_to_mask, max_similarity, overlap, overlap_masks, similarity_edges,
                                        similarity_matrix, similarity_score, stability, stability_masks, topk_mask,
                                        topk_set)


def peaked(length, hot, base=0.01):
    """Scores [length] that are large exactly on ``hot``: its top-|hot| set is ``hot``."""
    s = np.full(length, base, dtype=np.float32)
    s[list(hot)] = 1.0 + np.arange(len(hot), dtype=np.float32) / 100  # distinct, all above base
    return s


# ------------------------------------------------------------------ top-k
def test_topk_set_ties_go_to_lower_index():
    s = np.array([0.1, 0.5, 0.5, 0.2, 0.5])
    assert topk_set(s, 1).tolist() == [1]
    assert topk_set(s, 2).tolist() == [1, 2]
    assert topk_set(s, 3).tolist() == [1, 2, 4]
    assert topk_set(s, 4).tolist() == [1, 2, 3, 4]
    assert topk_set(s, 99).tolist() == [0, 1, 2, 3, 4]  # k >= T: everything


def test_topk_nan_is_smallest_and_bad_k_raises():
    s = np.array([np.nan, 0.0, -1.0])
    assert topk_set(s, 2).tolist() == [1, 2]
    with pytest.raises(ValueError):
        topk_set(s, 0)
    with pytest.raises(ValueError):
        topk_set(s[None], 1)  # 2-D needs topk_mask


def test_topk_mask_batched():
    s = np.array([[3.0, 1.0, 3.0, 2.0], [0.0, 0.0, 0.0, 0.0]])
    assert topk_mask(s, 2).tolist() == [[True, False, True, False], [True, True, False, False]]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=30), st.integers(1, 35))
def test_topk_mask_matches_bruteforce(vals, k):
    # Small integer scores -> many ties. Brute force: sort by (-score, index).
    s = np.array(vals, dtype=np.float32)
    want = sorted(sorted(range(len(vals)), key=lambda i: (-vals[i], i))[:k])
    assert topk_set(s, k).tolist() == want
    assert np.flatnonzero(topk_mask(s[None, :], k)[0]).tolist() == want


# ------------------------------------------------------------------ overlap
def test_overlap_hand_computed():
    assert overlap([1, 2, 3, 4], [3, 4, 5]) == pytest.approx(2 / 3)
    assert overlap([3, 4, 5], [1, 2, 3, 4]) == pytest.approx(2 / 3)
    assert overlap([0, 1], [0, 1, 2, 3]) == 1.0  # subset: coefficient 1
    assert overlap([0, 0, 1], [1, 7]) == 0.5  # duplicates ignored
    assert overlap([0], [1]) == 0.0
    with pytest.raises(ValueError):
        overlap([], [1])
    a, b = indices_to_mask([1, 2, 3, 4], 8), indices_to_mask([3, 4, 5], 8)
    assert overlap_masks(a, b) == pytest.approx(2 / 3)
    with pytest.raises(ValueError):
        overlap_masks(np.zeros(4, bool), a[:4])
    with pytest.raises(ValueError):
        indices_to_mask([8], 8)


@settings(max_examples=60, deadline=None)
@given(st.sets(st.integers(0, 40), min_size=1), st.sets(st.integers(0, 40), min_size=1))
def test_overlap_masks_agree_with_sets(a, b):
    want = len(a & b) / min(len(a), len(b))
    got = overlap(sorted(a), sorted(b))
    assert got == pytest.approx(want) and 0.0 <= got <= 1.0
    assert overlap(sorted(b), sorted(a)) == got
    assert overlap_masks(indices_to_mask(sorted(a), 41), indices_to_mask(sorted(b), 41)) == pytest.approx(want)


# ------------------------------------------------------------------ stability
def test_stability_on_constructed_attention():
    # Prefill focus on tokens 0..9 (k = 10). Decode steps (the context grows
    # by one token per step): same focus -> 1.0; shifted by 5 -> 0.5; moved
    # away entirely -> 0.0; 8 of 10 kept -> 0.8. Overlaps [1, .5, 0, .8].
    k, T = 10, 40
    prefill = topk_set(peaked(T, range(0, 10)), k)
    steps = [
        topk_set(peaked(T + 1, range(0, 10)), k),
        topk_set(peaked(T + 2, range(5, 15)), k),
        topk_set(peaked(T + 3, range(20, 30)), k),
        topk_set(peaked(T + 4, list(range(2, 10)) + [T + 1, T + 2]), k),
    ]
    assert [overlap(prefill, s) for s in steps] == [1.0, 0.5, 0.0, 0.8]
    assert stability(prefill, steps[:3]) == 0.5  # odd count: middle value
    assert stability(prefill, steps) == pytest.approx(0.65)  # even: mean of 0.5 and 0.8
    with pytest.raises(ValueError):
        stability(prefill, [])

    # Vectorised: masks padded with False to the widest step, [S, L=1, H=2, T].
    width = T + 4
    pre = np.stack([indices_to_mask(prefill, width)] * 2)[None]  # [1, 2, W]
    dec = np.stack([np.stack([indices_to_mask(s, width), indices_to_mask(prefill, width)])[None]
                    for s in steps])  # [4, 1, 2, W]; head 1 never moves
    np.testing.assert_allclose(stability_masks(pre, dec), [[0.65, 1.0]])


# ------------------------------------------------------------------ similarity
def test_similarity_matrix_edges_and_max():
    # A = {0..9}, B = {5..14}, C = {0..4}: O(A,B)=5/10, O(A,C)=5/5, O(B,C)=0/5.
    A, B, C = range(0, 10), range(5, 15), range(0, 5)
    want = np.array([[1.0, 0.5, 1.0], [0.5, 1.0, 0.0], [1.0, 0.0, 1.0]])
    # from attention scores via top-k, from index lists, and from masks
    T = 20
    sets = [topk_set(peaked(T, A), 10), topk_set(peaked(T, B), 10), topk_set(peaked(T, C), 5)]
    np.testing.assert_allclose(similarity_matrix(sets), want)
    np.testing.assert_allclose(similarity_matrix(np.stack([indices_to_mask(s, T) for s in sets])), want)

    e = similarity_edges(want, 0.5)
    assert e.tolist() == [[False, True, True], [True, False, False], [True, False, False]]
    assert similarity_edges(want, 0.6).tolist() == [[False, False, True], [False, False, False],
                                                    [True, False, False]]
    assert not similarity_edges(np.ones((3, 3)), 0.5).diagonal().any()
    np.testing.assert_allclose(max_similarity(want), [1.0, 0.5, 1.0])
    assert np.isnan(max_similarity(np.ones((1, 1)))).all()  # one head: nobody to compare with

    # Eq. 3 over 3 steps: median of the per-step maxima.
    other = np.array([[1.0, 0.2, 0.1], [0.2, 1.0, 0.3], [0.1, 0.3, 1.0]])  # maxima .2 .3 .3
    np.testing.assert_allclose(similarity_score(np.stack([want, other, want])), [1.0, 0.5, 1.0])
    np.testing.assert_allclose(similarity_score(np.stack([want, other, other])), [0.2, 0.3, 0.3])

    with pytest.raises(ValueError):
        similarity_matrix([[0, 1], []])
