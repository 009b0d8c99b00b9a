"""HCAttention (Yang et al., 2025): approximate scores on the device, values summed on the host.

After prefill no prompt value stays on the device: every layer's prompt V [B, Hkv, L, D] goes to the
pinned host store. The device keeps, per layer, in its state record (``HCState``), either the exact
post-RoPE keys ("values on host", the paper's 50% point) or, with a key codebook
(``codebook.py`` beside this module), only each key's g int16 codes plus the layer's codebook [c, d]
(paper §3.1). Every head keeps 0 prompt rows in the row pool: its region holds only the tail.

Decode, per layer, per query head q (paper §3.2), inside the jitted step:
- scores z_t = q . k_t (exact keys), or from the look-up table T[i, j] = q_i . C[j] over the g
  sub-vectors q_i of q: z~_t = sum_i T[i, P[t, i]] (Eq. 3);
- a = softmax(z / sqrt(D)) over the prompt; the mass set Pi = the k* most probable tokens,
  k* = min{k : sum of the k largest a >= tau} (Eq. 4; tau >= 1 keeps every token);
- a host callback (``host_store.host_weighted_sum``, numpy) returns y = sum_{t in Pi} a_t V_t (Eq. 5);
- merged with the exact attention over the tail (tokens added after prefill, in the head's region of
  the pool, ``LayerStep.attend_tail``) by log-sum-exp. ``renormalize=True`` (the issue's default) divides y by its kept mass sum_Pi a_t: the
  result is softmax attention over Pi and the tail. ``renormalize=False`` is the paper's Eq. 5: the
  kept tokens keep their weights under the softmax over the whole prompt and the tail, so the
  weights sum to less than 1.

A session turn's chunk does the same for each of its queries (so a turn equals decoding its tokens).

Budget: byte-based. Operating points per prompt: values on host, rho 0.5 (keys L x D of 2 L x D);
per codebook, rho = (codes L x g x 2 B + codebook c x d x itemsize per layer) / full K+V bytes, e.g.
fp32 SmolLM2 (D 64): g 16 -> 0.0625 + the codebook's share. ``budget`` must lie within 5% of a
point's rho for every prompt, else BudgetError lists the points.

Departures: the tail stays exact on the device (the paper quantizes generated keys too); the device
sends every query row's weights over the whole prompt, zero off the mass set (a static callback shape),
where the paper sends only the k* kept ones; the codebook is per layer, shared by heads and groups.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from flax import struct

from hetero_jax.model.cache import KVCache, LayerPrefill, RowBlock, kv_bytes
from hetero_jax.model.config import ModelConfig
from hetero_jax.model.host_store import HostKVStore, host_weighted_sum
from hetero_jax.model.spec import axes_field
from hetero_jax.policies.base import BudgetError, Policy, PolicyError, bool_param, real_param
from hetero_jax.policies.protocol import DecodeState, PrefillPlan
from pallas_kernels import MASK_VALUE
from hetero_jax.policies.hcattention.codebook import KeyCodebook, load_codebook, shipped_codebooks

MATCH = 0.05  # a budget picks the operating point whose rho is within 5% of it
CODE_BYTES = 2  # int16 codes


@struct.dataclass
class HCState:
    """A layer's decode state: the prompt's keys, or their codes and the layer's codebook (the values are on
    the host, in the store ``store``)."""

    prompt_lens: jax.Array = axes_field("batch")  # [B] int32
    store: jax.Array = axes_field()  # int32 handle of the values-only host store (``host_weighted_sum``)
    keys: jax.Array | None = axes_field("batch", "kv_heads", "tokens", "head_dim", default=None)  # [B, H, T, D]
    codes: jax.Array | None = axes_field("batch", "kv_heads", "tokens", "subvectors", default=None)  # [B, H, T, g]
    codebook: jax.Array | None = axes_field("centroids", "sub_dim", default=None)  # [c, d], shared by the layer


@dataclasses.dataclass(frozen=True)
class OperatingPoint:
    """One way HCAttention can hold a prompt: values on host (``codebook`` None) or a codebook's codes."""

    rho: float  # device bytes (keys, or codes + codebook) / the prompt's full K+V bytes
    codebook: KeyCodebook | None

    def label(self, head_dim: int) -> str:
        if self.codebook is None:
            return f"values on host, exact keys: rho={self.rho:.4g}"
        cb = self.codebook
        return f"codebook g={cb.groups(head_dim)} (d={cb.sub_dim}, c={cb.size}): rho={self.rho:.4g}"


