"""The tasks script's cases: generated from a seed, placed in a haystack, graded automatically (docs/tasks.md).

- :class:`TaskCase`, :func:`make_case` (one maker per task of :data:`TASKS`): what goes in the haystack, what is
  asked, what a correct answer states.
- :func:`grade` (:func:`grade_pairs`, :func:`grade_names`, :func:`grade_key`, :func:`grade_span`): a reply's
  score; :func:`case_sha256`: what a record keeps of the case it graded.
- :class:`CasePrompt`, :func:`build_case_prompt`: the case's prompt of exactly N tokens, and where its forced reply
  quotes each value.
- :func:`forced_metrics`: a teacher-forced reply through every policy's engine in lockstep (``fidelity``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import re

import haystack
from harness.needles import find_answer, fold_text, normalize_text, numbers_in

# digits of a generated value: SmolLM2-135M copies four digits from far away; with five it often drops one
DIGITS = 4
TASKS = ("multi-fact", "variable-tracking", "multi-key", "span-copy", "fidelity")


# ------------------------------------------------------------------ cases
@dataclasses.dataclass(frozen=True)
class TaskCase:
    """One generated case: what goes in the haystack, what is asked, what a correct answer states.

    ``needles``: (depth in [0, 1] of the haystack, sentence), in depth order. ``values``: what a correct answer
    states (``multi-fact``: the value of each of ``things``, in the order asked). ``distractors``: what it must not
    state. ``answer_prefix``: the start of the assistant's reply, fed after the chat template's generation prompt
    (the model continues it).
    ``forced``: the whole teacher-forced reply (``fidelity``; it continues ``answer_prefix``), quoting
    ``values`` in turn."""

    task: str
    seed: int
    needles: tuple[tuple[float, str], ...]
    question: str
    values: tuple[str, ...]
    distractors: tuple[str, ...] = ()
    answer_prefix: str = ""
    instruction: str | None = None  # before the haystack (a worked example)
    forced: str | None = None
    max_new_tokens: int = 32
    things: tuple[str, ...] = ()  # multi-fact: what each value is the ticket number of, in the order asked


def spread_depths(n: int, lo: float = 0.1, hi: float = 0.9) -> list[float]:
    """``n`` depths evenly from ``lo`` to ``hi`` (the middle for one)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if n == 1:
        return [round((lo + hi) / 2, 4)]
    return [round(lo + (hi - lo) * i / (n - 1), 4) for i in range(n)]


def _numbers(rng: random.Random, n: int, digits: int = DIGITS) -> list[str]:
    """``n`` distinct ``digits``-digit numbers, none in any haystack's corpus and no two sharing their first two digits
    (so an answer cannot be half of one value and half of another)."""
    out: list[str] = []
    while len(out) < n:
        v = haystack.absent_number(rng, 10 ** (digits - 1), 10**digits - 1, tuple(haystack.HAYSTACKS))
        if all(v[:2] != o[:2] for o in out):
            out.append(v)
    return out


def _list_text(items) -> str:
    """'a, b and c'."""
    items = list(items)
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


# subjects of the multi-fact tickets (none is a word of the added haystacks' answers; each names a different thing)
_TICKETS = ("ferry", "museum", "opera", "night train", "cable car", "harbour tour")
# multi-fact's reply cap per value: in SmolLM2's tokens a complete reply in the forms it writes takes 6 for the first
# value (" 9302.") and up to 16 for each next ("\n\nThe ticket number for the harbour tour is 7017."), so 16 a
# value leaves the last one room (the longest four-value reply of seeds 0-299 takes 54 of 64)
TOKENS_PER_FACT = 16


