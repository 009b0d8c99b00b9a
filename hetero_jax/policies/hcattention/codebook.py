"""HCAttention's offline key codebook (paper §3.1, §4.1): file format, k-means, training on a model.

Every post-RoPE key k [D] is cut into g = D / d contiguous sub-vectors of d dims. One codebook of c
centroids [c, d] per layer is shared by the layer's KV heads and by the g groups (the paper's default;
its Table 4b marks separate per-group codebooks with "*"). A key is stored as its g codes: the index of
the nearest centroid of each sub-vector.

Training (ours, numpy only, no scikit-learn): per layer, the sub-vectors of the keys of full-KV
prefills of calibration windows; k-means++ seeding (one candidate per step, ``numpy`` rng seeded
with ``seed``) on at most ``init_sample`` sub-vectors, then ``steps`` mini-batch updates of
``batch`` sub-vectors each with a per-centroid learning rate 1 / (points seen) (Sculley 2010, the
update of scikit-learn's MiniBatchKMeans, without its reassignment of rarely hit centroids). The
paper used MiniBatchKMeans with batch 10,000 and 200 iterations over 3 samples.

File (``.npz``, ``allow_pickle=False``): ``centroids`` [layers, c, d] (float16 by default) and
``meta``, a JSON string with the format name and version, the model's name, architecture, shape and
weights fingerprint, and the training settings. A codebook whose shape or fingerprint does not match
the model is refused (:meth:`KeyCodebook.check_compatible`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
import zipfile
import zlib
from typing import Any, Sequence

import numpy as np

from hetero_jax.dims import axis_size
from hetero_jax.io.files import atomic_path
from hetero_jax.profile.schema import ProfileError, read_int, read_mapping, read_str
from hetero_jax.profile.shipped import shipped_data_path, shipped_fitting

FORMAT_NAME = "hetero-jax-hcattention-codebook"
SCHEMA_VERSION = 1
# model -> shipped codebook files (one per group count g); see README "HCAttention"
SHIPPED_CODEBOOKS = {"smollm2-135m": ("smollm2-135m.hcattention-g16.npz", "smollm2-135m.hcattention-g32.npz")}
MAX_CODES = 32767  # codes are int16

DEFAULT_BATCH = 10_000  # paper §4.1
DEFAULT_STEPS = 200  # paper §4.1 ("200 iterations"; here mini-batch steps)
DEFAULT_INIT_SAMPLE = 20_000


@dataclasses.dataclass(frozen=True, eq=False)
class KeyCodebook:
    """Per layer, c centroids of d-dim key sub-vectors: ``centroids`` [layers, c, d]."""

    centroids: np.ndarray
    model: str = ""
    architecture: str | None = None
    head_dim: int | None = None
    num_kv_heads: int | None = None
    weights_fingerprint: str | None = None
    settings: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        c = np.asarray(self.centroids)
        if c.ndim != 3 or 0 in c.shape or c.dtype.kind != "f":
            raise ProfileError(f"HCAttention codebook: centroids must be a non-empty float [layers, c, d] array, "
                               f"got {c.dtype} {c.shape}")
        if not np.isfinite(c.astype(np.float32)).all():
            raise ProfileError("HCAttention codebook: centroids must be finite")
        if c.shape[1] > MAX_CODES:
            raise ProfileError(f"HCAttention codebook: c={c.shape[1]} centroids do not fit int16 codes (at most "
                               f"{MAX_CODES})")
        read_int(self.head_dim, "HCAttention codebook: head_dim", minimum=1, fix=None)
        read_int(self.num_kv_heads, "HCAttention codebook: num_kv_heads", minimum=1, fix=None)
        if self.head_dim is not None and self.head_dim % c.shape[2]:
            raise ProfileError(f"HCAttention codebook: sub-vector dim {c.shape[2]} does not divide head_dim "
                               f"{self.head_dim}")
        object.__setattr__(self, "centroids", c)

    num_layers = axis_size("centroids", 0, "layers the codebook covers")
    size = axis_size("centroids", 1, "c, the centroids per layer")
    sub_dim = axis_size("centroids", 2, "d, the dims of one sub-vector")

    def groups(self, head_dim: int) -> int:
        """g = head_dim / d sub-vectors (codes) per key."""
        return head_dim // self.sub_dim

    def layer_bytes(self) -> int:
        """Device bytes of one layer's codebook (as stored)."""
        return self.size * self.sub_dim * self.centroids.dtype.itemsize

    def key(self) -> str:
        """A short identity of the centroids (policies compare and hash on it)."""
        h = hashlib.sha256(str((self.centroids.shape, self.centroids.dtype.str)).encode())
        h.update(np.ascontiguousarray(self.centroids).tobytes())
        return h.hexdigest()[:16]

    def describe(self) -> str:
        return f"{self.model or 'unnamed model'}, c={self.size}, d={self.sub_dim}"

    def check_compatible(self, cfg: Any, weights_fingerprint: str | None = None) -> None:
        """ProfileError unless this codebook fits the model: its layers, a sub-vector dim dividing head_dim,
        the recorded head_dim / KV heads, and (both known) the weights fingerprint."""
        D, n_l = int(cfg.head_dim), int(cfg.num_layers)
        problems = []
        if self.num_layers != n_l:
            problems.append(f"{self.num_layers} layers (the model has {n_l})")
        if D % self.sub_dim:
            problems.append(f"sub-vectors of {self.sub_dim} dims (the model's head_dim {D} is not a multiple)")
        if self.head_dim is not None and self.head_dim != D:
            problems.append(f"head_dim {self.head_dim} (the model has {D})")
        hkv = getattr(cfg, "num_kv_heads", None)
        if self.num_kv_heads is not None and hkv is not None and self.num_kv_heads != hkv:
            problems.append(f"{self.num_kv_heads} KV heads (the model has {hkv})")
        if (not problems and weights_fingerprint and self.weights_fingerprint
                and weights_fingerprint != self.weights_fingerprint):
            problems.append(f"weights fingerprint {self.weights_fingerprint} (the model's is {weights_fingerprint})")
        if problems:
            raise ProfileError(
                f"HCAttention codebook ({self.describe()}) was trained for another model: " + "; ".join(problems)
                + ". Train one for this model with `hetero-jax profile --method hcattention --model M --data FILE "
                "--out codebook.npz` and pass HCAttention(codebook='codebook.npz')")

    # ------------------------------------------------------------------ I/O
    def meta(self) -> dict:
        return {"format": FORMAT_NAME, "version": SCHEMA_VERSION, "model": self.model,
                "architecture": self.architecture, "head_dim": self.head_dim, "num_kv_heads": self.num_kv_heads,
                "num_layers": self.num_layers, "size": self.size, "sub_dim": self.sub_dim,
                "weights_fingerprint": self.weights_fingerprint, "settings": dict(self.settings)}

    def save(self, path: str | os.PathLike) -> str:
        """Write the ``.npz`` to :func:`npz_path` of ``path`` (``.npz`` added when it lacks it, as numpy does),
        whole or not at all (OutputError for a path that cannot be written); returns the path written."""
        out = npz_path(path)
        with atomic_path(out, kind=FORMAT_NAME) as tmp:  # tmp ends in .npz, so numpy adds nothing
            np.savez_compressed(tmp, centroids=self.centroids, meta=np.array(json.dumps(self.meta())))
        return out


