"""Counting the launches of one run of a compiled XLA module from its HLO text (``COUNTING_RULE``), for
``bench_step_ops.py``: a small parser of the optimized HLO (computations, instructions, their attributes) and the
walk that counts kernels, custom calls, copies and control flow, with where each launch comes from."""

from __future__ import annotations

import dataclasses
import re
from collections import Counter

COUNTING_RULE = (
    "Counted in the optimized HLO of the compiled executable (`compiled.as_text()`). Only computations that run "
    "as control flow are walked: ENTRY and, transitively, the bodies/conditions of `while`, the branches of "
    "`conditional`, the `to_apply` of `call` (command buffers) and the computation an `async-start` wraps; "
    "fused computations and reducers (referenced by `calls=` of a fusion or `to_apply=` of a reduce/sort/"
    "scatter) are inside a kernel and are not walked. In a walked computation: each `fusion` is one kernel "
    "(by kind: kLoop/kInput/kOutput, kCustom by its backend kind, e.g. Triton GEMM); each `custom-call` is one "
    "launch, by `custom_call_target` (`__cublas$*`: cuBLAS GEMM; `__gpu$xla.gpu.triton`: a Pallas kernel; "
    "`*callback*`: a host callback, counted apart and not as a kernel); each `copy` and each `copy-start` "
    "(asynchronous, e.g. host<->device) one copy; every other op that is not free (parameter, constant, "
    "get-tuple-element, tuple, bitcast, after-all, the *-done/*-update halves of async pairs, ...) one kernel "
    "under 'other'. A `while` body's launches count once per trip when XLA knows the trip count "
    "(`known_trip_count`; the condition then never runs), else body and condition once each (flagged); a "
    "`conditional` counts its largest branch. A `conditional` (and each trip of a `while` without a known trip "
    "count) also waits for its predicate on the host: loops, trips and conditionals are listed apart. "
    "Kernels per step = fusions + custom calls other than host callbacks + copies + other, loops expanded. "
    "'fusion( in text' is the plain substring count, for comparison with the XLA:CPU numbers quoted before.")


# ==================================================================== HLO text
_FREE_OPS = frozenset({
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "add-dependency",
    "opt-barrier", "domain", "copy-done", "async-done", "async-update", "send-done", "recv-done",
    "all-reduce-done", "all-gather-done", "collective-permute-done", "get-dimension-size",
})
_HEADER = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-$]+)\s*(\(.*\))?\s*->.*\{\s*$")
_NAME = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-$]+)\s*=\s*")
_OPCODE = re.compile(r"\s*([a-z][a-z0-9\-_]*)\(")


@dataclasses.dataclass
class HloInstruction:
    name: str
    opcode: str
    text: str  # the whole line

    def attr(self, key: str) -> str | None:
        """The value of ``key=`` (a %name, a {list} or a "string"), or None."""
        m = re.search(r"[\s,]" + re.escape(key) + r"=(\{[^}]*\}|\"[^\"]*\"|%?[\w.\-$]+)", self.text)
        return None if m is None else m.group(1).strip('"')

    def called(self, key: str) -> list[str]:
        v = self.attr(key)
        if v is None:
            return []
        return [x.strip().lstrip("%") for x in v.strip("{}").split(",") if x.strip()]


def _split_type(rest: str) -> str:
    """``rest`` after 'name = ' with the result type removed (a tuple type may hold spaces and parentheses)."""
    rest = rest.lstrip()
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                return rest[i + 1:]
        return ""
    parts = rest.split(" ", 1)
    return parts[1] if len(parts) > 1 else ""


def parse_hlo(text: str) -> tuple[dict[str, list[HloInstruction]], str | None]:
    """The computations of an HLO module's text: ({name: instructions}, the ENTRY computation's name)."""
    comps: dict[str, list[HloInstruction]] = {}
    entry, current = None, None
    for line in text.splitlines():
        if current is None:
            m = _HEADER.match(line)
            if m:
                current = m.group(2)
                comps[current] = []
                if m.group(1):
                    entry = current
            continue
        if line.strip() == "}":
            current = None
            continue
        m = _NAME.match(line)
        if not m:
            continue
        op = _OPCODE.match(_split_type(line[m.end():]))
        if op:
            comps[current].append(HloInstruction(m.group(1), op.group(1), line))
    return comps, entry


def _trip_count(ins: HloInstruction) -> int | None:
    m = re.search(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)', ins.text)
    return int(m.group(1)) if m else None


def _fusion_kind(ins: HloInstruction) -> str:
    kind = ins.attr("kind") or "?"
    if kind == "kCustom":
        m = re.search(r'"fusion_backend_config"\s*:\s*\{\s*"kind"\s*:\s*"([^"]+)"', ins.text)
        return f"kCustom:{m.group(1)}" if m else "kCustom"
    return kind


def custom_call_kind(target: str) -> str:
    """cublas | pallas_triton | host_callback | cudnn | other, for a ``custom_call_target``."""
    t = target.lower()
    if t.startswith("__cublas"):
        return "cublas"
    if t == "__gpu$xla.gpu.triton":
        return "pallas_triton"
    if "callback" in t:
        return "host_callback"
    if t.startswith("__cudnn"):
        return "cudnn"
    return "other"


