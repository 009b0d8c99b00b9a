"""Offline head profiling for HeteroCache (issue 4).

Model-independent half: set metrics (``metrics``), star clustering, roles and
budgets (``clustering``), the profile file's document, settings and checks
(``schema``), the ``HeadProfile`` record and its construction (``head_profile``),
reading ours or the authors' published profiles (``official``), the shipped
profiles and the weights fingerprint (``shipped``), and the summary figure (``plot``,
imported lazily because it pulls in matplotlib). Calibration on a model
(``calibrate``, ``hetero-jax profile``) feeds these functions top-k masks.
"""

from hetero_jax.profile.clustering import (
    COMPRESSED_ROLES,
    FULL_ROLES,
    ROLE_NAMES,
    BudgetTooSmallError,
    Cluster,
    Role,
    RoleAssignment,
    allocation_weights,
    assign_roles,
    base_budget,
    budget_grid,
    head_budgets,
    min_rho,
    star_clustering,
)
from hetero_jax.profile.head_profile import HeadProfile, build_profile, build_synckv_profile
from hetero_jax.profile.official import load_profile
from hetero_jax.profile.schema import FORMAT_NAME, SCHEMA_VERSION, ProfileError, ProfileSettings
from hetero_jax.profile.shipped import (SHIPPED_PROFILES, SHIPPED_SYNCKV_PROFILES, default_profile, shipped_data_path,
                                        shipped_profile_path, weights_fingerprint)
# Imported eagerly: the function ``calibrate`` must shadow the submodule of the same name
# (importing the submodule later would otherwise rebind the package attribute to the module).
from hetero_jax.profile.calibrate import calibrate, calibrate_tokens  # noqa: E402
from hetero_jax.profile.metrics import (
    indices_to_mask,
    max_similarity,
    overlap,
    overlap_masks,
    similarity_edges,
    similarity_matrix,
    similarity_score,
    stability,
    stability_masks,
    topk_mask,
    topk_set,
)


def plot_profile(profile, path):
    """See :func:`hetero_jax.profile.plot.plot_profile` (matplotlib imported on call)."""
    from hetero_jax.profile.plot import plot_profile as _plot

    return _plot(profile, path)


__all__ = [
    "COMPRESSED_ROLES", "FULL_ROLES", "ROLE_NAMES", "BudgetTooSmallError", "Cluster", "Role",
    "RoleAssignment", "allocation_weights", "assign_roles", "base_budget", "budget_grid",
    "head_budgets", "min_rho", "star_clustering",
    "FORMAT_NAME", "SCHEMA_VERSION", "HeadProfile", "ProfileError", "ProfileSettings",
    "build_profile", "build_synckv_profile", "load_profile", "weights_fingerprint", "SHIPPED_PROFILES",
    "SHIPPED_SYNCKV_PROFILES", "shipped_data_path", "shipped_profile_path", "default_profile", "calibrate",
    "calibrate_tokens",
    "indices_to_mask", "max_similarity", "overlap", "overlap_masks", "similarity_edges",
    "similarity_matrix", "similarity_score", "stability", "stability_masks", "topk_mask", "topk_set",
    "plot_profile",
]
