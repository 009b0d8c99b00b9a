"""ContextKeeper's offline head ranking (paper §3.2-3.3): file format and calibration.

Score of a KV head on one sample (paper Eq. 1, prefill part only): the attention mass that the last
``window`` prompt queries put on the prompt's middle, the tokens ``[sink, T - recent)``, averaged
over those rows and over the head's query heads (GQA mean, paper §3.3). Per sample and layer the
top ``top_p`` share of heads (``max(1, round(top_p * Hkv))``) get a vote (paper §3.2, "candidates").

Ranking (global over layers): most votes first, then the larger mean score, ties to the lower
(layer, head). At request time ContextKeeper keeps the full KV for a prefix of this order, as long as
the budget allows.

Our departures, all recorded in the file's ``settings``:
- no decoding rows (the paper's V_x, first K decode steps): the paper does not give K, and the
  prefill window alone is what the issue asks for; ``decode_steps`` is recorded as 0;
- one task (plain text windows), so the task consensus reduces to the sample votes;
- the paper's consensus thresholds are not applied: the budget picks how many heads stay full.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hetero_jax.io.files import write_text
from hetero_jax.profile.schema import ProfileError
from hetero_jax.profile.shipped import shipped_data_path, shipped_fitting

FORMAT_NAME = "hetero-jax-contextkeeper-ranking"
SCHEMA_VERSION = 1
SHIPPED_RANKINGS = {"smollm2-135m": "smollm2-135m.contextkeeper.json"}

DEFAULT_SINK = 128  # paper Table 1
DEFAULT_RECENT = 256  # paper Table 1
DEFAULT_WINDOW = 32  # last prompt rows scored (ours: the paper gives no m; the project's SnapKV window)
DEFAULT_TOP_P = 0.65  # paper Table 1, Llama-3.1 range 60-70%


@dataclasses.dataclass(frozen=True, eq=False)
class CARanking:
    """Per KV head of a model: mean middle-mass score and votes over the calibration samples."""

    scores: np.ndarray  # [layers, KV heads] float64
    votes: np.ndarray  # [layers, KV heads] int64
    model: str = ""
    architecture: str | None = None
    head_dim: int | None = None
    settings: dict = dataclasses.field(default_factory=dict)
    weights_fingerprint: str | None = None  # format.weights_fingerprint of the calibrated weights

    def __post_init__(self):
        s = np.asarray(self.scores, np.float64)
        v = np.asarray(self.votes, np.int64)
        if s.ndim != 2 or s.size == 0 or v.shape != s.shape:
            raise ProfileError(f"ContextKeeper ranking: scores {s.shape} and votes {v.shape} must be the same "
                               "non-empty [layers, KV heads] grid")
        if not np.isfinite(s).all() or (v < 0).any():
            raise ProfileError("ContextKeeper ranking: scores must be finite and votes >= 0")
        object.__setattr__(self, "scores", s)
        object.__setattr__(self, "votes", v)

    @property
    def shape(self) -> tuple[int, int]:
        return self.scores.shape

    def order(self) -> np.ndarray:
        """[layers * KV heads, 2] (layer, head) best first: votes, then score, then lower (layer, head)."""
        n_l, n_h = self.shape
        layer, head = np.divmod(np.arange(n_l * n_h), n_h)
        idx = np.lexsort((head, layer, -self.scores.ravel(), -self.votes.ravel()))
        return np.stack([layer[idx], head[idx]], axis=1)

    def rank(self) -> np.ndarray:
        """[layers, KV heads] global rank of each head (0 = kept full first)."""
        r = np.empty(self.scores.size, np.int64)
        o = self.order()
        r[o[:, 0] * self.shape[1] + o[:, 1]] = np.arange(len(o))
        return r.reshape(self.shape)

    def key(self) -> str:
        """A short identity of the order (static jit arguments and layouts compare on it)."""
        import hashlib

        return hashlib.sha256(np.ascontiguousarray(self.order()).tobytes()).hexdigest()[:16]

    def check_compatible(self, cfg: Any, weights_fingerprint: str | None = None) -> None:
        """ProfileError unless this ranking has the model's layers x KV heads (and head_dim when recorded) and,
        both known, was calibrated on weights with the model's fingerprint."""
        want = (int(cfg.num_layers), int(cfg.num_kv_heads))
        hd = getattr(cfg, "head_dim", None)
        if self.shape != want or (self.head_dim is not None and hd is not None and self.head_dim != hd):
            raise ProfileError(
                f"ContextKeeper ranking for {self.model or 'an unnamed model'} has {self.shape[0]} layers x "
                f"{self.shape[1]} KV heads (head_dim {self.head_dim}), but the model has {want[0]} layers x "
                f"{want[1]} KV heads (head_dim {hd}): it was calibrated for another model. Calibrate one for "
                "this model (hetero_jax.policies.contextkeeper.calibrate_ranking, or "
                "`hetero-jax profile --method contextkeeper`) and pass ContextKeeper(ranking=...)")
        if weights_fingerprint and self.weights_fingerprint and weights_fingerprint != self.weights_fingerprint:
            raise ProfileError(
                f"ContextKeeper ranking for {self.model or 'an unnamed model'} was calibrated on weights "
                f"{self.weights_fingerprint}, but the model's weights are {weights_fingerprint} (same shape "
                f"{want[0]} layers x {want[1]} KV heads): it ranks another model's heads. Calibrate one for this "
                "model (`hetero-jax profile --method contextkeeper`) and pass ContextKeeper(ranking=...)")

    # ------------------------------------------------------------------ I/O
    def to_json(self) -> dict:
        return {"format": FORMAT_NAME, "version": SCHEMA_VERSION, "model": self.model,
                "architecture": self.architecture, "head_dim": self.head_dim,
                "num_layers": self.shape[0], "num_kv_heads": self.shape[1], "settings": dict(self.settings),
                "weights_fingerprint": self.weights_fingerprint,
                "scores": [[float(x) for x in row] for row in self.scores],
                "votes": [[int(x) for x in row] for row in self.votes],
                "order": [[int(l), int(h)] for l, h in self.order()]}

    def save(self, path: str | os.PathLike) -> None:
        """Write the ranking JSON, whole or not at all (OutputError for a path that cannot be written)."""
        write_text(path, json.dumps(self.to_json(), indent=1) + "\n", kind=FORMAT_NAME)


