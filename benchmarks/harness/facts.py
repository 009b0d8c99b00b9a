"""The multi-turn script's contexts: unrelated facts placed far apart in a haystack, and ``Session`` objects built
around engines that the shared prefill made.

- :class:`Fact`, :func:`make_facts`, :func:`fact_depths`: the facts of a seed and where they go.
- :class:`Context`, :func:`build_context`: the fitted context and where its facts landed, in the session's tokens.
- :func:`session_context_ids`, :func:`session_around`: what ``Session(model, context)`` prefills, and a
  ``Session`` whose engine is a prebuilt one (so its own turn logic runs unchanged).
- :func:`summarize`, :func:`within_one_of_full`, :func:`hetero_vs_snapkv`: a run's records per (length, combo),
  and its two criteria; :func:`retrieval_table`: decode-time retrieval's means over contexts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import sys

import haystack
from harness.grid import combo_label
from harness.needles import haystacks_of, record_haystack
from harness.results import fmt_num, markdown_table

MiB = 2**20


# -------------------------------------------------------------------- facts
@dataclasses.dataclass(frozen=True)
class Fact:
    """One fact: the sentence placed in the context, the question asked later, the one-word answer."""

    kind: str
    sentence: str
    question: str
    answer: str


_TICKETS = ["ferry", "museum", "night train", "cable car", "opera", "harbour tour"]
_NAMES = ["Tobias", "Ingrid", "Ravi", "Elena", "Kofi", "Hana", "Lucas", "Amara"]
_FAVOURITES = {
    "colour": ["purple", "turquoise", "crimson", "amber"],
    "animal": ["otter", "giraffe", "badger", "walrus"],
    "instrument": ["cello", "trumpet", "harp", "banjo"],
}
_DAY_EVENTS = ["piano recital", "team dinner", "boat trip", "book club"]
_DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Saturday", "Sunday"]
_CITY_EVENTS = ["chess final", "science fair", "jazz festival", "robot contest"]
_CITIES = ["Lisbon", "Oslo", "Nairobi", "Montevideo", "Reykjavik", "Kyoto", "Antwerp", "Cusco"]
FACT_KINDS = ("number", "favourite", "day", "city")


def _ticket_number(rng: random.Random, haystack_name: str = haystack.DEFAULT_HAYSTACK) -> str:
    """A 4-digit number that does not occur in the haystack's corpus."""
    return haystack.absent_number(rng, 1000, 9999, (haystack_name,))


def _make_fact(kind: str, rng: random.Random, used: set, haystack_name: str = haystack.DEFAULT_HAYSTACK) -> Fact:
    def pick(pool):
        left = [x for x in pool if x not in used] or list(pool)
        x = rng.choice(left)
        used.add(x)
        return x

    if kind == "number":  # not "code": next to Python's documentation the model starts writing code
        thing = pick(_TICKETS)
        n = _ticket_number(rng, haystack_name)
        return Fact(kind, f"The ticket number for the {thing} is {n}.", f"What is the ticket number for the {thing}?",
                    n)
    if kind == "favourite":
        name, cat = pick(_NAMES), pick(sorted(_FAVOURITES))
        v = pick(_FAVOURITES[cat])
        return Fact(kind, f"{name}'s favourite {cat} is the {v}." if cat != "colour"
                    else f"{name}'s favourite colour is {v}.", f"What is {name}'s favourite {cat}?", v)
    if kind == "day":
        event, day = pick(_DAY_EVENTS), pick(_DAYS)
        return Fact(kind, f"The {event} is on {day}.", f"On which day is the {event}?", day)
    if kind == "city":
        event, city = pick(_CITY_EVENTS), pick(_CITIES)
        return Fact(kind, f"The {event} will be held in {city}.", f"In which city will the {event} be held?", city)
    raise ValueError(f"unknown fact kind {kind!r}; known: {', '.join(FACT_KINDS)}")


def make_facts(seed: int, n: int = 3, haystack_name: str = haystack.DEFAULT_HAYSTACK) -> list[Fact]:
    """``n`` unrelated facts for ``seed``: kinds rotated by the seed, subjects and values drawn from it.

    The ticket number is one that ``haystack_name``'s corpus does not contain (so, rarely, the facts of a seed
    differ between haystacks); no other answer word occurs in any haystack (``haystack.ANSWER_WORDS``)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    rng = random.Random(f"multiturn-facts-{seed}")
    kinds = [FACT_KINDS[(seed + i) % len(FACT_KINDS)] for i in range(n)]
    used: set = set()
    return [_make_fact(k, rng, used, haystack_name) for k in kinds]


def fact_depths(n: int) -> list[float]:
    """Depths of ``n`` facts: evenly from 0.15 to 0.85 (0.15 / 0.5 / 0.85 for three; 0.5 for one)."""
    if n == 1:
        return [0.5]
    return [round(0.15 + 0.7 * i / (n - 1), 4) for i in range(n)]


@dataclasses.dataclass
class Context:
    """A fitted multi-fact context and where its facts landed, in the session's tokens."""

    text: str  # the context (user message without a question)
    ids: list[int]  # what Session(model, text) prefills
    tail_capacity: int  # the tail Session reserves
    facts: list[Fact]
    depths: list[float]  # requested
    fact_token_starts: list[int]  # index of each fact's first token in ``ids``
    actual_depths: list[float]


