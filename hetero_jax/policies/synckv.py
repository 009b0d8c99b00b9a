"""SyncKV: representative heads keep their full KV and choose, for the heads they stand for, which tokens
those keep; half of that choice is fixed at prefill, half refreshed from host memory every m steps.

Profile (offline, ``hetero-jax profile --method synckv``): per layer, k-means over the rows of
D = max(S) - S, S the mean top-k overlap of the heads' attention over decode steps (paper §4.1). Each
cluster's representative (R-head) is a pivot, its other members (NR-heads) satellites; a cluster of
one head is volatile (full KV, no NR-heads).

Budget (the B1 rule, our rho): N_R heads model-wide keep the whole prompt, every NR head
k = floor((rho N - N_R) L / N_NR) tokens; BudgetError (naming the smallest rho) when k < 1, e.g. any
rho <= 1/3 with one R-head of SmolLM2's three KV heads per layer.

Prefill (paper Alg. 1 lines 9-18), per layer and cluster: I_0 = the top-k positions of the R-head's
attention from the last prompt token (float32 softmax over the prompt, GQA max, no pooling). Its
k_s = k - floor((1 - static_ratio) k) best positions are static (kept for the whole decode), the
other k_dyn dynamic. Every NR head keeps its own K/V rows at I_0 (the prompt part of its region of the
row pool, ``model.cache``: rows [0, k_s) static, [k_s, k) dynamic, each part in position order); all NR
heads' full prompt KV goes to pinned host memory. The static positions are the layer's state
(:class:`SyncState`, a typed record whose fields declare their logical axes).

Decode (Alg. 1 lines 20-40): every ``m`` steps the R-head's query of that step scores its prompt keys
the same way; the top-k_dyn positions outside the static set (ours: the paper's set union implies
distinct tokens, and a repeated key would count twice in the softmax) become each NR head's dynamic
rows, fetched from the host and written into the NR heads' regions of the pool before the next step
(a one-step lag, as in Alg. 1). Only positions that were not already resident are moved (ours; the attended set is the
paper's). Ours too: an anticipation right after a session turn (``after_extend``), from the turn's last
query, so the answer starts on rows chosen for the question; and the R-head's softmax runs over the
prompt only (generated tokens sit in the tail, which every head attends in full).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from hetero_jax.model.cache import KVCache, KVPool, LayerPrefill, RowBlock, block_width, head_offsets
from hetero_jax.model.config import ModelConfig
from hetero_jax.model.host_store import TRANSFER_ERRORS, HostKVStore, write_head_rows
from hetero_jax.model.sharding import to_host
from hetero_jax.model.spec import axes_field
from hetero_jax.model.transformer import prompt_queries
from hetero_jax.policies.base import PolicyError, int_param, note_recall_steps, real_param
from hetero_jax.policies.protocol import DecodeState, PrefillPlan
from pallas_kernels import MASK_VALUE
from hetero_jax.model.scoring import gather_group, query_probs_max
from hetero_jax.policies.profiled import LayerRoles, ProfiledPolicy, profile_key, take_slots
from hetero_jax.policies.selection import bytes_rho, cap_bucket
from hetero_jax.policies.pages import page_bucket
from hetero_jax.profile.clustering import Role
from hetero_jax.profile.head_profile import HeadProfile
from hetero_jax.profile.schema import ProfileError
from hetero_jax.profile.shipped import SHIPPED_SYNCKV_PROFILES

# static_idx padding: an out-of-range position, dropped by the scatter that masks the static set
_NO_POS = 2**30


def check_synckv_profile(profile: HeadProfile) -> None:
    """ProfileError unless ``profile`` is a SyncKV grouping: pivots (R), satellites (NR) of one weight, volatile."""
    n_anchor = int((profile.roles == Role.ANCHOR).sum())
    w = profile.weights[profile.roles == Role.SATELLITE]
    if n_anchor or (w.size and not np.allclose(w, w[0], rtol=0, atol=1e-12)):
        raise ProfileError(
            f"SyncKV needs a SyncKV head grouping (R-heads as pivots, NR-heads as satellites of one weight), but "
            f"this profile has {n_anchor} anchor head(s) and {len(np.unique(w))} satellite weight(s): a "
            "HeteroCache profile? Calibrate one with `hetero-jax profile --method synckv` (or build_synckv_profile)")


@dataclasses.dataclass(frozen=True)
class SyncKV(ProfiledPolicy):
    """SyncKV (``profile=None``: the shipped SyncKV profile of the loaded model; a str is a profile JSON path).

    ``m``: decode steps between anticipations; ``static_ratio``: the paper's rho_s, the share of the NR
    heads' k tokens fixed at prefill (1 = no refresh, 0 = all refreshed).
    """

    profile: HeadProfile | None = dataclasses.field(default=None, compare=False, hash=False, repr=False)
    budget: float = 0.5
    m: int = int_param(5, 1, " (decode steps between anticipations)")
    static_ratio: float = real_param(0.5, 0.0, lo_open=False, hi=1.0, hi_open=False)
    profile_key: str = dataclasses.field(default="", init=False)

    name: ClassVar[str] = "synckv"
    summary: ClassVar[str] = ("k-means head groups: representative heads keep their full KV and pick the others' "
                              "tokens (half fixed, half re-fetched from host memory every m steps)")
    profile_table: ClassVar[dict[str, str]] = SHIPPED_SYNCKV_PROFILES
    calibrate_hint: ClassVar[str] = ("calibrate one with `hetero-jax profile --method synckv --model M --data FILE "
                                     "--out synckv.json` and pass {cls}(profile='synckv.json') (on the command "
                                     "line: generate --profile synckv.json, serve --option profile=synckv.json)")

    def __post_init__(self):
        super().__post_init__()
        self._load_profile_path()
        if self.profile is not None:
            if not isinstance(self.profile, HeadProfile):
                raise PolicyError(f"SyncKV: profile must be a HeadProfile, a path to a profile JSON or None for "
                                  f"the model's shipped SyncKV profile, got {type(self.profile).__name__}")
            check_synckv_profile(self.profile)
        object.__setattr__(self, "profile_key", profile_key(self.profile))

    def split(self, k: int) -> tuple[int, int]:
        """(k_s static, k_dyn dynamic) of an NR head's k tokens: k_dyn = floor((1 - static_ratio) k)."""
        k_dyn = int(math.floor((1.0 - self.static_ratio) * k + 1e-9))
        return k - k_dyn, k_dyn

    def nr_tokens(self, prompt_len: int) -> int:
        """k: tokens every NR head keeps on the device for one prompt (0 without NR heads); BudgetError if < 1."""
        grid, _ = self.budget_grid(prompt_len)
        sat = self._need_profile().roles == Role.SATELLITE
        return int(grid[sat].min()) if sat.any() else 0

    def make_prefill(self, cfg, prompt_lens, compile_fn=None):
        return SyncPrefill(self, cfg, prompt_lens, compile_fn=compile_fn)


