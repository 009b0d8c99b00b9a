"""Shared plumbing for the benchmark scripts in this directory.

- :func:`machine_info`: CPU model, cores, RAM, load average, Python/JAX
  versions, backend and devices, kernel backend in force.
- :func:`git_info`: short commit plus a dirty flag (read-only git calls).
- :func:`write_json`: atomic JSON write with the full config, command, machine
  and git info embedded (:func:`report_header` builds that header).
- :func:`markdown_table`: a GitHub markdown table from headers and rows.
- :func:`peak_rss_bytes`, :func:`current_rss_bytes`: this process's memory.
- :func:`run_child`, :func:`emit_child_result`: run one configuration in a
  fresh interpreter (so peak RSS is per configuration) and collect its JSON.
- :func:`update_results_section`: rewrite one benchmark's section of
  ``benchmarks/RESULTS.md`` between ``<!-- BEGIN name -->`` and
  ``<!-- END name -->``, leaving every other section untouched.
- The task scripts' harness (end of file): their shared arguments and presets
  (:func:`argument_parser`, :func:`add_output_arguments`, :func:`parse_with_preset`,
  :func:`parse_grid_args`), the top and bottom of their RESULTS sections
  (:func:`section_header`, :func:`closing_lines`), figures (:func:`subplots`,
  :func:`save_figure`) and their ending (:func:`run_task`).

Only the standard library is imported at module level, so a parent process
that merely orchestrates children never loads JAX; :func:`machine_info`
imports JAX lazily (call it from a child if the parent must stay light, or
accept the parent's import).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import math
import os
import platform
import re
import resource
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
RESULTS_MD = BENCH_DIR / "RESULTS.md"
OUT_DIR = BENCH_DIR / "out"

# A child prints exactly one line starting with this prefix, followed by JSON.
CHILD_RESULT_PREFIX = "@@BENCH_RESULT@@ "


# ------------------------------------------------------------------ machine
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith(("model name", "hardware", "processor\t: ")) and ":" in line:
                    value = line.split(":", 1)[1].strip()
                    if value and not value.isdigit():
                        return value
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _proc_kib_field(path: str, field: str) -> int | None:
    """The ``field: N kB`` line of a /proc file (``/proc/meminfo``, ``/proc/self/status``) in bytes, or None
    where the file or the field is missing."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _mem_total_bytes() -> int | None:
    total = _proc_kib_field("/proc/meminfo", "MemTotal")
    if total is not None:
        return total
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _cgroup_cpu_limit() -> float | None:
    """CPUs allowed by a cgroup v2 quota (containers), or None when unlimited/unknown."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            return int(quota) / int(period)
    except (OSError, ValueError):
        pass
    return None


def machine_info(with_jax: bool = True) -> dict[str, Any]:
    """A JSON-able description of the machine and software stack."""
    info: dict[str, Any] = {
        "hostname": platform.node(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cgroup_cpu_limit": _cgroup_cpu_limit(),
        "ram_bytes": _mem_total_bytes(),
        "loadavg_1_5_15": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "os": platform.platform(),
        "python": platform.python_version(),
        "env": {k: os.environ[k] for k in ("XLA_FLAGS", "JAX_PLATFORMS", "HETERO_JAX_KERNELS",
                                          "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES") if k in os.environ},
    }
    if with_jax:
        import jax
        import jaxlib

        devices = jax.devices()
        info["jax"] = {
            "version": jax.__version__,
            "jaxlib": getattr(jaxlib, "__version__", None),
            "backend": jax.default_backend(),
            "devices": [str(d) for d in devices],
            "device_kinds": sorted({getattr(d, "device_kind", "?") for d in devices}),
        }
        try:
            import pallas_kernels

            mode = pallas_kernels.use_kernels()
            pool = pallas_kernels.resolve_backend(native=True)
            # the pool attention (every layer's decode attention) has a native CPU kernel besides Pallas
            info["kernels"] = mode if pool == mode else f"{mode} (pool attention: {pool})"
        except Exception:  # noqa: BLE001 - informational only
            info["kernels"] = None
    return info


def machine_summary(info: dict[str, Any]) -> str:
    """One line for a results header."""
    ram = info.get("ram_bytes")
    cores = info.get("cpu_affinity") or info.get("cpu_count")
    parts = [f"{info.get('cpu_model', '?')}", f"{cores} cores"]
    if info.get("cgroup_cpu_limit"):
        parts.append(f"cgroup limit {info['cgroup_cpu_limit']:g} CPUs")
    if ram:
        parts.append(f"{ram / 2**30:.0f} GiB RAM")
    j = info.get("jax")
    if j:
        parts.append(f"jax {j['version']} ({j['backend']}: {', '.join(j['device_kinds'])})")
    if info.get("kernels"):
        parts.append(f"kernels: {info['kernels']}")
    la = info.get("loadavg_1_5_15")
    if la:
        parts.append(f"load avg at start {la[0]:.2f}")
    return ", ".join(parts)


# ---------------------------------------------------------------------- git
def git_info(repo: Path = REPO_ROOT) -> dict[str, Any]:
    """Short commit and a dirty flag. Read-only: never takes the index lock."""

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", "--no-optional-locks", *args], cwd=repo, capture_output=True,
                                 text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout if out.returncode == 0 else None

    if os.environ.get("HETERO_JAX_COMMIT"):
        # a copied tree (a lent GPU machine), whose .git may be missing or name an older commit than the files
        # it holds: the commit its caller says it was copied from
        return {"commit": os.environ["HETERO_JAX_COMMIT"], "dirty": None, "changed_files": []}
    commit = git("rev-parse", "--short", "HEAD")
    commit = commit.strip() if commit else None
    status = git("status", "--porcelain")  # not stripped: " M path" starts with a space
    changed = [line[3:] for line in status.splitlines() if line.strip()] if status else []
    # RESULTS.md and the docs/bench-*.png plots are what benchmarks write: a run queued after another
    # one's --write-results is not running uncommitted code.
    changed = [c for c in changed if c != "benchmarks/RESULTS.md"
               and not (c.startswith("docs/bench-") and c.endswith(".png"))]
    return {
        "commit": commit,
        "dirty": bool(changed) if status is not None else None,
        "changed_files": changed[:50],
    }


def git_ignored(path: str | os.PathLike, repo: Path = REPO_ROOT) -> bool:
    """True when git would ignore ``path`` (so a file there is never committed)."""
    try:
        out = subprocess.run(["git", "--no-optional-locks", "check-ignore", "-q", os.path.abspath(path)],
                             cwd=repo, capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0


def git_summary(g: dict[str, Any]) -> str:
    if not g.get("commit"):
        return "unknown (not a git checkout)"
    if g.get("dirty"):
        return f"{g['commit']} (dirty: {len(g['changed_files'])} changed/untracked paths)"
    return f"{g['commit']} (clean)"


# ------------------------------------------------------------------ command
def command_line(argv: Sequence[str] | None = None) -> str:
    """The command that ran this script, with paths relative to the repo root where possible."""
    argv = list(sys.argv if argv is None else argv)

    def rel(p: str) -> str:
        try:
            return os.path.relpath(os.path.abspath(p), REPO_ROOT) if os.path.exists(p) else p
        except ValueError:
            return p

    exe = sys.executable
    exe = rel(exe) if os.path.abspath(exe).startswith(str(REPO_ROOT) + os.sep) else "python"
    return shlex.join([exe, rel(argv[0]), *argv[1:]])


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).astimezone().isoformat(timespec="seconds")


def report_header(name: str, config: dict[str, Any], machine: dict[str, Any] | None = None) -> dict[str, Any]:
    """The common top of every benchmark's JSON: name, time, command, full config, machine, git."""
    return {
        "benchmark": name,
        "timestamp": now_iso(),
        "command": command_line(),
        "cwd": os.getcwd(),
        "config": config,
        "machine": machine if machine is not None else machine_info(),
        "git": git_info(),
    }


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


