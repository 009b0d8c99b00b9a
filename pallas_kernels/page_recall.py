"""Page recall into the row pool inside a decode step, for FreeKV and offloaded Quest on a CPU backend, with the
plain-JAX reference beside the dispatcher.

A compressed layer's head region is ``[start | n page slots | window]``; ``resident`` names the page in each slot
and ``pending`` the pages the slots should hold (the previous step's selection). Per sequence and head, over its
first ``k_sel`` slots, the pages of ``pending`` not resident replace, in slot order, the resident pages not in
``pending`` (the m-th new page into the m-th freed slot): pool row ``offsets + start + slot * ps + r`` takes store
row ``start + page * ps + r`` (K, V and that position), r < ps. The host recall between steps
(``hetero_jax.policies.speculative``) pairs them the same way.

The native kernel (``pallas_kernels.native.page_recall_native``) writes only the moved pages, in place; the
reference scatters every slot (the unmoved ones dropped), reading each slot's page from the store.

Shapes: pool_k / pool_v [B, 1, R, D], pool_pos [B, 1, R] int32 (one device's pool), store_k / store_v
[B, H, T, D] in the pool's dtype, offsets [B, H], pending / resident [B, H, n], start / k_sel [B], all int32.
Returns (pool_k, pool_v, pool_pos, resident' [B, H, n] int32, moved [B] int32: pages that entered a slot).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._util import resolve_backend
from pallas_kernels.native import page_recall_native


def _rank(flags: jax.Array) -> jax.Array:
  """[..., n] the 0-based rank of each True among the Trues of its row (garbage where False)."""
  return jnp.cumsum(flags.astype(jnp.int32), axis=-1) - 1


def page_recall_reference(
    pool_k,          # [B, 1, R, D]
    pool_v,          # [B, 1, R, D]
    pool_pos,        # [B, 1, R] int32
    store_k,         # [B, H, T, D]
    store_v,         # [B, H, T, D]
    offsets,         # [B, H] int32
    pending,         # [B, H, n] int32
    resident,        # [B, H, n] int32
    start,           # [B] int32
    k_sel,           # [B] int32
    page_size: int,  # static
):
  """The recall in plain JAX (module docstring): every slot is gathered from the store and scattered, the
  slots that keep their page dropped. Page ids are the caller's promise to lie in the store (traced, they
  cannot be checked without a host sync): one past it reads the store's last rows."""
  B, H, n = pending.shape
  if (jnp.shape(resident) != (B, H, n) or jnp.shape(offsets) != (B, H) or jnp.shape(start) != (B,)
      or jnp.shape(k_sel) != (B,)):
    raise ValueError(f"pending and resident must be [B, H, n] = {(B, H, n)}, offsets [B, H], start / k_sel [B]; "
                     f"got resident {jnp.shape(resident)}, offsets {jnp.shape(offsets)}, start "
                     f"{jnp.shape(start)}, k_sel {jnp.shape(k_sel)}")
  ps, T = page_size, store_k.shape[2]
  ok = jnp.arange(n)[None, None, :] < k_sel[:, None, None]  # [B, 1, n]
  eq = (pending[..., :, None] == resident[..., None, :]) & ok[..., None, :] & ok[..., :, None]  # [B, H, j, i]
  fresh = ok & ~eq.any(axis=-1)  # pending[j] not resident
  freed = ok & ~eq.any(axis=-2)  # resident[i] not pending
  m = jnp.minimum(fresh.sum(-1), freed.sum(-1))[..., None]  # [B, H, 1] pages moved per head
  by_rank = jnp.take_along_axis(pending, jnp.argsort(~fresh, axis=-1, stable=True), axis=-1)  # new pages first
  r_freed = _rank(freed)
  move = freed & (r_freed < m)
  new_res = jnp.where(move, jnp.take_along_axis(by_rank, jnp.clip(r_freed, 0, n - 1), axis=-1), resident)

  r = jnp.arange(ps)
  src = start[:, None, None, None] + new_res[..., None] * ps + r  # [B, H, n, ps]
  dst = offsets[..., None, None] + start[:, None, None, None] + jnp.arange(n)[None, None, :, None] * ps + r
  dst = jnp.where(move[..., None], dst, pool_k.shape[2])  # out of range: dropped
  b = jnp.broadcast_to(jnp.arange(B)[:, None, None, None], dst.shape)
  h = jnp.broadcast_to(jnp.arange(H)[None, :, None, None], dst.shape)
  src = jnp.clip(src, 0, T - 1)
  put = lambda pool, store: pool.at[b, 0, dst].set(store[b, h, src], mode="drop")  # noqa: E731
  pos = pool_pos.at[b, 0, dst].set(src.astype(jnp.int32), mode="drop")
  return (put(pool_k, store_k), put(pool_v, store_v), pos, new_res.astype(jnp.int32),
          m[..., 0].sum(-1).astype(jnp.int32))


def page_recall(pool_k, pool_v, pool_pos, store_k, store_v, offsets, pending, resident, start, k_sel, page_size: int,
                *, backend: str | None = None):
  """:func:`page_recall_reference`'s contract in the native CPU kernel where the pool attention is native
  (``resolve_backend(native=True)``), else the reference. Read at trace time."""
  args = (pool_k, pool_v, pool_pos, store_k, store_v, offsets, pending, resident, start, k_sel, page_size)
  if resolve_backend(backend, native=True) == "native":
    return page_recall_native(*args)
  return page_recall_reference(*args)
