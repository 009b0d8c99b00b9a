"""Argument rules every pool attention entry point shares (the reference and the Pallas kernel in
``pool_attention.py``, the native kernel in ``native/``): shapes, ranges and, where offsets and lengths are
concrete, every row a head sees inside the pool. A module of its own so the native package can use it without
importing the kernels (which import the native package)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def check_pool_args(q, k_pool, v_pool, offsets, lengths, score_heads=None, block_rows=None, *, block_size=0,
                    max_len=None, score_len=0):
  """ValueError naming the first argument that does not fit, before any compute: the rules every pool attention
  entry point shares (reference, Pallas, native; ``max_len`` None: the native kernel's "no bound"). Where
  offsets, lengths and block_rows are concrete (not traced), every row a head sees must also lie in the pool."""
  if jnp.ndim(q) != 5:
    raise ValueError(f"q must be [B, H, T, G, D], got shape {jnp.shape(q)}; add the missing axes (T = 1 for decode)")
  B, H, T, G, D = q.shape
  if jnp.ndim(k_pool) != 3 or jnp.shape(k_pool) != (B, k_pool.shape[1], D) or jnp.shape(v_pool) != k_pool.shape:
    raise ValueError(f"shape mismatch: q {q.shape} k_pool {jnp.shape(k_pool)} v_pool {jnp.shape(v_pool)}; k_pool "
                     f"and v_pool must both be [B, P, D] with q's B = {B} and D = {D}")
  if D < 1:
    raise ValueError(f"q's head_dim must be >= 1, got q {q.shape}")
  check_same_dtype(q=q, k_pool=k_pool, v_pool=v_pool)
  check_int_dtype(offsets=offsets, lengths=lengths)
  if jnp.shape(offsets) != (B, H) or jnp.shape(lengths) != (B, H):
    raise ValueError(f"offsets and lengths must be [B, H] = {(B, H)}, got {jnp.shape(offsets)} and "
                     f"{jnp.shape(lengths)}")
  if score_heads is not None and jnp.shape(score_heads) != (H,):
    raise ValueError(f"score_heads must be [H] = {(H,)} or None, got {jnp.shape(score_heads)}")
  if int(score_len) < 0:
    raise ValueError(f"score_len must be >= 0 (logits per scored head; 0: none), got {score_len}")
  if score_len and T != 1:
    raise ValueError(f"logits are returned for one query position only, got T={T} with score_len={score_len}; "
                     "pass score_len=0 or one position")
  if max_len is not None and int(max_len) < 1:
    raise ValueError(f"max_len must be >= 1 (the most rows a query position sees, max(lengths) + T - 1), "
                     f"got {max_len}")
  if block_rows is not None:
    if jnp.ndim(block_rows) != 3 or jnp.shape(block_rows)[:2] != (B, H) or jnp.shape(block_rows)[2] < 1:
      raise ValueError(f"block_rows must be [B, H, NB] = [{B}, {H}, NB >= 1], got {jnp.shape(block_rows)}")
    if int(block_size) < 1 or (max_len is not None and block_rows.shape[2] * block_size < max_len):
      raise ValueError(f"block_rows' {block_rows.shape[2]} blocks of block_size={block_size} rows must cover "
                       f"max_len={max_len}: pass the rows of one block and enough blocks")
  _check_rows_in_pool(offsets, lengths, block_rows, int(block_size), max_len, T, k_pool.shape[1])


def check_same_dtype(**arrays) -> None:
  """ValueError unless the arrays share one dtype: the GPU kernel's dot needs it (Triton's own error names no
  argument), while the CPU backends would convert silently."""
  dtypes = {name: jnp.result_type(a) for name, a in arrays.items()}
  if len(set(dtypes.values())) > 1:
    got = ", ".join(f"{n} {d}" for n, d in dtypes.items())
    raise ValueError(f"{', '.join(dtypes)} must share one dtype, got {got}; cast the queries to the pool's dtype")


def check_int_dtype(**arrays) -> None:
  """ValueError unless every array holds integers (a float length or offset was truncated)."""
  for name, a in arrays.items():
    if not jnp.issubdtype(jnp.result_type(a), jnp.integer):
      raise ValueError(f"{name} must hold integers (int32), got {jnp.result_type(a)}")


def _check_rows_in_pool(offsets, lengths, block_rows, block_size: int, max_len, T: int, P: int):
  """Where offsets, lengths and block_rows are concrete: ValueError if a row a head sees is outside [0, P)."""
  if any(isinstance(x, jax.core.Tracer) for x in (offsets, lengths, block_rows)):
    return  # traced: the caller's promise (module docstring); no host sync inside a jitted step
  off = np.asarray(offsets, np.int64)
  bound = max_len if block_rows is None or max_len is not None else block_rows.shape[2] * block_size
  n = np.clip(np.asarray(lengths, np.int64) + T - 1, 0, bound)                       # [B, H] rows seen
  if block_rows is None:
    first, count = off[..., None], n[..., None]                                      # one range per head
  else:                                                                              # one range per block
    first = off[..., None] + np.asarray(block_rows, np.int64)
    count = np.clip(n[..., None] - block_size * np.arange(first.shape[-1]), 0, block_size)
  bad = (count > 0) & ((first < 0) | (first + count > P))
  if bad.any():
    b, h, i = np.argwhere(bad)[0]
    lo, names = first[b, h, i], "offsets / lengths" + ("" if block_rows is None else " / block_rows")
    via = "" if block_rows is None else f" and block_rows[{b}, {h}, {i}] = {lo - off[b, h]}"
    raise ValueError(f"offsets[{b}, {h}] = {off[b, h]} with lengths[{b}, {h}] = {int(np.asarray(lengths)[b, h])}"
                     f"{via} make head ({b}, {h}) see pool rows [{lo}, {lo + count[b, h, i]}), outside the pool's "
                     f"[0, {P}): every row a head sees (offsets + min(lengths + T - 1, max_len) rows) must lie in "
                     f"the pool; fix {names} or pass a larger pool")
