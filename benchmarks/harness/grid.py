"""The grid runner of the benchmark scripts (needle, multi-turn, tasks, policies, latency).

A grid script runs policies x budgets (:class:`Combos`: :func:`make_combos`, :func:`combo_label`) over points
(lengths x depths / seeds / cases / haystacks):

1. :func:`load`: the persistent compilation cache, the combos of ``--policies`` / ``--budgets``, the model, and
   which (combo, length) pairs the policy refuses (:func:`refused_by_length`: a budget it cannot keep, left out and
   named in the report);
2. :func:`open_payload`: the JSON's header (name, time, command, full config, machine, git) and its lists;
3. :func:`drive`: every point in order under one progress bar (:func:`points`: the grid);
4. :func:`close_payload`: total wall (and CPU) time, load average and peak memory;

then :func:`harness.results.run_task` writes the JSON, the plot, the tables on stdout and, with ``--write-results``, the
script's RESULTS.md section. :func:`parser` and :func:`add_preset_list` build the command line of a script whose
presets name the grid (:data:`ISSUE_COMPARISONS`: the policy comparisons several of them run);
:func:`engine_kv_stats`: an engine's KV bytes and counters, as each record keeps them.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import sys
import time
from typing import Any, Callable, Sequence

from harness.args import SMALLEST, add_grid_preset_argument, argument_parser, preset_help, repeated_policy
from harness.machine import machine_info, peak_rss_bytes, report_header


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
    # a smallest-budget combo's policy holds the default budget; Combos.policy gives it each length's own
    policies = [make_policy(n, None if n == "full" or r == SMALLEST else r) for n, r in combos]
    t0 = time.perf_counter()
    model = hetero_jax.load(args.model, dtype=getattr(args, "dtype", None), progress=False)
    return model, combos, labels, policies, time.perf_counter() - t0


def smallest_budgets(model, combos, labels, policies, lengths) -> tuple[dict, dict]:
    """({label: {str(length): rho}} of every smallest-budget combo at each of ``lengths``
    (``Policy.smallest_budget``), {label: {str(length): the budget error}} where no budget fits)."""
    from hetero_jax.policies import BudgetError

    found: dict[str, dict[str, float]] = {}
    refused: dict[str, dict[str, str]] = {}
    for (_, rho), lab, pol in zip(combos, labels, policies):
        if rho != SMALLEST:
            continue
        for L in lengths:
            try:
                found.setdefault(lab, {})[str(L)] = pol.smallest_budget(model, int(L))
            except BudgetError as e:
                refused.setdefault(lab, {})[str(L)] = f"{L} tokens: {e}"
                print(f"skipping {lab} at {L} tokens: {e}", file=sys.stderr)
    return found, refused


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


def make_combos(policies: Sequence[str], budgets: Sequence[float | str]) -> list[tuple[str, float | str]]:
    """(registry name, rho or 'min'): full KV first and once (the reference), then every other policy x budget.
    A label given twice (a repeated policy or budget, or budgets one label rounds together) or two specs of one
    policy (:func:`harness.args.repeated_policy`) raise ConfigError: the combo would run, and count, twice."""
    from hetero_jax.errors import ConfigError

    combos = [("full", 1.0)]
    for name in policies:
        if name != "full":
            combos += [(name, b if b == SMALLEST else float(b)) for b in budgets]
    labels = [combo_label(n, r) for n, r in combos]
    twice = [lab for lab in dict.fromkeys(labels) if labels.count(lab) > 1]
    if twice:
        raise ConfigError(f"the combo {twice[0]} is given twice (--policies or --budgets repeat it): it would run, "
                          "and count, twice; give each policy and budget once")
    problem = repeated_policy([n for n, _ in combos])
    if problem:
        raise ConfigError(problem)
    return combos


def combo_label(name: str, rho: float | str) -> str:
    return "full" if name == "full" else f"{name}@{rho}" if rho == SMALLEST else f"{name}@{rho:g}"


@dataclasses.dataclass(frozen=True)
class Combos:
    """A grid's policy x budget combos in order (full KV first): (registry name, rho or 'min'), label and policy
    object of each, ``refused``: {label: {str(length): the budget error}} for the lengths a combo cannot run, and
    ``smallest``: {label: {str(length): rho}} of the 'min' combos (each policy's smallest budget at that length)."""

    combos: list
    labels: list
    policies: list
    refused: dict
    smallest: dict = dataclasses.field(default_factory=dict)

    def keep(self, which: Callable[[str], bool]) -> "Combos":
        """The combos whose label ``which`` accepts (``refused`` unchanged: the report names every refusal)."""
        idx = [i for i, lab in enumerate(self.labels) if which(lab)]
        return Combos([self.combos[i] for i in idx], [self.labels[i] for i in idx], [self.policies[i] for i in idx],
                      self.refused, self.smallest)

    def rho(self, i: int, length: int) -> float:
        """Combo ``i``'s budget at ``length`` (a 'min' combo's: that length's smallest)."""
        rho = self.combos[i][1]
        return self.smallest[self.labels[i]][str(length)] if rho == SMALLEST else rho

    def policy(self, i: int, length: int):
        """Combo ``i``'s policy at ``length`` (a 'min' combo's with that length's smallest budget)."""
        if self.combos[i][1] != SMALLEST:
            return self.policies[i]
        from hetero_jax.policies import make_policy

        return make_policy(self.combos[i][0], self.rho(i, length))

    def runnable_somewhere(self, lengths: Sequence[int]) -> "Combos":
        """The combos that some length of ``lengths`` does not refuse."""
        return self.keep(lambda lab: len(self.refused.get(lab, {})) < len(lengths))

    def never_refused(self) -> "Combos":
        """The combos no length refuses."""
        return self.keep(lambda lab: lab not in self.refused)

    def active(self, length: int) -> list[int]:
        """Indices of the combos that run at ``length``."""
        return [i for i, lab in enumerate(self.labels) if str(length) not in self.refused.get(lab, {})]


def refusals(model, combos, labels, policies, lengths: Sequence[int]) -> Combos:
    """:class:`Combos` of ``combos`` with the refusals of ``model`` at ``lengths`` (each also named on stderr) and
    the 'min' combos' budgets there."""
    fixed = [i for i, (_, rho) in enumerate(combos) if rho != SMALLEST]  # 'min' combos: smallest_budgets
    refused = refused_by_length(model, [labels[i] for i in fixed], [policies[i] for i in fixed],
                                lengths) if lengths else {}
    smallest, none_fits = smallest_budgets(model, combos, labels, policies, lengths)
    return Combos(list(combos), list(labels), list(policies), {**refused, **none_fits}, smallest)


def load(args, lengths: Sequence[int] = ()) -> tuple[object, Combos, float]:
    """``load_grid(args)`` and the refusals at ``lengths`` (none checked when empty).
    Returns (model, combos, seconds the model load took)."""
    model, combos, labels, policies, load_s = load_grid(args)
    return model, refusals(model, combos, labels, policies, lengths), load_s


def open_payload(section: str, config: dict, load_seconds: float, **lists) -> dict:
    """The JSON of a run: :func:`harness.machine.report_header` (config, machine, git), ``load_seconds``, then
    ``lists`` (the records the run appends to), in the order given."""
    payload = report_header(section, config, machine_info())
    payload["load_seconds"] = load_seconds
    payload.update(lists)
    return payload


def points(*axes: Sequence) -> list[tuple]:
    """Every point of the grid: the product of ``axes``, the first one outermost."""
    return list(itertools.product(*axes))


def drive(grid: Sequence[tuple], run_point: Callable, *, desc: str, unit: str, describe: Callable[..., str],
          total: int | None = None, disable: bool = False, update: bool = True) -> None:
    """``run_point(*point, bar)`` for every point of ``grid`` under one tqdm progress bar: its description is
    ``describe(*point)``; ``update``: one step per point (else ``run_point`` advances the bar itself, of
    ``total`` steps)."""
    from tqdm import tqdm

    bar = tqdm(total=len(grid) if total is None else total, desc=desc, unit=unit, dynamic_ncols=True,
               disable=disable)
    for point in grid:
        bar.set_description(describe(*point))
        run_point(*point, bar)
        if update:
            bar.update(1)
    bar.close()


def close_payload(payload: dict, t_start: float, *, cpu: bool = True) -> dict:
    """Set the run's total wall time (from ``t_start``, a ``time.perf_counter()``), with ``cpu`` its CPU seconds and
    the load average at the end, and its peak resident memory. Returns ``payload``."""
    payload["total_seconds"] = time.perf_counter() - t_start
    if cpu:
        payload["total_process_seconds"] = time.process_time()  # CPU seconds of every thread, since start
        payload["load_avg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    payload["peak_rss_bytes"] = peak_rss_bytes()
    return payload


def parser(description: str, presets: dict, estimate_minutes: Callable[[dict], float], described: str):
    """A grid script's parser (:func:`harness.args.argument_parser`) with its --preset (``described`` says what the
    presets are; the help adds each one's estimated run time)."""
    p = argument_parser(description)
    add_grid_preset_argument(p, presets, estimate_minutes, described)
    return p


def add_preset_list(p, presets: dict, flag: str, help: str, **kwargs) -> None:
    """One list argument that a grid preset sets: absent unless given (``parse_grid_args`` fills it from the
    preset); its help ends with every preset's value."""
    key = flag.lstrip("-").replace("-", "_")
    p.add_argument(flag, nargs="+", default=argparse.SUPPRESS, help=help + preset_help(presets, key), **kwargs)
