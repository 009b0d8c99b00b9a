"""The one water-filling bisection and the integer split built on it: hand-computed cases."""

import numpy as np
import pytest

from hetero_jax.policies.allocators import distribute
from hetero_jax.water_filling import water_level


def test_water_level_by_hand():
    # clip(c * [1, 1, 2], 0, 3) sums to 8 at c = 2.5: [2.5, 2.5, 3] (the third part is capped)
    c_lo, c_hi = water_level(np.array([1.0, 1.0, 2.0]), 8, 0, 3)
    assert c_lo <= 2.5 <= c_hi and c_hi - c_lo < 1e-12
    # no cap reached: plain proportion, 6 / (1 + 2) = 2
    assert water_level(np.array([1.0, 2.0]), 6, 0, 10)[1] == pytest.approx(2.0)


def test_distribute_by_hand():
    # [2.5, 2.5, 3] -> floors [2, 2, 3], one token short: the largest remainder, ties to the lower index
    np.testing.assert_array_equal(distribute(np.array([1.0, 1.0, 2.0]), 8, 0, 3), [3, 2, 3])
    np.testing.assert_array_equal(distribute(np.zeros(4), 10, 1, 5), [3, 3, 2, 2])  # no weight: even split
    with pytest.raises(ValueError, match="cannot split 20 into 3 parts"):
        distribute(np.ones(3), 20, 0, 5)
