"""Pallas kernels of hetero-jax, each with a pure-JAX reference beside it.

Kernels (always lowered through Triton: `plgpu.CompilerParams` on every
`pallas_call`, so they run on A100 and H100):

- :func:`sparse_decode_attention` — split-K decode attention over ragged
  per-(batch, KV head) caches; returns (out, lse) so cache tiers merge exactly
  with :func:`merge_attention`.
- :func:`pooled_scores` — softmax -> 5-tap average pooling -> GQA max/mean,
  the shared scoring primitive; :func:`overlap_bitmap` and
  :func:`drift_check` build on it (top-k membership without a sort:
  :func:`topk_threshold`, :func:`topk_membership`, :func:`topk_sets`).

Backend switch
--------------
`HETERO_JAX_KERNELS` = auto | pallas | native | reference | interpret (default auto):

- auto:      Pallas kernels when jax sees a GPU; otherwise the native CPU kernel for the pool attention
             (``pallas_kernels.native``, built on first use) and the jnp references for the rest;
- pallas:    the Pallas/Triton kernels (needs a CUDA GPU to run);
- native:    the native CPU kernel for the pool attention (an error if it cannot be built), references
             for the rest;
- reference: the plain-jnp references (any backend);
- interpret: the Pallas kernels in the Pallas interpreter (CPU debugging).

`use_kernels("pallas")` overrides the env var for the process (and works as a
context manager that restores the previous setting); `use_kernels()` returns
the concrete backend now in force; `use_kernels("env")` drops the override.
The choice is read at trace time: already-traced jitted callers keep theirs.
Dispatching entry points: :func:`decode_attention`, :func:`drift_check`
(`backend=` argument overrides both).
"""

from __future__ import annotations

from pallas_kernels._util import (BACKENDS, ENV_VAR, MASK_VALUE, KernelBackendError, gpu_available, is_pow2,
                                  kernel_head_dim_ok, resolve_backend, traced_for_gpu, use_kernels)
from pallas_kernels.pooled_scores import (POOL_KERNEL_SIZE, avg_pool, gqa_reduce, masked_softmax,
                                          attention_and_pooled_scores, base_overlap,
                                          drift_check, drift_check_reference,
                                          normalised_overlap, overlap_bitmap,
                                          pooled_scores,
                                          pooled_scores_reference,
                                          topk_membership, topk_threshold)
from pallas_kernels.pooled_scores import topk_sets as topk_sets_xla
from pallas_kernels.pool_attention import (check_pool_args, gather_blocks, pivot_pooled_scores,
                                           pivot_statistics_reference, pool_attention_reference,
                                           pool_attention_statistics_reference, score_flags)
from pallas_kernels.pool_attention import pool_attention as pool_attention_pallas
from pallas_kernels.page_recall import page_recall, page_recall_reference
from pallas_kernels.page_select import page_select, page_select_reference
from pallas_kernels.sparse_decode_attention import (
    default_num_splits, merge_attention, sparse_decode_attention,
    sparse_decode_attention_reference)

__all__ = [
    "BACKENDS", "ENV_VAR", "MASK_VALUE", "POOL_KERNEL_SIZE", "KernelBackendError", "kernel_head_dim_ok",
    "use_kernels", "resolve_backend", "traced_for_gpu", "gpu_available", "avg_pool", "gqa_reduce", "masked_softmax",
    "decode_attention", "sparse_decode_attention",
    "sparse_decode_attention_reference", "merge_attention",
    "default_num_splits",
    "pooled_scores", "pooled_scores_reference", "overlap_bitmap",
    "topk_threshold", "topk_membership", "topk_sets", "normalised_overlap",
    "drift_check", "drift_check_reference", "base_overlap", "attention_and_pooled_scores", "scores",
    "pool_attention", "pool_attention_pallas", "pool_attention_reference", "pivot_pooled_scores",
    "pivot_statistics", "pivot_statistics_reference", "native_statistics", "topk_sets_xla",
    "pool_attention_statistics", "pool_attention_statistics_reference", "score_flags", "page_select",
    "page_select_reference", "page_recall", "page_recall_reference",
]


