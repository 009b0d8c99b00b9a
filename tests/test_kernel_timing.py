"""benchmarks/kernel_timing.py's pool timing on a CPU (interpret mode, tiny shapes: the plumbing, not numbers): the
row-pool and paged layouts it times, each checked there against the kernel's reference."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from kernel_report import render_pool_timing  # noqa: E402
from kernel_timing import paged_layout, pool_timing  # noqa: E402


def test_paged_layout_is_in_device_quests_read():
    blocks, lens, offs, P = paged_layout(512, 3, 2, np.random.default_rng(0), page=16, rho=0.3)
    nb = round(0.3 * 512 / 16)  # 10 pages of the 32 a head's region holds
    assert blocks.shape == (2, 3, nb) and P == 3 * 512 and (lens == nb * 16).all()
    assert (offs == np.arange(3) * 512).all()  # regions back to back, each the whole context
    for row in blocks.reshape(-1, nb):
        assert len(set(row)) == nb and (row % 16 == 0).all() and row.min() >= 0 and row.max() <= 512 - 16


def test_pool_timing_rows_in_interpret_mode():
    out = pool_timing(dict(B=1, Hkv=6, G=2, D=16), contexts=(128,), iters=1, copy={"bandwidth": 1.0},
                      splits=(None,), interpret=True)
    pooled, paged = out["rows"]
    assert "layout" not in pooled and paged["layout"] == "paged, 16-row pages"
    assert pooled["ok"] and paged["ok"]  # each kernel within bf16 tolerance of its reference
    assert paged["kv_bytes"] == 6 * 2 * 16 * 2 * 16 * 2  # heads x pages x rows x (K, V) x D x bf16
    assert "per_group_s" in pooled and "per_group_s" not in paged
    table = "\n".join(render_pool_timing(out))
    assert "| 128 | row pool |" in table and "| 128 | paged, 16-row pages |" in table
