"""What every ``--merge`` shares (``bench_tasks.py``, ``bench_latency.py``): the merged payload's header (the merge's
own command, commit and time), each merged run's provenance (file, commit, machine, command) and its lines in the
RESULTS section, the checks that the runs compare (a field that differs names the two files), and the preset the
runs share (so the RESULTS section they belong to). Standard library only.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Sequence

from harness.machine import git_summary, machine_summary, report_header


def merge_header(parts: Sequence[dict], cfg: dict) -> dict:
    """The top of a merged payload (:func:`report_header`): the merge's own time, command, commit and config; the
    machine is the first run's (the section's header names every run's machine: :func:`header_machine`)."""
    return report_header(parts[0].get("benchmark", "merge"), cfg, parts[0].get("machine") or {})


def provenance(files: Sequence, parts: Sequence[dict]) -> list[dict]:
    """``config["merged_from"]`` of a merge: per run its file, commit (and the whole git state), machine, command,
    time, and the runs it resumed or merged itself (so merging a merge keeps every run's provenance)."""
    return [{"file": os.fspath(f), "commit": (p.get("git") or {}).get("commit"), "git": p.get("git") or {},
             "machine": p.get("machine") or {}, "command": p.get("command"), "timestamp": p.get("timestamp"),
             "resumed_from": p.get("resumed_from", []), "merged_from": (p.get("config") or {}).get("merged_from", [])}
            for f, p in zip(files, parts)]


def _machine_kind(machine: dict) -> str:
    """A run's machine without the load average at its start (which differs between any two runs)."""
    return machine_summary({**machine, "loadavg_1_5_15": None})


def header_machine(payload: dict) -> str | dict:
    """The header's machine of ``payload``: its machine (a dict) unless it is a merge (``config["merged_from"]``),
    then the one machine every run names (without load averages) or how many machines the runs ran on."""
    runs = [m for m in (payload.get("config") or {}).get("merged_from") or []
            if isinstance(m, dict) and m.get("machine")]
    if not runs:
        return payload["machine"]
    kinds = list(dict.fromkeys(_machine_kind(m["machine"]) for m in runs))
    if len(kinds) == 1:
        return f"{kinds[0]} (every merged run's; each run's load average is listed below)"
    return (f"{len(kinds)} different machines (each merged run's is listed below: rows of different runs were timed "
            "on different machines)")


def _timed_runs(runs: Sequence) -> list[dict]:
    """The runs that timed rows among a merge's ``merged_from`` (a merged merge's own runs in its place)."""
    out = []
    for m in runs:
        if isinstance(m, dict):
            out += _timed_runs(m["merged_from"]) if m.get("merged_from") else [m]
    return out


def figure_provenance(payload: dict) -> str:
    """A figure's 'commit, machine' subtitle: the run's own, or for a merge its runs' (not the merge's own commit
    and first run's machine): the one commit / CPU they share, else how many there are."""
    runs = _timed_runs((payload.get("config") or {}).get("merged_from") or [])
    if not runs:
        return f"{git_summary(payload['git'])}, {payload['machine'].get('cpu_model', '?')}"
    commits = list(dict.fromkeys(git_summary(m["git"]) if m.get("git") else str(m.get("commit")) for m in runs))
    kinds = list(dict.fromkeys(_machine_kind(m.get("machine") or {}) for m in runs))
    commit = commits[0] if len(commits) == 1 else f"runs at {len(commits)} commits ({'; '.join(commits)})"
    cpu = (runs[0].get("machine") or {}).get("cpu_model", "?") if len(kinds) == 1 else \
        f"{len(kinds)} different machines"
    return f"{commit}, {cpu}"


def _run_line(m: dict | str, indent: str = "") -> list[str]:
    if not isinstance(m, dict):  # a merge written before merged_from held more than file names
        return [f"{indent}- `{m}`"]
    git = git_summary(m["git"]) if m.get("git") else m.get("commit")
    where = f", {machine_summary(m['machine'])}" if m.get("machine") else ""
    when = f", {m['timestamp']}" if m.get("timestamp") else ""
    line = f"{indent}- `{m.get('file')}`: {git}{where}{when}, `{m.get('command')}`" + "".join(
        f" (resuming {r['cases']} cases run at {r['commit']} by `{r['command']}`)" for r in m.get("resumed_from", []))
    inner = m.get("merged_from") or []
    if inner:
        line += f", itself merged from {len(inner)} runs:"
    return [line, *[x for r in inner for x in _run_line(r, indent + "  ")]]


def merged_lines(cfg: dict) -> list[str]:
    """The section's lines naming a merge's runs (none when ``cfg`` is no merge's), then a blank line."""
    runs = cfg.get("merged_from") or []
    if not runs:
        return []
    return [f"Merged (`--merge`) from {len(runs)} runs, each its own commit, machine and command (the header's "
            "command and commit are the merge's):", "", *[x for m in runs for x in _run_line(m)], ""]


def refuse_differences(files: Sequence, parts: Sequence[dict], field: str,
                       values: Callable[[dict], dict[Any, Any]], what: Callable[[Any], str] | None = None) -> None:
    """SystemExit naming the two files when the runs disagree on ``field``: ``values(part)`` gives a run's values by
    key (one key for a scalar field; a policy label, a haystack, ... otherwise); each key's value must be the same
    in every run that has the key. ``what(key)`` names a key in the message."""
    first: dict = {}
    for f, p in zip(files, parts):
        for key, value in values(p).items():
            if key not in first:
                first[key] = (f, value)
            elif first[key][1] != value:
                name = field if what is None else f"{field} of {what(key)}"
                raise SystemExit(f"--merge: {f} was run with another {name} ({value!r}) than {first[key][0]} "
                                 f"({first[key][1]!r}): the runs do not compare; merge runs of one configuration")


def merged_preset(files: Sequence, parts: Sequence[dict], given: str | None) -> str | None:
    """The preset of the merged runs, which names their RESULTS section (``results_section_name``: no preset and
    'full' name the same one). SystemExit when the runs' presets differ or ``given`` (a ``--preset`` on the merge's
    command line) is not theirs."""
    def section(preset):
        return preset or "full"

    refuse_differences(files, parts, "--preset (none is 'full')", lambda p: {0: section(p["config"].get("preset"))})
    preset = parts[0]["config"].get("preset")
    if given is not None and section(given) != section(preset):
        raise SystemExit(f"--merge: the runs were run with --preset {section(preset)} (none is 'full'), not --preset "
                         f"{given}: drop --preset (a merge writes its runs' section) or give --section NAME with "
                         "--write-results")
    return preset
