"""Budget allocators: how many prompt tokens each KV head keeps, apart from which ones (``scorers.py``).

An allocator is a frozen, hashable dataclass (a static jit argument, like the policy holding it). Given the
policy's budget rho and the floor of the scorer it is composed with (``scorers.Floor``: no head keeps fewer),
``head_budgets(owner, rho, cfg, prompt_len, floor)`` returns int64 [num_layers, Hkv] tokens per head for one
sequence, raising BudgetError (naming ``owner``, the policy) before any compute; or None when the budgets
follow the prefill (``Cascade``, whose ``shares`` the plan calls layer by layer with the preferences its
traced ``preference`` hook returned). Uniform and pyramid keep exactly round(rho L) tokens per head on
average; the profile's budgets keep rho's model-wide total up to Eq. 8's rounding, the cascade at most it
(it can only cut a layer's candidates), and the ranking of full heads at most rho's total (whole heads).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math

import jax
import jax.numpy as jnp
import numpy as np

from hetero_jax.model.config import ModelConfig
from hetero_jax.model.layout import HeadLayout
from hetero_jax.model.scoring import observation_window_probs
from hetero_jax.policies.base import (BudgetError, PolicyError, check_fields, int_param, real_param, smallest_rho,
                                     tokens_for)
from hetero_jax.policies.scorers import Floor, window_forced, window_moments
from hetero_jax.profile.head_profile import HeadProfile
from hetero_jax.profile.schema import ProfileError
from hetero_jax.water_filling import water_level


def distribute(weights: np.ndarray, total: int, lo: int, hi: int) -> np.ndarray:
    """Integer budgets proportional to ``weights`` with an exact ``total``, each within [lo, hi].

    Water-filling: find c with sum(clip(c * w_j, lo, hi)) = total (bisection;
    the sum is monotone in c), then round by largest remainder (ties to the
    lower index) without leaving [lo, hi].
    """
    w = np.maximum(np.asarray(weights, np.float64), 0.0)
    n = len(w)
    if not lo * n <= total <= hi * n:
        raise ValueError(f"cannot split {total} into {n} parts within [{lo}, {hi}]")
    if not np.isfinite(w).all():  # the rounding below could never settle
        raise ValueError(f"distribute: weights must be finite, got {w.tolist()}")
    if w.sum() == 0:
        w = np.ones(n)
    _, c_hi = water_level(w, total, lo, hi)
    t = np.clip(c_hi * w, lo, hi)
    base = np.clip(np.floor(t + 1e-9), lo, hi).astype(np.int64)
    order = np.lexsort((np.arange(n), -(t - base)))  # largest remainder first, then lower index
    short = total - int(base.sum())
    while short != 0:
        step = 1 if short > 0 else -1
        for j in order if step > 0 else order[::-1]:
            if short != 0 and lo <= base[j] + step <= hi:
                base[j] += step
                short -= step
    return base


def uniform_tokens(owner: str, rho: float, prompt_len: int, floor: Floor) -> int:
    """Tokens per head at budget rho (``tokens_for``); BudgetError naming the smallest rho when under the floor."""
    n = tokens_for(rho, prompt_len)
    need = min(floor.tokens, prompt_len)
    if n < need:
        raise BudgetError(
            f"{owner}: budget rho={rho:g} keeps {n} token(s) per head of a {prompt_len}-token prompt, but it needs "
            f"at least {need} ({floor.reason}); the smallest budget that works for this prompt is "
            f"rho={smallest_rho(need, prompt_len):g}")
    return n


@dataclasses.dataclass(frozen=True)
class Allocator:
    """Base of the allocators: checks the declared fields; no layer preference."""

    def __post_init__(self):
        check_fields(self)

    def head_budgets(self, owner: str, rho: float, cfg: ModelConfig, prompt_len: int,
                     floor: Floor) -> np.ndarray | None:
        """int64 [num_layers, Hkv] tokens per head for one sequence, or None (decided while prefilling)."""
        raise NotImplementedError

    def preference(self, layer, x_in, keys, prompt_lens, cfg: ModelConfig):
        """Traced: a per-sequence preference of this layer [B] float32 that ``shares`` reads, or None."""
        return None


@dataclasses.dataclass(frozen=True)
class Uniform(Allocator):
    """Every head of every layer keeps round(rho * L) tokens."""

    def head_budgets(self, owner, rho, cfg, prompt_len, floor):
        n = uniform_tokens(owner, rho, prompt_len, floor)
        return np.full((cfg.num_layers, cfg.num_kv_heads), n, np.int64)


@dataclasses.dataclass(frozen=True)
class Pyramid(Allocator):
    """PyramidKV: per-layer budgets falling linearly with depth, the uniform total kept (every head of a layer
    alike). Of the average share beyond the floor, s, the last layer gets s / ``beta`` and the first 2s - s / beta
    (PyramidKV's rule): the first layer's share is 2 beta - 1 times the last's (3x at beta = 2)."""

    beta: float = real_param(20.0, 1.0, lo_open=False)  # the average share / the last layer's; 1 = flat

    def head_budgets(self, owner, rho, cfg, prompt_len, floor):
        n = uniform_tokens(owner, rho, prompt_len, floor)
        L = cfg.num_layers
        w = min(floor.tokens, prompt_len)
        sel = n - w  # selectable tokens per head beyond the floor, on average
        lo_sel = sel / self.beta
        hi_sel = 2 * sel - lo_sel
        steps = np.arange(L) / max(L - 1, 1)
        per_layer = distribute(w + hi_sel - (hi_sel - lo_sel) * steps, n * L, lo=w, hi=prompt_len)
        return np.repeat(per_layer[:, None], cfg.num_kv_heads, axis=1)


@dataclasses.dataclass(frozen=True)
class Cascade(Allocator):
    """CAKE: layer budgets from a preference P_l = entropy^(1/tau1) x variance^(1/tau2) of the last ``window``
    prompt queries' mean attention over the prefix (per head, averaged), decided while prefilling layer by
    layer (``shares``). P_l is carried as log P_l: only the layers' ratios count, and a small tau raises
    entropy and variance to powers that overflow (tau1 = 0.01 gave inf, and NaN shares)."""

    window: int = int_param(32, 1, " (prompt queries in the observation window)")
    tau1: float = real_param(1.0, 0.0)
    tau2: float = real_param(1.0, 0.0)

    def head_budgets(self, owner, rho, cfg, prompt_len, floor):
        uniform_tokens(owner, rho, prompt_len, floor)  # the mean it shares out must clear the floor
        return None

    def preference(self, layer, x_in, keys, prompt_lens, cfg):
        probs, _ = observation_window_probs(layer, x_in, keys, prompt_lens, self.window, cfg)
        prefix = ~window_forced(prompt_lens, keys.shape[2], self.window)
        mean, var = window_moments(probs, prefix, prompt_lens, self.window)
        dist = mean / jnp.maximum(mean.sum(axis=-1, keepdims=True), 1e-30)
        entropy = -(dist * jnp.log(jnp.maximum(dist, 1e-30))).sum(axis=-1)  # [B, Hkv, G]
        variance = var.sum(axis=-1)
        log_pref = (jnp.log(jnp.maximum(entropy, 1e-12)) / self.tau1
                    + jnp.log(jnp.maximum(variance, 1e-12)) / self.tau2)  # [B, Hkv, G]
        heads = log_pref.shape[1] * log_pref.shape[2]
        return jax.nn.logsumexp(log_pref, axis=(1, 2)) - jnp.log(heads)  # log of the heads' mean P

    def shares(self, prefs, n: int, prompt_len: int, floor: int) -> tuple[np.ndarray, np.ndarray]:
        """The cascade for one sequence keeping n tokens per head on average.

        prefs: [k] log preferences (``preference``) of the layers prefilled so far. After step l the total
        n * (l + 1) is split among layers 0..l in proportion to P_0..P_l, each share within [min(floor, L), L]
        (excess water-filled into the others, integers by largest remainder). Returns (own [k]: candidates layer
        j keeps at its own step j, final [k]: the smallest share layer j was given over steps j..k-1).
        """
        log_p = np.asarray(prefs, np.float64)
        k = len(log_p)
        w = min(floor, prompt_len)
        own = np.zeros(k, np.int64)
        final = np.full(k, np.iinfo(np.int64).max)
        for l in range(k):
            ratios = np.exp(log_p[: l + 1] - log_p[: l + 1].max())  # P_j / max P: in (0, 1], never inf
            alloc = distribute(ratios, n * (l + 1), lo=w, hi=prompt_len)
            own[l] = alloc[l]
            final[: l + 1] = np.minimum(final[: l + 1], alloc)
        return own, final


def profile_key(profile: HeadProfile | None) -> str:
    """A short hash of the roles, weights and clusters: what makes two bound policies compile differently."""
    if profile is None:
        return ""
    h = hashlib.sha256(np.ascontiguousarray(profile.roles).tobytes())
    h.update(np.nan_to_num(np.asarray(profile.weights, np.float64), nan=-1.0).tobytes())
    h.update(repr(profile.clusters).encode())
    return h.hexdigest()[:16]


def profile_grid(owner: str, profile: HeadProfile, rho: float, prompt_len: int) -> tuple[np.ndarray, int]:
    """(tokens per KV head [L, H] in original order, L_base as an int) for one prompt (Eq. 7-8): full heads
    (pivots, volatiles) keep the prompt, compressed heads a weighted share; BudgetError naming ``owner``."""
    from hetero_jax.profile.clustering import base_budget

    if profile.n_compressed == 0:  # every head keeps its full KV: nothing to budget
        if rho < 1.0:  # it would keep rho = 1, far above the request
            raise BudgetError(
                f"{owner}: budget rho={rho:g} cannot be kept: the profile has no compressed heads "
                "(every head is a pivot or volatile and keeps its full KV); the smallest rho that works "
                "is 1 (use budget=1.0, or a profile with compressed heads)")
        return np.full(profile.roles.shape, prompt_len, np.int64), prompt_len
    try:
        grid = profile.budgets(rho, prompt_len)
        n_comp = profile.n_compressed
        l_base = base_budget(rho, profile.roles.size, profile.roles.size - n_comp, n_comp, prompt_len)
    except ValueError as e:
        raise BudgetError(f"{owner}: {e}") from None
    return grid, int(max(1, min(prompt_len, np.floor(l_base))))


@dataclasses.dataclass(frozen=True)
class ProfileBudgets(Allocator):
    """The profile's per-head budgets (Eq. 7-8): full heads keep the prompt, compressed heads a share of the
    rest in proportion to their weights; every head at least the scorer's floor."""

    profile: HeadProfile = dataclasses.field(compare=False, hash=False, repr=False)
    key: str = dataclasses.field(default="", init=False)  # the profile's hash: what jit compares

    def __post_init__(self):
        if not isinstance(self.profile, HeadProfile):
            raise ProfileError(f"ProfileBudgets: profile must be a HeadProfile (load_profile('profile.json')), "
                               f"got {type(self.profile).__name__}")
        object.__setattr__(self, "key", profile_key(self.profile))

    def head_budgets(self, owner, rho, cfg, prompt_len, floor):
        self.profile.check_compatible(cfg)
        grid, _ = profile_grid(owner, self.profile, rho, prompt_len)
        need = min(floor.tokens, prompt_len)
        if grid.min() < need:
            raise BudgetError(
                f"{owner}: budget rho={rho:g} gives a compressed head {int(grid.min())} token(s) of a "
                f"{prompt_len}-token prompt, but every head needs at least {need} ({floor.reason}); the smallest "
                f"budget that works for this prompt is rho={self.smallest_rho(rho, prompt_len, need):g}")
        return grid

    def smallest_rho(self, rho: float, prompt_len: int, need: int) -> float:
        """Smallest rho (4 decimals) above ``rho`` whose smallest head budget reaches ``need`` (bisection: the
        Eq. 7-8 budgets grow with rho; rho = 1 keeps every token)."""
        def ok(k: int) -> bool:
            try:
                return int(profile_grid("", self.profile, k / 1e4, prompt_len)[0].min()) >= need
            except BudgetError:
                return False

        lo, hi = int(round(rho * 1e4)), 10_000  # lo fails, hi works
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if ok(mid) else (mid, hi)
        return hi / 1e4


@dataclasses.dataclass(frozen=True)
class RankedFull(Allocator):
    """ContextKeeper's rule: the first N_full heads of a global ranking keep the whole prompt, every other head
    c = min(L, sink + recent) tokens (StreamingLLM's sinks + recent), N_full the largest count with
    ``N_full L + (N - N_full) c <= rho N L`` (N = layers x KV heads: the B1 rule solved for whole heads).

    ``ranking``: a ``contextkeeper.CARanking`` (``order()``, ``rank()``, ``key()``, ``check_compatible``).
    Budgets are in the order of :meth:`layout`, each layer's heads in ranking order, so the full heads of a
    layer are a prefix of it for every prompt length.

    Heads become full in :meth:`order`: every layer's best-ranked head first, then the rest in ranking order
    (ours: the paper takes a global prefix of the ranking). A layer without a full head keeps only sinks and
    recent tokens in every head, and on SmolLM2 (3 KV heads a layer) the global prefix at rho 0.5 left 8 of
    30 layers so and lost every multi-turn fact (RESULTS ``contextkeeper-layer-floor``).
    """

    ranking: object = dataclasses.field(compare=False, hash=False, repr=False)
    sink: int = int_param(128, 0)  # the paper's Table 1 (ContextKeeper's defaults)
    recent: int = int_param(256, 1)
    key: str = dataclasses.field(default="", init=False)  # the ranking's order hash: what jit compares

    def __post_init__(self):
        super().__post_init__()
        if not all(callable(getattr(self.ranking, m, None)) for m in ("order", "rank", "key", "check_compatible")):
            raise PolicyError(f"RankedFull: ranking must be a CARanking (policies.contextkeeper.load_ranking("
                              f"'ranking.json')), got {type(self.ranking).__name__}")
        object.__setattr__(self, "key", self.ranking.key())

    def compressed(self, prompt_len: int) -> int:
        """Tokens a head outside the full ones keeps: sink + recent, or the whole of a shorter prompt."""
        return min(prompt_len, self.sink + self.recent)

    def _fits(self, rho: float, n_full: int, n: int, prompt_len: int) -> bool:
        c = self.compressed(prompt_len)
        return n_full * prompt_len + (n - n_full) * c <= rho * n * prompt_len * (1 + 1e-12)

    def min_rho(self, prompt_len: int, n: int = 1) -> float:
        """Smallest rho (4 decimals, rounded up) at which no head keeps everything: min(L, s + r) / L."""
        c = self.compressed(prompt_len)
        rho = math.ceil(c / prompt_len * 1e4 - 1e-6) / 1e4
        while not self._fits(rho, 0, n, prompt_len):
            rho = round(rho + 1e-4, 4)
        return min(rho, 1.0)

    def _message(self, owner: str, rho: float, prompt_len: int, rho_min: float) -> str:
        return (f"{owner}: budget rho={rho:g} cannot be kept for a {prompt_len}-token prompt: every head keeps at "
                f"least sink + recent = {self.sink}+{self.recent} tokens (or the whole prompt when shorter); the "
                f"smallest rho that works for this prompt is rho={rho_min:g}")

    def n_full(self, owner: str, rho: float, cfg: ModelConfig, prompt_len: int) -> int:
        """Heads (model-wide, in ranking order) that keep the whole prompt at budget rho; BudgetError naming
        ``owner`` and the smallest rho if even none fits."""
        n = cfg.num_layers * cfg.num_kv_heads
        c = self.compressed(prompt_len)
        if c == prompt_len:  # a compressed head would keep the whole prompt too
            if not self._fits(rho, n, n, prompt_len):
                raise BudgetError(self._message(owner, rho, prompt_len, 1.0))
            return n
        if not self._fits(rho, 0, n, prompt_len):
            raise BudgetError(self._message(owner, rho, prompt_len, self.min_rho(prompt_len, n)))
        nf = int(math.floor((rho * n * prompt_len - n * c) / (prompt_len - c) + 1e-9))
        nf = max(0, min(n, nf))
        while nf < n and self._fits(rho, nf + 1, n, prompt_len):
            nf += 1
        while nf > 0 and not self._fits(rho, nf, n, prompt_len):
            nf -= 1
        return nf

    def order(self) -> np.ndarray:
        """[layers * KV heads, 2] (layer, head) in the order heads keep the whole prompt: the best-ranked head of
        each layer (those in ranking order), then every other head in ranking order."""
        rank = self.ranking.order()
        first = np.zeros(len(rank), bool)
        _, idx = np.unique(rank[:, 0], return_index=True)  # each layer's first appearance in the ranking
        first[idx] = True
        return np.concatenate([rank[first], rank[~first]])

    def full_per_layer(self, n_full: int, cfg: ModelConfig) -> np.ndarray:
        """[layers] int64: how many of each layer's heads are among the first ``n_full`` of :meth:`order`."""
        top = self.order()[:n_full]
        return np.bincount(top[:, 0], minlength=cfg.num_layers).astype(np.int64)

    def layout(self, cfg: ModelConfig) -> HeadLayout:
        """Each layer's KV heads in ranking order (the split into full and compressed heads is per prompt)."""
        rank = self.ranking.rank()
        return HeadLayout.from_orders(np.argsort(rank[l], kind="stable") for l in range(cfg.num_layers))

    def head_budgets(self, owner, rho, cfg, prompt_len, floor):
        self.ranking.check_compatible(cfg)
        c, need = self.compressed(prompt_len), min(floor.tokens, prompt_len)
        if c < need:  # a scorer needing more than sink + recent (SinksRecent(sink) never does)
            raise PolicyError(f"{owner}: a compressed head keeps sink + recent = {self.sink}+{self.recent} "
                              f"token(s), but the scorer needs {need} ({floor.reason}); raise recent")
        per_layer = self.full_per_layer(self.n_full(owner, rho, cfg, prompt_len), cfg)
        slots = np.arange(cfg.num_kv_heads)
        return np.where(slots[None, :] < per_layer[:, None], prompt_len, c).astype(np.int64)


ALLOCATORS = (Uniform, Pyramid, Cascade, ProfileBudgets, RankedFull)