def _atomic_write_text(path: Path, text: str) -> None:
    """``hetero_jax.io.files.write_text`` (imported here: this module imports only the standard library at load),
    into a directory created when missing (benchmarks/out)."""
    from hetero_jax.io.files import write_text

    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, text)


def write_json(path: str | os.PathLike, payload: dict[str, Any]) -> Path:
    """Write ``payload`` (NaN/inf become null, so the file is strict JSON) atomically."""
    path = Path(path)
    _atomic_write_text(path, json.dumps(_nan_to_none(payload), indent=2, default=_json_default) + "\n")
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


# ---------------------------------------------------------------------- RSS
def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (ru_maxrss; KiB on Linux, bytes on macOS)."""
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(r) if sys.platform == "darwin" else int(r) * 1024


def current_rss_bytes() -> int | None:
    """Resident set size now (VmRSS), or None where /proc is missing."""
    return _proc_kib_field("/proc/self/status", "VmRSS")


# ----------------------------------------------------------------- children
def emit_child_result(result: dict[str, Any]) -> None:
    """Print a child's result as one prefixed JSON line on stdout (its last act)."""
    sys.stdout.write(CHILD_RESULT_PREFIX + json.dumps(_nan_to_none(result), default=_json_default) + "\n")
    sys.stdout.flush()