def make_multi_fact(seed: int, n: int = 4) -> TaskCase:
    """``n`` ticket numbers of different things at spread depths; the question names the things in depth order
    and the reply starts with the first ("The ticket number for the ferry is"), so every value after the first
    is reached by moving attention to another depth."""
    if not 1 <= n <= len(_TICKETS):
        raise ValueError(f"n must be in 1..{len(_TICKETS)}, got {n}")
    rng = random.Random(f"tasks-multi-fact-{seed}")
    values = _numbers(rng, n)
    things = rng.sample(_TICKETS, n)
    needles = tuple((d, f"The ticket number for the {t} is {v}.")
                    for d, t, v in zip(spread_depths(n), things, values))
    return TaskCase("multi-fact", seed, needles,
                    "What are the ticket numbers for " + _list_text([f"the {t}" for t in things]) + "?",
                    tuple(values), answer_prefix=f"The ticket number for the {things[0]} is",
                    max_new_tokens=TOKENS_PER_FACT * n, things=tuple(things))


def make_fidelity(seed: int, n: int | None = None) -> TaskCase:
    """The multi-fact prompt with ``n`` tickets (3-5 by the seed when None) and a forced reply quoting each in
    turn, in depth order ("... ferry is 9302. The ticket number for the museum is 7720. ...")."""
    n = 3 + seed % 3 if n is None else n
    base = make_multi_fact(seed, n)
    forced = " ".join(s for _, s in base.needles)
    return dataclasses.replace(base, task="fidelity", forced=forced, max_new_tokens=0)


# variable names: five capitals (RULER's form); a name is rejected if it is a word of any haystack
def _var_names(rng: random.Random, n: int) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        name = "".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ") for _ in range(5))
        if name not in out and not any(re.search(rf"\b{name}\b", haystack.haystack_corpus(h), re.I)
                                       for h in haystack.HAYSTACKS):
            out.append(name)
    return out


# RULER's variable tracking shows the model one worked chain first; its names and value are of another form than
# the generated ones (which they can never equal: those are drawn from letters without Q, R, S repeated)
VT_INSTRUCTION = ("Memorize and track the chains of variable assignments hidden in the following text. Example: in a "
                  "text with VAR QQQQQ = 5555. ... VAR RRRRR = VAR QQQQQ. ... VAR SSSSS = VAR RRRRR. the variables "
                  "assigned the value 5555 are VAR QQQQQ, VAR RRRRR and VAR SSSSS.")


def make_variable_tracking(seed: int, hops: int = 3, distractor_hops: int = 1) -> TaskCase:
    """A chain ``VAR A = v``, ``VAR B = VAR A``, ... of ``hops`` names over the context, interleaved with a
    distractor chain of ``distractor_hops`` names bound to another value; the question asks for the names bound
    to ``v`` (after :data:`VT_INSTRUCTION`'s worked example, before the haystack). A reply naming a distractor
    scores nothing (:func:`grade_names`)."""
    if hops < 1 or not 0 <= distractor_hops <= hops:
        raise ValueError(f"hops must be >= 1 and distractor_hops in 0..hops, got {hops}, {distractor_hops}")
    rng = random.Random(f"tasks-variable-tracking-{seed}")
    value, other = _numbers(rng, 2)
    names = _var_names(rng, hops + distractor_hops)
    chain, dchain = names[:hops], names[hops:]

    def assignments(ch, v):
        if not ch:
            return []
        return [f"VAR {ch[0]} = {v}."] + [f"VAR {b} = VAR {a}." for a, b in zip(ch, ch[1:])]

    depths = spread_depths(hops + distractor_hops)
    # the distractor chain on slots 1, 3, ..., the asked one on the others: each chain keeps its order in depth
    odd = list(range(1, 2 * distractor_hops, 2))
    slots = [i for i in range(len(depths)) if i not in odd] + odd
    sentences = assignments(chain, value) + assignments(dchain, other)
    needles = tuple(sorted((depths[slots[i]], sentence) for i, sentence in enumerate(sentences)))
    return TaskCase("variable-tracking", seed, needles, f"Which variables are assigned the value {value}?",
                    tuple(chain), tuple(dchain), answer_prefix=f"The variables assigned the value {value} are VAR",
                    instruction=VT_INSTRUCTION, max_new_tokens=8 * hops + 8)


