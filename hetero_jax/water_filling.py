"""Water-filling: the one bisection behind every budget split that caps some parts (PyramidKV's and CAKE's
per-layer budgets, HeteroCache's Eq. 8 when a head's share exceeds the prompt)."""

from __future__ import annotations

import numpy as np


def water_level(weights: np.ndarray, total: float, lo: float, hi: float) -> tuple[float, float]:
    """Bracket (c_lo, c_hi) of the level c at which sum_j clip(c * w_j, lo, hi) reaches ``total``.

    The sum is monotone in c, so 200 halvings of [0, hi / min w] leave c_lo and c_hi a few ulps apart:
    the sum at c_lo is below ``total`` and at c_hi it is not. ``weights`` >= 0 with some > 0.
    """
    w = np.asarray(weights, np.float64)
    c_lo, c_hi = 0.0, hi / max(w[w > 0].min(), 1e-300)
    for _ in range(200):
        c = 0.5 * (c_lo + c_hi)
        if np.clip(c * w, lo, hi).sum() < total:
            c_lo = c
        else:
            c_hi = c
    return c_lo, c_hi
