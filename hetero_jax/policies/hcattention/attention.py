"""HCAttention's decode-time attention over the prompt, traced inside the step: scores (exact or by the look-up
table), the mass set, and the host's weighted sum of the values over it (``host_store.weighted_sum_in_step`` on a
CPU backend, ``host_store.host_weighted_sum``'s callback on a GPU)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct

from hetero_jax.model.host_store import host_weighted_sum, weighted_sum_in_step
from hetero_jax.model.spec import axes_field
from pallas_kernels import MASK_VALUE, traced_for_gpu


@struct.dataclass
class HCState:
    """A layer's decode state: the prompt's keys, or their codes and the layer's codebook (the values are on
    the host, in the store ``store``)."""

    prompt_lens: jax.Array = axes_field("batch")  # [B] int32
    k_caps: jax.Array = axes_field("batch")  # [B] int32: each sequence's cap on k*, ceil(k_cap_fraction L_b)
    store: jax.Array = axes_field()  # int32 handle of the values-only host store (``host_weighted_sum``)
    keys: jax.Array | None = axes_field("batch", "kv_heads", "tokens", "head_dim", default=None)  # [B, H, T, D]
    codes: jax.Array | None = axes_field("batch", "kv_heads", "tokens", "subvectors", default=None)  # [B, H, T, g]
    codebook: jax.Array | None = axes_field("centroids", "sub_dim", default=None)  # [c, d], shared by the layer


def prompt_part(li: int, q, st: HCState, kind: str, tau: float, k_cap_fraction: float, renormalize: bool,
                mesh=None, values=None):
    """Traced: the prompt's share of attention for query rows q [B, H, Q, D] (``policy.py``'s docstring).
    ``values``: the layer's host values [B, H, T, D] as a step operand (a CPU backend: summed in the step), or
    None (summed by a host callback on the store ``st.store``).

    Returns (y [B, H, Q, D] float32, lse [B, H, Q] float32 of what y stands for, k* [B, H, Q] int32,
    truncated [B, H, Q] bool: the k_cap candidates held less than tau)."""
    B, H, Q, D = q.shape
    s = prompt_scores(q, st) * (1.0 / math.sqrt(D))
    T = s.shape[-1]
    valid = jnp.arange(T, dtype=jnp.int32)[None, :] < st.prompt_lens[:, None]  # [B, T]
    s = jnp.where(valid[:, None, None, :], s, MASK_VALUE)
    m = s.max(-1)
    p = jnp.exp(s - m[..., None])
    l = p.sum(-1)
    a = p / l[..., None]
    # each sequence's own cap (a cap from the batch's longest prompt changed a short one's answer with its
    # neighbours); the default 1.0 never binds and stays a static T
    k_cap = T if k_cap_fraction >= 1.0 else st.k_caps[:, None, None, None]
    keep = mass_set(a, tau, k_cap) & valid[:, None, None, :]
    w = jnp.where(keep, a, 0.0)
    if values is None:
        y = host_weighted_sum(st.store, li, w, D, kind, mesh=mesh)
    else:
        y = weighted_sum_in_step(values, w)
    mass = w.sum(-1)
    lse = m + jnp.log(l)
    if renormalize:  # softmax over the kept tokens (and, merged, the tail)
        y, lse = y / mass[..., None], lse + jnp.log(mass)
    kstar = keep.sum(-1, dtype=jnp.int32)
    cap = k_cap if isinstance(k_cap, int) else k_cap[..., 0]  # [B, 1, 1]
    truncated = (kstar == cap) & (mass < tau) & (cap < st.prompt_lens[:, None, None])
    return y, lse, kstar, truncated


MASS_BISECTION_STEPS = 31  # the bits of a non-negative float32 below +inf: the search ends on a value present


def mass_set(a, tau: float, k_cap, by_sort: bool | None = None):
    """Traced: the mass set Pi of every row of probabilities a [..., T] float32 (>= 0), as a [..., T] bool mask:
    the k* most probable tokens, k* = min(k_cap, min{k : sum of the k largest >= tau}) (Eq. 4), ties to the
    lower index; tau >= 1 keeps every token (up to k_cap). ``k_cap``: an int, or int32 caps broadcastable to
    [..., 1] (one per sequence).

    ``by_sort`` (None: when tracing for a GPU, ``pallas_kernels.traced_for_gpu``): one sort per row and an
    exclusive prefix sum (a GPU sorts in one kernel, where the bisection below is a loop of 31 trips of
    several kernels each, in every layer); else no sort (XLA:CPU sorts slowly): a non-negative float's int32
    bits order as its value, so two bisections over the bits find the k*-th largest value of the mass rule
    (the largest x with sum_{a >= x} a >= tau) and of the cap (the largest x with #{a >= x} >= k_cap) in 31
    masked reductions each (of a alone, compared as floats); tokens above the higher one are kept, and of the
    tokens equal to it the first ones by index while the rule still holds (their ranks by a prefix sum, taken
    only where some row has two such tokens: on a CPU it costs three reductions)."""
    if by_sort is None:
        by_sort = traced_for_gpu()
    if by_sort:
        return _mass_set_sorted(a, tau, k_cap)
    bits = jax.lax.bitcast_convert_type(a, jnp.int32)
    zero = jnp.zeros(a.shape[:-1] + (1,), jnp.int32)
    top = bits.max(-1, keepdims=True) + 1  # no token reaches it: both rules fail there

    def search(holds):
        def body(_, lo_hi):
            lo, hi = lo_hi
            mid = lo + (hi - lo) // 2
            ok = holds(jax.lax.bitcast_convert_type(mid, jnp.float32))  # a >= x as floats: one array read
            return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

        return jax.lax.fori_loop(0, MASS_BISECTION_STEPS, body, (zero, top))[0]

    # k_cap >= T (the default) never binds: the k_cap-th largest value is then the smallest, 0 or above
    static_cap = isinstance(k_cap, int) and k_cap >= a.shape[-1]
    cap = zero if static_cap else search(lambda x: (a >= x).sum(-1, keepdims=True) >= k_cap)
    if tau >= 1.0:
        cut = zero
    else:
        cut = search(lambda x: jnp.where(a >= x, a, 0.0).sum(-1, keepdims=True) >= tau)
    thr = jnp.maximum(cut, cap)
    above = bits > thr
    tie = bits == thr
    # 1-based rank among the ties, by index; where no row has two ties, a tie's rank is 1
    rank = jax.lax.cond((tie.sum(-1, dtype=jnp.int32) > 1).any(),
                        lambda t: jnp.cumsum(t, axis=-1, dtype=jnp.int32), lambda t: t.astype(jnp.int32), tie)
    value = jax.lax.bitcast_convert_type(thr, jnp.float32)
    mass_above = jnp.where(above, a, 0.0).sum(-1, keepdims=True)
    by_mass = (thr != cut) | (mass_above + (rank - 1).astype(jnp.float32) * value < tau) | (tau >= 1.0)
    by_cap = (thr != cap) | (rank <= k_cap - above.sum(-1, keepdims=True, dtype=jnp.int32))
    return above | (tie & by_mass & by_cap)


def _mass_set_sorted(a, tau: float, k_cap):
    """``mass_set`` by a sort: k* from the exclusive prefix sums of each row sorted in descending order, then
    the tokens above the k*-th largest value and the first ties at it by index."""
    T = a.shape[-1]
    desc = jnp.flip(jnp.sort(a, axis=-1), axis=-1)
    if tau >= 1.0:
        k = jnp.full(a.shape[:-1] + (1,), T, jnp.int32)
    else:
        before = jnp.cumsum(desc, axis=-1) - desc  # mass of the larger tokens
        k = (before < tau).sum(-1, keepdims=True, dtype=jnp.int32)
    k = jnp.minimum(k, k_cap)
    value = jnp.take_along_axis(desc, jnp.maximum(k - 1, 0), axis=-1)  # k = 0 (tau <= 0) keeps nothing below
    above = a > value
    tie = a == value
    rank = jnp.cumsum(tie, axis=-1, dtype=jnp.int32)
    return above | (tie & (rank <= k - above.sum(-1, keepdims=True, dtype=jnp.int32)))


def prompt_scores(q, st: HCState):
    """Traced: raw scores [B, H, Q, T] float32 of query rows q [B, H, Q, D] against the prompt: exact
    (``st.keys`` [B, H, T, D]) or by the look-up table (``st.codes`` [B, H, T, g] int16, ``st.codebook``
    [c, d]): z_t = sum_i (q_i . C[P[t, i]]) (paper Eq. 3)."""
    B, H, Q, D = q.shape
    qf = q.astype(jnp.float32)
    hi = jax.lax.Precision.HIGHEST
    if st.keys is not None:
        return jnp.einsum("bhqd,bhtd->bhqt", qf, st.keys.astype(jnp.float32), precision=hi)
    cb = st.codebook.astype(jnp.float32)  # [c, d]
    codes = st.codes
    T, g = codes.shape[2], codes.shape[3]
    c = cb.shape[0]
    lut = jnp.einsum("bhqid,cd->bhqic", qf.reshape(B, H, Q, g, D // g), cb, precision=hi)  # [B, H, Q, g, c]
    # every group's table in one row: group i's code indexes [i c, (i + 1) c); one gather summed over the
    # groups, which XLA fuses into one kernel (a loop over the groups launched two kernels a group and layer)
    idx = codes.astype(jnp.int32) + jnp.arange(g, dtype=jnp.int32) * c  # [B, H, T, g]
    idx = jnp.broadcast_to(idx.reshape(B, H, 1, T * g), (B, H, Q, T * g))
    return jnp.take_along_axis(lut.reshape(B, H, Q, g * c), idx, axis=-1).reshape(B, H, Q, T, g).sum(-1)
