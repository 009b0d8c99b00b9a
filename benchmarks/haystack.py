"""Needle-in-a-haystack prompts on real text, fitted to an exact token count.

Reusable by every long-context benchmark (policy sweep, needle grid,
multi-turn). The haystack is real English prose from one of :data:`HAYSTACKS`
(``haystack="pydoc"`` by default), or any ``filler_text`` you pass:

- ``pydoc``: Python's ``pydoc_data.topics.topics`` (the language reference)
  joined in sorted key order (the same corpus as ``bench_foundation.py``);
- ``stdlib-docs``: the docstrings (``inspect.getdoc``) of a fixed sorted list of
  pure-Python standard-library modules, their public classes, functions and
  methods, prose paragraphs only (no doctests, indented code or tables);
- ``licenses``: the license texts shipped in the ``.dist-info`` of a fixed list
  of distributions that ``make install`` installs (torch, pinned, among
  them), prose paragraphs only, each paragraph once.

Every corpus is built offline from what is installed, the same on every machine
with the same Python minor version (and, for ``licenses``, the same package
versions); :func:`haystack_info` records the source, versions, size and SHA-256
for the results. The two added corpora leave out every paragraph that contains
an answer word of the benchmarks (:data:`ANSWER_WORDS`) or a number of five or
more digits, so only the needle can supply an answer. One or more *needles* (sentences) are inserted at
given depth fractions of the haystack, at the nearest sentence / line
boundary, and the question follows the haystack in the model's chat template.
The haystack length is searched so the whole prompt (chat template included)
is exactly ``n_tokens`` tokens where the tokenizer allows it, and never more.

Everything is deterministic per ``seed``: the seed picks the passkey (when
none is given) and where in the corpus the haystack starts (seed 0 starts at
the beginning of the corpus; the exact-fit search may skip up to
``MAX_SKIPPED_WORDS`` words at the start, recorded in ``skipped_chars``).

    from haystack import build_passkey, passkey_correct
    p = build_passkey(model.tokenizer, 4000, depth=0.5, seed=1)
    out = hetero_jax.generate(model, p.ids, max_new_tokens=12)
    correct = passkey_correct(out.text, p.answer)

:func:`build_needle_prompt` is the general form (any needles, question and
answer; returns a :class:`NeedlePrompt` with the measured positions).
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import random
import re
from typing import Sequence

from harness.corpora import (ANSWER_WORDS, DEFAULT_HAYSTACK, HAYSTACKS, LICENSE_DISTRIBUTIONS, STDLIB_DOC_MODULES,
                             Haystack, haystack_corpus, haystack_info, is_prose, licenses_corpus, pydoc_corpus,
                             stdlib_docs_corpus)

PASSKEY_NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
PASSKEY_QUESTION = "What is the pass key?"

# Words the haystack may skip at its start to reach an exact token count.
MAX_SKIPPED_WORDS = 8

# Boundaries a needle may be inserted at: after a sentence end or a line break.
_BOUNDARY = re.compile(r"(?<=[.!?])\s+|\n+")

__all__ = [  # the corpora's names are re-exported: the benchmarks and tests read every haystack name from here
    "ANSWER_WORDS", "DEFAULT_HAYSTACK", "HAYSTACKS", "LICENSE_DISTRIBUTIONS", "STDLIB_DOC_MODULES", "Haystack",
    "haystack_corpus", "haystack_info", "is_prose", "licenses_corpus", "pydoc_corpus", "stdlib_docs_corpus",
    "PASSKEY_NEEDLE", "PASSKEY_QUESTION", "MAX_SKIPPED_WORDS", "absent_number", "NeedlePrompt", "make_passkey",
    "build_needle_prompt", "compose_fixed", "suffix_len", "build_passkey", "passkey_correct",
]


def absent_number(rng: random.Random, lo: int, hi: int, haystacks: Sequence[str] = (DEFAULT_HAYSTACK,)) -> str:
    """A number drawn by ``rng.randint(lo, hi)`` (redrawn until) that occurs as one number in none of the corpora
    of ``haystacks``, so an answer stating it can only come from a needle."""
    corpora = [haystack_corpus(h) for h in haystacks]
    while True:
        n = str(rng.randint(lo, hi))
        if not any(re.search(rf"(?<!\d){n}(?!\d)", c) for c in corpora):
            return n


@dataclasses.dataclass
class NeedlePrompt:
    """A fitted needle prompt and where its parts landed."""

    ids: list[int]  # prompt token ids (chat template applied when chat=True)
    text: str  # the user message: haystack with the needle(s), then the question
    answer: str
    n_tokens: int  # len(ids)
    target_tokens: int  # the n_tokens asked for
    depths: list[float]  # requested depth of each needle (fraction of the haystack)
    needle_char_starts: list[int]  # where each needle starts in ``text``
    needle_token_starts: list[int]  # index in ``ids`` of the first token of each needle (approximate at merges)
    actual_depths: list[float]  # needle token start / prompt tokens
    haystack_chars: int  # haystack characters used (needles excluded)
    skipped_chars: int  # characters of the source skipped at the haystack's start (exact-fit search)
    seed: int
    haystack: str = DEFAULT_HAYSTACK  # the corpus's name in HAYSTACKS ("filler_text" for a caller's text)

    @property
    def exact(self) -> bool:
        return self.n_tokens == self.target_tokens


def make_passkey(seed: int, digits: int = 5) -> str:
    """A deterministic ``digits``-digit passkey for ``seed`` (no leading zero)."""
    rng = random.Random(f"passkey-{seed}")
    return str(rng.randint(10 ** (digits - 1), 10**digits - 1))


def _haystack_source(filler_text: str | None, seed: int, min_chars: int, haystack: str = DEFAULT_HAYSTACK) -> str:
    """The corpus rotated to a seed-chosen paragraph start, repeated to at least ``min_chars``."""
    text = haystack_corpus(haystack) if filler_text is None else filler_text
    if not text.strip():
        raise ValueError("filler_text is empty")
    if seed:
        starts = [0] + [m.end() for m in re.finditer(r"\n\n+", text)]
        start = random.Random(f"haystack-{seed}").choice(starts[:-1] or starts)
        text = text[start:] + "\n\n" + text[:start]
    while len(text) < min_chars:
        text = text + "\n\n" + text
    return text


def _snap(boundaries: list[int], pos: int) -> int:
    """The boundary (character offset) nearest ``pos``."""
    i = bisect.bisect_left(boundaries, pos)
    cands = [boundaries[j] for j in (i - 1, i) if 0 <= j < len(boundaries)]
    return min(cands, key=lambda b: (abs(b - pos), b))


def _compose(source: str, boundaries: list[int], n_chars: int, needles, question: str | None,
             instruction: str | None) -> tuple[str, list[int]]:
    """(user message with the first ``n_chars`` of ``source`` as haystack, needle start offsets)."""
    hay = source[:n_chars]
    bounds = [0] + boundaries[: bisect.bisect_left(boundaries, n_chars)] + [n_chars]
    parts, starts, prev = [], [], 0
    head = f"{instruction}\n\n" if instruction else ""
    offset = len(head)
    for d, sentence in needles:
        at = max(_snap(bounds, int(round(d * n_chars))), prev)
        chunk = hay[prev:at]
        parts.append(chunk)
        offset += len(chunk)
        sep_l = "" if at == 0 or hay[at - 1] in " \n" else " "
        sep_r = "" if at >= n_chars or hay[at] in " \n" else " "
        parts.append(sep_l + sentence + sep_r)
        starts.append(offset + len(sep_l))
        offset += len(sep_l) + len(sentence) + len(sep_r)
        prev = at
    parts.append(hay[prev:])
    body = "".join(parts).rstrip()
    return (f"{head}{body}\n\n{question}" if question else f"{head}{body}"), starts


def build_needle_prompt(
    tokenizer,
    n_tokens: int,
    needles: Sequence[tuple[float, str]],
    question: str | None,
    answer: str,
    *,
    filler_text: str | None = None,
    seed: int = 0,
    chat: bool = True,
    instruction: str | None = None,
    haystack: str = DEFAULT_HAYSTACK,
) -> NeedlePrompt:
    """A prompt of (exactly, where possible; never more than) ``n_tokens`` tokens.

    ``needles``: (depth, sentence) pairs; depth in [0, 1] is the fraction of
    the haystack (0 = its start, 1 = its end) where the sentence goes, snapped
    to the nearest sentence or line boundary. ``instruction`` (optional) goes
    before the haystack. The user message is
    ``[instruction\\n\\n] haystack-with-needles \\n\\n question``, through the
    chat template when ``chat`` (``tokenizer.encode_prompt``). ``question=None``
    leaves the question out (a context for a multi-turn ``Session``, whose
    questions come later); ``chat=False`` encodes the raw text with BOS.
    ``haystack``: which of :data:`HAYSTACKS` (ignored when ``filler_text`` is given).
    """
    if n_tokens < 1:
        raise ValueError(f"n_tokens must be >= 1, got {n_tokens}")
    for d, _ in needles:
        if not 0.0 <= d <= 1.0:
            raise ValueError(f"needle depth must be in [0, 1], got {d}")
    needles = sorted(needles, key=lambda x: x[0])

    def compose(n_chars: int, skip: int = 0) -> tuple[str, list[int]]:
        return _compose(source[skip:], [b - skip for b in boundaries if b > skip], n_chars, needles, question,
                        instruction)

    def encode(text: str) -> list[int]:
        return tokenizer.encode_prompt(text, chat=chat)

    overhead = len(encode(compose_fixed(instruction, needles, question)))
    if overhead > n_tokens:
        raise ValueError(f"n_tokens={n_tokens} is smaller than the prompt without haystack ({overhead} tokens)")
    # Characters per token of the source, to bracket the search.
    source = _haystack_source(filler_text, seed, 8 * n_tokens + 4096, haystack)
    sample = source[: 6 * max(n_tokens, 256)]
    cpt = len(sample) / max(len(tokenizer.encode(sample)), 1)
    need_chars = int((n_tokens - overhead) * cpt * 1.25) + 256
    if 2 * need_chars > len(source):
        source = _haystack_source(filler_text, seed, 2 * need_chars, haystack)
    boundaries = [m.end() for m in _BOUNDARY.finditer(source)]

    # Largest haystack (characters) whose prompt fits: binary search (the count is
    # monotone up to token merges at the seams), then a small local scan. Where one more
    # character adds two tokens, n_tokens itself is skipped; then the haystack starts a
    # word or two later, which moves its end to another word.
    word_starts = [0] + [m.end() for m in re.finditer(r"\s+", source[:400])][:MAX_SKIPPED_WORDS]
    best = best_len = skip = None
    for k in word_starts:
        c, n = _fit(lambda c_: len(encode(compose(c_, k)[0])), n_tokens, min(len(source) - k, need_chars),
                    len(source) - k)
        if best_len is None or n > best_len:
            best, best_len, skip = c, n, k
        if best_len == n_tokens:
            break

    text, starts = compose(best, skip)
    ids = encode(text)
    needle_tok = [_token_index(tokenizer, text, ids, s, chat) for s in starts]
    return NeedlePrompt(
        ids=ids, text=text, answer=answer, n_tokens=len(ids), target_tokens=n_tokens,
        depths=[d for d, _ in needles], needle_char_starts=starts, needle_token_starts=needle_tok,
        actual_depths=[t / len(ids) for t in needle_tok], haystack_chars=best, skipped_chars=skip, seed=seed,
        haystack="filler_text" if filler_text is not None else haystack,
    )


def _fit(count, n_tokens: int, start: int, limit: int) -> tuple[int, int]:
    """(characters, tokens): the largest haystack with count(characters) <= n_tokens, preferring an exact fit."""
    lo, hi = 0, start
    while count(hi) <= n_tokens and hi < limit:
        lo, hi = hi, min(limit, hi * 2)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if count(mid) <= n_tokens:
            lo = mid
        else:
            hi = mid
    best, best_len = lo, count(lo)
    for step in range(1, 9):
        if best_len == n_tokens:
            break
        for c in (lo + step, lo - step):
            if 0 <= c <= limit:
                n = count(c)
                if best_len < n <= n_tokens:
                    best, best_len = c, n
    return best, best_len


def compose_fixed(instruction: str | None, needles, question: str | None) -> str:
    """The user message with an empty haystack (its token count is the fixed overhead)."""
    head = f"{instruction}\n\n" if instruction else ""
    return head + " ".join(s for _, s in needles) + (f"\n\n{question}" if question else "")


def _token_index(tokenizer, text: str, ids: list[int], char_start: int, chat: bool) -> int:
    """Index in ``ids`` of the token where ``text[char_start:]`` begins (prefix-token count)."""
    return len(ids) - len(tokenizer.encode(text[char_start:], add_special_tokens=False)) - suffix_len(tokenizer, chat)


@functools.lru_cache(maxsize=8)
def _suffix_tokens(tokenizer, chat: bool) -> int:
    if not chat:
        return 0
    marker = "\x00"
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": marker}], add_generation_prompt=True)
    return len(tokenizer.encode(rendered.split(marker, 1)[1], add_special_tokens=False))


def suffix_len(tokenizer, chat: bool) -> int:
    try:
        return _suffix_tokens(tokenizer, chat)
    except TypeError:  # unhashable tokenizer
        return _suffix_tokens.__wrapped__(tokenizer, chat)


def build_passkey(tokenizer, n_tokens: int, depth: float, passkey: str | int | None = None, *, seed: int = 0,
                  **prompt_options) -> NeedlePrompt:
    """A passkey prompt: "The pass key is K. Remember it. K is the pass key." at ``depth`` of a real-text
    haystack, then "What is the pass key?" in the chat template, (exactly, where possible; never more than)
    ``n_tokens`` tokens. ``passkey=None``: a 5-digit key from ``seed``. ``prompt_options``: the keywords of
    :func:`build_needle_prompt` (``filler_text``, ``chat``, ``instruction``, ``haystack``). Pass ``.ids`` to
    ``generate``, or ``.text`` with ``chat=True`` (it re-encodes to the same ids)."""
    key = make_passkey(seed) if passkey is None else str(passkey)
    return build_needle_prompt(tokenizer, n_tokens, [(depth, PASSKEY_NEEDLE.format(key=key))], PASSKEY_QUESTION, key,
                               seed=seed, **prompt_options)


def passkey_correct(generated: str, answer: str) -> bool:
    """Correct iff the generated text contains the answer's digits as one number."""
    return re.search(rf"(?<!\d){re.escape(str(answer))}(?!\d)", generated) is not None
