"""Needles, answer matching and haystack bookkeeping shared by the needle, multi-turn and tasks scripts.

- :class:`Needle`, :func:`make_needle` (:data:`NEEDLE_KINDS`): the fact a needle prompt hides and asks for;
  :func:`shortest_prompt` (with :func:`saved_tokenizer`, before the model loads): the fewest tokens its prompt takes.
- :func:`normalize_text`, :func:`numbers_in`, :func:`find_answer`, :func:`answer_correct`: whether a generated text
  states an answer.
- :func:`record_haystack`, :func:`haystacks_of`, :func:`config_haystacks`, :func:`haystack_lines`: which haystacks a
  run's records and config name, and the RESULTS lines describing them.
- :func:`cell_scores`, :func:`score_grid`, :func:`compare_with_full`, :func:`summarize`: a needle grid's scores
  per cell and combo, and how each combo's cells compare with full KV's.
- :func:`interp_cost`: the piecewise-linear cost tables of the presets' run-time estimates.
"""

from __future__ import annotations

import dataclasses
import random
import re
import unicodedata

import haystack
from harness.grid import combo_label


# The presets' run-time estimates: the model's load, and the cores an idle 2-core machine gives a run (the measured
# runs used about one core each, so wall time ~ CPU seconds / 1.3).
LOAD_S = 10.0
IDLE_CORES = 1.3


def interp_cost(table: dict[int, float], n: int) -> float:
    """Piecewise-linear interpolation in ``table`` (length -> seconds), extrapolated from the last two points."""
    xs = sorted(table)
    i = max(1, min(len(xs) - 1, next((k for k, x in enumerate(xs) if x >= n), len(xs) - 1)))
    x0, x1 = xs[i - 1], xs[i]
    return max(0.0, table[x0] + (table[x1] - table[x0]) * (n - x0) / (x1 - x0))


# ------------------------------------------------------------------ needles
@dataclasses.dataclass(frozen=True)
class Needle:
    """One fact to find: the sentence put in the haystack, the question after it, the expected answer."""

    kind: str
    sentence: str
    question: str
    answer: str


_CITIES = ["Lisbon", "Oslo", "Nairobi", "Montevideo", "Reykjavik", "Kyoto", "Antwerp", "Cusco"]


def _magic_number(seed: int) -> Needle:
    key = haystack.make_passkey(seed)
    return Needle("magic-number", f"The special magic number is {key}.",
                  "What is the special magic number mentioned in the text?", key)


def _passkey(seed: int) -> Needle:
    key = haystack.make_passkey(seed)
    return Needle("passkey", haystack.PASSKEY_NEEDLE.format(key=key), haystack.PASSKEY_QUESTION, key)


def _city(seed: int) -> Needle:
    city = random.Random(f"city-{seed}").choice(_CITIES)
    return Needle("city", f"The annual sailing festival takes place in {city}.",
                  "In which city does the annual sailing festival take place?", city)


NEEDLE_KINDS = {"magic-number": _magic_number, "passkey": _passkey, "city": _city}


def make_needle(kind: str, seed: int) -> Needle:
    """The needle of ``kind`` for ``seed`` (deterministic)."""
    return NEEDLE_KINDS[kind](seed)


def shortest_prompt(tokenizer, kind: str, seeds, instruction: str | None = None) -> int:
    """The fewest tokens a needle prompt of needle ``kind`` takes for any of ``seeds`` (its instruction, needle and
    question in the chat template, no haystack): ``haystack.build_needle_prompt`` refuses a shorter length."""
    needles = [make_needle(kind, seed) for seed in seeds]
    return max(len(tokenizer.encode_prompt(haystack.compose_fixed(instruction, [(0.0, n.sentence)], n.question),
                                           chat=True)) for n in needles)


def saved_tokenizer(model: str):
    """The tokenizer of ``--model`` read alone from its checkpoint on disk (a known model's converted copy), before
    the weights load; None where there is no checkpoint yet (the load converts it) or it cannot be read."""
    from hetero_jax.errors import HeteroJaxError
    from hetero_jax.io.checkpoint import is_checkpoint
    from hetero_jax.io.hub import checkpoint_dir
    from hetero_jax.io.tokenizer import Tokenizer

    path = checkpoint_dir(model)
    try:
        return Tokenizer.from_dir(path) if path and is_checkpoint(path) else None
    except HeteroJaxError:  # the load names what is wrong with the checkpoint
        return None


# ---------------------------------------------------------- answer matching
def fold_text(text: str) -> str:
    """Lower case with accents folded (NFKD, combining marks dropped); punctuation kept."""
    text = unicodedata.normalize("NFKD", text)
    return "".join(c for c in text if not unicodedata.combining(c)).lower()


def normalize_text(text: str) -> str:
    """Lower case, accents and punctuation folded to spaces, whitespace collapsed."""
    return " ".join(re.sub(r"[^a-z0-9]+", " ", fold_text(text)).split())


# a number as written: a thousands-grouped one (a 1-3 digit lead, then groups of exactly 3 digits, one separator
# throughout: 48,213, 48 213, 1,732,000) is one number; any other run of digits is one ("1732 123" is 1732 and 123)
_NUMBER = re.compile(r"(?<!\d)(?:\d{1,3}([,\u202f\u00a0 ])\d{3}(?:\1\d{3})*|\d+)(?!\d)")


def numbers_in(text: str) -> list[tuple[int, str]]:
    """(offset in ``text``, digits) of every number ``text`` states, in order (a grouped one with its separators
    dropped)."""
    return [(m.start(), re.sub(r"\D", "", m.group())) for m in _NUMBER.finditer(text)]


