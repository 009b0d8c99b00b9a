"""What a benchmark run writes: strict JSON, markdown tables, a child's result, and its section of RESULTS.md.

- :func:`write_json`: atomic JSON write (NaN/inf become null).
- :func:`markdown_table`, :func:`fmt_num`, :func:`fraction_text`: GitHub markdown tables and their cells.
- :func:`run_child`, :func:`emit_child_result`: run one configuration in a fresh interpreter (so peak RSS is per
  configuration) and collect its JSON.
- :func:`update_results_section`, :func:`write_results_section`: rewrite one benchmark's section of
  ``benchmarks/RESULTS.md`` between ``<!-- BEGIN name -->`` and ``<!-- END name -->``, other sections untouched;
  :func:`section_header`, :func:`closing_lines`: the top and bottom of a section.
- :func:`subplots`, :func:`save_figure`: figures; :func:`run_task`: a task script's ending (JSON, plot, tables,
  RESULTS section).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterable, Sequence

from harness.machine import BENCH_DIR, REPO_ROOT, git_ignored, git_summary, machine_summary, now_iso
from harness.merging import header_machine


RESULTS_MD = BENCH_DIR / "RESULTS.md"


OUT_DIR = BENCH_DIR / "out"


# A child prints exactly one line starting with this prefix, followed by JSON.
CHILD_RESULT_PREFIX = "@@BENCH_RESULT@@ "


# --------------------------------------------------------------------- JSON
def _json_default(o: Any):
    if isinstance(o, Path):
        return str(o)
    try:
        import numpy as np

        if isinstance(o, np.generic):
            return o.item()
        if isinstance(o, np.ndarray):
            return o.tolist()
    except ImportError:
        pass
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def _nan_to_none(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _nan_to_none(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_nan_to_none(v) for v in x]
    return x


def _atomic_write_text(path: Path, text: str, flag: str = "--out", *, updating: bool = False) -> None:
    """``hetero_jax.io.files.write_text`` (imported here: this module imports only the standard library at load),
    into a directory created when missing (benchmarks/out)."""
    from hetero_jax.io.files import write_text

    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, text, flag, updating=updating)


# The "format" of every benchmark's JSON: the mark by which a later run knows the file as ours and may replace it
# (hetero_jax.io.own_outputs); a file without it is refused.
BENCH_FORMAT = "hetero-jax-benchmark"


def write_json(path: str | os.PathLike, payload: dict[str, Any], flag: str = "--out") -> Path:
    """Write ``payload`` (NaN/inf become null, so the file is strict JSON; ``"format"`` set to
    :data:`BENCH_FORMAT` when it has none) atomically; an error names ``flag``."""
    path = Path(path)
    payload = {"format": BENCH_FORMAT, **payload}
    _atomic_write_text(path, json.dumps(_nan_to_none(payload), indent=2, default=_json_default) + "\n", flag)
    return path


# ----------------------------------------------------------------- markdown
def fraction_text(n: int, total: int) -> str:
    """A count out of a sample size for tables: "n/total", '—' when nothing was run."""
    return f"{n}/{total}" if total else "—"


def fmt_num(x: Any, digits: int = 1) -> str:
    """Numbers for tables: thousands separators, fixed decimals, '—' for missing/NaN."""
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "—"
    if isinstance(x, int):
        return f"{x:,}"
    if isinstance(x, float):
        return f"{x:,.{digits}f}"
    return str(x)


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]], align: str | None = None) -> str:
    """A GitHub markdown table. ``align``: one of 'l', 'r', 'c' per column (default: left)."""
    headers = [str(h) for h in headers]
    rows = [[str(c).replace("|", "\\|").replace("\n", " ") for c in r] for r in rows]
    align = align or "l" * len(headers)
    if len(align) != len(headers) or any(len(r) != len(headers) for r in rows):
        raise ValueError("markdown_table: every row and the align string need one entry per header")
    sep = {"l": ":---", "r": "---:", "c": ":---:"}
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(sep[a] for a in align) + " |"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


# ----------------------------------------------------------------- children
def emit_child_result(result: dict[str, Any]) -> None:
    """Print a child's result as one prefixed JSON line on stdout (its last act)."""
    sys.stdout.write(CHILD_RESULT_PREFIX + json.dumps(_nan_to_none(result), default=_json_default) + "\n")
    sys.stdout.flush()


