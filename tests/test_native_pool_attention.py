"""The native CPU pool attention (pallas_kernels.native, a C++ XLA FFI call) against pool_attention_reference.

Every case builds a pool whose heads sit at unsorted offsets with NaN in every row no query may see (the
gaps between heads, the pool's ends, the rows right after each head's range): the kernel must never read
them. The reference runs on the same pool with those rows zeroed (it gathers max_len rows per head, so it
would read them). Nothing is skipped when the kernel is unavailable: `make install` builds it. The last
section checks every backend (reference, native, Pallas interpreter) against numpy where the contract leaves
room: max_len below the lengths, and rows outside the pool (refused eagerly, one rule traced).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pallas_kernels import native
from pallas_kernels._util import MASK_VALUE
from pallas_kernels.pool_attention import pool_attention_reference

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


@pytest.fixture(scope="module", autouse=True)
def kernel_built():
  assert native.available(), f"native pool attention unavailable: {native.unavailable_reason()}"


def make_pool(seed, lengths, T, G, D, dtype=jnp.float32, slack=None):
  """q, (k, v) with NaN outside every head's visible rows, (k, v) with zeros there, offsets, lengths.
  lengths: [B, H]. Heads are laid out in a random order with random NaN gaps (sometimes none)."""
  rng = np.random.default_rng(seed)
  lengths = np.asarray(lengths, np.int32)
  B, H = lengths.shape
  rows = np.maximum(lengths + T - 1, 0)                     # rows the last query position sees
  gaps = rng.integers(0, 40, size=(B, H)) * (rng.random((B, H)) < 0.7)
  P = int(max((rows[b] + gaps[b]).sum() for b in range(B))) + 9 + (slack or 0)
  k = np.full((B, P, D), np.nan, np.float32)
  v = np.full((B, P, D), np.nan, np.float32)
  offsets = np.zeros((B, H), np.int32)
  for b in range(B):
    pos = int(rng.integers(0, 9))
    for h in rng.permutation(H):
      offsets[b, h] = pos
      n = rows[b, h]
      k[b, pos:pos + n] = rng.standard_normal((n, D))
      v[b, pos:pos + n] = rng.standard_normal((n, D))
      pos += n + gaps[b, h]
  q = rng.standard_normal((B, H, T, G, D)).astype(np.float32)
  cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
  return (cast(q), (cast(k), cast(v)), (cast(np.nan_to_num(k)), cast(np.nan_to_num(v))),
          jnp.asarray(offsets), jnp.asarray(lengths))


def run_both(seed, lengths, T, G, D, dtype=jnp.float32, score_len=0, score_heads=None, sm_scale=None,
             chunk_rows=None):
  q, (k, v), (kz, vz), offsets, lengths_a = make_pool(seed, lengths, T, G, D, dtype)
  flags = None if score_heads is None else jnp.asarray(score_heads, jnp.int32)
  got = native.pool_attention_native(q, k, v, offsets, lengths_a, flags, score_len=score_len, sm_scale=sm_scale,
                                     chunk_rows=chunk_rows)
  max_len = max(1, int(np.max(np.asarray(lengths))) + T - 1)
  want = pool_attention_reference(q, kz, vz, offsets, lengths_a, flags, max_len=max_len, score_len=score_len,
                                  sm_scale=sm_scale)
  return got, want


def assert_close(got, want, lengths, T, *, atol, rtol, score_heads=None, score_len=0):
  out, lse, logits = got
  r_out, r_lse, r_logits = want
  assert out.dtype == r_out.dtype and out.shape == r_out.shape
  assert lse.dtype == jnp.float32 and lse.shape == r_lse.shape
  out32 = np.asarray(out.astype(jnp.float32))
  assert np.isfinite(out32).all() and np.isfinite(np.asarray(lse)).all()
  np.testing.assert_allclose(out32, np.asarray(r_out.astype(jnp.float32)), atol=atol, rtol=rtol)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(r_lse), atol=max(atol, 1e-5), rtol=rtol)
  lengths = np.asarray(lengths)
  seen = lengths[:, :, None] + np.arange(T)                     # [B, H, T]
  empty = np.broadcast_to((seen <= 0)[..., None], lse.shape)
  assert (np.asarray(lse)[empty] == np.float32(MASK_VALUE)).all()
  assert (out32[np.broadcast_to(empty[..., None], out32.shape)] == 0).all()
  if not score_len:
    assert logits is None
    return
  logits, r_logits = np.asarray(logits), np.asarray(r_logits)
  B, H, G, S = logits.shape
  assert S == score_len and logits.dtype == np.float32
  for b in range(B):
    for h in range(H):
      n = max(0, min(score_len, lengths[b, h]))
      if score_heads is None or score_heads[h]:
        np.testing.assert_allclose(logits[b, h, :, :n], r_logits[b, h, :, :n], atol=atol, rtol=rtol)
        assert (logits[b, h, :, n:] == np.float32(MASK_VALUE)).all()
      else:
        assert (logits[b, h] == np.float32(MASK_VALUE)).all()


# lengths around the block (64 rows at D = 64, 32 at D = 128 with AVX-512), empty and long heads, batch 3
# with different lengths per sequence. chunk_rows=192 cuts the long heads into many work items (merged by
# log-sum-exp, on both threads); None is the kernel's own split.
LENGTHS = [[0, 1, 63, 4100], [65, 31, 33, 1], [2900, 64, 7, 32]]


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("G", [1, 4, 7])
def test_decode_matches_reference(G, D):
  for chunk_rows in (None, 192):
    got, want = run_both(G * 10 + D, LENGTHS, 1, G, D, chunk_rows=chunk_rows)
    assert_close(got, want, LENGTHS, 1, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("G,chunk_rows", [(1, None), (4, None), (3, 64)])
def test_causal_chunk_matches_reference(G, chunk_rows):
  # T = 5: position t sees lengths + t rows; with 64-row items, the item after row 64 holds rows that only
  # the later positions see
  lengths = [[0, 1, 64, 3000], [-2, 33, 65, 5]]
  got, want = run_both(7 + G, lengths, 5, G, 64, chunk_rows=chunk_rows)
  assert_close(got, want, lengths, 5, atol=2e-5, rtol=2e-5)


def test_logits_of_flagged_heads():
  lengths = [[3000, 40, 0, 299], [1, 300, 2500, 64]]
  flags = [1, 0, 1, 1]
  got, want = run_both(3, lengths, 1, 3, 64, score_len=300, score_heads=flags, chunk_rows=128)
  assert_close(got, want, lengths, 1, atol=2e-5, rtol=2e-5, score_heads=flags, score_len=300)
  got, want = run_both(4, lengths, 1, 2, 64, score_len=4000)  # every head, score_len past every length
  assert_close(got, want, lengths, 1, atol=2e-5, rtol=2e-5, score_len=4000)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision(dtype):
  lengths = [[2000, 65, 0], [1, 130, 63]]
  got, want = run_both(5, lengths, 1, 3, 64, dtype=dtype, score_len=100, score_heads=[1, 1, 0])
  assert got[0].dtype == dtype
  assert_close(got, want, lengths, 1, atol=1e-2, rtol=1e-2, score_heads=[1, 1, 0], score_len=100)


def test_odd_head_dim_and_scale():
  lengths = [[70, 1, 0], [129, 3, 500]]
  got, want = run_both(6, lengths, 2, 3, 40, sm_scale=0.3)  # D = 40: rows padded to the vector width
  assert_close(got, want, lengths, 2, atol=2e-5, rtol=2e-5)


def test_jit_vmap_and_errors():
  lengths = [[300, 5, 70], [0, 1000, 9]]
  q, (k, v), _, offsets, lens = make_pool(8, lengths, 1, 3, 64)
  eager = native.pool_attention_native(q, k, v, offsets, lens, score_len=16)
  jitted = jax.jit(native.pool_attention_native, static_argnames=("max_len", "score_len", "sm_scale"))(
      q, k, v, offsets, lens, score_len=16)
  for a, b in zip(eager, jitted):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # vmap over a leading axis: one call over the flattened batch, equal to the calls one by one
  q2 = jnp.stack([q, q * 0.5])
  k2, v2 = jnp.stack([k, k[:, ::-1][:, ::-1]]), jnp.stack([v, v])
  batched = jax.vmap(lambda a, b, c: native.pool_attention_native(a, b, c, offsets, lens)[:2])(q2, k2, v2)
  for i in range(2):
    one = native.pool_attention_native(q2[i], k2[i], v2[i], offsets, lens)
    np.testing.assert_allclose(np.asarray(batched[0][i]), np.asarray(one[0]), atol=1e-6)
    np.testing.assert_allclose(np.asarray(batched[1][i]), np.asarray(one[1]), atol=1e-6)
  # ranges outside the pool are refused where concrete; traced (under jit) they read nothing outside it: an
  # offset past the end is an empty head
  P = k.shape[1]
  bad_off, bad_lens = offsets.at[0, 0].set(P + 5).at[0, 1].set(P - 3), lens.at[0, 1].set(10**6)
  with pytest.raises(ValueError, match=r"offsets\[0, 0\] = .* outside the pool"):
    native.pool_attention_native(q, k, v, bad_off, bad_lens)
  out, lse, _ = jax.jit(native.pool_attention_native)(q, k, v, bad_off, bad_lens)
  assert lse[0, 0, 0, 0] == np.float32(MASK_VALUE) and not np.asarray(out[0, 0]).any()
  # vmap over q alone (the pool, offsets and flags broadcast), logits included
  flags = jnp.asarray([1, 0, 1], jnp.int32)
  batched = jax.vmap(lambda a: native.pool_attention_native(a, k, v, offsets, lens, flags, score_len=9))(q2)
  for i in range(2):
    one = native.pool_attention_native(q2[i], k, v, offsets, lens, flags, score_len=9)
    for a, b in zip(batched, one):
      np.testing.assert_array_equal(np.asarray(a[i]), np.asarray(b))
  with pytest.raises(ValueError, match="one query position"):
    native.pool_attention_native(jnp.zeros((2, 3, 2, 3, 64)), k, v, offsets, lens, score_len=4)
  with pytest.raises(ValueError, match="offsets and lengths"):
    native.pool_attention_native(q, k, v, offsets[:, :2], lens)
  with pytest.raises(ValueError, match="must share one dtype"):
    native.pool_attention_native(q, k, v.astype(jnp.bfloat16), offsets, lens)


def test_a_sequence_gives_the_same_bits_alone_in_a_batch_and_on_one_thread(monkeypatch):
  """Heads long enough that a call is cut into work items on helper threads (about 1,500 rows each, G = 3):
  each sequence of a batch of two gets exactly the bits it gets alone, and the batch on one thread
  (HETERO_JAX_NATIVE_THREADS=1) exactly those on the pool's threads: a head's items depend on its own rows only.
  (When the split followed the call's total rows and threads, a batch and a lone sequence differed in the last
  ulps, and a greedy decode could part at a near tie.) All of it matches the reference."""
  lengths = [[1500, 1700, 1300], [1600, 900, 1800]]
  q, (k, v), (kz, vz), offsets, lens = make_pool(21, lengths, 1, 3, 64)
  both = native.pool_attention_native(q, k, v, offsets, lens, score_len=32)
  want = pool_attention_reference(q, kz, vz, offsets, lens, max_len=1800, score_len=32)
  assert_close(both, want, lengths, 1, atol=2e-5, rtol=2e-5, score_len=32)
  for b in range(2):
    alone = native.pool_attention_native(q[b:b + 1], k[b:b + 1], v[b:b + 1], offsets[b:b + 1], lens[b:b + 1],
                                         score_len=32)
    for x, y in zip(both, alone):
      np.testing.assert_array_equal(np.asarray(x[b:b + 1]), np.asarray(y))
  monkeypatch.setenv("HETERO_JAX_NATIVE_THREADS", "1")
  for x, y in zip(both, native.pool_attention_native(q, k, v, offsets, lens, score_len=32)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 2), st.integers(1, 3), st.integers(1, 3), st.integers(1, 3), st.sampled_from([16, 64]),
       st.lists(st.integers(-1, 700), min_size=9, max_size=9), st.sampled_from([None, 64, 160]),
       st.integers(0, 2**31 - 1))
def test_property_random_shapes(B, H, T, G, D, lens, chunk_rows, seed):
  lengths = np.asarray(lens[:B * H]).reshape(B, H)
  got, want = run_both(seed, lengths, T, G, D, chunk_rows=chunk_rows)
  assert_close(got, want, lengths, T, atol=3e-5, rtol=3e-5)


def test_build_is_cached():
  path = native.build()
  assert os.path.isfile(path) and path.startswith(native.cache_dir())
  mtime = os.stat(path).st_mtime_ns
  assert native.build() == path and os.stat(path).st_mtime_ns == mtime  # no rebuild
  assert native.unavailable_reason() == ""


def _run_python(code: str, env_extra: dict, timeout: float = 300) -> subprocess.CompletedProcess:
  env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), **env_extra)
  return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env=env, capture_output=True,
                        text=True, timeout=timeout)


def test_unavailable_without_a_working_compiler(tmp_path):
  proc = _run_python("""
      import os, sys
      from pallas_kernels import native
      from pallas_kernels.native.__main__ import main
      print(native.available(), native.unavailable_reason())          # CXX names no file
      assert main(["build"]) == 1
      os.environ["CXX"] = "false"                                      # a compiler that always fails
      native._state.clear()
      print(native.available(), native.unavailable_reason().splitlines()[0])
      try:
          native.pool_attention_native(None, None, None, None, None)
      except RuntimeError as e:
          print("raised", e)
  """, {"CXX": str(tmp_path / "no-such-compiler"), "HETERO_JAX_CACHE": str(tmp_path)})
  assert proc.returncode == 0, proc.stderr[-3000:]
  lines = proc.stdout.splitlines()
  assert lines[0].startswith("False") and "no C++ compiler" in lines[0], proc.stdout
  assert "native CPU kernels not built: no C++ compiler" in proc.stderr
  assert lines[1].startswith("False") and "compiling the native CPU kernels failed" in lines[1], proc.stdout
  assert lines[2].startswith("raised") and "compiling" in lines[2], proc.stdout
  assert not [f for f in os.listdir(tmp_path / "native") if f.endswith((".so", ".tmp"))]


SHARD_MAP_CASE = """
    import numpy as np, jax, jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec as P
    from pallas_kernels import native
    assert jax.device_count() == 2, jax.devices()
    rng = np.random.default_rng(0)
    B, H, G, D, Pl = 2, 4, 3, 64, 3000
    mesh = Mesh(np.array(jax.devices()), ("x",))
    q = jnp.asarray(rng.standard_normal((B, H, 1, G, D)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, 2 * Pl, D)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((B, 2 * Pl, D)), jnp.float32)
    lens = jnp.asarray([[2900, 1, 0, 700], [64, 2000, 65, 5]], jnp.int32)
    local_off = jnp.asarray([[0, 2950, 1000, 1800], [100, 500, 2600, 2700]], jnp.int32)  # within each half
    # heads sharded: each device's pool half holds its two heads, offsets local to that half
    f = jax.jit(jax.shard_map(lambda *a: native.pool_attention_native(*a, score_len=8)[:3:2], mesh=mesh,
                              in_specs=(P(None, "x"), P(None, "x"), P(None, "x"), P(None, "x"), P(None, "x")),
                              out_specs=(P(None, "x"), P(None, "x"))))
    out, logits = f(q, k, v, local_off, lens)
    glob = local_off + jnp.asarray([0, 0, Pl, Pl], jnp.int32)  # the same rows, addressed in the whole pool
    w_out, _, w_logits = native.pool_attention_native(q, k, v, glob, lens, score_len=8)
    np.testing.assert_allclose(np.asarray(out), np.asarray(w_out), atol=1e-6)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(w_logits), atol=1e-6)
    # batch sharded
    g = jax.jit(jax.shard_map(lambda *a: native.pool_attention_native(*a)[0], mesh=mesh,
                              in_specs=(P("x"),) * 5, out_specs=P("x")))
    np.testing.assert_allclose(np.asarray(g(q, k, v, glob, lens)), np.asarray(w_out), atol=1e-6)
    print("OK")