def is_gemm_fusion(kind: str) -> bool:
    return kind.startswith("kCustom:") and ("gemm" in kind or "cublas" in kind)


def count_step_ops(text: str) -> dict:
    """Launches of one run of the module in ``text`` (``COUNTING_RULE``)."""
    comps, entry = parse_hlo(text)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    fusions: Counter = Counter()
    custom: Counter = Counter()
    other: Counter = Counter()
    c = {"copies": 0, "async_copies": 0, "while_loops": 0, "unknown_trip_loops": 0, "loop_trips": 0, "conditionals": 0}

    in_loops = [0]
    by_source: Counter = Counter()

    def walk(name: str, times: int, stack: tuple, looped: bool = False, source: str | None = None) -> None:
        if name in stack:
            raise ValueError(f"recursive HLO computation {name}")
        for ins in comps.get(name, ()):
            op = ins.opcode
            src = source or op_source(ins)
            if op not in _FREE_OPS and op not in ("while", "conditional", "call", "async-start") and not (
                    op == "custom-call" and custom_call_kind(ins.attr("custom_call_target") or "") == "host_callback"):
                by_source[src] += times
                if looped:
                    in_loops[0] += times
            if op == "fusion":
                fusions[_fusion_kind(ins)] += times
            elif op == "custom-call":
                custom[ins.attr("custom_call_target") or "?"] += times
            elif op == "copy":
                c["copies"] += times
            elif op == "copy-start":
                c["async_copies"] += times
            elif op == "while":
                c["while_loops"] += 1
                n = _trip_count(ins)
                if n is None:
                    c["unknown_trip_loops"] += 1
                c["loop_trips"] += times * (n or 1)
                for body in ins.called("body"):
                    walk(body, times * (n or 1), stack + (name,), True, src)
                if n is None:  # with a known trip count XLA runs the body n times without the condition
                    for cond in ins.called("condition"):
                        walk(cond, times, stack + (name,), True, src)
            elif op == "conditional":
                c["conditionals"] += 1
                branches = ins.called("branch_computations") or (
                    ins.called("true_computation") + ins.called("false_computation"))
                sizes = [(count_step_ops_in(comps, b), b) for b in branches]
                if sizes:
                    walk(max(sizes)[1], times, stack + (name,), looped, src)
            elif op == "call":
                for sub in ins.called("to_apply"):
                    walk(sub, times, stack + (name,), looped, source)
            elif op == "async-start":
                for sub in ins.called("calls"):
                    walk(sub, times, stack + (name,), looped, source)
            elif op not in _FREE_OPS:
                other[op] += times

    walk(entry, 1, ())
    by_kind = Counter()
    for target, n in custom.items():
        by_kind[custom_call_kind(target)] += n
    n_fusion = sum(fusions.values())
    gemm_fusions = sum(n for k, n in fusions.items() if is_gemm_fusion(k))
    host_callbacks = by_kind.get("host_callback", 0)
    n_custom = sum(custom.values())
    kernels = n_fusion + (n_custom - host_callbacks) + c["copies"] + c["async_copies"] + sum(other.values())
    return {
        "fusions": n_fusion,
        "fusions_by_kind": dict(sorted(fusions.items())),
        "custom_calls": n_custom,
        "custom_calls_by_target": dict(sorted(custom.items())),
        "custom_calls_by_kind": dict(sorted(by_kind.items())),
        "gemms": by_kind.get("cublas", 0) + gemm_fusions,
        "gemm_fusions": gemm_fusions,
        "pallas_calls": by_kind.get("pallas_triton", 0),
        "host_callbacks": host_callbacks,
        "copies": c["copies"],
        "async_copies": c["async_copies"],
        "other_ops": dict(sorted(other.items())),
        "while_loops": c["while_loops"],
        "unknown_trip_loops": c["unknown_trip_loops"],
        "loop_trips": c["loop_trips"],
        "kernels_in_loops": in_loops[0],
        "kernels_by_source": dict(by_source.most_common()),
        "conditionals": c["conditionals"],
        "kernels_per_step": kernels,
        "fusion_substrings": text.count(" fusion("),
        "computations": len(comps),
        "hlo_chars": len(text),
    }


def op_source(ins: HloInstruction) -> str:
    """Where an instruction comes from, for the launch breakdown: the first function jitted inside the step in its
    ``op_name`` metadata (``jit(decode_step_jit)/jit(topk_membership)/...`` -> ``topk_membership``), else the jax
    primitive (``jit(decode_step_jit)/slice`` -> ``slice``), else the opcode."""
    m = re.search(r'op_name="([^"]*)"', ins.text)
    if not m:
        return f"({ins.opcode})"
    parts = [p for p in m.group(1).split("/") if p]
    jits = [p[4:-1] for p in parts if p.startswith("jit(") and p.endswith(")")]
    if len(jits) >= 2:
        return jits[1]
    rest = [p for p in parts if not p.startswith("jit(")]
    return rest[-1] if rest else (jits[0] if jits else f"({ins.opcode})")


def count_step_ops_in(comps: dict, name: str) -> int:
    """Rough size of one computation (its non-free instructions), to pick a conditional's largest branch."""
    return sum(1 for ins in comps.get(name, ()) if ins.opcode not in _FREE_OPS)