def npz_path(path: str | os.PathLike) -> str:
    """Where :meth:`KeyCodebook.save` writes ``path``: with ``.npz`` appended unless it ends so."""
    path = os.fspath(path)
    return path if path.endswith(".npz") else path + ".npz"


def load_codebook(path: str | os.PathLike) -> KeyCodebook:
    """A codebook written by :meth:`KeyCodebook.save`; ProfileError on anything else."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
        if not head.startswith(b"PK"):  # np.load would call anything else "pickled data"
            kind = ("a JSON document (a head profile or a ContextKeeper ranking?)" if head.lstrip()[:1] in (b"{", b"[")
                    else "not an .npz archive")
            raise ProfileError(f"HCAttention codebook {str(path)!r} is {kind}; HCAttention(codebook=...) takes the .npz "
                               "written by `hetero-jax profile --method hcattention`")
        with np.load(path, allow_pickle=False) as z:
            centroids, meta = np.array(z["centroids"]), json.loads(str(z["meta"]))
    except FileNotFoundError:
        raise ProfileError(f"HCAttention codebook file {str(path)!r} does not exist") from None
    except ProfileError:
        raise
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, zlib.error) as e:
        # not an npz, a truncated or damaged archive, pickled arrays, missing members, bad JSON
        raise ProfileError(f"HCAttention codebook {str(path)!r} is not readable: {e}; train it again with "
                           "`hetero-jax profile --method hcattention`, or copy it again if the copy was cut off") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME or meta.get("version") != SCHEMA_VERSION:
        raise ProfileError(f"{str(path)!r} is not a {FORMAT_NAME} v{SCHEMA_VERSION} file")
    where, fix = f"HCAttention codebook {str(path)!r}", "train the codebook again with `hetero-jax profile --method hcattention`"
    model = read_str(meta.get("model"), "meta.model", where=where, fix=fix)
    info = {k: read_str(meta.get(k), f"meta.{k}", where=where, fix=fix) for k in ("architecture", "weights_fingerprint")}
    ints = {k: read_int(meta.get(k), f"meta.{k}", where=where, minimum=1, fix=fix) for k in ("head_dim", "num_kv_heads")}
    settings = read_mapping(meta.get("settings"), "meta.settings", where=where, optional=True, fix=fix)
    try:
        return KeyCodebook(centroids=centroids, model=model or "", settings=dict(settings), **info, **ints)
    except ProfileError as e:
        raise ProfileError(f"{where}: {str(e).removeprefix('HCAttention codebook: ')}") from None


def shipped_codebooks(model) -> tuple[KeyCodebook, ...]:
    """The shipped codebooks that fit ``model`` (a loaded ``hetero_jax.io.hub.Model``; its name first, then any
    shipped model whose shape and fingerprint fit), fewest codes first; () when none does."""
    from hetero_jax.profile.shipped import weights_fingerprint

    fp = weights_fingerprint(model.params) if getattr(model, "params", None) is not None else None
    names = [getattr(model, "name", None)] + list(SHIPPED_CODEBOOKS)
    for name in names:
        paths = [shipped_data_path({name: fname}, name) for fname in SHIPPED_CODEBOOKS.get(name, ())]
        found = shipped_fitting(paths, load_codebook, model.config, fp)
        if found:
            return tuple(sorted(found, key=lambda c: c.groups(model.config.head_dim)))
    return ()


# ------------------------------------------------------------------ k-means
def nearest(x: np.ndarray, centroids: np.ndarray, chunk: int = 8192) -> np.ndarray:
    """[N] index of the nearest centroid (squared L2) of each row of x [N, d]; ties to the lower index."""
    x = np.asarray(x, np.float32)
    c = np.asarray(centroids, np.float32)
    cn = (c * c).sum(1)
    out = np.empty(len(x), np.int64)
    for s in range(0, len(x), chunk):
        # ||x||^2 is the same for every centroid: argmin of ||c||^2 - 2 x.c
        out[s : s + chunk] = np.argmin(cn[None, :] - 2.0 * (x[s : s + chunk] @ c.T), axis=1)
    return out


def kmeans_pp(x: np.ndarray, c: int, rng: np.random.Generator) -> np.ndarray:
    """k-means++ seeding: c rows of x [N, d], each drawn with probability proportional to its squared
    distance to the nearest row already drawn (uniform when every distance is 0)."""
    x = np.asarray(x, np.float64)
    n = len(x)
    if c > n:
        raise ProfileError(f"k-means: {c} centroids need at least {c} sub-vectors, got {n}; use more or longer "
                           "calibration windows or a smaller codebook")
    centers = np.empty((c, x.shape[1]))
    centers[0] = x[rng.integers(n)]
    d2 = ((x - centers[0]) ** 2).sum(1)
    for j in range(1, c):
        total = d2.sum()
        i = rng.choice(n, p=d2 / total) if total > 0 else rng.integers(n)
        centers[j] = x[i]
        d2 = np.minimum(d2, ((x - centers[j]) ** 2).sum(1))
    return centers


def minibatch_kmeans(x: np.ndarray, c: int, *, batch: int = DEFAULT_BATCH, steps: int = DEFAULT_STEPS,
                     seed: int = 0, init_sample: int = DEFAULT_INIT_SAMPLE) -> np.ndarray:
    """[c, d] float32 centroids of x [N, d]: k-means++ seeding, then ``steps`` mini-batch updates (module
    docstring). Deterministic for a given ``seed``."""
    x = np.asarray(x, np.float32)
    rng = np.random.default_rng(seed)
    pick = rng.choice(len(x), size=min(len(x), max(init_sample, c)), replace=False)
    centers = kmeans_pp(x[pick], c, rng)
    counts = np.zeros(c)
    for _ in range(steps):
        xb = x[rng.choice(len(x), size=min(batch, len(x)), replace=False)].astype(np.float64)
        a = nearest(xb, centers)
        n_b = np.bincount(a, minlength=c).astype(np.float64)
        sums = np.zeros_like(centers)
        np.add.at(sums, a, xb)
        hit = n_b > 0
        counts[hit] += n_b[hit]
        # running mean of every point a centroid has absorbed: lr = n_b / counts
        centers[hit] += (sums[hit] - n_b[hit, None] * centers[hit]) / counts[hit, None]
    return centers.astype(np.float32)


# ------------------------------------------------------------------ training on a model
def collect_keys(cfg, params, token_samples: Sequence[Sequence[int]]) -> list[np.ndarray]:
    """Per layer, every post-RoPE prompt key of full-KV prefills of the samples: [N, head_dim] float32."""
    from hetero_jax.model import transformer as M
    from hetero_jax.runtime.compile_cache import chunk_bucket, compiled

    keys: list[list[np.ndarray]] = [[] for _ in range(cfg.num_layers)]
    for s in token_samples:
        T = len(s)
        C = chunk_bucket(T)
        tokens = np.zeros((1, -(-T // C) * C), np.int32)
        tokens[0, :T] = s
        lens = np.array([T], np.int32)

        def observe(li, layer, x_in, k_buf, v_buf, lens_d, T=T):
            keys[li].append(np.asarray(k_buf[0, :, :T], np.float32).reshape(-1, cfg.head_dim))

        M.prefill(params, cfg, tokens, lens, chunk=C, tail_capacity=1, observe=observe, compile_fn=compiled,
                  plan=M.DropKVPlan(lens, cfg.num_layers, cfg.num_kv_heads))
    return [np.concatenate(k) for k in keys]


def train_codebook(model, token_samples: Sequence[Sequence[int]], *, sub_dim: int = 4, size: int = 512,
                   batch: int = DEFAULT_BATCH, steps: int = DEFAULT_STEPS, seed: int = 0, dtype=np.float16,
                   source: str = "", progress: bool = False) -> KeyCodebook:
    """HCAttention's codebook of ``model`` from token samples (no chat template): per layer, mini-batch
    k-means of the sub-vectors of every prompt key of the samples (shared by the layer's heads and groups)."""
    from hetero_jax.profile.shipped import weights_fingerprint

    cfg = model.config
    D = int(cfg.head_dim)
    if sub_dim < 1 or D % sub_dim:
        raise ProfileError(f"sub_dim must divide head_dim {D}, got {sub_dim}")
    if not 1 <= size <= MAX_CODES:
        raise ProfileError(f"the codebook size must be in [1, {MAX_CODES}] (int16 codes), got {size}")
    t0 = time.perf_counter()
    per_layer = collect_keys(cfg, model.params, token_samples)
    cents = []
    for li, k in enumerate(per_layer):
        cents.append(minibatch_kmeans(k.reshape(-1, sub_dim), size, batch=batch, steps=steps, seed=seed + li))
        if progress:
            print(f"  layer {li + 1}/{len(per_layer)}: {len(k) * (D // sub_dim)} sub-vectors, "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)
    return KeyCodebook(
        centroids=np.stack(cents).astype(dtype), model=str(getattr(model, "name", "") or ""),
        architecture=getattr(cfg, "architecture", None), head_dim=D, num_kv_heads=int(cfg.num_kv_heads),
        weights_fingerprint=weights_fingerprint(model.params),
        settings={"sub_dim": sub_dim, "size": size, "batch": batch, "steps": steps, "seed": seed,
                  "init": "k-means++ (seed, per layer seed + layer)", "scope": "per layer, shared by heads and groups",
                  "keys": "post-RoPE", "samples": len(token_samples),
                  "tokens_per_sample": sorted({len(s) for s in token_samples}), "source": source,
                  "dtype": np.dtype(dtype).name})