def run_child(argv: Sequence[str], *, timeout: float | None = None,
              env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``python argv...`` in a fresh interpreter and return its emitted result.

    The child reports its own peak RSS (``peak_rss_bytes()`` just before it
    emits): the parent's RUSAGE_CHILDREN is a running maximum over every child,
    not per child. Adds ``child_wall_seconds``. On failure returns ``{"error": ..., "stderr_tail": ...}`` instead of
    raising.
    """
    import time

    cmd = [sys.executable, *map(str, argv)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})}, cwd=os.getcwd())
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        return {"error": f"timed out after {timeout:.0f} s", "stderr_tail": stderr[-4000:], "cmd": shlex.join(cmd)}
    wall = time.perf_counter() - t0
    result = None
    for line in stdout.splitlines():
        if line.startswith(CHILD_RESULT_PREFIX):
            result = json.loads(line[len(CHILD_RESULT_PREFIX):])
    if proc.returncode != 0 or result is None:
        return {
            "error": f"child exited with status {proc.returncode}" + ("" if result is None else " after its result"),
            "stderr_tail": stderr[-4000:],
            "stdout_tail": stdout[-2000:],
            "cmd": shlex.join(cmd),
        }
    result["child_wall_seconds"] = wall
    return result


# ------------------------------------------------------------ RESULTS.md
_RESULTS_PREAMBLE = (
    "# Benchmark results\n\n"
    "Each section below is rewritten by its benchmark script (`--write-results`) between its\n"
    "BEGIN/END markers; edit outside the markers only.\n"
)


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive advisory lock beside ``path`` so two benchmarks never interleave their rewrites."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def replace_section(text: str, name: str, body: str) -> str:
    """``text`` with the section ``name`` set to ``body`` (appended when absent)."""
    if not re.fullmatch(r"[A-Za-z0-9_.\-]+", name):
        raise ValueError(f"section name {name!r}: use letters, digits, '_', '-', '.'")
    begin, end = f"<!-- BEGIN {name} -->", f"<!-- END {name} -->"
    block = f"{begin}\n{body.strip()}\n{end}"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.DOTALL)
    n = len(pattern.findall(text))
    if n > 1:
        raise ValueError(f"RESULTS.md holds {n} '{name}' sections; fix it by hand")
    if n == 1:
        return pattern.sub(lambda _m: block, text)
    if text.count(begin) or text.count(end):
        raise ValueError(f"RESULTS.md has an unmatched marker for section '{name}'; fix it by hand")
    return text.rstrip("\n") + "\n\n" + block + "\n"


def update_results_section(name: str, body: str, path: str | os.PathLike = RESULTS_MD) -> Path:
    """Rewrite section ``name`` of ``path`` (created when missing), other sections untouched."""
    path = Path(path)
    with _locked(path):
        text = path.read_text() if path.exists() else _RESULTS_PREAMBLE
        # the rest of the file is kept, so it need not be an output of ours
        _atomic_write_text(path, replace_section(text, name, body), "--results-file", updating=True)
    return path


def plot_markdown(alt: str, plot_rel: str | None, plot_path: str | os.PathLike) -> str:
    """The results line for a plot: embedded when committed (``plot_rel``), else named with how to get it."""
    if plot_rel:
        return f"![{alt}]({plot_rel})"
    return f"Plot: `{os.path.relpath(plot_path, REPO_ROOT)}` (not committed; rerun to regenerate)."


def results_section_name(section: str, preset: str | None) -> str:
    """RESULTS.md section of a run: ``make bench`` (preset "cpu") owns ``section``; a run with no preset or
    preset "full" (the full grids, with or without overrides) writes ``section-full``; any other preset NAME
    writes ``section-NAME``. So no run overwrites another's table."""
    if preset == "cpu":
        return section
    return f"{section}-{preset or 'full'}"


def write_results_section(section: str, render, png: Path | None, results_file: str | os.PathLike = RESULTS_MD,
                          preset: str | None = "cpu", name: str | None = None) -> Path:
    """Rewrite ``section`` (``results_section_name(section, preset)``; ``name`` instead when given: a script's
    ``--section``) of ``results_file`` with ``render(plot_rel)``.

    ``preset``: the run's preset; scripts with no presets leave the default and write ``section`` itself.

    ``plot_rel`` is the PNG's path relative to the results file, or None when there is
    no plot or it is git-ignored (RESULTS.md then names it without embedding it).
    """
    section = name or results_section_name(section, preset)
    results_file = Path(results_file)
    plot_rel = None
    if png:
        plot_rel = os.path.relpath(Path(png).resolve(), results_file.resolve().parent)
        if git_ignored(png):
            print(f"note: {png} is git-ignored; RESULTS.md names it but will not embed it")
            plot_rel = None
    path = update_results_section(section, render(plot_rel), results_file)
    print(f"updated the '{section}' section of {path}")
    return path


def results_header(title: str, machine: dict[str, Any] | str, git: dict[str, Any], command: str,
                   timestamp: str | None = None) -> str:
    """The markdown lines every section starts with: title, machine (its summary, or the line itself), commit,
    exact command."""
    return "\n".join([
        f"## {title}",
        "",
        f"- Machine: {machine if isinstance(machine, str) else machine_summary(machine)}",
        f"- Commit: {git_summary(git)}",
        f"- Date: {timestamp or now_iso()}",
        f"- Command: `{command}`",
    ])


def section_header(title: str, payload: dict) -> str:
    """:func:`results_header` of a run's JSON payload (:func:`report_header`: its machine, commit, command, time;
    a merge's machine line names its runs' machines: ``harness.merging.header_machine``)."""
    return results_header(title, header_machine(payload), payload["git"], payload["command"],
                          payload.get("timestamp"))


def closing_lines(payload: dict, alt: str, plot_rel: str | None) -> list[str]:
    """The last lines of a task's RESULTS section: the run's wall time and peak memory, then its plot."""
    return [wall_and_memory_line(payload), "", plot_markdown(alt, plot_rel, payload["config"]["plot"])]


def wall_and_memory_line(payload: dict) -> str:
    """The closing line of a RESULTS section: the run's wall time and peak resident memory."""
    return (f"Total wall time {payload['total_seconds'] / 60:.1f} min; peak RSS "
            f"{payload['peak_rss_bytes'] / 2**20:,.0f} MiB.")


def subplots(*args, **kwargs):
    """``matplotlib.pyplot.subplots`` on the file-only Agg backend (benchmarks run headless): (fig, axes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(*args, **kwargs)


def save_figure(fig, path: Path, title: str, dpi: int = 110, *, crop: bool = False,
                title_y: float | None = None) -> Path:
    """Title, lay out, write and close a matplotlib figure; returns ``path``.

    ``crop``: cut the image to what is drawn (``bbox_inches="tight"``) instead of ``tight_layout``, for a figure
    with a legend or colour bar outside its axes; ``title_y``: the title's height, where the default overlaps."""
    import matplotlib.pyplot as plt

    fig.suptitle(title, fontsize=9, **({} if title_y is None else {"y": title_y}))
    if not crop:
        fig.tight_layout()
    from hetero_jax.io.files import atomic_path
    from hetero_jax.io.own_outputs import figure_metadata

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fmt = path.suffix.lstrip(".").lower() or "png"
    try:
        with atomic_path(path, "--plot") as tmp:  # the format named: matplotlib would add .png to a bare name
            fig.savefig(tmp, dpi=dpi, format=fmt, metadata=figure_metadata(fmt),
                        **({"bbox_inches": "tight"} if crop else {}))
    finally:
        plt.close(fig)
    return path


def run_task(args, run, *, section: str, make_plot, results_section, tables, plot_rows: str = "summary") -> dict:
    """A task script after its arguments: ``run(args)``, then the JSON (``args.out``), the plot (``args.plot``; none
    when ``make_plot`` is None or the payload's ``plot_rows`` are empty), ``tables(payload)`` on stdout, the total
    time, and with ``args.write_results`` the script's section of RESULTS.md. Returns the payload."""
    payload = run(args)
    out = write_json(args.out, payload)
    png = make_plot(payload, args.plot) if make_plot is not None and payload[plot_rows] else None
    print(f"wrote {out}" + (f" and {png}" if png else ""))
    print("\n\n".join(tables(payload)))
    print(f"total {payload['total_seconds'] / 60:.1f} min")
    if args.write_results:
        # a script without presets writes ``section`` itself, the name results_section_name gives preset "cpu"
        preset = getattr(args, "preset", "cpu")
        write_results_section(section, lambda plot_rel: results_section(payload, plot_rel), png,
                              args.results_file, preset=preset, name=getattr(args, "section", None))
    return payload


def run_table_task(args, run, *, section: str, results_section, results_table) -> dict:
    """``run_task`` for a script with one table of ``payload["rows"]`` and no figure (extend, serve)."""
    return run_task(args, run, section=section, make_plot=None,
                    results_section=lambda payload, _plot: results_section(payload),
                    tables=lambda payload: [results_table(payload["rows"])])