"""


def test_under_shard_map_on_two_simulated_devices():
  flags = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()
  proc = _run_python(SHARD_MAP_CASE, {"XLA_FLAGS": flags})
  assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), (proc.stdout + proc.stderr)[-4000:]


@pytest.mark.parametrize("bs,G,dtype,chunk_rows", [(16, 4, jnp.float32, None), (8, 1, jnp.float32, None),
                                                   (32, 7, jnp.float32, 32), (16, 3, jnp.bfloat16, None),
                                                   (64, 4, jnp.float32, 64)])
def test_paged_heads_read_in_place_match_reference(bs, G, dtype, chunk_rows):
  """A paged call (Quest's and FreeKV's block tables) read in place by the native kernel, blocks of 8 to 64 rows
  (below, at and above the kernel's own block of 64 rows at D = 64), float32 and bfloat16, a head cut into
  chunks on threads: equal to the reference, with NaN in every pool row outside the rows the table makes
  visible (so a row read out of turn shows)."""
  from pool_utils import make_paged_pool

  rng = np.random.default_rng(11 + bs)
  lengths = np.array([[0, 1, bs - 1], [bs + 1, 5 * bs, 2 * bs + 1]], np.int32)
  k, v, offsets, table, _ = make_paged_pool(rng, lengths, 5, 9, bs, 64, dtype)
  q = jnp.asarray(rng.standard_normal((2, 3, 1, G, 64)), dtype)
  lens = jnp.asarray(lengths)
  out, lse, _ = native.pool_attention_native(q, k, v, offsets, lens, None, table, block_size=bs,
                                             chunk_rows=chunk_rows)
  r_out, r_lse, _ = pool_attention_reference(q, jnp.nan_to_num(k), jnp.nan_to_num(v), offsets, lens, None, table,
                                             max_len=5 * bs, block_size=bs)
  tol = 2e-5 if dtype == jnp.float32 else 2e-2
  assert np.isfinite(np.asarray(out, np.float32)).all()
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(r_out, np.float32), atol=tol, rtol=tol)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(r_lse), atol=tol, rtol=tol)


def test_paged_rows_past_the_pool_are_refused_or_under_jit_clipped_as_the_reference_clips_them():
  """Block-table entries that point before the pool's start or past its end: refused where the table is
  concrete; traced (under jit, the caller's fault) each row is clipped into [0, P) (the reference's rule), also
  through pallas_kernels.pool_attention's dispatch and with a page size that is not a power of two (gathered
  first there)."""
  import pallas_kernels as pk

  rng = np.random.default_rng(5)
  B, H, P, D, bs = 2, 3, 70, 64, 16
  k = jnp.asarray(rng.standard_normal((B, P, D)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((B, P, D)), jnp.float32)
  offsets = jnp.asarray([[0, 20, 40], [5, 30, 50]], jnp.int32)
  table = jnp.asarray([[[-10, 0, 60], [0, 16, 45], [-40, 5, 100]], [[2, 60, -3], [10, 0, 30], [8, 9, 10]]], jnp.int32)
  lens = jnp.asarray([[48, 40, 33], [3, 48, 47]], jnp.int32)
  q = jnp.asarray(rng.standard_normal((B, H, 1, 2, D)), jnp.float32)
  for f in (pool_attention_reference, native.pool_attention_native):
    with pytest.raises(ValueError, match=r"block_rows\[0, 0, 0\] = -10 make head \(0, 0\) see pool rows \[-10, 6\)"):
      f(q, k, v, offsets, lens, None, table, max_len=48, block_size=bs)
  traced = lambda f, **kw: jax.jit(lambda *a: f(*a, **kw))  # noqa: E731
  args = (q, k, v, offsets, lens, None, table)
  want = traced(pool_attention_reference, max_len=48, block_size=bs)(*args)
  got = traced(native.pool_attention_native, block_size=bs)(*args)
  via = traced(pk.pool_attention, max_len=48, block_size=bs, backend="native")(*args)
  for g in (got, via):
    np.testing.assert_allclose(np.asarray(g[0]), np.asarray(want[0]), atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(np.asarray(g[1]), np.asarray(want[1]), atol=2e-5, rtol=2e-5)
  args = (q, k, v, offsets, jnp.minimum(lens, 24), None, table[..., :2])
  got = traced(pk.pool_attention, max_len=24, block_size=12, backend="native")(*args)
  want12 = traced(pool_attention_reference, max_len=24, block_size=12)(*args)
  np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want12[0]), atol=2e-5, rtol=2e-5)
  with pytest.raises(ValueError, match="power of two"):
    native.pool_attention_native(q, k, v, offsets, lens, None, jnp.zeros_like(table), block_size=12)


# ---------------------------------------------------------------------------
# Every backend alike (reference, native, Pallas interpreter) on what the contract leaves to the backends


def _numpy_pool_attention(q, k, v, offsets, lengths, max_len):
  """float64 softmax attention of head (b, h), position t over the pool rows [o, o + clip(lengths + t, 0,
  max_len)) that lie in [0, P) (none when o is outside the pool): (out, lse), 0 and MASK_VALUE when empty."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  B, H, T, G, D = q.shape
  P = k.shape[1]
  out, lse = np.zeros(q.shape), np.full((B, H, T, G), MASK_VALUE)
  for b, h, t in np.ndindex(B, H, T):
    o = int(offsets[b, h])
    rows = [r for r in range(o, o + int(np.clip(lengths[b, h] + t, 0, max_len))) if 0 <= o < P and r < P]
    if rows:
      s = q[b, h, t] @ k[b, rows].T / np.sqrt(D)
      m = s.max(-1, keepdims=True)
      e = np.exp(s - m)
      out[b, h, t], lse[b, h, t] = e @ v[b, rows] / e.sum(-1, keepdims=True), (m + np.log(e.sum(-1, keepdims=True)))[:, 0]
  return out, lse