def find_answer(generated: str, answer: str) -> list[int]:
    """Where ``generated`` states ``answer``: the start of each occurrence, in order (empty when it does not).

    A number must appear as one number (:func:`numbers_in`: 48,213 or 48 213
    count; 482130 does not, nor does 48213 in "48 2130"; "1732 123" states 1732);
    offsets are in ``generated``. Words must appear as whole words, ignoring case,
    accents and punctuation, with an optional plural ``s``/``es``; offsets are in
    ``normalize_text(generated)``. So offsets of two answers compare (their order
    in the text) when both are numbers or both are words.
    """
    ans = normalize_text(answer)
    if not ans:
        raise ValueError("empty answer")
    if ans.isdigit():
        return [at for at, digits in numbers_in(generated) if digits == ans]
    return [m.start() for m in re.finditer(rf"(?<![a-z0-9]){re.escape(ans)}(?:e?s)?(?![a-z0-9])",
                                           normalize_text(generated))]


def answer_correct(generated: str, answer: str) -> bool:
    """Whether ``generated`` states ``answer`` (:func:`find_answer` finds it at least once)."""
    return bool(find_answer(generated, answer))


def record_haystack(r: dict) -> str:
    """The haystack of a record (records written before haystacks were recorded used pydoc)."""
    return r.get("haystack", haystack.DEFAULT_HAYSTACK)


def haystacks_of(records: list[dict]) -> list[str]:
    """The haystacks the records ran on, in first-seen order."""
    return list(dict.fromkeys(record_haystack(r) for r in records))


def config_haystacks(cfg: dict) -> list[str]:
    """The haystacks of a run's config (["pydoc"] for runs from before haystacks were configurable)."""
    return list(cfg.get("haystacks") or [haystack.DEFAULT_HAYSTACK])


def haystack_lines(cfg: dict) -> list[str]:
    """One markdown bullet per haystack: its source, size and the versions it depends on."""
    lines = []
    for h, info in (cfg.get("haystack_sources") or {}).items():
        deps = ", ".join(f"{d} {v['version']}" for d, v in info.get("distributions", {}).items())
        size = f"{info['tokens']:,} tokens" if "tokens" in info else f"{info['chars']:,} characters"
        lines.append(f"- Haystack `{h}`: {info['source']}; {size}, Python {info['python']}"
                     + (f", {deps}" if deps else "") + f"; sha256 {info['sha256'][:12]}.")
    return lines


# --------------------------------------------------------- grid bookkeeping
def cell_scores(records: list[dict], label: str, haystack_name: str | None = None) -> dict[tuple[int, float], float]:
    """{(length, depth): fraction of the cell's prompts answered correctly} for one combo: the cell's seeds on
    ``haystack_name``, or on every haystack pooled when None."""
    cells: dict[tuple[int, float], list[bool]] = {}
    for r in records:
        if r["label"] == label and haystack_name in (None, record_haystack(r)):
            cells.setdefault((r["length"], r["depth"]), []).append(bool(r["correct"]))
    return {k: sum(v) / len(v) for k, v in cells.items()}


def score_grid(records: list[dict], label: str, lengths, depths) -> list[list[float | None]]:
    """[depth][length] cell scores of one combo (None where the grid has no record)."""
    cells = cell_scores(records, label)
    return [[cells.get((L, d)) for L in lengths] for d in depths]


def compare_with_full(records: list[dict], label: str) -> dict:
    """How a combo's (haystack, length, depth) cells compare with full KV's: equal cells, cells above/below, and
    which differ."""
    n_cells, differ = 0, []
    for h in haystacks_of(records):
        ref, mine = cell_scores(records, "full", h), cell_scores(records, label, h)
        common_cells = sorted(set(ref) & set(mine))
        n_cells += len(common_cells)
        differ += [{"haystack": h, "length": L, "depth": d, "full": ref[(L, d)], "score": mine[(L, d)]}
                   for L, d in common_cells if mine[(L, d)] != ref[(L, d)]]
    return {
        "cells": n_cells,
        "equal": n_cells - len(differ),
        "above": sum(1 for c in differ if c["score"] > c["full"]),
        "below": sum(1 for c in differ if c["score"] < c["full"]),
        "differ": differ,
    }


def summarize(records: list[dict], combos, lengths) -> list[dict]:
    """One row per combo: accuracy overall and per length, achieved rho, comparison with full KV."""
    rows = []
    for name, rho in combos:
        label = combo_label(name, rho)
        rs = [r for r in records if r["label"] == label]
        if not rs:
            continue
        per_len, per_hay = {}, {}
        for L in lengths:
            c = [r["correct"] for r in rs if r["length"] == L]
            per_len[str(L)] = (sum(c), len(c))
        for h in haystacks_of(rs):
            c = [r["correct"] for r in rs if record_haystack(r) == h]
            per_hay[h] = (sum(c), len(c))
        rows.append({
            "label": label, "policy": name, "rho": rho,
            "correct": sum(r["correct"] for r in rs), "total": len(rs),
            "accuracy": sum(r["correct"] for r in rs) / len(rs),
            "per_length": per_len, "per_haystack": per_hay,
            "achieved_rho": sum(r["achieved_rho"] for r in rs) / len(rs),
            "kv_bytes_prompt_mean": sum(r["kv_bytes_prompt"] for r in rs) / len(rs),
            "vs_full": compare_with_full(records, label),
        })
    return rows
