"""The command lines of the benchmark scripts: a parser that refuses an output clashing with another path, the
output and RESULTS.md flags, and the presets (a script's named configurations; a grid script's name its whole grid).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Sequence

from harness.results import BENCH_FORMAT, OUT_DIR, RESULTS_MD


def policy_spec(text: str) -> str:
    """argparse type of ``--policies``: a registered name, optionally with options (``quest:offload=true``),
    returned with the name as its registry key ('HeteroCache:copy_window=16' -> 'heterocache:copy_window=16'):
    the benchmarks pick profiles, targets and weights by that name."""
    from hetero_jax.errors import HeteroJaxError
    from hetero_jax.policies import make_policy, registry_key

    try:
        make_policy(text)
    except HeteroJaxError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    name, sep, options = text.partition(":")
    return registry_key(name) + sep + options


def add_results_arguments(parser, section: str, presets: bool = True, *, named: bool = False) -> None:
    """``--write-results`` and ``--results-file`` of a benchmark script whose RESULTS.md section is ``section``
    (named per preset by :func:`results_section_name` where the script has ``presets``); with ``named``,
    ``--section NAME`` too (``run_task`` writes that section instead; :meth:`BenchParser.check_section`)."""
    parser.add_argument("--write-results", action="store_true",
                        help=f"rewrite the '{section}' section of --results-file with --preset cpu, "
                             f"'{section}-full' with no preset or 'full', '{section}-NAME' with any other --preset NAME"
                        if presets else f"rewrite the '{section}' section of --results-file")
    parser.add_argument("--results-file", type=Path, default=RESULTS_MD, help="markdown results file")
    if named:
        parser.results_section = section
        parser.add_argument("--section", default=None, metavar="NAME",
                            help=f"with --write-results: rewrite section NAME ('{section}' or '{section}-...': "
                                 "letters, digits, '_', '-', '.') instead of the preset's, so a section cited by name "
                                 "(README) is rewritten by the command it records; a section of that name is "
                                 "replaced, never repeated")


# The destinations of the files a script writes (--out, --plot, --json; --results-file only with --write-results);
# every other argument of type Path is an input it reads (--merge, --text, --profile, --render, ...), except the
# folders it writes into (OUTPUT_FOLDER_DESTS: each must be a directory it can create or write into).
OUTPUT_DESTS = ("out", "plot", "json", "results_file")


OUTPUT_FOLDER_DESTS = ("dump_hlo", "out_dir")


# The model a script loads (a str: a known model name or a checkpoint directory): an input too (model_input).
MODEL_DESTS = ("model",)


def model_input(value) -> str | None:
    """The checkpoint a ``--model`` value loads, as an input path for the output checks: the path itself when it
    exists, else the directory ``hetero_jax.io.hub.load`` reads for a known name (``hub.checkpoint_dir``), else
    None (nothing on disk to protect)."""
    if not isinstance(value, (str, os.PathLike)):
        return None
    if os.path.lexists(value):
        return os.fspath(value)
    from hetero_jax.io.hub import checkpoint_dir

    return checkpoint_dir(value)


class BenchParser(argparse.ArgumentParser):
    """A benchmark script's parser: ``parse_args`` also refuses (a usage error, exit 2, before any work) an output
    that is the same file as another output or as a Path-typed input (:meth:`check_paths`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.plot_beside_out = False  # --plot defaults to --out with .png (add_output_arguments)
        self.unwritten: dict[str, str] = {}  # output dest -> the dest that, when given, means it is not written
        self.results_section: str | None = None  # the script's section, where it has --section (add_results_arguments)

    def not_written_with(self, output: str, given: str) -> None:
        """Declare that output ``output`` (a dest) is not written when argument ``given`` is set."""
        self.unwritten[output] = given

    def parse_args(self, args=None, namespace=None):
        ns = super().parse_args(args, namespace)
        self.check_paths(ns)
        self.check_section(ns)
        return ns

    def check_section(self, ns: argparse.Namespace) -> None:
        """``parser.error`` unless ``--section NAME`` (where the script has it) is given with --write-results and NAME
        is the script's section or starts with it and '-' (a script never rewrites another's section), in the
        characters of a section marker (``harness.results.replace_section``)."""
        name, base = getattr(ns, "section", None), self.results_section
        if name is None or base is None:
            return
        if not getattr(ns, "write_results", False):
            self.error(f"--section {name} names the section --write-results rewrites: add --write-results")
        if not re.fullmatch(r"[A-Za-z0-9_.\-]+", name) or not (name == base or name.startswith(base + "-")):
            self.error(f"--section {name!r}: give '{base}' or '{base}-' and a suffix of letters, digits, '_', '-', "
                       f"'.' (e.g. '{base}-2k-three-seeds')")

    def check_paths(self, ns: argparse.Namespace) -> None:
        """``hetero_jax.io.files.check_outputs`` over ``ns``'s outputs (OUTPUT_DESTS, those of type Path) and
        its other Path-typed arguments as inputs, with the checkpoint ``--model`` loads (:func:`model_input`) an
        input too; each output folder (OUTPUT_FOLDER_DESTS) must be a directory that can be created or written
        into. ``parser.error`` on a clash or an unusable path. Call it again after filling in an output's default
        (``parse_grid_args`` does)."""
        from hetero_jax.io.files import dir_problem

        outputs, inputs = {}, {}
        for action in self._actions:
            value = getattr(ns, action.dest, None)
            if value is None:
                continue
            flag = action.option_strings[-1] if action.option_strings else action.dest
            if action.dest in MODEL_DESTS and action.type is not Path:
                model = model_input(value)
                if model is not None:
                    inputs[flag] = model
                continue
            if action.type is not Path:
                continue
            if action.dest in OUTPUT_FOLDER_DESTS:
                problem = dir_problem(value)
                if problem:
                    self.error(f"{flag} {value} cannot be used as a folder to write into ({problem}); choose "
                               f"another {flag}")
                continue
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
        from hetero_jax.io.own_outputs import FIGURE

        try:  # --results-file: one section rewritten; --out / --plot replace only an earlier result / figure
            check_outputs(outputs, inputs, parents=True, updated=["--results-file"],
                          kinds={"--out": BENCH_FORMAT, "--plot": FIGURE})
        except OutputError as e:
            self.error(str(e))


def read_json_inputs(parser, flag: str, paths: Sequence[str | os.PathLike], keys: Sequence[str],
                     script: str, *, benchmark: str | None = None, config_keys: Sequence[str] = (),
                     items: dict[str, Sequence[str]] | None = None,
                     mappings: dict[str, Sequence[str]] | None = None) -> list[dict]:
    """The files of input ``flag`` (``--merge A.json B.json``, ``--render X.json``), each read as a JSON object
    holding every one of ``keys`` (the parts of a result file of ``script`` that the reader uses). Otherwise
    ``parser.error`` (exit 2, before any work) naming the flag, the file and what is wrong: not found, a
    directory, unreadable, not JSON, or not a result file of ``script``.

    ``benchmark``: the ``"benchmark"`` field every result of ``script`` carries (``report_header``): a file of
    another benchmark is refused as such, one without the field as no result. ``config_keys``: what its config
    must hold. ``items``: {key: item keys}: ``data[key]`` must be a list of objects each holding the item keys;
    ``mappings`` the same for an object of objects (e.g. bench_step_ops' targets)."""
    fix = f"give a JSON file that {script} wrote (its --out)"
    parts = []
    for path in paths:
        shown = os.fspath(path)
        if not os.path.exists(shown):
            parser.error(f"{flag} {shown}: no such file; {fix}")
        if os.path.isdir(shown):
            parser.error(f"{flag} {shown} is a directory, not a file; {fix}")
        try:
            with open(shown, encoding="utf-8") as f:
                data = json.load(f)
        except OSError as e:
            parser.error(f"{flag} {shown} cannot be read ({e.strerror or e}); {fix}")
        except UnicodeDecodeError:
            parser.error(f"{flag} {shown} is not JSON (not UTF-8 text); {fix}")
        except json.JSONDecodeError as e:
            parser.error(f"{flag} {shown} is not JSON ({e.msg} at line {e.lineno} column {e.colno}); {fix}")
        if not isinstance(data, dict):
            parser.error(f"{flag} {shown} is not a result file of {script} (a JSON {type(data).__name__}, not an "
                         f"object); {fix}")
        if benchmark is not None and data.get("benchmark", benchmark) != benchmark:
            parser.error(f"{flag} {shown} is a result of {_script_of(data['benchmark'])}, not of {script} (its "
                         f"'benchmark' is {data['benchmark']!r}, {script}'s {benchmark!r}); {fix}")
        missing = [k for k in keys if k not in data]
        if missing:
            parser.error(f"{flag} {shown} is not a result file of {script} (it has no "
                         f"{', '.join(repr(k) for k in missing)}); {fix}")
        if "config" in keys and not isinstance(data["config"], dict):
            parser.error(f"{flag} {shown} is not a result file of {script} (its 'config' is not an object); {fix}")
        if benchmark is not None and "benchmark" not in data:
            parser.error(f"{flag} {shown} is not a result file of {script} (it has no 'benchmark'); {fix}")
        problem = _shape_problem(data, config_keys, items or {}, mappings or {})
        if problem:
            parser.error(f"{flag} {shown} is not a complete result file of {script} ({problem}); {fix}")
        parts.append(data)
    return parts


def _script_of(benchmark) -> str:
    """The script whose results carry ``"benchmark": benchmark`` (bench_NAME.py or NAME.py where one exists)."""
    from harness.machine import BENCH_DIR

    for name in (f"bench_{benchmark}.py", f"{benchmark}.py"):
        if isinstance(benchmark, str) and (BENCH_DIR / name).is_file():
            return name
    return f"another benchmark ({benchmark!r})"


def _shape_problem(data: dict, config_keys: Sequence[str], items: dict[str, Sequence[str]],
                   mappings: dict[str, Sequence[str]]) -> str | None:
    """What a result's config, lists or objects lack (:func:`read_json_inputs`' ``config_keys``, ``items`` and
    ``mappings``), or None."""
    missing = [k for k in config_keys if k not in data.get("config", {})]
    if missing:
        return f"its 'config' has no {', '.join(repr(k) for k in missing)}"
    for key, needed in [*items.items(), *mappings.items()]:
        value, kind = data.get(key), list if key in items else dict
        if not isinstance(value, kind):
            return (f"its {key!r} is a JSON {_json_type(value)}, not "
                    + ("a list" if kind is list else "an object") + " of objects")
        pairs = enumerate(value) if kind is list else ((repr(k), v) for k, v in value.items())
        for i, item in pairs:
            if not isinstance(item, dict):
                return f"its {key}[{i}] is a JSON {_json_type(item)}, not an object"
            lacks = [k for k in needed if k not in item]
            if lacks:
                return f"its {key}[{i}] has no {', '.join(repr(k) for k in lacks)}"
    return None


def _json_type(value) -> str:
    return {dict: "object", list: "array", str: "string", int: "number", float: "number", bool: "boolean",
            type(None): "null"}.get(type(value), type(value).__name__)


def argument_parser(description: str, **kwargs) -> BenchParser:
    """A benchmark script's parser (:class:`BenchParser`); its --help shows every argument's default unless
    ``kwargs`` name another ``formatter_class``."""
    kwargs.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
    return BenchParser(description=description, **kwargs)


def add_output_arguments(parser, name: str, section: str, plot_help: str = "PNG plot", *, presets: bool = True,
                         out_per_preset: bool = False, named: bool = False, out_help: str | None = None) -> None:
    """--out / --plot (beside the JSON by default) and the RESULTS.md flags of a task script writing
    benchmarks/out/NAME.json (NAME-PRESET.json with ``out_per_preset``: :func:`parse_grid_args` or
    :func:`fill_outputs` fills it in; ``out_help`` names that default where it is another)."""
    if out_per_preset:
        parser.add_argument("--out", type=Path, default=None,
                            help=f"JSON output (default: {out_help or f'benchmarks/out/{name}[-PRESET].json'})")
    else:
        parser.add_argument("--out", type=Path, default=OUT_DIR / f"{name}.json", help="JSON output")
    parser.add_argument("--plot", type=Path, default=None, help=f"{plot_help} (default: --out with .png)")
    parser.plot_beside_out = True
    add_results_arguments(parser, section, presets, named=named)


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


SMALLEST = "min"  # a --budgets value: each policy's smallest budget at each length (Policy.smallest_budget)


def budget_value(text: str) -> float | str:
    """A --budgets value: a number, or 'min' (each policy's smallest budget at each prompt length)."""
    if text == SMALLEST:
        return SMALLEST
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a budget: give a number in (0, 1] or '{SMALLEST}'") from None


def add_policy_arguments(parser, presets: dict, *, smallest: bool = False) -> None:
    """--policies and --budgets of a grid script; ``smallest``: the script runs --budgets min (its combos resolve
    the budget per prompt length: ``harness.grid.Combos.policy``)."""
    parser.add_argument("--policies", nargs="+", default=argparse.SUPPRESS, type=policy_spec,
                        help="registered policies, optionally with options (quest:offload=true); full KV always runs, "
                             "as the reference" + preset_help(presets, "policies"))
    parser.add_argument("--budgets", type=budget_value if smallest else float, nargs="+", default=argparse.SUPPRESS,
                        help="budgets rho in (0, 1]" + (f", or '{SMALLEST}': each policy's smallest budget at each "
                                                        "length" if smallest else "")
                             + preset_help(presets, "budgets"))


def add_compressed_policy_arguments(parser) -> None:
    """--policies and --budget of a script that times a few policies at one rho (extend, serve)."""
    parser.add_argument("--policies", nargs="+", type=policy_spec,
                        help="registered policies, optionally with options (quest:offload=true)")
    parser.add_argument("--budget", type=float, default=0.3, help="rho of the compressed policies")


def parse_compressed_policy_args(parser, presets: dict, argv=None) -> argparse.Namespace:
    """``parse_with_preset`` ('full' when no preset is given) with ``--budget`` checked to lie in (0, 1]."""
    args = parse_with_preset(parser, presets, argv, fallback="full")
    if not 0.0 < args.budget <= 1.0:
        parser.error("--budget must be in (0, 1]")
    return args


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
    (the reference), --budgets checked, a value repeated in a preset list (--lengths, --seeds, --depths,
    --policies, --haystacks, ...) run once (:func:`unique`), and two --policies specs of one policy configuration
    refused (:func:`repeated_policy`)."""
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
    for key in dict.fromkeys(k for p in presets.values() for k, v in p.items() if isinstance(v, list)):
        setattr(args, key, unique(f"--{key.replace('_', '-')}", getattr(args, key)))
    problem = repeated_policy(args.policies)
    if problem:
        parser.error(problem)
    return args


def repeated_policy(specs: Sequence[str]) -> str | None:
    """Why two of ``specs`` (--policies) would run one policy twice under two labels ('snapkv' and 'SnapKV' or
    'snapkv:window=32': the same configuration, ``repr`` of ``make_policy``), or None."""
    from hetero_jax.policies import make_policy

    seen: dict[str, str] = {}
    for spec in specs:
        key = repr(make_policy(spec))
        if key in seen and seen[key] != spec:
            return (f"--policies {seen[key]} and {spec} are one policy ({key}): it would run, and count, twice; "
                    "give it once")
        seen.setdefault(key, spec)
    return None


def unique(flag: str, values: Sequence) -> list:
    """``values`` with each repeat dropped (the first kept, in order), a note on stderr naming the repeats: a grid
    point given twice would run, and count, twice."""
    kept = list(dict.fromkeys(values))
    if len(kept) < len(values):
        repeated = [v for v in kept if values.count(v) > 1]
        print(f"note: {flag} repeats {' '.join(map(str, repeated))}: each runs once", file=sys.stderr)
    return kept


def fill_outputs(parser, args: argparse.Namespace, name: str) -> None:
    """--out benchmarks/out/NAME.json and --plot beside it where not given (``add_output_arguments`` with
    ``out_per_preset``), then the output checks again over the paths just filled in."""
    args.out = args.out or OUT_DIR / f"{name}.json"
    args.plot = args.plot or args.out.with_suffix(".png")
    parser.check_paths(args)


def checked_budgets(parser, budgets: Sequence[float | str]) -> list[float | str]:
    """``--budgets`` in (0, 1] (or 'min' where the script takes it), repeats dropped in order with a note
    (:func:`unique`; ``parser.error`` otherwise)."""
    if any(b != SMALLEST and not 0.0 < b <= 1.0 for b in budgets):
        parser.error("--budgets must be in (0, 1]")
    return unique("--budgets", budgets)