def run_child(argv: Sequence[str], *, timeout: float | None = None, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``python argv...`` in a fresh interpreter and return its emitted result.

    The child reports its own peak RSS (``peak_rss_bytes()`` just before it
    emits): the parent's RUSAGE_CHILDREN is a running maximum over every child,
    not per child. Adds ``child_wall_seconds``. On failure returns ``{"error": ..., "stderr_tail": ...}`` instead of raising.
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
        _atomic_write_text(path, replace_section(text, name, body))
    return path


def plot_markdown(alt: str, plot_rel: str | None, plot_path: str | os.PathLike) -> str:
    """The results line for a plot: embedded when committed (``plot_rel``), else named with how to get it."""
    if plot_rel:
        return f"![{alt}]({plot_rel})"
    return f"Plot: `{os.path.relpath(plot_path, REPO_ROOT)}` (not committed; rerun to regenerate)."


def engine_kv_stats(engine) -> dict[str, Any]:
    """An ``Engine``'s KV bytes as ``GenerationStats`` reports them (``Engine.stats_fields``), its achieved rho
    (first sequence) and the policy's decode counters under "recall" (HeteroCache's; empty for static policies)."""
    f = engine.stats_fields()
    return {
        "kv_bytes_device": int(f["kv_bytes_device"]), "kv_bytes_prompt": int(f["kv_bytes_prompt"]),
        "kv_bytes_tail": int(f["kv_bytes_tail"]), "kv_bytes_host": int(f["kv_bytes_host"]),
        "kv_bytes_used": int(f["kv_bytes_used"]), "achieved_rho": float(engine.achieved_rho[0]),
        "kv_bytes_index": int(f["kv_bytes_index"]), "kv_bytes_read_per_step": int(f["kv_bytes_read_per_step"]),
        "recall": dict(f["policy_stats"]),
    }


def policy_spec(text: str) -> str:
    """argparse type of ``--policies``: a registered name, optionally with options (``quest:offload=true``)."""
    from hetero_jax.errors import HeteroJaxError
    from hetero_jax.policies import make_policy

    try:
        make_policy(text)
    except HeteroJaxError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def load_grid(args):
    """What a grid script's run starts with: the persistent compilation cache (unless ``--no-compile-cache``), the
    policy x budget combos of ``--policies`` / ``--budgets``, their labels and policies, and the model (``--model``,
    ``--dtype``). Returns (model, combos, labels, policies, seconds the load took)."""
    import hetero_jax
    from hetero_jax.policies import make_policy

    if not args.no_compile_cache:
        from hetero_jax.cli import enable_compilation_cache

        enable_compilation_cache()
    combos = make_combos(args.policies, args.budgets)
    labels = [combo_label(n, r) for n, r in combos]
    policies = [make_policy(n, None if n == "full" else r) for n, r in combos]
    t0 = time.perf_counter()
    model = hetero_jax.load(args.model, dtype=getattr(args, "dtype", None), progress=False)
    return model, combos, labels, policies, time.perf_counter() - t0


def refused_by_length(model, labels, policies, lengths) -> dict[str, dict[str, str]]:
    """{label: {length: the budget error}} for every (combo, length) whose budget the policy cannot keep, each
    also named on stderr: a grid leaves those out and names them in its report."""
    refused: dict[str, dict[str, str]] = {}
    for lab, pol in zip(labels, policies):
        for L in lengths:
            err = budget_problem(model, pol, [L])
            if err:
                refused.setdefault(lab, {})[str(L)] = err
                print(f"skipping {lab} at {L} tokens: {err}", file=sys.stderr)
    return refused


def budget_problem(model, policy, lengths) -> str | None:
    """Why ``policy`` cannot run a prompt of one of ``lengths`` tokens on ``model`` (its budget error), or None.

    Builds the prefill plan only (``make_prefill`` checks every budget rule before any compute)."""
    from hetero_jax.policies import BudgetError

    for n in lengths:
        try:
            policy.bind(model).make_prefill(model.config, [int(n)])
        except BudgetError as e:
            return f"{n} tokens: {e}"
    return None


def results_section_name(section: str, preset: str | None) -> str:
    """RESULTS.md section of a run: ``make bench`` (preset "cpu") owns ``section``; a run with no preset or
    preset "full" (the full grids, with or without overrides) writes ``section-full``; any other preset NAME
    writes ``section-NAME``. So no run overwrites another's table."""
    if preset == "cpu":
        return section
    return f"{section}-{preset or 'full'}"


def add_results_arguments(parser, section: str, presets: bool = True) -> None:
    """``--write-results`` and ``--results-file`` of a benchmark script whose RESULTS.md section is ``section``
    (named per preset by :func:`results_section_name` where the script has ``presets``)."""
    parser.add_argument("--write-results", action="store_true",
                        help=f"rewrite the '{section}' section of --results-file with --preset cpu, "
                             f"'{section}-full' with no preset or 'full', '{section}-NAME' with any other --preset NAME"
                        if presets else f"rewrite the '{section}' section of --results-file")
    parser.add_argument("--results-file", type=Path, default=RESULTS_MD, help="markdown results file")


def write_results_section(section: str, render, png: Path | None, results_file: str | os.PathLike = RESULTS_MD,
                          preset: str | None = "cpu") -> Path:
    """Rewrite ``section`` (``results_section_name(section, preset)``) of ``results_file`` with ``render(plot_rel)``.

    ``preset``: the run's preset; scripts with no presets leave the default and write ``section`` itself.

    ``plot_rel`` is the PNG's path relative to the results file, or None when there is
    no plot or it is git-ignored (RESULTS.md then names it without embedding it).
    """
    section = results_section_name(section, preset)
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


def results_header(title: str, machine: dict[str, Any], git: dict[str, Any], command: str,
                   timestamp: str | None = None) -> str:
    """The markdown lines every section starts with: title, machine, commit, exact command."""
    return "\n".join([
        f"## {title}",
        "",
        f"- Machine: {machine_summary(machine)}",
        f"- Commit: {git_summary(git)}",
        f"- Date: {timestamp or now_iso()}",
        f"- Command: `{command}`",
    ])


def section_header(title: str, payload: dict) -> str:
    """:func:`results_header` of a run's JSON payload (:func:`report_header`: its machine, commit, command, time)."""
    return results_header(title, payload["machine"], payload["git"], payload["command"], payload.get("timestamp"))


def closing_lines(payload: dict, alt: str, plot_rel: str | None) -> list[str]:
    """The last lines of a task's RESULTS section: the run's wall time and peak memory, then its plot."""
    return [wall_and_memory_line(payload), "", plot_markdown(alt, plot_rel, payload["config"]["plot"])]


# ------------------------------------------------------------ the harness every task script shares
# The policy comparisons of issues 17 and 18, each run by the needle and multi-turn presets of that name on the
# script's own grid. issue17: decode-time retrieval (Quest in-device / offloaded, FreeKV) against full KV, SnapKV
# and HeteroCache. issue18: the other seed systems (ContextKeeper, SyncKV); SyncKV is refused at rho 0.3 (SmolLM2's
# R-heads, one of 3 KV heads per layer, alone hold 1/3 of the KV; its BudgetError is recorded as the reason it is
# absent). issue18-peers: the three peers side by side at the budgets each can reach on SmolLM2: rho 0.5 (all of
# them; HCAttention = values on host, exact keys) and 0.125 (HCAttention's g=32 key codes; the others refuse it).
ISSUE_COMPARISONS = {
    "issue17": {"policies": ["full", "snapkv", "heterocache", "quest", "quest:offload=true", "freekv"],
                "budgets": [0.1, 0.3]},
    "issue18": {"policies": ["full", "snapkv", "heterocache", "contextkeeper", "synckv"], "budgets": [0.3, 0.5]},
    "issue18-peers": {"policies": ["full", "heterocache", "contextkeeper", "synckv", "hcattention"],
                      "budgets": [0.125, 0.5]},
}


def make_combos(policies: Sequence[str], budgets: Sequence[float]) -> list[tuple[str, float]]:
    """(registry name, rho): full KV first and once (the reference), then every other policy x budget."""
    combos = [("full", 1.0)]
    for name in policies:
        if name != "full":
            combos += [(name, float(b)) for b in budgets]
    return combos


def combo_label(name: str, rho: float) -> str:
    return "full" if name == "full" else f"{name}@{rho:g}"


def subplots(*args, **kwargs):
    """``matplotlib.pyplot.subplots`` on the file-only Agg backend (benchmarks run headless): (fig, axes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(*args, **kwargs)


def wall_and_memory_line(payload: dict) -> str:
    """The closing line of a RESULTS section: the run's wall time and peak resident memory."""
    return (f"Total wall time {payload['total_seconds'] / 60:.1f} min; peak RSS "
            f"{payload['peak_rss_bytes'] / 2**20:,.0f} MiB.")


# The destinations of the files a script writes (--out, --plot, --json; --results-file only with --write-results);
# every other argument of type Path is an input it reads (--merge, --text, --profile, --render, ...), except the
# folders it writes into.
OUTPUT_DESTS = ("out", "plot", "json", "results_file")
OUTPUT_FOLDER_DESTS = ("dump_hlo",)


class BenchParser(argparse.ArgumentParser):
    """A benchmark script's parser: ``parse_args`` also refuses (a usage error, exit 2, before any work) an output
    that is the same file as another output or as a Path-typed input (:meth:`check_paths`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.plot_beside_out = False  # --plot defaults to --out with .png (add_output_arguments)
        self.unwritten: dict[str, str] = {}  # output dest -> the dest that, when given, means it is not written

    def not_written_with(self, output: str, given: str) -> None:
        """Declare that output ``output`` (a dest) is not written when argument ``given`` is set."""
        self.unwritten[output] = given

    def parse_args(self, args=None, namespace=None):
        ns = super().parse_args(args, namespace)
        self.check_paths(ns)
        return ns

    def check_paths(self, ns: argparse.Namespace) -> None:
        """``hetero_jax.io.files.check_outputs`` over ``ns``'s outputs (OUTPUT_DESTS, those of type Path) and
        its other Path-typed arguments as inputs; ``parser.error`` on a clash. Call it again after filling in
        an output's default (``parse_grid_args`` does)."""
        outputs, inputs = {}, {}
        for action in self._actions:
            value = getattr(ns, action.dest, None)
            if action.type is not Path or value is None or action.dest in OUTPUT_FOLDER_DESTS:
                continue
            flag = action.option_strings[-1] if action.option_strings else action.dest
            if action.dest not in OUTPUT_DESTS:
                inputs[flag] = value
            elif action.dest == "results_file" and not getattr(ns, "write_results", False):
                continue
            elif getattr(ns, self.unwritten.get(action.dest, ""), None) is None:
                outputs[flag] = value
        if self.plot_beside_out and getattr(ns, "plot", None) is None and "--out" in outputs:
            outputs["--plot"] = Path(outputs["--out"]).with_suffix(".png")
        from hetero_jax.errors import OutputError
        from hetero_jax.io.files import check_outputs

        try:
            check_outputs(outputs, inputs, parents=True)
        except OutputError as e:
            self.error(str(e))


def argument_parser(description: str, **kwargs) -> BenchParser:
    """A benchmark script's parser (:class:`BenchParser`); its --help shows every argument's default unless
    ``kwargs`` name another ``formatter_class``."""
    kwargs.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
    return BenchParser(description=description, **kwargs)


def add_output_arguments(parser, name: str, section: str, plot_help: str = "PNG plot", *, presets: bool = True,
                         out_per_preset: bool = False) -> None:
    """--out / --plot (beside the JSON by default) and the RESULTS.md flags of a task script writing
    benchmarks/out/NAME.json (NAME-PRESET.json with ``out_per_preset``: :func:`parse_grid_args` fills it in)."""
    if out_per_preset:
        parser.add_argument("--out", type=Path, default=None,
                            help=f"JSON output (default: benchmarks/out/{name}[-PRESET].json)")
    else:
        parser.add_argument("--out", type=Path, default=OUT_DIR / f"{name}.json", help="JSON output")
    parser.add_argument("--plot", type=Path, default=None, help=f"{plot_help} (default: --out with .png)")
    parser.plot_beside_out = True
    add_results_arguments(parser, section, presets)


def add_preset_argument(parser, presets: dict) -> None:
    """--preset of a script whose presets are argument defaults (:func:`parse_with_preset`); the help lists them."""
    parser.add_argument("--preset", choices=sorted(presets),
                        help="a named configuration; explicit flags override it. "
                             + "; ".join(f"{k}: {v}" for k, v in presets.items()))


def parse_with_preset(parser, presets: dict, argv=None, fallback: str | None = None) -> argparse.Namespace:
    """Parse ``argv`` with the values of its --preset (of preset ``fallback`` when none is given) as the parser's
    defaults, so explicit flags override them (and ``--preset NAME --help`` shows them)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--preset", choices=sorted(presets))
    preset = pre.parse_known_args(argv)[0].preset or fallback
    if preset:
        parser.set_defaults(**presets[preset])
    return parser.parse_args(argv)


# A grid script's presets (bench_needle, bench_multiturn) each name the whole grid: its preset arguments are absent
# unless given (argparse.SUPPRESS) and :func:`parse_grid_args` fills the others from --preset.
def preset_help(presets: dict, key: str) -> str:
    """' (full: ...; cpu: ...)' for one preset argument's help."""
    def show(v):
        return " ".join(map(str, v)) if isinstance(v, list) else str(v)

    return " (" + "; ".join(f"{name}: {show(p[key])}" for name, p in presets.items()) + ")"


def preset_minutes_help(presets: dict, estimate) -> str:
    """'cpu ~4 min, issue15 ~11 min, ...' for the --preset help."""
    return (", ".join(f"{k} ~{estimate(v):.0f} min" for k, v in presets.items())
            + " on an idle machine (longer on a shared one).")


def apply_preset(args, presets: dict) -> None:
    """Fill every preset argument not given on the command line from ``--preset`` (or the full preset)."""
    preset = presets[getattr(args, "preset", None) or "full"]
    for key, value in preset.items():
        if getattr(args, key, None) is None:
            setattr(args, key, list(value) if isinstance(value, list) else value)


def add_grid_preset_argument(parser, presets: dict, estimate_minutes, described: str) -> None:
    """--preset of a grid script; ``described`` says what the presets are, the help adds each one's run time."""
    parser.add_argument("--preset", choices=sorted(presets), default=argparse.SUPPRESS,
                        help=f"{described} Explicit arguments override the preset. Estimated time on 2 CPU cores: "
                             + preset_minutes_help(presets, estimate_minutes))


def add_policy_arguments(parser, presets: dict) -> None:
    """--policies and --budgets of a grid script."""
    parser.add_argument("--policies", nargs="+", default=argparse.SUPPRESS, type=policy_spec,
                        help="registered policies, optionally with options (quest:offload=true); full KV always runs, "
                             "as the reference" + preset_help(presets, "policies"))
    parser.add_argument("--budgets", type=float, nargs="+", default=argparse.SUPPRESS,
                        help="budgets rho in (0, 1]" + preset_help(presets, "budgets"))


def add_haystacks_argument(parser, presets: dict, each: str) -> None:
    """--haystacks of a grid script; ``each`` says what runs on every haystack."""
    import haystack

    parser.add_argument("--haystacks", nargs="+", default=argparse.SUPPRESS, choices=list(haystack.HAYSTACKS),
                        metavar="NAME", help="haystacks (benchmarks/haystack.py HAYSTACKS: "
                                             + ", ".join(haystack.HAYSTACKS) + f"); {each}"
                                             + preset_help(presets, "haystacks"))


def add_model_arguments(parser, model: str) -> None:
    """--no-compile-cache, --dtype and the hidden --model of a script that loads one model."""
    parser.add_argument("--no-compile-cache", action="store_true",
                        help="do not use the persistent XLA compilation cache")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                        help="model dtype (default: the loader's)")
    parser.add_argument("--model", default=model, help=argparse.SUPPRESS)