_warned_block_sizes: set[int] = set()


def pool_attention(q, k_pool, v_pool, offsets, lengths, score_heads=None, block_rows=None, *, max_len: int,
                   score_len: int = 0, sm_scale: float | None = None, block_size: int = 0,
                   backend: str | None = None):
  """Every KV head of a layer over one row pool (``pallas_kernels.pool_attention``'s contract), dispatched
  by the backend switch.

  q [B, H, T, G, D]; k_pool, v_pool [B, P, D]; offsets, lengths [B, H] int32; score_heads [H] int32 flags or
  None; block_rows [B, H, NB] int32 (paged heads, blocks of ``block_size`` rows) or None. Returns (out
  [B, H, T, G, D] in q.dtype, lse [B, H, T, G] float32, logits [B, H, G, score_len] float32 or None).
  The native CPU kernel reads a paged head's blocks in place too (blocks of any power of two). Where the
  Pallas kernel cannot read blocks of ``block_size`` rows (not a power of two >= 16) the reference runs (a
  warning). Every backend clips the visible rows to ``max_len`` and refuses the same bad arguments
  (``check_pool_args``; rows outside the pool where offsets and lengths are concrete).
  """
  mode = resolve_backend(backend, native=True, head_dim=q.shape[-1])
  if block_rows is not None and mode in ("pallas", "interpret") and not (is_pow2(block_size) and block_size >= 16):
    if block_size not in _warned_block_sizes:
      import warnings
      _warned_block_sizes.add(block_size)
      warnings.warn(f"paged attention with blocks of {block_size} rows: the Pallas kernel reads blocks of a power "
                    "of two >= 16 rows (use a page size of 16, 32 or 64); the plain-JAX reference runs instead "
                    "(correct, slower on a GPU)", RuntimeWarning, stacklevel=2)
    mode = "reference"
  if mode == "reference":
    return pool_attention_reference(q, k_pool, v_pool, offsets, lengths, score_heads, block_rows, max_len=max_len,
                                    score_len=score_len, sm_scale=sm_scale, block_size=block_size)
  if mode == "native":
    from pallas_kernels.native import pool_attention_native
    if block_rows is not None and not is_pow2(block_size):  # the kernel's blocks must divide a page
      check_pool_args(q, k_pool, v_pool, offsets, lengths, score_heads, block_rows, block_size=block_size,
                      max_len=max_len, score_len=score_len)
      k_pool, v_pool, offsets = gather_blocks(k_pool, v_pool, offsets, block_rows, block_size=block_size,
                                              max_len=max_len)
      block_rows = None
    return pool_attention_native(q, k_pool, v_pool, offsets, lengths, score_heads, block_rows, max_len=max_len,
                                 score_len=score_len, sm_scale=sm_scale, block_size=block_size)
  return pool_attention_pallas(q, k_pool, v_pool, offsets, lengths, score_heads, block_rows, max_len=max_len,
                               score_len=score_len, sm_scale=sm_scale, block_size=block_size,
                               interpret=(mode == "interpret"))


def native_statistics(backend: str | None = None) -> bool:
  """Whether :func:`pivot_statistics` runs the native CPU kernel (read at trace time): where the pool attention
  does (``resolve_backend(native=True)`` is 'native')."""
  return resolve_backend(backend, native=True) == "native"


def pivot_statistics(logits, lengths, k_base, *, backend: str | None = None):
  """A pivot layer's drift statistics of one decode step (``pivot_statistics_reference``'s contract):
  logits [B, Hp, G, T] float32, lengths [B, Hp] int32, k_base [B, Hp, K] int32 -> (scores [B, Hp, T],
  o'_t [B, Hp]), both float32. The native CPU kernel where :func:`native_statistics`, else the reference."""
  if native_statistics(backend):
    from pallas_kernels.native import pivot_statistics_native
    return pivot_statistics_native(logits, lengths, k_base)
  return pivot_statistics_reference(logits, lengths, k_base)


