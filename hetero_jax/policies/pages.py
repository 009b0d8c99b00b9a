"""Page primitives for decode-time page retrieval (Quest, FreeKV).

A page is ``page_size`` consecutive prompt tokens of one KV head, summarised by
its per-channel min and max key. Keys are post-RoPE ``[B, H, T, D]`` (H = KV
heads), queries ``[B, H, G, D]`` (G = query heads per KV head). Scores are
float32 and pages beyond a sequence's count score MASK_VALUE (finite, never -inf).
Everything here is pure and jittable with ``page_size``, ``n_select`` and
``how`` static; ``start`` is static when it is a python int.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from hetero_jax.model.cache import bucket
from pallas_kernels.page_select import group_page_scores, quest_page_scores, top_pages  # noqa: F401 (re-exported)


PAGE_QUANTUM = 4  # the smallest step of a bucketed page count


def page_bucket(pages: int) -> int:
    """The static page count a decode step is compiled for (summaries P, slots k): ``pages`` rounded up to a
    multiple of max(PAGE_QUANTUM, a quarter of its power of two). The exact count compiled the step once per
    page of prompt length; every page past a sequence's own count is masked (``n_pages``, ``k_sel``), so the
    bound changes no result. The budget counts the summaries allocated: ``page_bucket(P)`` of them, not P."""
    return bucket(pages, PAGE_QUANTUM)


def page_shapes(n_pages, k_sel) -> tuple[int, int]:
    """The static (summaries per head, page slots per head) of a batch whose sequences have ``n_pages`` pages
    and select ``k_sel`` [B] each: their largest, bucketed (:func:`page_bucket`), at least 1, slots <= pages."""
    pages = max(1, page_bucket(int(np.max(n_pages))))
    return pages, min(max(1, page_bucket(int(np.max(k_sel)))), pages)


def fit_pages(a: jax.Array, n: int) -> jax.Array:
    """``a`` [B, H, P, ...] cut or zero-padded to ``n`` pages on axis 2."""
    P = a.shape[2]
    if n <= P:
        return a[:, :, :n]
    return jnp.pad(a, [(0, 0), (0, 0), (0, n - P)] + [(0, 0)] * (a.ndim - 3))


def _per_seq(start, batch: int) -> jax.Array:
    """``start`` (int or [B]) as a [B] int32 array."""
    return jnp.broadcast_to(jnp.asarray(start, dtype=jnp.int32), (batch,))


def page_summaries(
    k: jax.Array, lengths: jax.Array, page_size: int, start: int | jax.Array = 0
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per-channel min/max key of every full page (the Quest/FreeKV page summary).

    k: [B, H, T, D]; lengths: [B] valid tokens per sequence (slots at or beyond
    a length are padding and never enter a summary). Page j covers tokens
    ``[start + j*ps, start + (j+1)*ps)``; ``start`` is a python int or a [B] array
    (FreeKV: the pages begin after the sinks). Only full pages count:
    ``n_pages = max(0, (lengths - start) // ps)``.

    The static page axis is ``P = (T - start) // ps`` for an int start and
    ``T // ps`` for an array start (its values are unknown at trace time).
    Returns kmin, kmax [B, H, max(P, 1), D] in k's dtype (zeros on pages >= n_pages)
    and n_pages [B] int32.
    """
    B, H, T, D = k.shape
    ps = page_size
    starts = _per_seq(start, B)
    if isinstance(start, int):
        if start < 0:
            raise ValueError(f"start must be >= 0, got {start}")
        P = max(0, (T - start) // ps)
        pages = k[:, :, start : start + P * ps].reshape(B, H, P, ps, D)
    else:
        P = T // ps
        tok = starts[:, None] + jnp.arange(P * ps, dtype=jnp.int32)[None, :]  # [B, P*ps]
        tok = jnp.clip(tok, 0, T - 1)  # out-of-range slots belong to masked pages only
        pages = jnp.take_along_axis(k, tok[:, None, :, None], axis=2).reshape(B, H, P, ps, D)
    n_pages = jnp.clip((jnp.minimum(lengths.astype(jnp.int32), T) - starts) // ps, 0, P).astype(jnp.int32)
    # Only full pages count, so a page is wholly inside [start, length) or wholly dropped: a select
    # after the reduction is the token mask, and garbage (even NaN/inf) in dropped pages cannot leak.
    valid = (jnp.arange(P, dtype=jnp.int32)[None, :] < n_pages[:, None])[:, None, :, None]
    zero = jnp.zeros((), k.dtype)
    kmin, kmax = jnp.where(valid, pages.min(axis=3), zero), jnp.where(valid, pages.max(axis=3), zero)
    if P == 0:  # every prompt shorter than a page: one unusable page, so a top-1 page selection is defined
        kmin = kmax = jnp.zeros((B, H, 1, D), k.dtype)
    return kmin, kmax, n_pages


def pages_for_budget(rho: float, prompt_len: int, num_layers: int, full_layers: int, page_size: int, *,
                     fixed_tokens: int, summary_pages: int) -> int:
    """Pages per head of a sparse layer that fit budget rho (may be < 1: the budget is too small).

    The device holds rho * L * num_layers token rows per KV-head index over the model (K and V).
    ``full_layers`` layers keep all L; each sparse layer spends ``fixed_tokens`` (sinks, window,
    partial page) and ``summary_pages`` page summaries (kmin + kmax = one token's K + V each) first,
    then whole pages: k = floor((B_c - fixed - summaries) / page_size) with
    B_c = (rho * num_layers - full_layers) * L / (num_layers - full_layers) (the B1 rule of Eq. 7).
    """
    n_sparse = num_layers - full_layers
    b_c = (rho * num_layers - full_layers) * prompt_len / n_sparse
    return int(np.floor((b_c - fixed_tokens - summary_pages) / page_size + 1e-9))


def smallest_page_rho(prompt_len: int, num_layers: int, full_layers: int, page_size: int, *,
                      fixed_tokens: int, summary_pages: int) -> float:
    """The smallest rho (4 decimals) for which ``pages_for_budget`` gives at least one page."""
    n_sparse = num_layers - full_layers
    need = (full_layers * prompt_len + n_sparse * (page_size + fixed_tokens + summary_pages)) / (num_layers * prompt_len)
    rho = np.ceil(need * 1e4 - 1e-6) / 1e4
    kw = dict(fixed_tokens=fixed_tokens, summary_pages=summary_pages)
    while pages_for_budget(rho, prompt_len, num_layers, full_layers, page_size, **kw) < 1:
        rho = round(rho + 1e-4, 4)
    return float(rho)