@struct.dataclass
class SyncState:
    """A layer's SyncKV state (layers with NR heads): the static positions of each R-head's cluster."""

    # [B, Np, k_s max] int32 the k_s static positions of each R-head (its NR heads' rows [0, k_s)), ascending;
    # ``_NO_POS`` past a sequence's k_s
    static_idx: jax.Array = axes_field("batch", "pivots", "slots")


@functools.partial(jax.jit, static_argnames=("cfg", "n_pivots", "cap"))
def _prefill_layer(layer, x_in, k_buf, v_buf, lens, owner, k, k_s, cfg, n_pivots: int, cap: int):
    """One layer's NR rows and static sets. owner [Nnr]: the pivot (layout position) of each NR head;
    k, k_s [B]. Returns (the NR heads' row block [B, Nnr, cap] (rows [0, k_s) static, [k_s, k) dynamic,
    each in position order), positions by pivot [B, Np, cap] in the same row order)."""
    B, _, T, _ = k_buf.shape
    q = prompt_queries(layer, x_in, (lens - 1)[:, None], cfg)[:, :n_pivots, 0]  # [B, Np, G, D]
    scores = query_probs_max(q, k_buf[:, :n_pivots], jnp.broadcast_to(lens[:, None], (B, n_pivots)))
    _, top = jax.lax.top_k(scores, cap)  # [B, Np, cap] best first: I_0 (ties to the lower position)
    rank = jnp.arange(cap, dtype=jnp.int32)[None, None, :]
    seg = jnp.where(rank < k_s[:, None, None], 0, jnp.where(rank < k[:, None, None], 1, 2))
    pos = jnp.sort(seg * T + top, axis=-1) % T  # static part sorted, then dynamic part sorted, then padding
    idx = pos[:, owner]  # [B, Nnr, cap]: each NR head takes its R-head's positions
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), idx.shape[:2] + (T,))
    counts = jnp.broadcast_to(k[:, None], idx.shape[:2])
    block = gather_group(k_buf[:, -len(owner):], v_buf[:, -len(owner):], positions, idx, counts)
    return block, pos


