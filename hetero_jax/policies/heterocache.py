"""HeteroCache: role-aware budgets, a pinned-host reservoir, and drift-triggered recall.

Prefill (per request, prompt length L):
- L_base by Eq. 7 over the whole model, l_i by Eq. 8 (``HeadProfile.budgets``);
- full heads (volatile, pivot) keep the whole prompt on the device;
- compressed heads (anchor, satellite) keep their top-l_i tokens by the pooled
  attention (GQA max) of the last ``select_window`` prompt queries, summed
  (causal), stored in position order. The paper scores by the last token alone
  (``select_window=1``); our default 8 reaches past the chat template's
  closing tokens into the question (see docs/architecture.md);
- the satellites' full prompt KV goes to a host reservoir in pinned host memory;
- each pivot records K_base = the top-L_base of its pooled last-token attention.

Decode: every ``window`` steps the buffered pivot queries are scored against
the pivot's prompt keys (``pallas_kernels.drift_check``); when the median
overlap with K_base drops below ``tau_drift``, each satellite of that pivot
gets its own top-l_s positions of the pivot's latest pooled scores, gathered
from the reservoir and written into its device slots, and K_base moves on.
A check also runs when an extension chunk (a session's question) has been
appended, on the last ``window`` steps, so a drift the question causes is
recalled before the answer is decoded rather than up to ``window`` steps in.

Scheduling: by default every layer's pivots are checked on the same step (the paper's release).
``stagger_checks=True`` (our option) spreads the layers with pivots over the ``window`` phases, so
each decode step checks about 1/window of the pivots instead of all of them every ``window`` steps;
each pivot is still checked every ``window`` steps on its last ``window`` queries. It is off by
default because it cost facts in sessions (docs/architecture.md). When staggered, a session's
question is followed by a check of every layer at its end and ``window`` steps later on the same
step (see ``end_of_chunk``), then the layers return to their phases.

Asynchrony and lag: the check is dispatched right after step t's decode and
its small outputs (flags, indices) are copied to the host asynchronously;
they are read before step t + 1 is dispatched, and recalled rows are written
then, so a recall takes effect exactly one step after the check. The
reservoir gather runs on the host (numpy view of the pinned array) and the
rows go to the device with an asynchronous ``device_put``.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import warnings
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from hetero_jax.cache import HeadGroup, KVCache, full_group
from hetero_jax.config import ModelConfig
from hetero_jax.layout import HeadLayout
from hetero_jax.model import prompt_queries
from hetero_jax.policies.base import BudgetError, Policy, PolicyError, check_int
from hetero_jax.policies.primitives import avg_pool, finalize_scores, gqa_reduce, observation_window_probs
from hetero_jax.policies.runtime import select_group
from hetero_jax.profile.clustering import Role
from hetero_jax.profile.format import HeadProfile, ProfileError


# How a drifting pivot's satellites choose the rows they get back from the host reservoir:
# "pivot" (the paper): top-l_s of the pivot's latest pooled scores;
# "own": top-l_s of the satellite's own latest query scored against its own reservoir keys.
RECALL_MODES = ("pivot", "own")


def _profile_key(profile: HeadProfile | None) -> str:
    if profile is None:
        return ""
    h = hashlib.sha256(np.ascontiguousarray(profile.roles).tobytes())
    h.update(np.nan_to_num(np.asarray(profile.weights, np.float64), nan=-1.0).tobytes())
    h.update(repr(profile.clusters).encode())
    return h.hexdigest()[:16]


def _check_hetero_args(p: "HeteroCache") -> None:
    """Types and ranges of HeteroCache's numeric arguments (before the older checks in __post_init__)."""
    if p.profile is not None and not isinstance(p.profile, HeadProfile):
        raise PolicyError(f"HeteroCache: profile must be a HeadProfile (load_profile('profile.json')) or None "
                          f"for the model's shipped profile, got {type(p.profile).__name__}")
    check_int("HeteroCache", "window", p.window, 1, " (decode steps between drift checks)")
    if isinstance(p.select_window, bool):  # an int to isinstance, but True is no number of queries
        raise PolicyError(f"HeteroCache: select_window must be an int >= 1 prompt query (1 = the paper's last "
                          f"token), got {p.select_window!r}")
    tau = p.tau_drift
    if tau is not None and (isinstance(tau, bool) or not isinstance(tau, (int, float, np.integer, np.floating))
                            or not np.isfinite(tau)):
        raise PolicyError(f"HeteroCache: tau_drift must be a finite number (a drift is a median top-k overlap "
                          f"below it, so [0, 1] is meaningful) or None for the profile's tau_stable, got {tau!r}")


