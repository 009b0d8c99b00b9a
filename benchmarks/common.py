"""Shared plumbing for the benchmark scripts in this directory: one name for what ``benchmarks/harness/`` holds,
and the end of every task script.

- :mod:`harness.machine`: :func:`machine_info`, :func:`git_info`, :func:`command_line`, :func:`report_header`,
  :func:`peak_rss_bytes` (where a run ran, on which commit, with which command).
- :mod:`harness.results`: :func:`write_json` (atomic, strict JSON), :func:`markdown_table`, :func:`run_child` /
  :func:`emit_child_result` (one configuration per fresh interpreter), :func:`update_results_section` /
  :func:`write_results_section` (one benchmark's section of ``benchmarks/RESULTS.md`` between its BEGIN/END
  markers, every other section untouched), :func:`section_header`, :func:`closing_lines`.
- :mod:`harness.args`: the scripts' parser (:class:`BenchParser`: an output may not clash with another path), the
  output and RESULTS.md flags, presets (:func:`parse_with_preset`, :func:`parse_grid_args`).
- :mod:`harness.grid`: the grid runner's combos, refusals and engine stats (:func:`make_combos`, :func:`load_grid`,
  :func:`refused_by_length`, :func:`engine_kv_stats`).
  Also figures (:func:`subplots`, :func:`save_figure`) and a task script's ending (:func:`run_task`).

Only the standard library is imported at module level (and by the harness modules above), so a parent process
that merely orchestrates children never loads JAX; :func:`machine_info` imports JAX lazily (call it from a child
if the parent must stay light, or accept the parent's import).
"""

from __future__ import annotations

from harness.args import (
    BenchParser, OUTPUT_DESTS, OUTPUT_FOLDER_DESTS, add_compressed_policy_arguments, add_grid_preset_argument,
    add_haystacks_argument, add_model_arguments, add_output_arguments, add_policy_arguments, add_preset_argument,
    add_results_arguments, apply_preset, argument_parser, checked_budgets, fill_outputs, parse_compressed_policy_args,
    parse_grid_args, parse_with_preset, policy_spec, preset_help, preset_minutes_help, read_json_inputs,
)
from harness.grid import (
    ISSUE_COMPARISONS, budget_problem, combo_label, engine_kv_stats, load_grid, make_combos, refused_by_length,
)
from harness.machine import (
    BENCH_DIR, REPO_ROOT, command_line, current_rss_bytes, git_ignored, git_info, git_summary, machine_info,
    machine_summary, now_iso, peak_rss_bytes, report_header,
)
from harness.results import (
    CHILD_RESULT_PREFIX, OUT_DIR, RESULTS_MD, closing_lines, emit_child_result, fmt_num, fraction_text,
    markdown_table, plot_markdown, replace_section, results_header, results_section_name, run_child, run_table_task,
    run_task, save_figure, section_header, subplots, update_results_section, wall_and_memory_line, write_json,
    write_results_section,
)

__all__ = [  # every name this module has always had, and the harness's newer shared ones
    "BENCH_DIR", "BenchParser", "CHILD_RESULT_PREFIX", "ISSUE_COMPARISONS", "OUTPUT_DESTS", "OUTPUT_FOLDER_DESTS",
    "OUT_DIR", "REPO_ROOT", "RESULTS_MD", "add_compressed_policy_arguments", "add_grid_preset_argument",
    "add_haystacks_argument", "add_model_arguments", "add_output_arguments", "add_policy_arguments",
    "add_preset_argument", "add_results_arguments", "apply_preset", "argument_parser", "budget_problem",
    "checked_budgets", "closing_lines", "combo_label", "command_line", "current_rss_bytes", "emit_child_result",
    "engine_kv_stats", "fill_outputs", "fmt_num", "fraction_text", "git_ignored", "git_info", "git_summary",
    "load_grid", "machine_info", "machine_summary", "make_combos", "markdown_table", "now_iso",
    "parse_compressed_policy_args", "parse_grid_args", "parse_with_preset", "peak_rss_bytes", "plot_markdown",
    "policy_spec", "preset_help", "preset_minutes_help", "read_json_inputs", "refused_by_length", "replace_section",
    "report_header", "results_header", "results_section_name", "run_child", "run_table_task", "run_task",
    "save_figure", "section_header", "subplots", "update_results_section", "wall_and_memory_line", "write_json",
    "write_results_section",
]