# multi-key keys: people's names (bench_multiturn's, among haystack.ANSWER_WORDS: no haystack contains them)
KEY_NAMES = ("Tobias", "Ingrid", "Ravi", "Elena", "Kofi", "Hana", "Lucas", "Amara")


def make_multi_key(seed: int, n_keys: int = 4) -> TaskCase:
    """``n_keys`` needles "The special magic number for <name> is N." of one form under different names at spread
    depths; one, at a seed-chosen depth, is asked for. The others' numbers are the distractors."""
    if not 2 <= n_keys <= len(KEY_NAMES):
        raise ValueError(f"n_keys must be in 2..{len(KEY_NAMES)}, got {n_keys}")
    rng = random.Random(f"tasks-multi-key-{seed}")
    keys = rng.sample(KEY_NAMES, n_keys)
    values = _numbers(rng, n_keys)
    ask = rng.randrange(n_keys)
    needles = tuple((d, f"The special magic number for {k} is {v}.")
                    for d, k, v in zip(spread_depths(n_keys), keys, values))
    return TaskCase("multi-key", seed, needles, f"What is the special magic number for {keys[ask]}?", (values[ask],),
                    tuple(v for i, v in enumerate(values) if i != ask),
                    answer_prefix=f"The special magic number for {keys[ask]} is", max_new_tokens=12)


_ADJ = ("silver", "quiet", "frozen", "wooden", "golden", "narrow", "ancient", "crooked", "velvet", "distant")
_NOUN = ("lantern", "gardener", "harbour", "violin", "orchard", "lighthouse", "bakery", "glacier", "ferryman",
         "telescope", "meadow", "caravan")
_VERB = ("followed", "painted", "guarded", "repaired", "carried", "watched", "measured", "borrowed")
SPAN_MARKER = "[QUOTE]"


def make_span(rng: random.Random) -> str:
    """A sentence of generated words: 'The <adj> <noun> <verb> the <adj> <noun>.' (SmolLM2-135M copies seven
    words from far away more often than twelve)."""
    a, n = rng.sample(_ADJ, 2), rng.sample(_NOUN, 2)
    return f"The {a[0]} {n[0]} {rng.choice(_VERB)} the {a[1]} {n[1]}."


def make_span_copy(seed: int, depth: float | None = None) -> TaskCase:
    """A generated sentence after :data:`SPAN_MARKER` at a seed-chosen depth (or ``depth``); the reply starts
    with the marker and must go on with the sentence."""
    rng = random.Random(f"tasks-span-copy-{seed}")
    d = rng.choice((0.2, 0.35, 0.5, 0.65, 0.8)) if depth is None else depth
    span = make_span(rng)
    return TaskCase("span-copy", seed, ((d, f"{SPAN_MARKER} {span}"),),
                    f"Repeat the sentence that follows {SPAN_MARKER} in the text above, word for word.", (span,),
                    answer_prefix=SPAN_MARKER, max_new_tokens=24)


MAKERS = {"multi-fact": make_multi_fact, "variable-tracking": make_variable_tracking, "multi-key": make_multi_key,
          "span-copy": make_span_copy, "fidelity": make_fidelity}


def make_case(task: str, seed: int) -> TaskCase:
    """The case of ``task`` for ``seed`` (deterministic; the same on every haystack)."""
    try:
        return MAKERS[task](seed)
    except KeyError:
        raise ValueError(f"unknown task {task!r}; known: {', '.join(TASKS)}") from None


