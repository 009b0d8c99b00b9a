"""Summary figure of a HeadProfile (cf. paper Fig. 1 c-d and Fig. 6).

One PNG, three panels: (a) the role of every KV head (layers x heads grid),
(b) stability S_stable sorted descending with the tau_stable line, (c) each
head's similarity (max overlap with another head of its layer) sorted
descending with the tau_sim line. Heads kept whole by the copy rule
(copy score >= tau_copy) are marked "C" in (a). Panels (b)/(c) say so when the profile
does not carry the scores (the authors' published files do not).
"""

from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")  # headless; must precede pyplot

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.backend_bases import FigureCanvasBase  # noqa: E402
from matplotlib.colors import BoundaryNorm, ListedColormap  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from hetero_jax.io.files import atomic_path  # noqa: E402
from hetero_jax.io.own_outputs import figure_metadata  # noqa: E402
from hetero_jax.profile.clustering import ROLE_NAMES, Role  # noqa: E402
from hetero_jax.profile.schema import ProfileError  # noqa: E402

# Colour-blind-safe (Okabe-Ito) colours; full heads warm, compressed cool.
ROLE_COLORS = {
    Role.ANCHOR: "#0072B2",
    Role.VOLATILE: "#D55E00",
    Role.PIVOT: "#E69F00",
    Role.SATELLITE: "#56B4E9",
}


def plot_format(path: str | os.PathLike, flag: str = "plot path") -> str:
    """The image format ``path``'s extension names (PNG without one); ProfileError (naming ``flag``) for one
    matplotlib cannot write, or one with no field for hetero-jax's mark (JPEG, TIFF, WebP, raw: a re-run could
    not tell the file is its own and would refuse to replace it), so a bad ``--plot`` is refused before
    calibrating."""
    ext = os.path.splitext(os.fspath(path))[1].lstrip(".").lower()
    marked = sorted(f for f in FigureCanvasBase.get_supported_filetypes() if figure_metadata(f) is not None)
    if ext and ext not in marked:
        why = ("has no field for hetero-jax's mark, so a re-run could not replace it"
               if ext in FigureCanvasBase.get_supported_filetypes() else "is not a format matplotlib writes")
        raise ProfileError(f"{flag} {os.fspath(path)}: .{ext} {why}; use one of "
                           + ", ".join("." + f for f in marked) + " (e.g. roles.png)")
    return ext or "png"


