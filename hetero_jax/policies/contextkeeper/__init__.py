"""ContextKeeper, with its calibration beside it: the policy (``policy.py``: StreamingLLM's scorer with
the ranking's allocator, ``allocators.RankedFull``), the ranking's file format and calibration (``ranking.py``)
and the handler of ``hetero-jax profile --method contextkeeper`` (``cli.py``)."""

from hetero_jax.policies.contextkeeper.policy import ContextKeeper
from hetero_jax.policies.contextkeeper.ranking import (CARanking, calibrate_ranking, default_ranking, load_ranking,
                                                       shipped_ranking_path)

__all__ = ["CARanking", "ContextKeeper", "calibrate_ranking", "default_ranking", "load_ranking", "shipped_ranking_path"]
