"""What a benchmark run records about where it ran: the machine, the commit, the command, its memory.

- :func:`machine_info`, :func:`machine_summary`: CPU model, cores, RAM, load average, Python/JAX versions, backend
  and devices, kernel backend in force (JAX imported lazily: a parent that only orchestrates children stays light).
- :func:`git_info`, :func:`git_summary`, :func:`git_ignored`: short commit plus a dirty flag (read-only git calls).
- :func:`command_line`, :func:`now_iso`, :func:`report_header`: the common top of every benchmark's JSON.
- :func:`peak_rss_bytes`, :func:`current_rss_bytes`: this process's memory.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import resource
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence


BENCH_DIR = Path(__file__).resolve().parents[1]  # benchmarks/ (this file: benchmarks/harness/machine.py)


REPO_ROOT = BENCH_DIR.parent


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


def _thp_mode() -> str | None:
    """The kernel's transparent huge page mode (always / madvise / never), or None where it has none. Under
    madvise, XLA's buffers (the host store on a CPU) get 4 KiB pages unless glibc's malloc asks for huge ones
    (GLIBC_TUNABLES=glibc.malloc.hugetlb=1): the host gather's rows then cost a page walk each."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else text.strip()


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
                                          "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "GLIBC_TUNABLES")
                if k in os.environ},
        "transparent_hugepage": _thp_mode(),
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
            # the pool attention (every layer's decode attention) and HeteroCache's drift statistics have
            # native CPU kernels besides Pallas
            info["kernels"] = mode if pool == mode else f"{mode} (pool attention, drift statistics: {pool})"
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
    tunables = (info.get("env") or {}).get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb=1" in tunables or "glibc.malloc.hugetlb=2" in tunables:
        parts.append("malloc huge pages (GLIBC_TUNABLES)")
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
        return {"commit": os.environ["HETERO_JAX_COMMIT"], "dirty": None, "changed_files": [],
                "commit_from": "HETERO_JAX_COMMIT"}
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
    """'COMMIT (clean)' or '(dirty: N ...)'; where the tree was not checked (``dirty`` None: a commit given by
    HETERO_JAX_COMMIT, ``git status`` failing), '(tree state unknown)', never clean."""
    if not g.get("commit"):
        return "unknown (not a git checkout)"
    if g.get("dirty"):
        return f"{g['commit']} (dirty: {len(g['changed_files'])} changed/untracked paths)"
    if g.get("dirty") is None:
        given = f"from {g['commit_from']}; " if g.get("commit_from") else ""
        return f"{g['commit']} ({given}tree state unknown)"
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


# ---------------------------------------------------------------------- RSS
def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (ru_maxrss; KiB on Linux, bytes on macOS)."""
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(r) if sys.platform == "darwin" else int(r) * 1024


def current_rss_bytes() -> int | None:
    """Resident set size now (VmRSS), or None where /proc is missing."""
    return _proc_kib_field("/proc/self/status", "VmRSS")