@dataclasses.dataclass(frozen=True)
class HeteroCache(Policy):
    """HeteroCache (``profile=None``: the shipped profile of the loaded model)."""

    profile: HeadProfile | None = dataclasses.field(default=None, compare=False, hash=False, repr=False)
    budget: float = 0.3
    window: int = 5
    tau_drift: float | None = None
    pool_kernel: int = 5
    recall: str = "pivot"
    stagger_checks: bool = False
    select_window: int = 8
    profile_key: str = dataclasses.field(default="", init=False)

    name: ClassVar[str] = "heterocache"
    summary: ClassVar[str] = ("role-aware head budgets from an offline profile, satellites' full KV in pinned host "
                              "memory, drift-triggered recall")

    def __post_init__(self):
        super().__post_init__()
        _check_hetero_args(self)
        if self.window < 1:
            raise BudgetError(f"HeteroCache: window must be >= 1 decode step, got {self.window}")
        if not isinstance(self.select_window, int) or self.select_window < 1:
            raise BudgetError(f"HeteroCache: select_window must be an int >= 1 prompt query (1 = the paper's "
                              f"last token), got {self.select_window!r}")
        if self.recall not in RECALL_MODES:
            raise BudgetError(f"HeteroCache: recall must be one of {', '.join(RECALL_MODES)}, got {self.recall!r}")
        if self.pool_kernel != 5:
            raise BudgetError("HeteroCache: the pooled-score kernel supports pool_kernel=5 only")
        object.__setattr__(self, "profile_key", _profile_key(self.profile))

    # -------------------------------------------------------------- binding
    def bind(self, model) -> "HeteroCache":
        """This policy with its profile resolved and checked against ``model``."""
        from hetero_jax.profile.format import default_profile, weights_fingerprint

        prof = self.profile
        if prof is None:
            prof = default_profile(model)
            if prof is None:
                raise ProfileError(
                    f"HeteroCache(profile=None) needs the shipped profile of the loaded model, but hetero-jax "
                    f"ships none for {getattr(model, 'name', 'this model')}; calibrate one with "
                    "`hetero-jax profile --model M --data FILE --out profile.json` and pass "
                    "HeteroCache(profile=load_profile('profile.json'))"
                )
        prof.check_compatible(model.config, weights_fingerprint=weights_fingerprint(model.params)
                              if prof.weights_fingerprint else None)
        return dataclasses.replace(self, profile=prof) if prof is not self.profile else self

    @property
    def drift_threshold(self) -> float:
        if self.tau_drift is not None:
            return float(self.tau_drift)
        tau = self.profile.settings.tau_stable if self.profile is not None else None
        return 0.5 if tau is None else float(tau)

    def _need_profile(self) -> HeadProfile:
        if self.profile is None:
            raise ProfileError("HeteroCache has no profile yet: call policy.bind(model) (generate does this)")
        return self.profile

    # ---------------------------------------------------------------- layout
    def roles_in_layout(self, layer: int) -> dict[str, list[int]]:
        """Original KV-head indices per role of one layer, in layout order within each role."""
        r = self._need_profile().roles[layer]
        pick = lambda role: [int(h) for h in np.flatnonzero(r == role)]  # noqa: E731
        return {"pivot": pick(Role.PIVOT), "volatile": pick(Role.VOLATILE),
                "satellite": pick(Role.SATELLITE), "anchor": pick(Role.ANCHOR)}

    def layout(self, cfg: ModelConfig) -> HeadLayout:
        """Per layer: [pivots + volatiles] (full) then [satellites + anchors] (compressed)."""
        groups = []
        for l in range(cfg.num_layers):
            r = self.roles_in_layout(l)
            groups.append([g for g in (r["pivot"] + r["volatile"], r["satellite"] + r["anchor"]) if g])
        return HeadLayout.from_groups(groups)

    # --------------------------------------------------------------- budgets
    def budget_grid(self, prompt_len: int) -> tuple[np.ndarray, int]:
        """(tokens per KV head [L, H] in original order, L_base as an int) for one prompt."""
        from hetero_jax.profile.clustering import base_budget

        prof = self._need_profile()
        if prof.n_compressed == 0:  # every head keeps its full KV: nothing to budget
            if self.budget < 1.0:  # it would keep rho = 1, far above the request
                raise BudgetError(
                    f"HeteroCache: budget rho={self.budget:g} cannot be kept: the profile has no compressed "
                    "heads (every head is a pivot or volatile and keeps its full KV); the smallest rho that "
                    "works is 1 (use budget=1.0, or a profile with anchor/satellite heads)")
            return np.full(prof.roles.shape, prompt_len, np.int64), prompt_len
        try:
            grid = prof.budgets(self.budget, prompt_len)
            n_comp = prof.n_compressed
            l_base = base_budget(self.budget, prof.roles.size, prof.roles.size - n_comp, n_comp, prompt_len)
        except ValueError as e:
            raise BudgetError(f"HeteroCache: {e}") from None
        return grid, int(max(1, min(prompt_len, np.floor(l_base))))

    def check_budget(self, prompt_len: int) -> int:
        self.budget_grid(prompt_len)
        return prompt_len

    def layer_counts(self, cfg, prompt_len):
        return None

    def make_prefill(self, cfg, prompt_lens, compile_fn=None):
        return HeteroPrefill(self, cfg, prompt_lens, compile_fn=compile_fn)

    def token_scores(self, layer, x_in, keys, prompt_lens, cfg):
        raise NotImplementedError("HeteroCache selects per role in HeteroPrefill")