@dataclasses.dataclass(frozen=True)
class HCAttention(Policy):
    """HCAttention; ``codebook``: a KeyCodebook, a path to one (.npz), a tuple of them, or None (the
    model's shipped codebooks, resolved by ``bind``)."""

    budget: float = 0.5
    tau: float = real_param(0.9, 0.0, hi=1.0, hi_open=False)
    renormalize: bool = bool_param(True)
    codebook: KeyCodebook | str | tuple | None = dataclasses.field(default=None, compare=False, hash=False,
                                                                     repr=False)
    k_cap_fraction: float = real_param(1.0, 0.0, hi=1.0, hi_open=False)
    kv_itemsize: int | None = dataclasses.field(default=None, repr=False)  # the KV dtype's, set by bind
    codebook_keys: tuple = dataclasses.field(default=(), init=False, repr=False)

    name: ClassVar[str] = "hcattention"
    summary: ClassVar[str] = ("prompt values in pinned host memory, exact keys (rho 0.5) or key codes (codebook) "
                              "on the device; each step the tokens holding tau=0.9 of the approximate attention "
                              "mass are summed on the host")

    def __post_init__(self):
        super().__post_init__()
        sz = self.kv_itemsize
        if sz is not None and (isinstance(sz, (bool, np.bool_)) or not isinstance(sz, (int, np.integer))
                               or int(sz) not in (1, 2, 4, 8)):
            raise PolicyError(f"HCAttention: kv_itemsize must be None or a dtype size in bytes (1, 2, 4 or 8), got "
                              f"{sz!r}")
        cbs = self.codebook
        if cbs is not None:
            cbs = cbs if isinstance(cbs, tuple) else (cbs,)
            cbs = tuple(load_codebook(c) if isinstance(c, (str, bytes)) or hasattr(c, "__fspath__") else c
                        for c in cbs)
            bad = [c for c in cbs if not isinstance(c, KeyCodebook)]
            if bad:
                raise PolicyError(f"HCAttention: codebook must be a KeyCodebook, a path to a codebook .npz, a tuple "
                                  f"of those or None, got {type(bad[0]).__name__}")
            object.__setattr__(self, "codebook", cbs)
            object.__setattr__(self, "codebook_keys", tuple(c.key() for c in cbs))

    def bind(self, model) -> "HCAttention":
        """This policy with its codebooks resolved (None: the model's shipped ones) and checked against
        ``model`` (shape and weights fingerprint), and the KV dtype's size recorded."""
        from hetero_jax.profile.shipped import weights_fingerprint

        itemsize = int(np.dtype(model.params["embed"].dtype).itemsize)
        if self.codebook is None:
            cbs = shipped_codebooks(model)
        else:
            fp = weights_fingerprint(model.params) if any(c.weights_fingerprint for c in self.codebook) else None
            for c in self.codebook:
                c.check_compatible(model.config, fp)
            cbs = self.codebook
        if cbs is self.codebook and itemsize == self.kv_itemsize:
            return self
        return dataclasses.replace(self, codebook=cbs, kv_itemsize=itemsize)

    # --------------------------------------------------------------- budgets
    def operating_points(self, cfg: ModelConfig, prompt_len: int) -> list[OperatingPoint]:
        """Every way to hold a ``prompt_len``-token prompt on this model, values on host first."""
        isz = self.kv_itemsize or 4
        D, H, NL = cfg.head_dim, cfg.num_kv_heads, cfg.num_layers
        full = prompt_len * H * NL * 2 * D * isz
        points = [OperatingPoint(0.5, None)]
        for cb in self.codebook or ():
            cb.check_compatible(cfg)
            dev = prompt_len * H * NL * cb.groups(D) * CODE_BYTES + NL * cb.layer_bytes()
            points.append(OperatingPoint(dev / full, cb))
        return points

    def plan(self, cfg: ModelConfig, prompt_lens) -> OperatingPoint:
        """The operating point every prompt of the batch runs at: the point nearest the budget, within 5% of it
        for every prompt; BudgetError listing the points otherwise."""
        chosen = None
        for L in (int(x) for x in prompt_lens):
            pts = self.operating_points(cfg, L)
            ok = [p for p in pts if abs(p.rho - self.budget) <= MATCH * self.budget]
            if ok:
                best = min(ok, key=lambda p: abs(p.rho - self.budget))
                same = chosen is None or (best.codebook is chosen.codebook)
                if same:
                    chosen = chosen or best
                    continue
            listing = "; ".join(p.label(cfg.head_dim) for p in pts)
            hint = ("" if len(pts) > 1 else
                    " (no key codebook for this model: train one with `hetero-jax profile --method hcattention` "
                    "and pass HCAttention(codebook='file.npz') for the smaller points)")
            raise BudgetError(
                f"HCAttention: budget rho={self.budget:g} matches no operating point of a {L}-token prompt "
                f"(within {MATCH:.0%}{', the same point for the whole batch' if ok else ''}); "
                f"its points are: {listing}{hint}. Pass one of those rho values")
        return chosen

    def check_budget(self, prompt_len: int) -> int:
        return prompt_len  # checked per model and batch in make_prefill (bytes depend on the model)

    def make_prefill(self, cfg, prompt_lens, compile_fn=None):
        return HCPrefill(self, cfg, prompt_lens, compile_fn)

    def token_scores(self, layer, x_in, keys, prompt_lens, cfg):
        raise NotImplementedError("HCAttention selects at every decode step; it scores no token at prefill")

    # ----------------------------------------------------------------- decode
    def prompt_part(self, li: int, q, st: HCState, kind: str):
        """Traced: the prompt's share of attention for query rows q [B, H, Q, D] (module docstring).

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
        k_cap = max(1, min(T, math.ceil(self.k_cap_fraction * T)))
        keep = mass_set(a, self.tau, k_cap) & valid[:, None, None, :]
        w = jnp.where(keep, a, 0.0)
        y = host_weighted_sum(st.store, li, w, D, kind)
        mass = w.sum(-1)
        lse = m + jnp.log(l)
        if self.renormalize:  # softmax over the kept tokens (and, merged, the tail)
            y, lse = y / mass[..., None], lse + jnp.log(mass)
        kstar = keep.sum(-1, dtype=jnp.int32)
        truncated = (kstar == k_cap) & (mass < self.tau) & (k_cap < st.prompt_lens[:, None, None])
        return y, lse, kstar, truncated

    def attend(self, li, q, step):
        """The prompt part (host sum over the mass set) merged with the exact tail; extra: (k* [B, H, G] int32,
        truncated [B, H, G] bool)."""
        y, lse, kstar, trunc = self.prompt_part(li, q, step.layer.state, "decode")
        out_t, lse_t = step.attend_tail(q[:, :, None])  # [B, H, 1, G, D], [B, H, 1, G]
        out, _ = pallas_kernels.merge_attention(y.astype(out_t.dtype), lse, out_t[:, :, 0], lse_t[:, :, 0])
        return out, step, (kstar, trunc)

    def attend_chunk(self, li, q, step):
        """A session turn's C queries [B, H, G, C, D], each as one decode step would: its own mass set."""
        B, H, G, C, D = q.shape
        y, lse, _, _ = self.prompt_part(li, q.reshape(B, H, G * C, D), step.layer.state, "turn")
        out_t, lse_t = step.attend_tail(q.transpose(0, 1, 3, 2, 4))  # [B, H, C, G, D], [B, H, C, G]
        out, _ = pallas_kernels.merge_attention(y.reshape(B, H, G, C, D), lse.reshape(B, H, G, C),
                                                out_t.transpose(0, 1, 3, 2, 4), lse_t.transpose(0, 1, 3, 2))
        return out.astype(q.dtype)


