"""What the benchmark scripts of this folder share, and what a script alone needs beside its command line, run and
report (imported by bare name: a script run as ``python benchmarks/NAME.py`` and the tests have ``benchmarks/`` on
``sys.path``). ``common`` re-exports the shared names, as it always has.

Shared, lowest first (each imports only those above it):

- :mod:`harness.machine`: where a run ran (machine, commit, command) and its memory.
- :mod:`harness.merging`: what every ``--merge`` shares (the merged runs' provenance and its lines in a section, the
  checks that the runs compare, their preset).
- :mod:`harness.results`: what a run writes (JSON, markdown tables, RESULTS.md sections, figures, a child's result).
- :mod:`harness.args`: the scripts' command lines (output checks, RESULTS.md flags, presets).
- :mod:`harness.grid`: the grid runner of the needle, multi-turn, tasks, policies and latency scripts (combos and
  their refusals, the JSON's header, the progress bar over the points, the totals).
- :mod:`harness.prefill`: one forward pass feeding every policy's selection; greedy decode after it.
- :mod:`harness.needles`: needles, answer matching, haystack bookkeeping, the needle grid's scores.

One script's own: :mod:`harness.facts` (multi-turn), :mod:`harness.task_cases` and :mod:`harness.task_report`
(tasks), :mod:`harness.synthetic`, :mod:`harness.roofline`, :mod:`harness.latency_report` (latency),
:mod:`harness.policies_report` (policies).
"""