def plot_profile(profile, path: str | os.PathLike) -> str:
    """Write the profile figure to ``path``, whole or not at all (OutputError for a path that cannot be
    written); the format follows its extension (:func:`plot_format`). Returns the path."""
    fmt = plot_format(path)

    n_layers, n_heads = profile.roles.shape
    fig = plt.figure(figsize=(12, max(6.0, 0.2 * n_layers + 2.5)))
    # The grid panel's width follows the head count so that 3 heads stay
    # readable next to 8 without stretching cells into long bars.
    grid_w = min(max(n_heads, 3), 16) / 16 * 1.5 + 0.5
    # Fixed margins: constrained_layout costs seconds with a few hundred cell labels.
    gs = fig.add_gridspec(2, 2, width_ratios=[grid_w, 2.5], left=0.06, right=0.98, bottom=0.12,
                          top=0.9, wspace=0.15, hspace=0.3)
    ax_roles = fig.add_subplot(gs[:, 0])
    ax_stab = fig.add_subplot(gs[0, 1])
    ax_sim = fig.add_subplot(gs[1, 1])

    title = profile.model_name or profile.describe_shape()
    fig.suptitle(f"HeteroCache head profile: {title}", fontsize=12)

    # (a) roles
    cmap = ListedColormap([ROLE_COLORS[r] for r in Role])
    norm = BoundaryNorm([0.5 + i for i in range(len(Role) + 1)], cmap.N)
    ax_roles.imshow(profile.roles, cmap=cmap, norm=norm, aspect="auto", interpolation="nearest")
    ax_roles.set_xlabel("KV head")
    ax_roles.set_ylabel("layer")
    ax_roles.set_xticks(range(n_heads))
    step = 1 if n_layers <= 32 else 2
    ax_roles.set_yticks(range(0, n_layers, step))
    ax_roles.tick_params(labelsize=7)
    # Thin cell borders keep neighbouring heads of one role apart.
    ax_roles.set_xticks(np.arange(-0.5, n_heads), minor=True)
    ax_roles.set_yticks(np.arange(-0.5, n_layers), minor=True)
    ax_roles.grid(which="minor", color="white", linewidth=0.5)
    ax_roles.tick_params(which="minor", length=0)
    # Cluster membership: pivots marked "P", each satellite with its pivot's
    # head index, so layers with several clusters stay readable.
    fs = 7 if n_heads <= 8 else 5
    for layer, clusters in enumerate(profile.clusters):
        for c in clusters:
            ax_roles.text(c.pivot, layer, "P", ha="center", va="center", fontsize=fs, color="black")
            for sat in c.satellites:
                ax_roles.text(sat, layer, str(c.pivot), ha="center", va="center", fontsize=fs - 1,
                              color="#333333")
    s = profile.settings
    copy_heads = profile.copy_heads()
    for layer, head in zip(*np.nonzero(copy_heads & (profile.roles == Role.VOLATILE))):
        ax_roles.text(head, layer, "C", ha="center", va="center", fontsize=fs, color="white", fontweight="bold")
    counts = profile.role_counts()
    handles = [Patch(color=ROLE_COLORS[r], label=f"{ROLE_NAMES[r]} ({counts[ROLE_NAMES[r]]})") for r in Role]
    ax_roles.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.06 if n_layers > 12 else -0.15),
                    ncol=2, fontsize=8, frameon=False)
    ax_roles.set_title("(a) role per KV head\n(P = pivot; number = its pivot"
                       + (f";\nC = copy score >= {s.tau_copy:g}: kept whole)" if copy_heads.any() else ")"),
                       fontsize=10)

    # Two random top-k sets of L tokens overlap k/L on average: the floor both scores sit on.
    chance = s.top_k / s.tokens_per_sample if s.top_k and s.tokens_per_sample else None
    _sorted_curve(ax_stab, profile.stability, s.tau_stable, r"$\tau_{stable}$",
                  "(b) stability $S_{stable}$ (Eq. 2), sorted", "stability", chance)
    _sorted_curve(ax_sim, profile.similarity, s.tau_sim, r"$\tau_{sim}$",
                  "(c) similarity: max overlap with another head of the layer, sorted", "similarity", chance)
    ax_sim.set_xlabel(f"head rank (of {n_layers * n_heads} KV heads)")

    try:
        with atomic_path(path) as tmp:
            # An explicit format: the temporary name's extension is path's, but without one matplotlib would add
            # ".png" to it and the rename would miss the file.
            fig.savefig(tmp, dpi=120, format=fmt, metadata=figure_metadata(fmt))
    finally:
        plt.close(fig)
    return os.fspath(path)


def _sorted_curve(ax, values, tau, tau_label, title, ylabel, chance=None):
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(ylabel)
    vals = np.asarray(values, dtype=np.float64).ravel()
    vals = np.sort(vals[np.isfinite(vals)])[::-1]
    if vals.size == 0:
        ax.text(0.5, 0.5, "not recorded in this profile", ha="center", va="center",
                transform=ax.transAxes, color="gray")
        ax.set_xticks([])
        ax.set_yticks([])
        return
    x = np.arange(vals.size)
    above = vals >= tau if tau is not None else np.ones(vals.size, bool)
    # Solid dark above the threshold, dashed light below (as in paper Fig. 1c-d).
    ax.plot(x[above], vals[above], color="#0072B2", linewidth=1.5, marker=".", markersize=3,
            label=f">= threshold ({above.sum()})")
    ax.plot(x[~above], vals[~above], color="#56B4E9", linewidth=1.5, linestyle="--", marker=".",
            markersize=3, label=f"< threshold ({(~above).sum()})")
    if tau is not None:
        ax.axhline(tau, color="#D55E00", linestyle="--", linewidth=1, label=f"{tau_label} = {tau:g}")
    if chance is not None:
        ax.axhline(chance, color="gray", linestyle=":", linewidth=1, label=f"chance k/L = {chance:.2f}")
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlim(-0.5, vals.size - 0.5)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