BACKENDS = ("reference", "native", "interpret")


def _every_backend(fn, *args, **kw):
  import pallas_kernels as pk
  return {be: fn(pk, *args, backend=be, **kw) for be in BACKENDS}


@pytest.mark.parametrize("T", [1, 3])
def test_every_backend_clips_to_max_len(T):
  """n = clip(lengths + t, 0, max_len) on every backend (the native kernel once attended all lengths + t rows):
  heads longer than max_len, a chunk of 3 positions, logits; equal to numpy, and the statistics entry point too."""
  rng = np.random.default_rng(T)
  B, H, G, D, P, max_len = 1, 3, 2, 16, 160, 20
  offsets, lengths = np.array([[0, 50, 100]]), np.array([[40, 19, 5]])
  q = jnp.asarray(rng.standard_normal((B, H, T, G, D)), jnp.float32)
  k, v = (jnp.asarray(rng.standard_normal((B, P, D)), jnp.float32) for _ in range(2))
  score_len = 30 if T == 1 else 0
  res = _every_backend(lambda pk, *a, **kw: pk.pool_attention(*a, **kw), q, k, v, jnp.asarray(offsets, jnp.int32),
                       jnp.asarray(lengths, jnp.int32), max_len=max_len, score_len=score_len)
  want_out, want_lse = _numpy_pool_attention(q, k, v, offsets, lengths, max_len)
  for be, (out, lse, logits) in res.items():
    np.testing.assert_allclose(np.asarray(out), want_out, atol=2e-5, rtol=2e-5, err_msg=be)
    np.testing.assert_allclose(np.asarray(lse), want_lse, atol=2e-5, rtol=2e-5, err_msg=be)
    if score_len:  # the first min(lengths, max_len, score_len) logits of every head
      for h in range(H):
        n = min(lengths[0, h], max_len)
        s = np.asarray(q, np.float64)[0, h, 0] @ np.asarray(k, np.float64)[0, offsets[0, h]:offsets[0, h] + n].T
        np.testing.assert_allclose(np.asarray(logits)[0, h, :, :n], s / np.sqrt(D), atol=2e-5, rtol=2e-5)
  if T == 1:
    stats = {be: r for be, r in _every_backend(
        lambda pk, *a, **kw: pk.pool_attention_statistics(*a, **kw), q, k, v, jnp.asarray(offsets, jnp.int32),
        jnp.asarray(lengths, jnp.int32), (0, 2), jnp.asarray([[18, 5]], jnp.int32),
        jnp.asarray([[1, 3], [0, -1]], jnp.int32)[None], max_len=max_len, score_len=score_len).items()}
    for be in ("native", "interpret"):
      for a, b in zip(stats[be], stats["reference"]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=2e-5, err_msg=be)
    np.testing.assert_allclose(np.asarray(stats["native"][0]), want_out, atol=2e-5, rtol=2e-5)