# ---------------------------------------------------------------- grading
def grade_pairs(text: str, things, values) -> dict:
    """Each asked thing's value as ``text`` states it, against its true value (``values[i]`` of ``things[i]``).

    The value stated for a thing is the first number (``numbers_in``) after a mention of its name (whole words,
    any case, up to the next asked thing's name); before any name the reply continues the answer prefix, which names
    ``things[0]``. A thing scores when a value is stated for it and every value stated for it is its true value: a
    value stated under another thing earns nothing, and the order of the things is not graded. Returns {"found":
    things stated right, "wrong": things stated with another value, "n", "score" = found / n}."""
    things, values = list(things), [normalize_text(v) for v in values]
    if len(things) != len(values) or not things or not all(v.isdigit() for v in values):
        raise ValueError("grade_pairs takes one number per thing")
    mentions = sorted((m.start(), m.end(), i) for i, t in enumerate(things)
                      for m in re.finditer(r"(?<![a-z0-9])" + r"[^a-z0-9]+".join(map(re.escape, t.split()))
                                           + r"(?:e?s)?(?![a-z0-9])", text, re.I))
    starts = [(0, 0)] + [(end, i) for _, end, i in mentions]  # where each thing's statement begins
    ends = [start for start, _, _ in mentions] + [len(text)]
    nums = numbers_in(text)
    stated: list[set[str]] = [set() for _ in things]
    for (lo, i), hi in zip(starts, ends):
        first = next((d for at, d in nums if lo <= at < hi), None)
        if first is not None:
            stated[i].add(first)
    right = sum(s == {v} for s, v in zip(stated, values))
    wrong = sum(bool(s - {v}) for s, v in zip(stated, values))
    return {"found": right, "wrong": wrong, "n": len(things), "score": right / len(things)}


def grade_names(text: str, names, wrong) -> dict:
    """Names of ``names`` stated / names, and nothing when any name of ``wrong`` is stated (so naming every
    variable scores 0); order not graded. Returns {"found", "wrong", "n", "score" = found / n, or 0 with a wrong
    name}."""
    names = list(names)
    found = sum(bool(find_answer(text, v)) for v in names)
    bad = sum(bool(find_answer(text, v)) for v in wrong)
    return {"found": found, "wrong": bad, "n": len(names), "score": 0.0 if bad else found / len(names)}


def grade_key(text: str, value: str, distractors) -> dict:
    """1 when ``text`` states ``value`` and none of ``distractors``. Returns {"found", "wrong", "n": 1, "score"}."""
    found = bool(find_answer(text, value))
    bad = sum(bool(find_answer(text, v)) for v in distractors)
    return {"found": int(found), "wrong": bad, "n": 1, "score": float(found and not bad)}


# what may follow a copied sentence's last word: a closing quote or bracket (the copy ends there; an apostrophe
# followed by a letter is the word going on), or its end (a full stop, a question or exclamation mark, a line break
# or the end of the reply); anything else adds to its last word or carries the sentence on
_SENTENCE_END = r"""[ \t]*(?:["\u201d\u00bb)\]]|['\u2019](?![a-z0-9])|[.!?\n]|$)"""


def grade_span(text: str, span: str) -> dict:
    """1 when ``text`` contains ``span`` word for word, ended there (case, punctuation between words and spacing
    ignored: quotes or a missing full stop do not matter; a changed, dropped or added word does, after the last
    word too). Returns {"found", "n": 1, "score"}."""
    want = normalize_text(span).split()
    if not want:
        raise ValueError("empty span")
    words = "[^a-z0-9]+".join(map(re.escape, want))
    ok = re.search(rf"(?<![a-z0-9]){words}(?={_SENTENCE_END})", fold_text(text)) is not None
    return {"found": int(ok), "n": 1, "score": float(ok)}


def case_sha256(case: TaskCase) -> str:
    """SHA-256 of ``case`` as generated (its fields as JSON, keys sorted): records of one (task, seed) whose hashes
    differ came from different case generators and do not compare."""
    return hashlib.sha256(json.dumps(dataclasses.asdict(case), sort_keys=True).encode()).hexdigest()


def grade(case: TaskCase, text: str) -> dict:
    """The graded answer of a generation task (not ``fidelity``, which is compared step by step)."""
    if case.task == "multi-fact":
        return grade_pairs(text, case.things, case.values)
    if case.task == "variable-tracking":
        return grade_names(text, case.values, case.distractors)
    if case.task == "multi-key":
        return grade_key(text, case.values[0], case.distractors)
    if case.task == "span-copy":
        return grade_span(text, case.values[0])
    raise ValueError(f"task {case.task!r} is not graded on generated text")