def pool_attention_statistics(q, k_pool, v_pool, offsets, lengths, score_slots, stat_lengths, k_base, *,
                              max_len: int, score_len: int, sm_scale: float | None = None,
                              backend: str | None = None):
  """A decode step's pool attention with the drift statistics of the heads ``score_slots`` (static tuple)
  (``pool_attention_statistics_reference``'s contract): q [B, H, 1, G, D], k_pool / v_pool [B, P, D],
  offsets, lengths [B, H], stat_lengths [B, Hs], k_base [B, Hs, K] -> (out [B, H, 1, G, D], lse [B, H, 1, G],
  scores [B, Hs, score_len], o'_t [B, Hs]). One native call where :func:`native_statistics` (the statistics
  are computed by the thread that merges each scored head, from logits that never leave the kernel); else
  :func:`pool_attention` with the heads' logits, then :func:`pivot_statistics`."""
  if native_statistics(backend):
    from pallas_kernels.native import pool_attention_statistics_native
    return pool_attention_statistics_native(q, k_pool, v_pool, offsets, lengths, score_slots, stat_lengths, k_base,
                                            score_len=score_len, sm_scale=sm_scale, max_len=max_len)
  out, lse, logits = pool_attention(q, k_pool, v_pool, offsets, lengths, score_flags(q.shape[1], score_slots),
                                    max_len=max_len, score_len=score_len, sm_scale=sm_scale, backend=backend)
  scores, overlap = pivot_statistics(logits[:, list(score_slots)], stat_lengths, k_base, backend=backend)
  return out, lse, scores, overlap


def topk_sets(scores, sizes, cap: int, *, backend: str | None = None):
  """For each size k of ``sizes``, the positions ``lax.top_k(scores, k)`` picks, ascending, -1 past k
  (``pooled_scores.topk_sets``' contract): scores [..., T] float32, sizes [..., K] int each in
  [0, min(cap, T)] -> int32 [..., K, cap]. The native CPU kernel where :func:`native_statistics`, else
  ``topk_sets_xla`` (bisections and prefix sums; sorts on a GPU)."""
  if native_statistics(backend):
    from pallas_kernels.native import topk_sets_native
    return topk_sets_native(scores, sizes, cap)
  return topk_sets_xla(scores, sizes, cap)


def decode_attention(q, k, v, lengths, *, sm_scale: float | None = None, backend: str | None = None,
                     finite_padding: bool = False, **kernel_kwargs):
  """Ragged per-head decode attention, dispatched by the backend switch.

  q [B, Hkv, G, D]; k, v [B, Hkv, S, D]; lengths [B, Hkv] int32 (the
  arguments of :func:`sparse_decode_attention`).

  ``finite_padding``: the caller promises slots beyond ``lengths`` hold finite
  values, letting the reference skip masking K and V (the kernel never reads
  them at all).

  Returns (out [B, Hkv, G, D] in q.dtype, lse [B, Hkv, G] float32), the same
  for every backend. `kernel_kwargs` (block_k, num_splits, num_warps,
  num_stages) only reach the Pallas kernel.
  """
  mode = resolve_backend(backend, head_dim=q.shape[-1])
  if mode == "reference":
    return sparse_decode_attention_reference(q, k, v, lengths,
                                             sm_scale=sm_scale,
                                             finite_padding=finite_padding)
  return sparse_decode_attention(q, k, v, lengths, sm_scale=sm_scale,
                                 interpret=(mode == "interpret"),
                                 **kernel_kwargs)


def scores(
    q_rows,         # [B, Hkv, W, G, D]
    keys,           # [B, Hkv, T, D]
    lengths=None,   # [B, Hkv] int32
    *,
    gqa: str = "max",
    backend: str | None = None,
    **kernel_kwargs,
):
  """:func:`pooled_scores` dispatched by the backend switch; [B, Hkv, W, T]."""
  mode = resolve_backend(backend, head_dim=keys.shape[-1])
  if mode == "reference":
    return pooled_scores_reference(q_rows, keys, lengths, gqa=gqa)
  return pooled_scores(q_rows, keys, lengths, gqa=gqa,
                       interpret=(mode == "interpret"), **kernel_kwargs)