@functools.partial(jax.jit, static_argnames=("cfg",))
def _last_token_scores(layer, x_in, keys, prompt_lens, cfg):
    """Pooled last-prompt-token attention, GQA max: [B, Hkv, Tp] (INVALID beyond the prompt)."""
    q = prompt_queries(layer, x_in, (prompt_lens - 1)[:, None], cfg)  # [B, Hkv, 1, G, D]
    lengths = jnp.broadcast_to(prompt_lens[:, None], keys.shape[:2])
    return pallas_kernels.scores(q, keys, lengths, gqa="max")[:, :, 0]


@functools.partial(jax.jit, static_argnames=("cfg", "window"))
def _window_scores(layer, x_in, keys, prompt_lens, cfg, window: int):
    """Pooled attention of the last ``window`` prompt queries, summed (causal), GQA max: [B, Hkv, Tp]."""
    probs, _ = observation_window_probs(layer, x_in, keys, prompt_lens, window, cfg)  # [B, Hkv, W, G, Tp]
    return finalize_scores(gqa_reduce(avg_pool(probs.sum(axis=2)), "max", axis=2), prompt_lens)


@dataclasses.dataclass
class LayerRoles:
    n_full: int  # heads [0, n_full) of the layer (layout order) keep everything
    pivots: list[int]  # layout positions of pivots (inside the full group)
    satellites: list[int]  # positions inside the compressed group
    # cluster of each pivot: positions of its satellites inside the compressed group
    members: dict[int, list[int]]