def build_context(tokenizer, n_tokens: int, facts: list[Fact], depths: list[float], seed: int,
                  haystack_name: str = haystack.DEFAULT_HAYSTACK) -> Context:
    """The context with ``facts`` at ``depths`` whose session prefill (:func:`session_context_ids`) is exactly
    ``n_tokens`` tokens (where the tokenizer allows; never more).

    ``haystack.build_needle_prompt`` fits the whole chat prompt, whose end (the
    turn's close and the generation suffix) a ``Session`` context does not
    prefill, so its target is raised by that difference, measured on the
    fitted context and corrected until the session's tokens are ``n_tokens``.
    """
    if len(facts) != len(depths):
        raise ValueError(f"{len(facts)} facts but {len(depths)} depths")
    target, best = n_tokens + haystack.suffix_len(tokenizer, True), None
    for _ in range(4):  # the difference is a few tokens, the same at every length: one correction finds it
        p = haystack.build_needle_prompt(tokenizer, target, list(zip(depths, [f.sentence for f in facts])),
                                         None, "", seed=seed, haystack=haystack_name)
        ids, tail = session_context_ids(tokenizer, p.text)
        if len(ids) <= n_tokens and (best is None or len(ids) > len(best[1])):
            best = (p, ids, tail)
        if len(ids) == n_tokens:
            break
        target += n_tokens - len(ids)
    if best is None:
        raise ValueError(f"no context of at most {n_tokens} session tokens holds the facts")
    p, ids, tail = best
    # needle_token_starts index the chat prompt; its prefix is the session's ids
    return Context(text=p.text, ids=ids, tail_capacity=tail, facts=list(facts), depths=list(depths),
                   fact_token_starts=list(p.needle_token_starts),
                   actual_depths=[t / len(ids) for t in p.needle_token_starts])


# ------------------------------------------------- sessions around engines
def _session_cls():
    from hetero_jax.runtime import Session

    return Session


@contextlib.contextmanager
def session_engine(factory):
    """While active, the ``Engine(...)`` call in ``Session.__init__`` is answered by ``factory``."""
    mod = sys.modules[_session_cls().__module__]
    original = mod.Engine
    mod.Engine = factory
    try:
        yield
    finally:
        mod.Engine = original


class _Probe(Exception):
    pass


def session_context_ids(tokenizer, context: str) -> tuple[list[int], int]:
    """(token ids, tail capacity) that ``Session(model, context)`` would prefill; no model or compute needed."""
    got: dict = {}

    def probe(model, batch, policy, *, tail_capacity, **_):
        got.update(ids=[int(t) for t in batch[0]], tail_capacity=tail_capacity)
        raise _Probe

    with session_engine(probe):
        try:
            _session_cls()(_TokenizerOnly(tokenizer), context)
        except _Probe:
            return got["ids"], got["tail_capacity"]
    raise RuntimeError("Session(...) built no Engine; the shared prefill cannot be used (try --prefill separate)")


@dataclasses.dataclass(frozen=True)
class _TokenizerOnly:
    tokenizer: object


def session_around(model, context: str, engine, ids: list[int]):
    """``Session(model, context, policy)`` whose prefilled engine is ``engine`` (built for ``ids``)."""

    def reuse(model_, batch, policy, **_):
        if [int(t) for t in batch[0]] != ids:
            raise RuntimeError("the session's context tokens differ from the prefilled ones")
        return engine

    with session_engine(reuse):
        return _session_cls()(model, context, engine.policy)


# ------------------------------------------------------------ aggregation
def _session_key(r: dict) -> tuple[str, int]:
    return record_haystack(r), r["seed"]