def load_ranking(path: str | os.PathLike) -> CARanking:
    """A ranking JSON written by ``CARanking.save``; ProfileError on anything else."""
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except FileNotFoundError:
        raise ProfileError(f"ContextKeeper ranking file {str(path)!r} does not exist") from None
    except (OSError, ValueError) as e:  # ValueError: bad JSON, or a path with a NUL byte
        raise ProfileError(f"ContextKeeper ranking {str(path)!r} is not readable JSON: {e}") from None
    if not isinstance(d, dict) or d.get("format") != FORMAT_NAME or d.get("version") != SCHEMA_VERSION:
        raise ProfileError(f"{str(path)!r} is not a {FORMAT_NAME} v{SCHEMA_VERSION} file")
    try:
        return CARanking(scores=np.array(d["scores"], np.float64), votes=np.array(d["votes"], np.int64),
                         model=str(d.get("model", "")), architecture=d.get("architecture"),
                         head_dim=d.get("head_dim"), settings=dict(d.get("settings") or {}),
                         weights_fingerprint=d.get("weights_fingerprint"))
    except (KeyError, TypeError, ValueError) as e:
        raise ProfileError(f"ContextKeeper ranking {str(path)!r} is malformed: {e}") from None


def model_fingerprint(model) -> str | None:
    """``format.weights_fingerprint`` of a loaded model's params (None for an object without params)."""
    from hetero_jax.profile.shipped import weights_fingerprint

    params = getattr(model, "params", None)
    return weights_fingerprint(params) if params is not None else None


def shipped_ranking_path(model_name: str) -> str | None:
    """Path of the ranking shipped for known model ``model_name``, or None."""
    return shipped_data_path(SHIPPED_RANKINGS, model_name)


def default_ranking(model) -> CARanking | None:
    """The shipped ranking for this model (by its name, else the first whose shape and weights fit), or None."""
    names = [getattr(model, "name", None)] + list(SHIPPED_RANKINGS)
    fp = model_fingerprint(model)
    for name in names:
        found = shipped_fitting([shipped_ranking_path(name) if name else None], load_ranking, model.config, fp)
        if found:
            return found[0]
    return None


# ------------------------------------------------------------------ calibration
@functools.partial(jax.jit, static_argnames=("cfg", "window", "sink", "recent"))
def middle_mass(layer, x_in, keys, prompt_lens, cfg, window: int, sink: int, recent: int):
    """[B, Hkv] float32: attention mass of the last ``window`` prompt queries on ``[sink, T - recent)``,
    averaged over the valid rows and the G query heads of each KV head (paper Eq. 1, prefill rows)."""
    from hetero_jax.model.scoring import observation_window_probs

    probs, valid = observation_window_probs(layer, x_in, keys, prompt_lens, window, cfg)  # [B, H, W, G, Tp]
    t = jnp.arange(keys.shape[2], dtype=jnp.int32)
    mid = (t[None, :] >= sink) & (t[None, :] < (prompt_lens - recent)[:, None])  # [B, Tp]
    mass = jnp.where(mid[:, None, None, None, :], probs, 0.0).sum(-1).mean(-1)  # [B, H, W]
    n = jnp.maximum(valid.sum(axis=1), 1).astype(jnp.float32)
    return (mass * valid[:, None, :]).sum(-1) / n[:, None]