# (offsets, lengths) of a head (T = 2) with rows outside a pool of 64 rows: past the end, before the start, beyond it
BAD_RANGES = [((50, 30), "offsets\\[0, 1\\] = 50 with lengths\\[0, 1\\] = 30 make head \\(0, 1\\) see pool rows "
               "\\[50, 81\\), outside the pool's \\[0, 64\\)"),
              ((-5, 10), "offsets\\[0, 1\\] = -5 .* see pool rows \\[-5, 6\\)"),
              ((70, 3), "offsets\\[0, 1\\] = 70 .* see pool rows \\[70, 74\\)")]


@pytest.mark.parametrize("bad,match", BAD_RANGES, ids=["past_end", "negative", "beyond"])
def test_rows_outside_the_pool_are_refused_and_traced_alike_on_every_backend(bad, match):
  """Concrete offsets / lengths that make a head see rows outside [0, P) are refused by every backend, naming
  them. Traced (under jit: the caller's fault, not checked), every backend follows the one rule: a head whose
  offset is outside the pool is empty, a range past its end is cut there; no NaN (the interpreter gave NaN for
  a negative offset, and the reference read clamped rows)."""
  rng = np.random.default_rng(0)
  B, H, T, G, D, P, max_len = 1, 2, 2, 2, 16, 64, 32
  offsets, lengths = np.array([[0, bad[0]]]), np.array([[10, bad[1]]])
  q = jnp.asarray(rng.standard_normal((B, H, T, G, D)), jnp.float32)
  k, v = (jnp.asarray(rng.standard_normal((B, P, D)), jnp.float32) for _ in range(2))
  args = (q, k, v, jnp.asarray(offsets, jnp.int32), jnp.asarray(lengths, jnp.int32))
  import pallas_kernels as pk
  for be in BACKENDS:
    with pytest.raises(ValueError, match=match):
      pk.pool_attention(*args, max_len=max_len, backend=be)
  want_out, want_lse = _numpy_pool_attention(q, k, v, offsets, lengths, max_len)
  for be in BACKENDS:
    out, lse, _ = jax.jit(lambda *a: pk.pool_attention(*a, max_len=max_len, backend=be))(*args)
    np.testing.assert_allclose(np.asarray(out), want_out, atol=2e-5, rtol=2e-5, err_msg=be)
    np.testing.assert_allclose(np.asarray(lse), want_lse, atol=2e-5, rtol=2e-5, err_msg=be)