def summarize(records: list[dict], combos, lengths, n_facts: int) -> list[dict]:
    """One row per (length, combo), every haystack pooled: per-turn accuracy, facts recalled (in total and per
    haystack), recall stats."""
    rows = []
    for L in lengths:
        for name, rho in combos:
            label = combo_label(name, rho)
            rs = [r for r in records if r["length"] == L and r["label"] == label]
            if not rs:
                continue
            sessions = sorted({_session_key(r) for r in rs})
            per_turn = [[r["correct"] for r in rs if r["turn"] == t] for t in range(n_facts)]
            last = {s: max((r for r in rs if _session_key(r) == s), key=lambda r: r["turn"]) for s in sessions}
            per_hay = {}
            for h in haystacks_of(rs):
                c = [r["correct"] for r in rs if record_haystack(r) == h]
                per_hay[h] = (sum(c), len(c))
            recall = [last[s]["recall"] for s in sessions]
            checks = sum(x.get("drift_checks", 0) for x in recall)
            triggers = sum(x.get("drift_triggers", 0) for x in recall)
            rows.append({
                "length": L, "label": label, "policy": name, "rho": rho, "sessions": len(sessions),
                "turn_correct": [sum(c) for c in per_turn], "turn_total": [len(c) for c in per_turn],
                "turn_accuracy": [sum(c) / len(c) if c else None for c in per_turn],
                "recalled": sum(r["correct"] for r in rs), "facts": len(rs), "per_haystack": per_hay,
                "achieved_rho": sum(r["achieved_rho"] for r in rs) / len(rs),
                "drift_checks": checks, "drift_triggers": triggers,
                "trigger_rate": triggers / checks if checks else None,
                "recalls": sum(x.get("recalls", 0) for x in recall),
                "bytes_recalled": sum(x.get("bytes_recalled", 0) for x in recall),
                "kv_bytes_host": max(last[s]["kv_bytes_host"] for s in sessions),
                "kv_bytes_device": max(last[s]["kv_bytes_device"] for s in sessions),
            })
    return rows


def recalled_per_session(records: list[dict], label: str) -> dict[tuple[str, int, int], int]:
    """{(haystack, length, seed): facts recalled} of one combo."""
    out: dict[tuple[str, int, int], int] = {}
    for r in records:
        if r["label"] == label:
            k = (record_haystack(r), r["length"], r["seed"])
            out[k] = out.get(k, 0) + int(r["correct"])
    return out


def within_one_of_full(records: list[dict], label: str) -> dict:
    """Whether ``label`` recalls at most one fact fewer than full KV in every context (haystack, length, seed)."""
    ref, mine = recalled_per_session(records, "full"), recalled_per_session(records, label)
    keys = sorted(set(ref) & set(mine))
    worst = [k for k in keys if mine[k] < ref[k] - 1]
    return {"met": bool(keys) and not worst, "contexts": len(keys),
            "failing": [{"haystack": h, "length": L, "seed": s, "full": ref[(h, L, s)], "recalled": mine[(h, L, s)]}
                        for h, L, s in worst],
            "max_shortfall": max((ref[k] - mine[k] for k in keys), default=0)}


def hetero_vs_snapkv(records: list[dict], budgets) -> list[dict]:
    """Per budget: facts recalled by HeteroCache and by SnapKV over every context, in total and per haystack;
    met iff HeteroCache's total is higher."""
    out = []
    for b in budgets:
        labels = [combo_label(n, b) for n in ("heterocache", "snapkv")]
        if not all(any(r["label"] == lab for r in records) for lab in labels):
            continue
        counts = [recalled_per_session(records, lab) for lab in labels]
        h, s = (sum(c.values()) for c in counts)
        per_hay = {hay: [sum(v for k, v in c.items() if k[0] == hay) for c in counts] for hay in haystacks_of(records)}
        out.append({"rho": b, "heterocache": h, "snapkv": s, "met": h > s, "per_haystack": per_hay})
    return out


def retrieval_table(payload: dict) -> str | None:
    """Decode-time retrieval policies (Quest, FreeKV): per combo and context length, the means over contexts of
    the last turn's session totals; None when no such policy ran."""
    rows = []
    for label in payload["config"]["combos"]:
        for L in payload["config"]["lengths"]:
            rs = [r for r in payload["records"] if r["label"] == label and r["length"] == L]
            last = {}
            for r in rs:  # the last turn of each context holds the session's totals
                k = (record_haystack(r), r["seed"])
                if k not in last or r["turn"] > last[k]["turn"]:
                    last[k] = r
            st = [r["recall"] for r in last.values()]
            if not st or "attended_fraction" not in st[0]:
                continue
            mean = lambda key: sum(x.get(key, 0) for x in st) / len(st)  # noqa: E731
            rmean = lambda key: sum(r.get(key, 0) for r in last.values()) / len(last)  # noqa: E731
            rows.append([
                label, fmt_num(L), f"{mean('attended_fraction'):.2f}",
                fmt_num(mean("recalled_pages_per_step"), 1) if "recalled_pages_per_step" in st[0] else "—",
                fmt_num(rmean("kv_bytes_prompt") / MiB, 1), fmt_num(rmean("kv_bytes_index") / MiB, 2),
                fmt_num(rmean("kv_bytes_host") / MiB, 1),
                fmt_num(rmean("kv_bytes_read_per_step") / MiB, 1),
            ])
    if not rows:
        return None
    return markdown_table(
        ["policy", "context tok", "attended fraction", "pages recalled / step",
         "prompt KV on device MiB", "index MiB (summaries, page ids)", "host KV MiB", "KV read / step MiB"],
        rows, align="lr" + "r" * 6)
