"""HCAttention's decode state: the counters of the in-step selection and host sums, and its bytes."""

from __future__ import annotations

import numpy as np

from hetero_jax.model.cache import kv_bytes
from hetero_jax.model.config import ModelConfig
from hetero_jax.model.host_store import HostKVStore, sums_in_step
from hetero_jax.model.sharding import per_process, to_host
from hetero_jax.policies.protocol import DecodeState


class HCDecode(DecodeState):
    """HCAttention's counters; selection and the host sums run inside the step (``HCAttention.attend``).

    ``policy``: the HCAttention, ``point``: its ``OperatingPoint`` for this batch (``policy.py``). On a CPU
    backend the store's value arrays are the step's host operands, summed in the step's graph; elsewhere a
    callback per layer sums them (``host_store.sums_in_step``)."""

    writes_prompt_rows = False  # its attend reads the codes and the host; only the tail grows

    def __init__(self, policy, cfg: ModelConfig, lens, point, store: HostKVStore, itemsize: int):
        self.policy, self.cfg, self.lens, self.point, self.store, self.itemsize = (policy, cfg, lens, point, store,
                                                                                   itemsize)
        self.steps = 0
        self.pending = []  # device extras of dispatched steps, read lazily
        self.kstar_sum = np.zeros(cfg.num_layers)  # sum over steps, sequences and query heads of k*/L
        self.rows = 0  # (step, layer, sequence, query head) rows counted
        self.truncations = 0
        self.base = {k: list(v) for k, v in store.counters.items()}  # callback counters at this state's start
        self.operands = tuple(store.v) if sums_in_step() else ()

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
                k = to_host(kstar)  # under jax.distributed a gather: every process reads at the same step
                self.kstar_sum[li] += float((k / L).sum())
                self.truncations += int(to_host(trunc).sum())
            self.rows += extras[0][0].size
        self.pending = []

    def in_flight(self):
        return self.pending

    def host_arrays(self) -> tuple:
        return self.store.arrays()

    def host_operands(self) -> tuple:
        return self.operands

    def _host_rows_per_step(self) -> float:
        """Value rows a step reads on the host: every row where the step sums in its graph (one product over
        the store), else what the callbacks counted, per step."""
        if self.operands:
            return float(sum(a.size // a.shape[-1] for a in self.operands))
        return self._counter("decode")[2] / self.steps if self.steps else 0.0

    def host_bytes_by_role(self) -> dict:
        return {"value": self.store.nbytes()}

    def achieved_rho(self, cache, cfg) -> np.ndarray:
        """[B] bytes: each sequence's keys (or codes + the codebook) / its full prompt K+V bytes."""
        return np.array([next(p.rho for p in self.policy.operating_points(cfg, int(L))
                              if p.codebook is self.point.codebook) for L in self.lens])

    def _counter(self, kind: str) -> tuple[int, float, int]:
        """(calls, seconds, rows) of the host sums of ``kind`` since this state began: calls and rows summed over
        the processes of a ``jax.distributed`` job (each sums its own heads), seconds the slowest process's."""
        now = self.store.counters.get(kind, [0, 0.0, 0])
        base = self.base.get(kind, [0, 0.0, 0])
        each = per_process(np.array([now[0] - base[0], now[2] - base[2], now[1] - base[1]], np.float64))
        return int(each[:, 0].sum()), float(each[:, 2].max()), int(each[:, 1].sum())

    def kv_bytes_read(self, cache, steps: int) -> int:
        """Keys or codes + codebooks (the state records) and the pool (device: every head's region holds only
        its tail), plus the value rows a step reads on the host (mean)."""
        host = self._host_rows_per_step() * self.cfg.head_dim * self.itemsize if self.steps else 0
        return int(kv_bytes(cache) + self.index_bytes(cache) + host)

    def stats(self) -> dict:
        self._collect()
        cfg, n = self.cfg, self.steps
        B, NL = len(self.lens), cfg.num_layers
        per_layer = self.kstar_sum / self.rows if self.rows else np.zeros(NL)
        _, seconds, _ = self._counter("decode")
        T = int(self.lens.max())
        q_rows = B * cfg.num_heads * NL  # query rows per step
        cb = self.point.codebook
        crossing = 0 if self.operands else 1  # summed in the step, nothing crosses between device and host
        return {
            "steps": n,
            "mode": "values_on_host" if cb is None else f"codebook_g{cb.groups(cfg.head_dim)}",
            "host_sums": "in_step" if self.operands else "callback",
            "selection_ratio": float(per_layer.mean()),  # mean k*/L (paper Fig. 3)
            "selection_ratio_by_layer": [float(x) for x in per_layer],
            "truncations": self.truncations,
            # each row's weights over the prompt (float32, 0 off Pi), and y back (float32)
            "bytes_to_host_per_step": crossing * q_rows * T * 4,
            "bytes_from_host_per_step": crossing * q_rows * cfg.head_dim * 4,
            "host_value_bytes_read_per_step": self._host_rows_per_step() * cfg.head_dim * self.itemsize if n else 0.0,
            "callback_ms_per_step": 1e3 * seconds / n if n else 0.0,
            "host_bytes": self.store.nbytes(),
            "turn_callbacks": self._counter("turn")[0],
        }

    def summary(self) -> str:
        s = self.stats()
        sums = "host sums in the step" if self.operands else f"host sums {s['callback_ms_per_step']:.1f} ms/step"
        return f"{s['mode']}, kept {s['selection_ratio']:.1%} of the prompt per query (tau {self.policy.tau:g}), {sums}"