class HeteroPrefill:
    """``build_layer`` hook for HeteroCache plus the state its decode needs (see module docstring)."""

    def __init__(self, policy: HeteroCache, cfg: ModelConfig, prompt_lens, compile_fn=None):
        self.policy, self.cfg = policy, cfg
        self.lens = np.asarray(prompt_lens, np.int64)
        self.compile_fn = compile_fn or (lambda f, *a, **st: functools.partial(f, **st))
        grids = [policy.budget_grid(int(L)) for L in self.lens]  # validates every prompt first
        self.grid = np.stack([g for g, _ in grids])  # [B, L, H] original head order
        self.l_base = np.array([lb for _, lb in grids])  # [B]
        self.layout = policy.layout(cfg)
        self.roles: list[LayerRoles] = []
        for l in range(cfg.num_layers):
            r = policy.roles_in_layout(l)
            full = r["pivot"] + r["volatile"]
            comp = r["satellite"] + r["anchor"]
            sat_pos = {h: comp.index(h) for h in r["satellite"]}
            members = {}
            for pivot, sats in policy.profile.clusters[l]:
                members[full.index(int(pivot))] = [sat_pos[int(s)] for s in sats]
            self.roles.append(LayerRoles(len(full), list(range(len(r["pivot"]))),
                                         [sat_pos[h] for h in r["satellite"]], members))
        self.reservoir_k: list = []  # per layer: pinned-host [B, Ns, T, D] or None
        self.reservoir_v: list = []
        self._host_view: dict[int, tuple] = {}  # layer -> (k, v) numpy views of the reservoir, made on first use
        self.counts: list[np.ndarray] = []  # per layer [B, Hc] tokens kept by compressed heads
        self.k_base: list = []

    def build_layer(self, li, layer, x_in, k_buf, v_buf, lens) -> tuple[HeadGroup, ...]:
        cfg, roles = self.cfg, self.roles[li]
        nf = roles.n_full
        t_max = int(self.lens.max())
        perm = np.asarray(self.layout.perms[li])
        groups = []
        scores = None
        n_comp = cfg.num_kv_heads - nf
        window = self.policy.select_window
        if nf:
            groups.append(full_group(k_buf[:, :nf, :t_max], v_buf[:, :nf, :t_max], lens))
        args = (layer, x_in, k_buf, lens)
        if roles.pivots or (n_comp and window == 1):  # K_base is always the last token's (the paper's)
            scores = self.compile_fn(_last_token_scores, *args, cfg=cfg)(*args)
        if roles.pivots:
            kb = int(self.l_base.max())
            _, idx = jax.lax.top_k(scores[:, : len(roles.pivots)], kb)
            self.k_base.append(idx.astype(jnp.int32))
        else:
            self.k_base.append(None)
        if n_comp:
            counts = self.grid[:, li, perm[nf:]]  # [B, Hc]
            T = k_buf.shape[2]
            positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (k_buf.shape[0], n_comp, T))
            if window > 1:
                scores = self.compile_fn(_window_scores, *args, cfg=cfg, window=window)(*args)
            group, _ = select_group(scores[:, nf:], k_buf[:, nf:], v_buf[:, nf:], positions,
                                    jnp.asarray(counts, jnp.int32), int(counts.max()), self.compile_fn)
            # one group per compressed head, each exactly as long as its own budget: heads of a
            # layer get different l_i, and padding them to the longest would hold memory for nothing
            for j in range(counts.shape[1]):
                c = int(counts[:, j].max())
                groups.append(HeadGroup(k=group.k[:, j : j + 1, :c], v=group.v[:, j : j + 1, :c],
                                        positions=group.positions[:, j : j + 1, :c],
                                        lengths=group.lengths[:, j : j + 1]))
            self.counts.append(counts)
        else:
            self.counts.append(np.zeros((len(self.lens), 0), np.int64))
        ns = len(roles.satellites)
        if ns:
            # satellites are the first ns heads of the compressed group
            host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
            rk = jax.device_put(k_buf[:, nf : nf + ns, :t_max], host)
            rv = jax.device_put(v_buf[:, nf : nf + ns, :t_max], host)
            self.reservoir_k.append(rk)
            self.reservoir_v.append(rv)
        else:
            self.reservoir_k.append(None)
            self.reservoir_v.append(None)
        return tuple(groups)

    def host_view(self, li: int) -> tuple[np.ndarray, np.ndarray]:
        """Numpy views (k, v) [B, Ns, T, D] of layer ``li``'s reservoir, made on the first recall.

        Not made in ``build_layer``: ``np.asarray`` waits for the layer's KV, and waiting there
        would stop the host from dispatching the next layers while this one computes (TTFT).
        """
        if li not in self._host_view:
            self._host_view[li] = (np.asarray(self.reservoir_k[li]), np.asarray(self.reservoir_v[li]))
        return self._host_view[li]

    def finish(self, cache: KVCache) -> KVCache:
        layers = tuple(
            lc.replace(aux={"k_base": kb}) if kb is not None else lc for lc, kb in zip(cache.layers, self.k_base)
        )
        return cache.replace(layers=layers)

    def decode_controller(self, compile_fn=None):
        return HeteroDecode(self, compile_fn=compile_fn or self.compile_fn)

    def host_arrays(self) -> tuple:
        """The pinned-host reservoirs (k and v of every layer with satellites)."""
        return tuple(a for a in (*self.reservoir_k, *self.reservoir_v) if a is not None)

    def host_bytes(self) -> int:
        return int(sum(k.nbytes + v.nbytes for k, v in zip(self.reservoir_k, self.reservoir_v) if k is not None))


