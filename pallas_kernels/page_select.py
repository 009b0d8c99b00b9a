"""Page selection for decode-time page retrieval (Quest, FreeKV): each KV head's best pages by Quest's bound,
a per-channel min / max key summary per page (``hetero_jax.policies.pages.page_summaries``), with the plain-JAX
reference beside the dispatcher. The native CPU kernel (``pallas_kernels.native.page_select_native``) computes
the same in one call per layer, where XLA:CPU runs a handful of small fusions and a top_k, each costing more than
its data; on a GPU the reference runs (it compiles to a few fused kernels, RESULTS `step-ops-paged`).

Shapes: q [B, H, G, D] (H KV heads, G query heads each), kmin / kmax [B, H, P, D], n_pages [B] int32. Scores
are float32 and pages at or beyond a sequence's count score MASK_VALUE (finite, never -inf).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._util import MASK_VALUE, resolve_backend
from pallas_kernels.native import PAGE_SELECT_RULES as RULES
from pallas_kernels.native import page_select_native


def _page_valid(n_pages: jax.Array, n: int) -> jax.Array:
  """[B, n] True on pages below each sequence's count."""
  return jnp.arange(n, dtype=jnp.int32)[None, :] < n_pages[:, None]


def quest_page_scores(q: jax.Array, kmin: jax.Array, kmax: jax.Array, n_pages: jax.Array) -> jax.Array:
  """Quest's upper bound of q·k over each page, per query head.

  ``u = sum_d max(q_d*kmin_d, q_d*kmax_d)`` in float32, no 1/sqrt(D).
  q: [B, H, G, D]; kmin, kmax: [B, H, P, D]; n_pages: [B].
  Returns [B, H, G, P], MASK_VALUE on pages >= n_pages.
  """
  qf = q.astype(jnp.float32)[:, :, :, None, :]
  lo = kmin.astype(jnp.float32)[:, :, None, :, :]
  hi = kmax.astype(jnp.float32)[:, :, None, :, :]
  u = jnp.maximum(qf * lo, qf * hi).sum(axis=-1)
  return jnp.where(_page_valid(n_pages, u.shape[-1])[:, None, None, :], u, MASK_VALUE)


def group_page_scores(
  q: jax.Array, kmin: jax.Array, kmax: jax.Array, n_pages: jax.Array, how: str
) -> jax.Array:
  """One page score per KV head from its G query heads' Quest bounds.

  how="max": the group max of the bound (group-consistent Quest, "maxS").
  how="mean_softmax": FreeKV's MeanS rule, a softmax of each query head's
  bounds over the valid pages, then the mean over the group.
  Shapes as in quest_page_scores; returns [B, H, P] float32, MASK_VALUE on pages
  >= n_pages (all MASK_VALUE, no NaN, for a sequence without pages).
  """
  u = quest_page_scores(q, kmin, kmax, n_pages)
  if how == "max":
    s = u.max(axis=2)
  elif how == "mean_softmax":
    s = jax.nn.softmax(u, axis=-1).mean(axis=2)  # MASK_VALUE pages get weight 0
  else:
    raise ValueError(f"group page rule must be one of {RULES}, got {how!r}")
  return jnp.where(_page_valid(n_pages, s.shape[-1])[:, None, :], s, MASK_VALUE)


def top_pages(scores: jax.Array, n_select: int, counts: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """The ``n_select`` best pages of each head, best first.

  scores: [B, H, P] float32 (MASK_VALUE on unusable pages); n_select <= P,
  static; counts: optional [B] pages each sequence may keep (<= n_select; the
  best ``counts[b]`` are kept). Ties go to the lower page (``lax.top_k`` is
  stable). Returns pages [B, H, n_select] int32 and valid [B, H, n_select]
  bool, valid a prefix (scores come best first and ``counts`` cuts a prefix):
  slots that could only pick an MASK_VALUE page (or are past the count) are
  marked False and hold the head's best page (page 0 when it has none), so
  every id is in range. No sort after ``top_k``: which slot a page takes does
  not matter to attention (a set of rows) nor to the recall (a set of pages).
  """
  if not 0 < n_select <= scores.shape[-1]:
    raise ValueError(f"n_select must be in [1, {scores.shape[-1]}] (the page axis), got {n_select}")
  vals, idx = jax.lax.top_k(scores, n_select)  # best first
  ok = vals > MASK_VALUE
  if counts is not None:
    ok &= jnp.arange(n_select)[None, None, :] < counts[:, None, None]
  filler = jnp.where(ok[..., :1], idx[..., :1], 0)
  return jnp.where(ok, idx, filler).astype(jnp.int32), ok


def page_select_reference(
    q,              # [B, H, G, D]   queries of each KV head's group
    kmin,           # [B, H, P, D]   per-channel min key of each page
    kmax,           # [B, H, P, D]   per-channel max key of each page
    n_pages,        # [B] int32      selectable pages of each sequence
    n_select: int,  # static, in [1, P]: slots per head
    counts=None,    # [B] int32 or None: slots each sequence may keep (<= n_select)
    how: str = "max",
):
  """``top_pages(group_page_scores(...))``: (pages [B, H, n_select] int32, valid [B, H, n_select] bool)."""
  B = jnp.shape(q)[0]
  if jnp.shape(n_pages) != (B,) or (counts is not None and jnp.shape(counts) != (B,)):
    raise ValueError(f"n_pages and counts must be [B] = ({B},), got {jnp.shape(n_pages)} and "
                     f"{None if counts is None else jnp.shape(counts)}")
  return top_pages(group_page_scores(q, kmin, kmax, n_pages, how), n_select, counts)


def page_select(q, kmin, kmax, n_pages, n_select: int, counts=None, how: str = "max", *, backend: str | None = None):
  """Each KV head's ``n_select`` best pages (:func:`page_select_reference`'s contract), in the native CPU kernel
  where the pool attention is native (``resolve_backend(native=True)``), else the reference. Read at trace
  time; either path refuses a rule not in ``RULES``."""
  if resolve_backend(backend, native=True) == "native":
    return page_select_native(q, kmin, kmax, n_pages, n_select, counts, how)
  return page_select_reference(q, kmin, kmax, n_pages, n_select, counts, how)