MASS_BISECTION_STEPS = 31  # the bits of a non-negative float32 below +inf: the search ends on a value present


def mass_set(a, tau: float, k_cap: int):
    """Traced: the mass set Pi of every row of probabilities a [..., T] float32 (>= 0), as a [..., T] bool mask:
    the k* most probable tokens, k* = min(k_cap, min{k : sum of the k largest >= tau}) (Eq. 4), ties to the
    lower index; tau >= 1 keeps every token (up to k_cap).

    No sort: a non-negative float's int32 bits order as its value, so two bisections over the bits find the
    k*-th largest value of the mass rule (the largest x with sum_{a >= x} a >= tau) and of the cap (the largest
    x with #{a >= x} >= k_cap) in 31 masked reductions each; tokens above the higher one are kept, and of the
    tokens equal to it the first ones by index while the rule still holds."""
    bits = jax.lax.bitcast_convert_type(a, jnp.int32)
    zero = jnp.zeros(a.shape[:-1] + (1,), jnp.int32)
    top = bits.max(-1, keepdims=True) + 1  # no token reaches it: both rules fail there

    def search(holds):
        def body(_, lo_hi):
            lo, hi = lo_hi
            mid = lo + (hi - lo) // 2
            ok = holds(mid)
            return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

        return jax.lax.fori_loop(0, MASS_BISECTION_STEPS, body, (zero, top))[0]

    # k_cap >= T (the default) never binds: the k_cap-th largest value is then the smallest, 0 or above
    cap = zero if k_cap >= a.shape[-1] else search(lambda x: (bits >= x).sum(-1, keepdims=True) >= k_cap)
    if tau >= 1.0:
        cut = zero
    else:
        cut = search(lambda x: jnp.where(bits >= x, a, 0.0).sum(-1, keepdims=True) >= tau)
    thr = jnp.maximum(cut, cap)
    above = bits > thr
    tie = bits == thr
    rank = jnp.cumsum(tie, axis=-1, dtype=jnp.int32)  # 1-based among the ties, by index
    value = jax.lax.bitcast_convert_type(thr, jnp.float32)
    mass_above = jnp.where(above, a, 0.0).sum(-1, keepdims=True)
    by_mass = (thr != cut) | (mass_above + (rank - 1).astype(jnp.float32) * value < tau) | (tau >= 1.0)
    by_cap = (thr != cap) | (rank <= k_cap - above.sum(-1, keepdims=True, dtype=jnp.int32))
    return above | (tie & by_mass & by_cap)


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
    lut = jnp.einsum("bhqid,cd->ibhqc", qf.reshape(B, H, Q, g, D // g), cb, precision=hi)  # [g, B, H, Q, c]

    def add_group(z, xs):  # one group at a time: never a [.., g, T] intermediate
        table, code = xs  # [B, H, Q, c], [B, H, T]
        idx = jnp.broadcast_to(code.astype(jnp.int32)[:, :, None, :], (B, H, Q, T))
        return z + jnp.take_along_axis(table, idx, axis=-1), None

    z, _ = jax.lax.scan(add_group, jnp.zeros((B, H, Q, T), jnp.float32), (lut, jnp.moveaxis(codes, -1, 0)))
    return z


ENCODE_CHUNK = 128  # tokens encoded at a time: bounds the [B, H, chunk, g, c] distance block


@jax.jit
def encode_keys(keys, centroids, lens):
    """Codes [B, H, T, g] int16 of keys [B, H, T, D]: per sub-vector the nearest centroid of ``centroids``
    [c, d] (squared L2, ties to the lower index); 0 past each sequence's length ``lens`` [B]."""
    B, H, T, D = keys.shape
    c, d = centroids.shape
    g = D // d
    cb = centroids.astype(jnp.float32)
    cn = (cb * cb).sum(-1)
    n = -(-T // ENCODE_CHUNK)
    x = jnp.pad(keys.astype(jnp.float32), ((0, 0), (0, 0), (0, n * ENCODE_CHUNK - T), (0, 0)))
    x = jnp.moveaxis(x.reshape(B, H, n, ENCODE_CHUNK, g, d), 2, 0)

    def one(xc):  # [B, H, chunk, g, d]; ||x||^2 is the same for every centroid
        dist = cn - 2.0 * jnp.einsum("bhtid,cd->bhtic", xc, cb, precision=jax.lax.Precision.HIGHEST)
        return jnp.argmin(dist, axis=-1).astype(jnp.int16)

    codes = jnp.moveaxis(jax.lax.map(one, x), 0, 2).reshape(B, H, n * ENCODE_CHUNK, g)[:, :, :T]
    valid = jnp.arange(T)[None, :] < lens[:, None]
    return jnp.where(valid[:, None, :, None], codes, 0).astype(jnp.int16)


def _no_rows(B: int, H: int, D: int, dtype) -> RowBlock:
    """The layer's heads keep no prompt row in the pool (count 0): their regions hold only the tail."""
    return RowBlock(k=jnp.zeros((B, H, 0, D), dtype), v=jnp.zeros((B, H, 0, D), dtype),
                    positions=jnp.zeros((B, H, 0), jnp.int32), lengths=jnp.zeros((B, H), jnp.int32),
                    heads=tuple(range(H)))


class HCPrefill(PrefillPlan):
    """Dense prefill; each layer's prompt V to the host store, its keys (or codes + codebook) to its state
    record; no prompt row in the pool."""

    def __init__(self, policy: HCAttention, cfg: ModelConfig, prompt_lens, compile_fn=None):
        self.policy, self.cfg = policy, cfg
        self.lens = np.asarray(prompt_lens, np.int64)
        self.compile_fn = compile_fn or (lambda f, *a, **st: functools.partial(f, **st))
        self.point = policy.plan(cfg, self.lens)  # validates every prompt first
        self.store = HostKVStore(cfg.num_layers)

    def prompt_counts(self) -> np.ndarray:
        return np.zeros((self.cfg.num_layers, len(self.lens), self.cfg.num_kv_heads), np.int64)

    def build_layer(self, li, layer, x_in, k_buf, v_buf, lens) -> LayerPrefill:
        B, H, _, D = k_buf.shape
        want = self.policy.kv_itemsize or 4
        if k_buf.dtype.itemsize != want:
            raise PolicyError(f"HCAttention planned its bytes for a {want}-byte KV dtype but the prefill runs in "
                              f"{k_buf.dtype}; bind the policy to the model first (policy.bind(model))")
        t_max = int(self.lens.max())
        self.store.put(li, None, v_buf[:, :, :t_max])
        # fresh arrays per layer: the decode step donates every cache leaf separately
        st = HCState(prompt_lens=jnp.asarray(self.lens.astype(np.int32)), store=self.store.handle_array())
        cb = self.point.codebook
        if cb is None:
            st = st.replace(keys=jnp.array(k_buf[:, :, :t_max]))  # a copy: k_buf may be shared (benchmarks)
        else:
            cents = jnp.asarray(cb.centroids[li])
            args = (k_buf[:, :, :t_max], cents, lens)
            st = st.replace(codes=self.compile_fn(encode_keys, *args)(*args), codebook=cents)
        return LayerPrefill(blocks=(_no_rows(B, H, D, k_buf.dtype),), state=st)

    def finish(self, cache: KVCache) -> tuple[KVCache, "HCDecode"]:
        self.store.materialize()  # the in-step callbacks read numpy views only (waits for the copies)
        itemsize = self.policy.kv_itemsize or 4
        return cache, HCDecode(self.policy, self.cfg, self.lens, self.point, self.store, itemsize)


class HCDecode(DecodeState):
    """HCAttention's counters; selection and the host sums run inside the step (``HCAttention.attend``)."""

    writes_prompt_rows = False  # its attend reads the codes and the host; only the tail grows

    def __init__(self, policy: HCAttention, cfg: ModelConfig, lens, point: OperatingPoint, store: HostKVStore,
                 itemsize: int):
        self.policy, self.cfg, self.lens, self.point, self.store, self.itemsize = (policy, cfg, lens, point, store,
                                                                                   itemsize)
        self.steps = 0
        self.pending = []  # device extras of dispatched steps, read lazily
        self.kstar_sum = np.zeros(cfg.num_layers)  # sum over steps, sequences and query heads of k*/L
        self.rows = 0  # (step, layer, sequence, query head) rows counted
        self.truncations = 0
        self.base = {k: list(v) for k, v in store.counters.items()}  # callback counters at this state's start

    def fresh(self) -> "HCDecode":
        return HCDecode(self.policy, self.cfg, self.lens, self.point, self.store, self.itemsize)

    def before_step(self, step, cache):
        self._collect()  # the last step's token was read back: its extras are ready, reading them never waits
        return cache

    def after_step(self, step, extras, cache) -> None:
        self.steps += 1
        for e in extras:
            for a in e:
                a.copy_to_host_async()
        self.pending.append(extras)

    def _collect(self) -> None:
        L = self.lens.astype(np.float64)[:, None, None]
        for extras in self.pending:
            for li, (kstar, trunc) in enumerate(extras):
                k = np.asarray(kstar)
                self.kstar_sum[li] += float((k / L).sum())
                self.truncations += int(np.asarray(trunc).sum())
            self.rows += extras[0][0].size
        self.pending = []

    def in_flight(self):
        return self.pending

    def host_arrays(self) -> tuple:
        return self.store.arrays()

    def host_bytes_by_role(self) -> dict:
        return {"value": self.store.nbytes()}

    def achieved_rho(self, cache, cfg) -> np.ndarray:
        """[B] bytes: each sequence's keys (or codes + the codebook) / its full prompt K+V bytes."""
        return np.array([next(p.rho for p in self.policy.operating_points(cfg, int(L))
                              if p.codebook is self.point.codebook) for L in self.lens])

    def _counter(self, kind: str) -> tuple[int, float, int]:
        now = self.store.counters.get(kind, [0, 0.0, 0])
        base = self.base.get(kind, [0, 0.0, 0])
        return now[0] - base[0], now[1] - base[1], now[2] - base[2]

    def kv_bytes_read(self, cache) -> int:
        """Keys or codes + codebooks (the state records) and the pool (device: every head's region holds only
        its tail), plus the value rows a step reads on the host (mean)."""
        _, _, rows = self._counter("decode")
        host = rows * self.cfg.head_dim * self.itemsize / self.steps if self.steps else 0
        return int(kv_bytes(cache) + self.index_bytes(cache) + host)

    def stats(self) -> dict:
        self._collect()
        cfg, n = self.cfg, self.steps
        B, NL = len(self.lens), cfg.num_layers
        per_layer = self.kstar_sum / self.rows if self.rows else np.zeros(NL)
        calls, seconds, rows = self._counter("decode")
        T = int(self.lens.max())
        q_rows = B * cfg.num_heads * NL  # query rows per step
        cb = self.point.codebook
        return {
            "steps": n,
            "mode": "values_on_host" if cb is None else f"codebook_g{cb.groups(cfg.head_dim)}",
            "selection_ratio": float(per_layer.mean()),  # mean k*/L (paper Fig. 3)
            "selection_ratio_by_layer": [float(x) for x in per_layer],
            "truncations": self.truncations,
            "bytes_to_host_per_step": q_rows * T * 4,  # each row's weights over the prompt (float32, 0 off Pi)
            "bytes_from_host_per_step": q_rows * cfg.head_dim * 4,  # y, float32
            "host_value_bytes_read_per_step": rows * cfg.head_dim * self.itemsize / n if n else 0.0,
            "callback_ms_per_step": 1e3 * seconds / n if n else 0.0,
            "host_bytes": self.store.nbytes(),
            "turn_callbacks": self._counter("turn")[0],
        }

    def summary(self) -> str:
        s = self.stats()
        return (f"{s['mode']}, kept {s['selection_ratio']:.1%} of the prompt per query (tau {self.policy.tau:g}), "
                f"host sums {s['callback_ms_per_step']:.1f} ms/step")
