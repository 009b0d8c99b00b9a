"""Star clustering, roles, allocation weights and budgets (HeteroCache Sec. 4.1-4.2)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetero_jax.profile.clustering import (BudgetTooSmallError, Role, allocation_weights, assign_roles, base_budget,
                                           budget_grid, head_budgets, min_rho, star_clustering)

A, V, P, S = Role.ANCHOR, Role.VOLATILE, Role.PIVOT, Role.SATELLITE


def graph(n, edges):
    adj = np.zeros((n, n), dtype=bool)
    for i, j in edges:
        adj[i, j] = adj[j, i] = True
    return adj


def as_lists(clusters):
    return [(c.pivot, list(c.satellites)) for c in clusters]


# ------------------------------------------------------------ star clustering
def test_tie_goes_to_lowest_index():
    # degrees 0:1 1:2 2:2 3:2 4:1 -> 1, 2, 3 tie; 1 wins and takes {0, 3};
    # then 2 and 4 are left with the edge 2-4 (effective degree 1 each) -> 2.
    adj = graph(5, [(1, 0), (1, 3), (2, 3), (2, 4)])
    assert as_lists(star_clustering(adj)) == [(1, [0, 3]), (2, [4])]
    # two disjoint pairs: all degree 1 -> 0 then 2
    assert as_lists(star_clustering(graph(4, [(0, 1), (2, 3)]))) == [(0, [1]), (2, [3])]


def test_effective_degree_counts_only_unassigned_neighbours():
    # 0 has degree 3 (1, 2, 3); after it takes them, 4 (raw degree 2) has one
    # unassigned neighbour (5) left.
    adj = graph(6, [(0, 1), (0, 2), (0, 3), (3, 4), (4, 5)])
    assert as_lists(star_clustering(adj)) == [(0, [1, 2, 3]), (4, [5])]
    # 3 has the top raw degree (4); 0-1-2 triangle remains after -> 0 takes 1, 2
    adj = graph(7, [(3, 4), (3, 5), (3, 6), (3, 2), (0, 1), (0, 2), (1, 2)])
    assert as_lists(star_clustering(adj)) == [(3, [2, 4, 5, 6]), (0, [1])]


def test_isolated_full_empty_single():
    assert as_lists(star_clustering(graph(4, [(1, 2)]))) == [(1, [2])]  # 0 and 3 isolated
    full = ~np.eye(8, dtype=bool)
    assert as_lists(star_clustering(full)) == [(0, list(range(1, 8)))]
    assert star_clustering(np.zeros((8, 8), bool)) == []
    assert star_clustering(np.zeros((1, 1), bool)) == []


def test_bad_adjacency_rejected():
    with pytest.raises(ValueError, match="self loops"):
        star_clustering(np.ones((2, 2), bool))
    with pytest.raises(ValueError, match="symmetric"):
        star_clustering(np.array([[False, True], [False, False]]))
    with pytest.raises(ValueError):
        star_clustering(np.zeros((2, 3), bool))


def _reference_star(adj):
    """Plain-Python statement of the rule, for the property test."""
    n = len(adj)
    free = set(range(n))
    out = []
    while True:
        cands = [(sum(1 for j in free if adj[i][j]), -i) for i in free]
        if not cands:
            break
        deg, neg_i = max(cands)
        if deg == 0:
            break
        p = -neg_i
        sats = sorted(j for j in free if adj[p][j])
        free -= {p, *sats}
        out.append((p, sats))
    return out


@st.composite
def random_graph(draw):
    n = draw(st.integers(1, 10))
    bits = draw(st.lists(st.booleans(), min_size=n * n, max_size=n * n))
    upper = np.triu(np.array(bits, bool).reshape(n, n), 1)
    return upper | upper.T


@settings(max_examples=150, deadline=None)
@given(random_graph())
def test_star_clustering_properties(adj):
    clusters = star_clustering(adj)
    members = [h for c in clusters for h in (c.pivot, *c.satellites)]
    assert len(members) == len(set(members))  # every head at most once
    for c in clusters:
        assert c.satellites and all(adj[c.pivot, s] for s in c.satellites)
    left = np.setdiff1d(np.arange(len(adj)), members)
    assert not adj[np.ix_(left, left)].any()  # leftovers: no edge among them
    sizes = [len(c.satellites) for c in clusters]
    assert sizes == sorted(sizes, reverse=True)  # effective degrees only fall
    assert as_lists(clusters) == _reference_star(adj.tolist())


# ------------------------------------------------------------ roles
def test_assign_roles():
    stab = np.array([
        [0.9, 0.1, 0.5, 0.49],  # layer 0: no edges -> anchor/volatile by tau 0.5 (0.5 is anchor)
        [0.9, 0.1, 0.9, 0.1],  # layer 1: fully connected -> pivot 0, rest satellites
        [0.2, 0.2, 0.8, 0.3],  # layer 2: edge 1-3 -> pivot 1, satellite 3; 0 volatile, 2 anchor
    ])
    adjs = [np.zeros((4, 4), bool), ~np.eye(4, dtype=bool), graph(4, [(1, 3)])]
    roles, clusters = assign_roles(stab, adjs, tau_stable=0.5)
    assert roles.tolist() == [[A, V, A, V], [P, S, S, S], [V, P, A, S]]
    assert [as_lists(c) for c in clusters] == [[], [(0, [1, 2, 3])], [(1, [3])]]
    # NaN stability never passes the threshold -> volatile (full KV: the safe side)
    roles, _ = assign_roles(np.array([[np.nan]]), [np.zeros((1, 1), bool)], 0.5)
    assert roles.tolist() == [[V]]
    with pytest.raises(ValueError):
        assign_roles(stab, adjs[:2], 0.5)


def test_assign_roles_copy_heads_kept_whole():
    """Heads at or above tau_copy keep full KV; clusters shrink; NaN copy scores change nothing."""
    stab = np.array([
        [0.9, 0.1, 0.5, 0.49],
        [0.9, 0.1, 0.9, 0.1],
        [0.2, 0.2, 0.8, 0.3],
    ])
    adjs = [np.zeros((4, 4), bool), ~np.eye(4, dtype=bool), graph(4, [(1, 3)])]
    copy = np.array([
        [0.3, 0.9, 0.29, np.nan],  # anchor 0 at tau -> volatile; anchor 2 just below stays; volatile 1 stays
        [0.9, 0.5, 0.0, 0.1],  # pivot 0 stays (already full); satellite 1 leaves its cluster
        [0.0, 0.0, 0.0, 0.4],  # satellite 3 was pivot 1's only member -> both volatile
    ])
    roles, clusters = assign_roles(stab, adjs, tau_stable=0.5, copy_score=copy, tau_copy=0.3)
    assert roles.tolist() == [[V, V, A, V], [P, V, S, S], [V, V, A, V]]
    assert [as_lists(c) for c in clusters] == [[], [(0, [2, 3])], []]
    # tau_copy above every score, or no score: the plain taxonomy
    plain = assign_roles(stab, adjs, tau_stable=0.5)
    for kw in (dict(copy_score=copy, tau_copy=1.5), dict(copy_score=np.full((3, 4), np.nan), tau_copy=0.0),
               dict(copy_score=copy, tau_copy=None)):
        r, c = assign_roles(stab, adjs, tau_stable=0.5, **kw)
        assert r.tolist() == plain.roles.tolist() and c == plain.clusters
    with pytest.raises(ValueError, match="copy_score"):
        assign_roles(stab, adjs, 0.5, copy_score=copy[:, :3], tau_copy=0.3)


# ------------------------------------------------------------ allocation
def test_allocation_weights_hand_computed():
    stab = np.array([[0.25, 0.5, 0.1], [1.0, 0.5, 0.9]])
    roles = np.array([[S, A, P], [A, S, V]])
    w = allocation_weights(stab, roles)
    # compressed S = .25 .5 1 .5 -> 1/S = 4 2 1 2 (eps 1e-6 moves it ~4e-6),
    # mean 9/4 -> 16/9 8/9 4/9 8/9
    np.testing.assert_allclose(w[[0, 0, 1, 1], [0, 1, 0, 1]], [16 / 9, 8 / 9, 4 / 9, 8 / 9], rtol=1e-5)
    assert np.isnan(w[0, 2]) and np.isnan(w[1, 2])  # full heads: no weight
    # a zero stability is finite thanks to the 1e-6
    w0 = allocation_weights(np.array([[0.0, 1.0]]), np.array([[S, A]]))
    np.testing.assert_allclose(w0, [[2 * 1e6 / (1e6 + 1 / (1 + 1e-6)), 2 / (1e6 * (1 + 1e-6) + 1)]], rtol=1e-9)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 1), st.sampled_from(list(Role))), min_size=1, max_size=40))
def test_weights_mean_one(heads):
    stab = np.array([[s for s, _ in heads]])
    roles = np.array([[r for _, r in heads]])
    w = allocation_weights(stab, roles)
    comp = np.isin(roles, (A, S))
    assert np.isnan(w[~comp]).all()
    if comp.any():
        assert np.mean(w[comp]) == pytest.approx(1.0)
        assert (w[comp] > 0).all()


# ------------------------------------------------------------ budgets (Eq. 7-8)
def test_base_budget_eq7():
    # (0.4 * 10 - 2) * 1000 / 8 = 250
    assert base_budget(0.4, 10, 2, 8, 1000) == pytest.approx(250.0)
    # Llama profile counts: (0.5 * 256 - 50) * 10000 / 206 = 780000 / 206
    assert base_budget(0.5, 256, 50, 206, 10_000) == pytest.approx(780_000 / 206)
    with pytest.raises(ValueError):
        base_budget(0.5, 10, 2, 7, 1000)  # counts do not add up
    with pytest.raises(ValueError):
        base_budget(0.5, 10, 10, 0, 1000)  # nothing to compress


def test_too_small_budget_names_smallest_rho():
    # rho * N = N_full exactly -> L_base = 0; smallest rho = (2 + 8/1000) / 10 = 0.2008
    for rho in (0.2, 0.1):
        with pytest.raises(BudgetTooSmallError, match=r"smallest rho that works is 0\.2008\b") as ei:
            base_budget(rho, 10, 2, 8, 1000)
        assert isinstance(ei.value, ValueError)
        assert ei.value.min_rho == pytest.approx(0.2008)
    assert min_rho(10, 2, 8, 1000) == pytest.approx(0.2008)
    assert base_budget(0.2008, 10, 2, 8, 1000) == pytest.approx(1.0)
    # Llama: (50 + 206/4096) / 256 = 0.195508... -> printed rounded up, 0.1956
    with pytest.raises(BudgetTooSmallError, match=r"\b0\.1956\b"):
        base_budget(0.19, 256, 50, 206, 4096)


def test_head_budgets_eq8():
    # l = min(L, floor(250 * w)), at least 1
    got = head_budgets(250.0, np.array([0.5, 1.5, 1.0, 9.0, 0.001, 1.002]), 1000)
    assert got.tolist() == [125, 375, 250, 1000, 1, 250]
    with pytest.raises(ValueError):
        head_budgets(250.0, np.array([1.0, np.nan]), 1000)


def test_budget_grid():
    roles = np.array([[A, P], [S, V]])
    w = np.array([[0.5, np.nan], [1.5, np.nan]])
    # N=4, N_full=2, N_comp=2, L=100, rho=0.75: (3 - 2) * 100 / 2 = 50
    assert budget_grid(0.75, roles, w, 100).tolist() == [[25, 100], [75, 100]]


def test_budget_grid_hands_capped_excess_to_other_heads():
    roles = np.array([[A, A, S, V]])
    w = np.array([[3.0, 0.5, 0.5, np.nan]])
    # N=4, N_full=1, N_comp=3, L=100, rho=0.5: L_base = (2 - 1) * 100 / 3 = 33.33, total 100 tokens;
    # Eq. 8 alone: 100 (capped from 100.0), 16, 16 -> 132 > 100 is not capped; use rho=0.8 instead:
    # L_base = (3.2 - 1) * 100 / 3 = 73.33, Eq. 8: min(100, 220) = 100, 36, 36 (sum 172 of 220 granted);
    # water-filling gives the capped head's excess to the others: 100, 60, 60.
    assert budget_grid(0.8, roles, w, 100).tolist() == [[100, 60, 60, 100]]
    assert budget_grid(1.0, roles, w, 100).tolist() == [[100, 100, 100, 100]]
    # no capped head: plain Eq. 8
    assert budget_grid(0.5, roles, np.array([[1.2, 0.9, 0.9, np.nan]]), 100).tolist() == [[40, 30, 30, 100]]