def parse_grid_args(parser, presets: dict, name: str, argv=None) -> argparse.Namespace:
    """Parse a grid script's ``argv``: the preset arguments not given from --preset (the 'full' preset without
    one), --out benchmarks/out/NAME[-PRESET].json and --plot beside it by default, full KV first among the policies
    (the reference), --budgets checked, repeated --haystacks dropped."""
    args = parser.parse_args(argv)
    args.preset = getattr(args, "preset", None)
    apply_preset(args, presets)
    suffix = "" if args.preset in (None, "full") else f"-{args.preset}"
    args.out = args.out or OUT_DIR / f"{name}{suffix}.json"
    args.plot = args.plot or args.out.with_suffix(".png")
    parser.check_paths(args)  # the outputs just filled in
    if "full" not in args.policies:
        args.policies = ["full", *args.policies]
    args.budgets = checked_budgets(parser, args.budgets)
    args.haystacks = list(dict.fromkeys(args.haystacks))
    return args


def checked_budgets(parser, budgets: Sequence[float]) -> list[float]:
    """``--budgets`` in (0, 1], duplicates dropped in order (``parser.error`` otherwise)."""
    if any(not 0.0 < b <= 1.0 for b in budgets):
        parser.error("--budgets must be in (0, 1]")
    return list(dict.fromkeys(budgets))


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

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with atomic_path(path, "--plot") as tmp:  # the format named: matplotlib would add .png to a bare name
            fig.savefig(tmp, dpi=dpi, format=path.suffix.lstrip(".").lower() or "png",
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
                              args.results_file, preset=preset)
    return payload