def sample_scores(cfg, params, token_samples: Sequence[Sequence[int]], *, window: int, sink: int,
                  recent: int, progress: bool = False) -> np.ndarray:
    """[samples, layers, KV heads] middle-mass scores, one full-KV prefill per group of equal-length samples
    (``progress``: a bar over those prefills' layers)."""
    from tqdm.auto import tqdm

    from hetero_jax.model import transformer as M
    from hetero_jax.runtime.compile_cache import chunk_bucket, compiled

    out = [None] * len(token_samples)
    by_len: dict[int, list[int]] = {}
    for i, s in enumerate(token_samples):
        if len(s) <= sink + recent:
            raise ProfileError(f"calibration sample {i} has {len(s)} tokens; the middle [sink={sink}, "
                               f"T-recent={recent}) is empty: use samples longer than {sink + recent} tokens")
        by_len.setdefault(len(s), []).append(i)
    bar = tqdm(total=len(by_len) * cfg.num_layers, desc="rank heads", unit="layer", disable=not progress)
    for T, idx in by_len.items():
        C = chunk_bucket(T)
        Tp = -(-T // C) * C
        tokens = np.zeros((len(idx), Tp), np.int32)
        for j, i in enumerate(idx):
            tokens[j, :T] = token_samples[i]
        lens = np.full(len(idx), T, np.int32)
        per_layer = []

        def observe(li, layer, x_in, k_buf, v_buf, lens_d):
            per_layer.append(middle_mass(layer, x_in, k_buf, lens_d, cfg=cfg, window=window, sink=sink,
                                         recent=recent))
            if progress:  # waiting for the layer paces the bar (the prefill runs layer after layer anyway)
                per_layer[-1].block_until_ready()
                bar.update(1)

        M.prefill(params, cfg, tokens, lens, chunk=C, tail_capacity=1, observe=observe, compile_fn=compiled,
                  plan=M.DropKVPlan(lens, cfg.num_layers, cfg.num_kv_heads))
        grid = np.asarray(jnp.stack(per_layer, axis=1), np.float64)  # [b, layers, H]
        for j, i in enumerate(idx):
            out[i] = grid[j]
    bar.close()
    return np.stack(out)


def votes_from_scores(per_sample: np.ndarray, top_p: float) -> np.ndarray:
    """[layers, H] votes: per sample and layer the top max(1, round(top_p * H)) heads (ties: lower head)."""
    S, n_l, n_h = per_sample.shape
    n_top = max(1, min(n_h, int(math.floor(top_p * n_h + 0.5))))
    votes = np.zeros((n_l, n_h), np.int64)
    for s in range(S):
        for l in range(n_l):
            votes[l, np.argsort(-per_sample[s, l], kind="stable")[:n_top]] += 1
    return votes


def calibrate_ranking(model, token_samples: Sequence[Sequence[int]], *, window: int = DEFAULT_WINDOW,
                      sink: int = DEFAULT_SINK, recent: int = DEFAULT_RECENT, top_p: float = DEFAULT_TOP_P,
                      source: str = "", progress: bool = False) -> CARanking:
    """ContextKeeper's ranking of ``model``'s KV heads from token samples (no chat template; ``progress``: a
    bar over the prefills' layers)."""
    cfg = model.config
    if not 0.0 < top_p <= 1.0:
        raise ProfileError(f"top_p must be in (0, 1], got {top_p!r}")
    per_sample = sample_scores(cfg, model.params, token_samples, window=window, sink=sink, recent=recent,
                               progress=progress)
    return CARanking(
        scores=per_sample.mean(axis=0), votes=votes_from_scores(per_sample, top_p),
        model=str(getattr(model, "name", "") or ""), architecture=getattr(cfg, "architecture", None),
        head_dim=int(cfg.head_dim), weights_fingerprint=model_fingerprint(model),
        settings={"sink": sink, "recent": recent, "window": window, "top_p": top_p, "decode_steps": 0,
                  "samples": len(token_samples), "tokens_per_sample": sorted({len(s) for s in token_samples}),
                  "gqa": "mean", "source": source})