@functools.partial(jax.jit, static_argnames=("l_base", "tau", "n_top"))
def _drift_layer(q_buf, keys, k_base, lengths, l_base: int, tau: float, n_top: int):
    """One layer's drift check: q_buf [B, Np, W, G, D]; keys [B, Np, T, D]; k_base [B, Np, l_base].

    Returns (drift [B, Np] bool, new K_base [B, Np, l_base], top-n_top positions of the latest
    pooled scores, best first [B, Np, n_top]; zeros when no pivot drifted, or when ``n_top`` is 0,
    i.e. the recall does not use them).
    """
    drift, latest_idx, latest_scores = pallas_kernels.drift_check(q_buf, keys, k_base, l_base, tau, lengths)
    top_shape = latest_scores.shape[:-1] + (n_top,)
    if n_top == 0:
        top = jnp.zeros(top_shape, jnp.int32)
    else:
        # a top-k over the whole prompt costs about as much as the check itself at long contexts, and
        # its rows are read only for a drifted pivot: skip it (lax.cond runs one branch) otherwise
        top = jax.lax.cond(drift.any(), lambda s: jax.lax.top_k(s, n_top)[1].astype(jnp.int32),
                           lambda s: jnp.zeros(top_shape, jnp.int32), latest_scores)
    return drift, latest_idx.astype(jnp.int32), top


def check_phases(pivots_per_layer: list[int], window: int, stagger: bool) -> np.ndarray:
    """Phase in [0, window) of each layer's drift checks: [num_layers] int.

    Layer l is checked at the decode steps n = phase[l] + k * window, k >= 1, counted from prefill
    (after a session's question see ``HeteroDecode.end_of_chunk``), so each pivot is still checked
    every ``window`` steps on its last ``window`` queries. ``stagger``: layers with pivots go, in order, to the phase with the
    fewest pivots so far (ties: the lowest phase), so each step checks about 1/window of the pivots
    instead of all of them every ``window`` steps (a latency spike); otherwise every phase is 0.
    """
    phase = np.zeros(len(pivots_per_layer), np.int64)
    if not stagger:
        return phase
    load = np.zeros(window, np.int64)
    for li, n in enumerate(pivots_per_layer):
        if n:
            phase[li] = int(np.argmin(load))
            load[phase[li]] += n
    return phase


def host_pooled_scores(q_rows: np.ndarray, keys: np.ndarray, length: int, pool_kernel: int = 5) -> np.ndarray:
    """Pooled attention of one KV head on the host: q_rows [G, D], keys [T, D] -> [length] float32.

    softmax(q K^T / sqrt(D)) in float32 over the first ``length`` keys, average
    pooling (kernel 5, zero padding, divide by 5), GQA max: the scoring of
    ``pallas_kernels.pooled_scores``, computed where the reservoir lives.
    """
    k = np.asarray(keys[:length], np.float32)
    logits = np.asarray(q_rows, np.float32) @ k.T / np.float32(np.sqrt(k.shape[-1]))  # [G, length]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    half = pool_kernel // 2
    padded = np.pad(probs, ((0, 0), (half, half)))
    pooled = sum(padded[:, i : i + length] for i in range(pool_kernel)) / np.float32(pool_kernel)
    return pooled.max(0)


def top_positions(scores: np.ndarray, k: int) -> np.ndarray:
    """Positions of the k highest scores (ties: lower position first), any order: [k]."""
    order = np.argsort(-scores, kind="stable")
    return order[:k]