# ----------------------------------------------------------------- prompts
@dataclasses.dataclass
class CasePrompt:
    """A case fitted to a prompt of ``n_tokens`` tokens: the chat prompt with the answer prefix after it."""

    ids: list[int]  # chat prompt + answer prefix
    n_tokens: int  # len(ids)
    target_tokens: int
    needle_token_starts: list[int]  # index in ``ids`` of each needle's first token, in depth order
    actual_depths: list[float]  # needle token start / prompt tokens
    skipped_chars: int
    sha256: str  # of the token ids (:func:`ids_sha256`)
    forced_ids: list[int]  # teacher-forced tokens after ``ids`` (fidelity; else empty)
    quoted: list[tuple[int, int, int]]  # (value index, start, end) token spans of the quoted values in forced_ids


def ids_sha256(ids) -> str:
    """SHA-256 of token ids written as decimal numbers joined by commas (what a run records per prompt)."""
    return hashlib.sha256(",".join(str(int(i)) for i in ids).encode()).hexdigest()


def quoted_spans(tokenizer, text: str, values) -> list[tuple[int, int, int]]:
    """(value index, start, end): the tokens of ``tokenizer.encode(text)`` that spell each of ``values``, taken
    in turn left to right (each after the previous one). Raises ValueError when a value is not a whole run of
    tokens (a merge across its edge), so a quoted token is never half a value."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    spans, at = [], 0
    for i, v in enumerate(values):
        c = text.find(v, at)
        if c < 0:
            raise ValueError(f"value {v!r} is not in {text[at:]!r}")
        s = len(tokenizer.encode(text[:c], add_special_tokens=False))
        e = len(tokenizer.encode(text[:c + len(v)], add_special_tokens=False))
        if ids[:e] != tokenizer.encode(text[:c + len(v)], add_special_tokens=False) or \
                tokenizer.decode(ids[s:e]).strip() != v:
            raise ValueError(f"value {v!r} does not tokenize on its own in {text!r}")
        spans.append((i, s, e))
        at = c + len(v)
    return spans


def build_case_prompt(tokenizer, case: TaskCase, n_tokens: int, haystack_name: str) -> CasePrompt:
    """``case`` in haystack ``haystack_name`` (its start chosen by the case's seed): ``[chat prompt][answer
    prefix]`` of (exactly, where the tokenizer allows) ``n_tokens`` tokens, needles at their depths."""
    prefix = tokenizer.encode(case.answer_prefix, add_special_tokens=False) if case.answer_prefix else []
    p = haystack.build_needle_prompt(tokenizer, n_tokens - len(prefix), list(case.needles), case.question,
                                     "; ".join(case.values), seed=case.seed, haystack=haystack_name,
                                     instruction=case.instruction)
    ids = p.ids + prefix
    forced, quoted = [], []
    if case.forced is not None:
        whole = tokenizer.encode(case.forced, add_special_tokens=False)
        if whole[:len(prefix)] != prefix or not case.forced.startswith(case.answer_prefix):
            raise ValueError(f"the forced reply {case.forced!r} does not start with the answer prefix")
        forced = whole[len(prefix):]
        quoted = [(i, s - len(prefix), e - len(prefix)) for i, s, e in quoted_spans(tokenizer, case.forced,
                                                                                     case.values)]
        if min(s for _, s, _ in quoted) < 1:
            raise ValueError("a quoted value starts the forced reply: prefill's prediction of it is not compared")
    return CasePrompt(ids=ids, n_tokens=len(ids), target_tokens=n_tokens, needle_token_starts=p.needle_token_starts,
                      actual_depths=[t / len(ids) for t in p.needle_token_starts], skipped_chars=p.skipped_chars,
                      sha256=ids_sha256(ids), forced_ids=forced, quoted=quoted)


def forced_metrics(engines, forced: list[int], quoted) -> list[dict]:
    """Teacher-force ``forced`` through every engine in lockstep (engine 0 is full KV, the reference).

    Step t feeds ``forced[t]``; its logits predict ``forced[t + 1]``. At the step before each quoted token
    (``quoted``: (value index, start, end) spans of ``forced``) it records, per engine: KL(full || engine),
    whether its top-1 equals full KV's, and whether it equals the true token. Returns one dict per engine of lists
    over the quoted tokens in order (``value``: which value, ``pos``: the token's place in it), and the engine's
    top-1 token at every step."""
    import numpy as np

    from bench_fidelity import next_token_metrics, step_logits

    at = {j - 1: (i, j - s) for i, s, e in quoted for j in range(s, e)}
    out = [{"value": [], "pos": [], "kl": [], "agree": [], "true_top1": [], "top1": []} for _ in engines]
    for t in range(len(forced) - 1):
        logits = [step_logits(e, forced[t]) for e in engines]
        for k, lg in enumerate(logits):
            out[k]["top1"].append(int(np.argmax(lg)))
        if t not in at:
            continue
        i, pos = at[t]
        for k, lg in enumerate(logits):
            m = next_token_metrics(logits[0], lg)
            o = out[k]
            o["value"].append(i)
            o["pos"].append(pos)
            o["kl"].append(float(m["kl"]))
            o["agree"].append(bool(m["agree"]))
            o["true_top1"].append(int(np.argmax(lg)) == forced[t + 1])
    return out



def lockstep_margins(engines, max_new: int, eos) -> list[dict]:
    """Engine 0 (full KV) answers greedily from its prefill logits (``engine.logits`` [1, V]), as
    :func:`harness.prefill.greedy_answer` decodes; every engine is fed its tokens one step at a time
    (``Engine.step_with_logits``), so engine k's own greedy reply equals engine 0's up to the first step where
    their top-1 differ (:func:`parting`).

    One record per token of engine 0's reply: ``token``; ``p1`` and ``margin``: full KV's probability of it and
    that minus the probability of its second choice ``second``; ``top1``: each other engine's top-1. Stops as
    ``greedy_answer`` does: after ``max_new`` tokens, or at an EOS, which gets a last record with ``"eos": True``
    (not part of the reply's text) so that an engine that would go on where full KV stops parts there; an engine
    whose top-1 is any id of ``eos`` there stops too and agrees."""
    import numpy as np

    def probs(logits):  # float32 logits -> softmax in float64
        z = np.asarray(logits, np.float64).ravel()
        e = np.exp(z - z.max())
        return e / e.sum()

    ps = [probs(np.asarray(e.logits)[0]) for e in engines]
    steps: list[dict] = []
    while True:
        order = np.argsort(-ps[0], kind="stable")
        tok, second = int(order[0]), int(order[1])
        top1 = [int(np.argmax(q)) for q in ps[1:]]
        step = {"token": tok, "p1": float(ps[0][tok]), "margin": float(ps[0][tok] - ps[0][second]),
                "second": second, "top1": top1}
        if tok in eos:  # any EOS id ends an engine's reply as full KV's does
            steps.append({**step, "eos": True, "top1": [tok if t in eos else t for t in top1]})
            return steps
        steps.append(step)
        if len(steps) >= max_new:
            return steps
        ps = [probs(e.step_with_logits([tok], 0.0, 1.0)[1][0]) for e in engines]


def parting(steps: list[dict], k: int) -> dict | None:
    """Where the ``k``-th other engine of :func:`lockstep_margins` (0-based) first parts from full KV's reply:
    {"step", "margin" (full KV's there), "second_choice" (it took full KV's second token)}; None if it never does."""
    for t, s in enumerate(steps):
        if s["top1"][k] != s["token"]:
            return {"step": t, "margin": s["margin"], "second_choice": s["top1"][k] == s["second"]}
    return None
