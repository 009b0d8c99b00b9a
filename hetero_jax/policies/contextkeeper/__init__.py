"""ContextKeeper, with its calibration beside it: the policy (``policy.py``: full heads by an offline ranking,
the rest sinks + recent), the ranking's file format and calibration (``ranking.py``) and the handler of
``hetero-jax profile --method contextkeeper`` (``cli.py``)."""

from hetero_jax.policies.contextkeeper.policy import ContextKeeper, kept_positions
from hetero_jax.policies.contextkeeper.ranking import (CARanking, calibrate_ranking, default_ranking, load_ranking,
                                                       shipped_ranking_path)

__all__ = ["CARanking", "ContextKeeper", "calibrate_ranking", "default_ranking", "kept_positions", "load_ranking",
           "shipped_ranking_path"]