class HeteroDecode:
    """Per-request decode-time state of HeteroCache: query buffer, pending checks, recall stats."""

    def __init__(self, plan: HeteroPrefill, compile_fn=None):
        self.plan = plan
        self.policy = plan.policy
        self.compile_fn = compile_fn or (lambda f, *a, **st: functools.partial(f, **st))
        # the last `window` steps: tuples over layers of pivot queries [B, Np, G, D] (device)
        self.buffer: collections.deque = collections.deque(maxlen=plan.policy.window)
        self.pivot_layers = [li for li, r in enumerate(plan.roles) if r.pivots]
        self.phase = check_phases([len(r.pivots) for r in plan.roles], plan.policy.window,
                                  plan.policy.stagger_checks)
        # per layer: steps buffered since its last check; a layer is due at `window`. Starting at
        # -phase delays a layer's first check by its phase, which keeps the layers staggered.
        self.since = -self.phase
        # a session's question re-synchronises the layers for one check W steps into the answer
        self.resync = np.zeros(len(plan.roles), bool)
        self.pending = None  # (step, per layer check outputs, per layer satellite queries) of a dispatched check
        self.checks = 0  # pivot checks run (pivots x checks)
        self.triggers = 0  # pivot checks that drifted
        self.recalls = 0  # satellite heads refreshed
        self.bytes_recalled = 0
        self.bytes_scored = 0  # reservoir key bytes read on the host to score satellites (recall="own")
        self.recall_failures = 0  # recalls dropped because their transfer failed (see before_step)
        self.recall_steps: list[int] = []
        self.last_queries = None  # every head's query rows of the latest step (for recall="own")

    @property
    def wants_queries(self) -> bool:
        return True

    def after_step(self, step: int, queries, cache: KVCache) -> None:
        """Buffer the pivots' queries of decode step ``step``; dispatch the checks of the layers now due."""
        self.buffer.append(tuple(q[:, : len(r.pivots)] if r.pivots else None
                                 for q, r in zip(queries, self.plan.roles)))
        self.last_queries = queries
        self.since += 1
        due = [li for li in self.pivot_layers if self.since[li] >= self.policy.window]
        if due:
            self._dispatch_check(step, cache, due)

    def end_of_chunk(self, step: int, cache: KVCache) -> None:
        """An extension chunk (a session's question) was appended: check every pivot layer now, on the
        last ``window`` steps' queries, so a drift the question causes is recalled before the answer's
        second token instead of up to ``window`` steps into it.

        Then every layer is checked again ``window`` steps into the answer, all on the same step, and
        only after that goes back to its phase. The question's last steps are chat-template tokens,
        whose queries say little about the question; the answer's first tokens restate it, and a
        recall from them must land before the answer needs the fact. Staggering that re-check by up to
        ``window - 1`` more steps lost facts on SmolLM2 (tests/test_session_smollm2.py)."""
        checked = self._pending_layers(step)
        due = [li for li in self.pivot_layers if li not in checked]
        if due:
            self._dispatch_check(step, cache, due)
        self.since[:] = 0
        self.resync[:] = True

    def _pending_layers(self, step: int) -> set[int]:
        """Layers whose check was dispatched at ``step`` and not applied yet."""
        if self.pending is None or self.pending[0] != step:
            return set()
        return {li for li, out in enumerate(self.pending[1]) if out is not None}

    def _dispatch_check(self, step: int, cache: KVCache, layers: list[int]) -> None:
        """Dispatch the drift check of ``layers`` on the buffered steps (merged into a check already
        dispatched at this step); outputs are copied to the host asynchronously, read next step."""
        n_layers = len(self.plan.roles)
        if self.pending is not None and self.pending[0] == step:
            _, outs, sat_queries = self.pending
        else:
            outs, sat_queries = [None] * n_layers, [None] * n_layers
        queries = self.last_queries
        l_base = int(self.plan.l_base.max())
        for li in layers:
            r = self.plan.roles[li]
            q_buf = jnp.stack([b[li] for b in self.buffer], axis=2)  # [B, Np, W, G, D] (W <= window)
            g = cache.layers[li].groups[0]
            np_ = len(r.pivots)
            counts = self.plan.counts[li]
            n_top = max(1, int(counts.max())) if counts.size else 1
            args = (q_buf, g.k[:, :np_], cache.layers[li].aux["k_base"], g.lengths[:, :np_])
            if self.policy.recall != "pivot":  # the satellites rank their own rows on the host
                n_top = 0
            fn = self.compile_fn(_drift_layer, *args, l_base=l_base, tau=self.policy.drift_threshold,
                                 n_top=min(n_top, g.capacity))
            out = fn(*args)
            for a in out:
                a.copy_to_host_async()  # read before the next step is dispatched, never waited on now
            outs[li] = out
            if self.policy.recall == "own" and r.satellites:  # the satellites' own latest query rows
                qs = queries[li][:, r.n_full : r.n_full + len(r.satellites)]
                qs.copy_to_host_async()
                sat_queries[li] = qs
            # back to its phase after the re-synchronised check that follows a question
            self.since[li] = -self.phase[li] if self.resync[li] else 0
            self.resync[li] = False
        self.pending = (step, outs, sat_queries)

    def before_step(self, step: int, cache: KVCache) -> KVCache:
        """Apply the previous check's recalls (one step after it ran), all or nothing.

        A recall whose host -> device transfer fails (a RuntimeError from ``jax.device_put``, e.g. out of
        device memory) leaves the cache and the recall stats as they were, with a RuntimeWarning:
        the recall is an accuracy aid, and decoding (a session's turn) goes on without it. K_base is
        kept too, so the next check sees the drift again and retries the recall.
        """
        if self.pending is None:
            return cache
        saved = (self.checks, self.triggers, self.recalls, self.bytes_recalled, self.bytes_scored,
                 len(self.recall_steps))
        try:
            return self._apply_recalls(step, cache)
        except (RuntimeError, MemoryError) as e:
            (self.checks, self.triggers, self.recalls, self.bytes_recalled, self.bytes_scored, n) = saved
            del self.recall_steps[n:]
            self.recall_failures += 1
            warnings.warn(f"HeteroCache: the recall at decode step {step} failed ({type(e).__name__}: {e}); the "
                          "device cache is unchanged and the drift will be checked again", RuntimeWarning,
                          stacklevel=2)
            return cache

    def _apply_recalls(self, step: int, cache: KVCache) -> KVCache:
        _, outs, sat_queries = self.pending
        self.pending = None
        layers = list(cache.layers)
        for li, out in enumerate(outs):
            if out is None:
                continue
            drift, new_base, top = (np.asarray(a) for a in out)
            r = self.plan.roles[li]
            self.checks += drift.size
            self.triggers += int(drift.sum())
            if not drift.any():
                continue
            lc = layers[li]
            groups = list(lc.groups)
            first_comp = 1 if r.n_full else 0  # compressed head j lives in groups[first_comp + j]
            kv_view_k, kv_view_v = self.plan.host_view(li)
            counts = self.plan.counts[li]  # [B, Hc]
            base = np.asarray(lc.aux["k_base"]).copy()
            edits: dict[int, tuple] = {}
            for b, p in zip(*np.nonzero(drift)):
                for s in r.members.get(int(p), []):
                    gi = first_comp + s
                    if gi not in edits:
                        g = groups[gi]
                        edits[gi] = (np.asarray(g.k).copy(), np.asarray(g.v).copy(), np.asarray(g.positions).copy())
                    k_new, v_new, pos_new = edits[gi]
                    l_s = int(counts[b, s])
                    res = r.satellites.index(s)  # reservoir index of this satellite
                    if self.policy.recall == "pivot":
                        pos = np.sort(top[b, p, :l_s])
                    else:
                        own = host_pooled_scores(np.asarray(sat_queries[li][b, res]), kv_view_k[b, res],
                                                 int(self.plan.lens[b]))
                        pos = np.sort(top_positions(own, l_s))
                        self.bytes_scored += int(self.plan.lens[b]) * kv_view_k.shape[-1] * kv_view_k.dtype.itemsize
                    k_new[b, 0, :l_s] = kv_view_k[b, res, pos]
                    v_new[b, 0, :l_s] = kv_view_v[b, res, pos]
                    pos_new[b, 0, :l_s] = pos
                    self.recalls += 1
                    self.bytes_recalled += 2 * l_s * k_new.shape[-1] * k_new.dtype.itemsize
                base[b, p] = new_base[b, p]
            for gi, (k_new, v_new, pos_new) in edits.items():  # asynchronous host -> device copies
                groups[gi] = groups[gi].replace(k=jax.device_put(k_new), v=jax.device_put(v_new),
                                                positions=jax.device_put(pos_new))
            aux = dict(lc.aux)
            aux["k_base"] = jax.device_put(base)
            layers[li] = lc.replace(groups=tuple(groups), aux=aux)
            self.recall_steps.append(step)
        return cache.replace(layers=tuple(layers))

    def stats(self) -> dict:
        return {
            "drift_checks": self.checks,
            "drift_triggers": self.triggers,
            "trigger_rate": self.triggers / self.checks if self.checks else 0.0,
            "recalls": self.recalls,
            "bytes_recalled": self.bytes_recalled,
            "bytes_scored_on_host": self.bytes_scored,
            "recall_failures": self.recall_failures,
        }