def _pivot_keys(pool: KVPool, offsets, n_pivots: int, t_max: int):
    """Traced: the R-heads' (layout slots [0, Np)) prompt keys [B, Np, t_max, D], read from their regions of
    the pool (rows past a head's prompt are other rows: the caller masks them by the lengths)."""
    B, H = offsets.shape
    n_local = H // pool.num_shards
    rows = jnp.clip(offsets[:, :n_pivots, None] + jnp.arange(t_max, dtype=jnp.int32), 0, pool.num_rows - 1)
    s = (jnp.arange(n_pivots) // n_local)[None, :, None]
    return pool.k[jnp.arange(B)[:, None, None], s, rows]


@functools.partial(jax.jit, static_argnames=("k_dyn", "n_pivots", "t_max"))
def _anticipate(q, pool, offsets, lengths, static_idx, k_dyn: int, n_pivots: int, t_max: int):
    """The dynamic set I_D,t of each R-head: top-k_dyn of softmax(q K^T / sqrt(D)) (GQA max) over its prompt
    keys (read from the pool), static positions excluded. q [B, Np, G, D]; offsets, lengths [B, H] (the
    layer's; R-heads first); static_idx [B, Np, k_s] (``_NO_POS`` padding); t_max: the longest prompt.
    Returns [B, Np, k_dyn] int32, best first."""
    keys = _pivot_keys(pool, offsets, n_pivots, t_max)
    s = query_probs_max(q, keys, lengths[:, :n_pivots])
    B, Np, _ = s.shape
    s = s.at[jnp.arange(B)[:, None, None], jnp.arange(Np)[None, :, None], static_idx].set(MASK_VALUE, mode="drop")
    return jax.lax.top_k(s, k_dyn)[1].astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class SyncPrefilled:
    """What SyncKV's prefill hands its decode."""

    policy: SyncKV
    roles: list[LayerRoles]
    k: np.ndarray  # [B] tokens per NR head
    k_s: np.ndarray  # [B] static part
    k_dyn: np.ndarray  # [B] dynamic part
    dyn: dict  # layer -> [B, Np, k_dyn max] positions held by the dynamic rows (-1 padding), after prefill
    store: HostKVStore  # per layer: the NR heads' full prompt K/V [B, Nnr, T, D]
    offsets: list  # per layer [B, H] int64 each head's first pool row (layout slots), at prefill
    info: dict  # planned sizes and the byte-based rho


class SyncPrefill(PrefillPlan):
    """R-heads (and volatile singletons) keep their whole prompt, every NR head k rows (k_s static then k_dyn
    dynamic); the NR heads' prompt KV goes to the host."""

    def __init__(self, policy: SyncKV, cfg: ModelConfig, prompt_lens, compile_fn=None):
        self.policy, self.cfg = policy, cfg
        self.lens = np.asarray(prompt_lens, np.int64)
        self.t_max = int(self.lens.max())
        self.compile_fn = compile_fn or (lambda f, *a, **st: functools.partial(f, **st))
        self.k = np.array([policy.nr_tokens(int(L)) for L in self.lens], np.int64)  # validates every prompt
        split = np.array([policy.split(int(k)) for k in self.k], np.int64).reshape(-1, 2)
        self.k_s, self.k_dyn = split[:, 0], split[:, 1]
        self.roles = policy.layer_roles(cfg)
        H = cfg.num_kv_heads
        for r in self.roles:  # one device's layout: [R-heads, volatiles][NR heads] (``ProfiledPolicy.layout``)
            assert r.full_slots == list(range(r.n_full)) and r.comp_slots == list(range(r.n_full, H)), r
        # [L, B, H] prompt rows each head keeps: full heads their prompt, NR heads k
        self.counts = np.zeros((cfg.num_layers, len(self.lens), H), np.int64)
        for li, r in enumerate(self.roles):
            self.counts[li][:, r.full_slots] = self.lens[:, None]
            self.counts[li][:, r.comp_slots] = self.k[:, None]
        self.store = HostKVStore(cfg.num_layers)
        self.dyn: dict[int, tuple] = {}

    def prompt_counts(self) -> np.ndarray:
        return self.counts

    def build_layer(self, li, layer, x_in, k_buf, v_buf, lens) -> LayerPrefill:
        r, t_max = self.roles[li], self.t_max
        B = k_buf.shape[0]
        blocks = []
        if r.n_full:
            full = r.full_slots
            w = block_width(t_max, k_buf.shape[2])
            blocks.append(RowBlock(k=take_slots(k_buf, full)[:, :, :w], v=take_slots(v_buf, full)[:, :, :w],
                                   positions=jnp.broadcast_to(jnp.arange(w, dtype=jnp.int32), (B, len(full), w)),
                                   lengths=jnp.asarray(self.counts[li][:, full], jnp.int32), heads=tuple(full)))
        if not r.comp_slots:
            return LayerPrefill(blocks=tuple(blocks))
        owner = np.zeros(len(r.comp_slots), np.int32)
        for p, sats in r.members.items():
            owner[sats] = p
        kmax = int(self.k.max())
        # compiled per 64-slot bucket, and written at it: the rows past each head's k are padding the write drops
        cap = cap_bucket(kmax, k_buf.shape[2])
        arr = lambda a: jnp.asarray(np.asarray(a, np.int32))  # noqa: E731
        args = (layer, x_in, k_buf, v_buf, lens, arr(owner), arr(self.k), arr(self.k_s))
        block, pos = self.compile_fn(_prefill_layer, *args, cfg=self.cfg, n_pivots=len(r.pivots), cap=cap)(*args)
        blocks.append(block.replace(heads=tuple(r.comp_slots)))
        self.store.put_heads(li, k_buf[:, :, :t_max], v_buf[:, :, :t_max], r.comp_slots)
        ks_max, kd_max = int(self.k_s.max()), int(self.k_dyn.max())
        # a decode-step operand: its width bucketed by the page-count rule, so nearby lengths share the step
        slot = np.arange(min(max(1, page_bucket(ks_max)), cap))[None, None, :]
        state = SyncState(static_idx=jnp.where(jnp.asarray(slot < self.k_s[:, None, None]),
                                               pos[:, :, : slot.shape[-1]], _NO_POS).astype(jnp.int32))
        self.dyn[li] = (pos, kd_max)
        return LayerPrefill(blocks=tuple(blocks), state=state)

    def finish(self, cache: KVCache) -> tuple[KVCache, "SyncDecode"]:
        self.store.settle_on_huge_pages()  # a CPU's recall gathers from huge pages
        dyn = {}
        for li, (pos, kd_max) in self.dyn.items():  # host mirror of the dynamic rows (copies, never views)
            pos = np.array(to_host(pos), np.int64)
            d = np.full(pos.shape[:2] + (kd_max,), -1, np.int64)
            for b in range(len(self.lens)):
                ks, kd = int(self.k_s[b]), int(self.k_dyn[b])
                d[b, :, :kd] = pos[b, :, ks : ks + kd]
            dyn[li] = d
        n = self.cfg.num_layers * self.cfg.num_kv_heads
        n_r = int(sum(len(r.pivots) for r in self.roles))
        n_nr = int(sum(len(r.satellites) for r in self.roles))
        itemsize = cache.pool.k.dtype.itemsize
        full_bytes = cache.batch_size * self.t_max * n * 2 * self.cfg.head_dim * itemsize
        index = int(sum(a.nbytes for a in jax.tree.leaves([lc.state for lc in cache.layers])))  # static_idx
        info = {
            "r_heads": n_r, "nr_heads": n_nr, "k": self.k.tolist(), "k_static": self.k_s.tolist(),
            "k_dynamic": self.k_dyn.tolist(),
            "bytes_rho": bytes_rho(cache, self.cfg) + index / full_bytes,
        }
        offsets = head_offsets(cache)
        prefilled = SyncPrefilled(self.policy, self.roles, self.k, self.k_s, self.k_dyn, dyn, self.store, offsets,
                                  info)
        return cache, SyncDecode(prefilled, compile_fn=self.compile_fn)


class SyncDecode(DecodeState):
    """SyncKV between steps: dispatches an anticipation every ``m`` steps (after the step whose query it
    uses), and before the next step moves the NR heads' new dynamic rows from the host into their regions
    of the pool."""

    wants_turn_queries = True

    def __init__(self, prefilled: SyncPrefilled, compile_fn=None):
        self.prefilled = prefilled
        self.policy = prefilled.policy
        self.compile_fn = compile_fn or (lambda f, *a, **st: functools.partial(f, **st))
        self.dyn = {li: d.copy() for li, d in prefilled.dyn.items()}  # replaced on each recall, never edited
        self.layers = [li for li, d in prefilled.dyn.items() if d.shape[-1]]  # layers with dynamic rows
        # per layer [B, H] each head's first pool row (host copies: reading the cache's would wait for the
        # step in flight); refreshed when the pool is repacked (``pool_moved``)
        self.offsets = [np.asarray(o, np.int64) for o in prefilled.offsets]
        self.since = 0  # decode steps since prefill, or since the last turn's anticipation
        self.pending = None  # (step, {layer: device indices}) of a dispatched anticipation
        self.anticipations = 0  # decode-time anticipations (every layer at once)
        self.turn_anticipations = 0  # anticipations right after a session turn
        self.layer_anticipations = 0  # (anticipation, layer) pairs scored
        self.rows_requested = 0  # k_dyn rows per NR head per anticipation: what the paper moves
        self.rows_recalled = 0  # rows actually moved (positions that were not resident yet)
        self.recalls = 0  # (anticipation, NR head) pairs that moved at least one row
        self.bytes_recalled = 0
        self.overlap_sum, self.overlap_n = 0.0, 0  # |I_D,t ∩ I_D,t-1| / k_dyn per (sequence, cluster)
        self.recall_failures = 0
        self.recall_steps: list[int] = []

    def fresh(self) -> "SyncDecode":
        return SyncDecode(self.prefilled, compile_fn=self.compile_fn)

    def _dispatch(self, queries, cache: KVCache) -> dict:
        """Start every layer's anticipation on ``queries`` (per layer the pivots' [B, Np, G, D]); the indices
        are copied to the host asynchronously."""
        kd_max = int(self.prefilled.k_dyn.max())
        outs = {}
        for li in self.layers:
            lc = cache.layers[li]
            n_p = len(self.prefilled.roles[li].pivots)
            args = (queries[li], cache.pool, lc.offsets, lc.lengths, lc.state.static_idx)
            # t_max: the R-heads keep the whole prompt, the most rows any head of the layer keeps
            # k_dyn bucketed as well: the host reads each sequence's first k_dyn (top_k lists the best first)
            k_dyn = min(page_bucket(kd_max), lc.capacity)
            outs[li] = self.compile_fn(_anticipate, *args, k_dyn=k_dyn, n_pivots=n_p, t_max=lc.capacity)(*args)
            outs[li].copy_to_host_async()  # read before the next step is dispatched, never waited on now
        return outs

    def after_step(self, step: int, extras, cache: KVCache) -> None:
        self.since += 1
        if self.layers and self.since % self.policy.m == 0:
            self.pending = (step, self._dispatch(extras, cache))

    def before_step(self, step: int, cache: KVCache) -> KVCache:
        if self.pending is None:
            return cache
        _, outs = self.pending
        self.pending = None
        out, ok = self._recall(outs, cache, f"before decode step {step}")
        if ok:
            self.anticipations += 1
            note_recall_steps(self.recall_steps, step)
        return out

    def after_extend(self, turn_queries, cache: KVCache) -> KVCache:
        """A session turn: drop a pending anticipation (it was scored before the question) and anticipate now
        from the turn's last query, landing before the answer's first step (ours, see module docstring)."""
        self.pending = None
        self.since = 0
        if not self.layers:
            return cache
        queries = [None if q is None or li not in self.layers else q[:, : len(self.prefilled.roles[li].pivots), -1]
                   for li, q in enumerate(turn_queries)]
        out, ok = self._recall(self._dispatch(queries, cache), cache, "after a session turn")
        if ok:
            self.turn_anticipations += 1
        return out

    def _recall(self, outs: dict, cache: KVCache, when: str) -> tuple[KVCache, bool]:
        """(the cache, whether the anticipation was applied). All or nothing: a failed host -> device
        transfer keeps the cache, mirrors and counters, with a RuntimeWarning (the next anticipation tries
        again). An anticipation whose positions are all resident already is applied and moves nothing."""
        saved = (self.layer_anticipations, self.rows_requested, self.rows_recalled, self.bytes_recalled,
                 self.overlap_sum, self.overlap_n, self.recalls)
        try:
            return self._apply(outs, cache), True
        except TRANSFER_ERRORS as e:
            (self.layer_anticipations, self.rows_requested, self.rows_recalled, self.bytes_recalled,
             self.overlap_sum, self.overlap_n, self.recalls) = saved
            self.recall_failures += 1
            warnings.warn(f"SyncKV: the anticipation {when} failed ({type(e).__name__}: {e}); the device cache "
                          "keeps its rows", RuntimeWarning, stacklevel=3)
            return cache, False

    def _apply(self, outs: dict, cache: KVCache) -> KVCache:
        """Per sequence and cluster, the new dynamic positions that are not resident replace, row by row,
        the resident ones no longer chosen, in every NR head of the cluster. Only those rows cross to the
        device (every transfer started before any write) and are scattered in place into the
        heads' regions of the pool (``write_head_rows``: slot k_s + the row of the head's region)."""
        p = self.prefilled
        mirrors, parts = {}, []
        for li, top in outs.items():
            top = to_host(top)
            mirror = self.dyn[li].copy()
            comp = p.roles[li].comp_slots
            b_l, h_l, slot_l, pos_l = [], [], [], []
            for b in range(len(p.k)):
                ks, kd = int(p.k_s[b]), int(p.k_dyn[b])
                if kd == 0:
                    continue
                for piv, sats in p.roles[li].members.items():
                    new, old = top[b, piv, :kd], mirror[b, piv, :kd]
                    missing = new[~np.isin(new, old)]
                    free = np.flatnonzero(~np.isin(old, new))  # as many as missing: both sets hold kd positions
                    mirror[b, piv, free] = missing
                    self.overlap_sum += (kd - len(missing)) / kd
                    self.overlap_n += 1
                    self.rows_requested += kd * len(sats)
                    self.recalls += len(sats) if len(missing) else 0
                    for j in sats:  # NR head j of the layer, layout slot comp[j]
                        n = len(missing)
                        b_l.append(np.full(n, b))
                        h_l.append(np.full(n, comp[j]))
                        slot_l.append(ks + free)
                        pos_l.append(missing)
            self.layer_anticipations += 1
            mirrors[li] = mirror
            if not b_l or not sum(len(x) for x in b_l):
                continue
            parts.append((li, *(np.concatenate(x) for x in (b_l, h_l, pos_l, slot_l))))
        if parts:  # every layer's rows in one transfer set: all of them leave before anything is written
            pool, n, nbytes = write_head_rows(cache.pool, p.store, self.offsets, parts, self.compile_fn)
            cache = cache.replace(pool=pool)
            self.rows_recalled += n
            self.bytes_recalled += nbytes
        self.dyn.update(mirrors)
        return cache

    def pool_moved(self, cache: KVCache) -> None:
        """The pool was repacked (a session outgrew its tail rows): read the heads' new offsets."""
        self.offsets = head_offsets(cache)

    def in_flight(self):
        return None if self.pending is None else self.pending[1]

    def host_arrays(self) -> tuple:
        return self.prefilled.store.arrays()

    def host_bytes_by_role(self) -> dict[str, int]:
        """Pinned-host KV bytes: the NR heads' (satellites') full prompt KV, the paper's context bank."""
        return {"satellite": self.prefilled.store.nbytes()}

    def recalled_bytes(self) -> int:
        return self.bytes_recalled

    def stats(self) -> dict:
        return {
            **self.prefilled.info,
            "anticipations": self.anticipations,
            "turn_anticipations": self.turn_anticipations,
            "layer_anticipations": self.layer_anticipations,
            "recalls": self.recalls,
            "rows_requested": self.rows_requested,
            "rows_recalled": self.rows_recalled,
            "bytes_recalled": self.bytes_recalled,
            "dynamic_overlap": self.overlap_sum / self.overlap_n if self.overlap_n else None,
            "recall_failures": self.recall_failures,
        }

    def summary(self) -> str:
        ov = self.overlap_sum / self.overlap_n if self.overlap_n else 0.0
        return (f"anticipations {self.anticipations} (+{self.turn_anticipations} at turns), recalled "
                f"{self.rows_recalled} rows ({self.bytes_recalled / 2**10:.0f} KiB), kept {ov:.0%} of the dynamic "
                f"set, bytes rho {self.prefilled.info['bytes_rho']:.3f}")
