"""Checks and normalisation of what a caller passes, before any compute: prompts, questions, decoding
arguments, the model bundle. Every refusal is a PromptError that names the problem and the fix."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from hetero_jax.errors import PromptError
from hetero_jax.io.tokenizer import check_unicode
from hetero_jax.model.config import ModelConfig


def as_token_batches(model, prompt, chat: bool) -> tuple[list[list[int]], bool]:
    """Normalise the prompt forms to a list of token-id lists; returns (batch, is_batch)."""
    tok = model.tokenizer
    if isinstance(prompt, str):
        return [_encode(tok, prompt, chat, "the prompt")], False
    if isinstance(prompt, np.ndarray):
        prompt = prompt.tolist()
    if isinstance(prompt, (list, tuple)):
        if len(prompt) == 0:
            raise PromptError("empty prompt: pass a non-empty string, list of strings or token ids")
        if all(isinstance(p, str) for p in prompt):
            return [_encode(tok, p, chat, f"prompt {i}") for i, p in enumerate(prompt)], True
        if all(isinstance(p, (int, np.integer)) for p in prompt):
            return [token_list(prompt, "the prompt")], False
        if all(isinstance(p, (list, tuple, np.ndarray)) for p in prompt):
            return [token_list(p, f"prompt {i}") for i, p in enumerate(prompt)], True
        if not any(isinstance(p, (str, list, tuple, np.ndarray)) for p in prompt):
            token_list(prompt, "the prompt")  # numbers, not all integers: name the first that is not
    raise PromptError(
        f"unsupported prompt type {type(prompt).__name__}: pass a string, a list of strings, "
        "a list of token ids or a list of token-id lists"
    )


def _encode(tok, text: str, chat: bool, what: str) -> list[int]:
    """``text``'s ids; ``what`` names it in a refusal ("the prompt", or "prompt 3" of a batch)."""
    if not text.strip():
        raise PromptError(f"empty prompt: {what}'s text has no content")
    check_unicode(text, what)
    try:
        return tok.encode_prompt(text, chat=chat)
    except PromptError as e:  # the chat template's refusal: say which prompt of a batch it refused
        if what == "the prompt":
            raise
        raise PromptError(f"{what}: {e}") from None


def validate_ids(batch: list[list[int]], cfg: ModelConfig, is_batch: bool, what: str = "prompt") -> None:
    for i, ids in enumerate(batch):
        if len(ids) == 0:
            raise PromptError(f"empty {what} (batch item {i}): it encodes to zero tokens")
        if len(ids) >= cfg.max_position_embeddings:
            raise PromptError(
                f"{what}{'' if not is_batch else f' {i}'} has {len(ids)} tokens but the model's context "
                f"is {cfg.max_position_embeddings} tokens (room is needed for at least one new token); "
                f"shorten the {what}"
            )
        bad = [t for t in ids if not 0 <= t < cfg.vocab_size]
        if bad:
            raise PromptError(f"token id {bad[0]} is outside the vocabulary [0, {cfg.vocab_size})")


def is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def is_real(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))


def check_request(max_new_tokens, temperature, top_p, *, seed=0, stop=None, on_token=None) -> list[str]:
    """Types and ranges of the decoding arguments, before any compute; returns the stop strings as a list.

    The types are checked first, so the range comparisons at the end only ever see numbers.
    """
    if not is_int(max_new_tokens):
        raise PromptError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if not is_real(temperature) or not np.isfinite(temperature) or temperature < 0:
        raise PromptError(f"temperature must be a finite number >= 0 (0 = greedy, > 0 samples), got {temperature!r}")
    if not is_real(top_p) or not np.isfinite(top_p):
        raise PromptError(f"top_p must be a number in (0, 1], got {top_p!r}")
    if not is_int(seed) or not -(2**63) <= seed < 2**63:
        raise PromptError(f"seed must be an integer in [-2**63, 2**63), got {seed!r}")
    if on_token is not None and not callable(on_token):
        raise PromptError(f"on_token must be a function taking the new text, or None; got {on_token!r}")
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)) or not all(isinstance(x, str) for x in stops):
        raise PromptError(f"stop must be a string, a list of strings or None, got {stop!r}")
    if any(x == "" for x in stops):
        raise PromptError("stop strings must be non-empty: an empty stop string matches at once and ends "
                          "generation after one token; drop it or pass stop=None")
    for x in stops:
        check_unicode(x, f"the stop string {x!r}")
    if max_new_tokens < 0:
        raise PromptError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if not (0.0 < top_p <= 1.0):
        raise PromptError(f"top_p must be in (0, 1], got {top_p}")
    return list(stops)


def stop_token_ids(tok, stops: Sequence[str]) -> set[int]:
    """The ids of the special tokens whose text is a whole stop string: decoding leaves special tokens out of
    the answer's text, so such a stop ("<|im_end|>", "</s>") is matched by its token as well as by its text.

    PromptError for a stop string that holds a special token's text among other text: its text is never in the
    answer when the model generates that token, so it could not stop there.
    """
    special: dict[str, set[int]] = {}
    backend = getattr(tok, "backend", None)  # a tokenizer-only stand-in (tests, benchmarks) has no added tokens
    if backend is not None:
        for i, t in backend.get_added_tokens_decoder().items():
            if t.special and t.content:  # the added tokens ``decode`` skips; the others decode to their text
                special.setdefault(t.content, set()).add(i)
    ids: set[int] = set()
    for s in stops:
        if s in special:
            ids |= special[s]
            continue
        inside = [(s.find(c), -len(c), c) for c in special if c in s]
        if inside:
            c = min(inside)[2]  # the first in the string, the longest there
            raise PromptError(
                f"the stop string {s!r} holds the special token {c!r} among other text; decoding leaves special "
                f"tokens out of the answer's text, so it cannot match when the model generates {c!r}; pass {c!r} "
                "alone as a stop string: it stops at that token")
    return ids


def check_model(model) -> None:
    """A loaded model bundle (``hetero_jax.load``), not a name or a path."""
    if not all(hasattr(model, a) for a in ("config", "params", "tokenizer")) or not isinstance(
            getattr(model, "config", None), ModelConfig):
        got = repr(model) if model is None or isinstance(model, str) else f"a {type(model).__name__}"
        raise PromptError(f"model must be a loaded model from hetero_jax.load(NAME_OR_DIR), got {got}"
                          + ("; load it first: model = hetero_jax.load(name)" if isinstance(model, str) else ""))


def token_list(seq, what: str) -> list[int]:
    """``seq`` as a list of Python ints; PromptError naming the first element that is not an integer."""
    if isinstance(seq, np.ndarray):
        if seq.ndim != 1:
            raise PromptError(f"{what} must be a flat list of token ids, got an array of shape {seq.shape}")
        seq = seq.tolist()
    if not isinstance(seq, (list, tuple)):
        raise PromptError(f"{what} must be a list of token ids, got {type(seq).__name__}")
    for j, t in enumerate(seq):
        if not is_int(t):
            raise PromptError(f"token ids must be integers: {what} has {t!r} ({type(t).__name__}) at position {j}")
    return [int(t) for t in seq]



def check_session_args(model, context, chat, seed, reserve_tokens) -> None:
    """Session's arguments, before any compute. The model needs only its tokenizer here (Engine checks the
    rest): benchmarks/bench_multiturn.py probes a Session's context ids with a tokenizer-only stand-in."""
    if not hasattr(model, "tokenizer"):
        check_model(model)
    if context is None or not isinstance(context, (str, list, tuple, np.ndarray)):
        raise PromptError(f"context must be a string or a list of token ids, got {type(context).__name__}; "
                          "a Session answers questions about a context given up front")
    check_flag("chat", chat)
    check_request(0, 0.0, 1.0, seed=seed)
    if reserve_tokens is not None and (not is_int(reserve_tokens) or reserve_tokens < 1):
        raise PromptError(f"reserve_tokens must be an integer >= 1, got {reserve_tokens!r} (None: the default)")


def check_flag(name: str, value) -> None:
    """A boolean option: True or False only (a string such as "no" is truthy and would mean the opposite)."""
    if not isinstance(value, (bool, np.bool_)):
        raise PromptError(f"{name} must be True or False, got {value!r}")


DEFAULT_RESERVE = 512  # tail rows a Session allocates for its turns and answers unless told


def session_reserve(reserve_tokens, cfg: ModelConfig, context_tokens: int) -> int:
    """The tail rows a Session allocates after a context of ``context_tokens`` tokens.

    None: ``DEFAULT_RESERVE``, or the positions the context leaves if fewer. A value the context leaves no room
    for is refused before the pool is allocated: the tail can never hold more than those positions, and a value
    far past them ran out of memory allocating rows that could never be used.
    """
    left = cfg.max_position_embeddings - context_tokens
    if left < 2:  # refused before the prefill: every ask would fail after it
        raise PromptError(
            f"the context has {context_tokens} tokens but the model's context is {cfg.max_position_embeddings} "
            f"tokens, and a question and its answer need at least two more positions; shorten the context")
    if reserve_tokens is None:
        return min(DEFAULT_RESERVE, left)
    if reserve_tokens > left:
        raise PromptError(
            f"reserve_tokens={reserve_tokens} is more than the context leaves: the model's context is "
            f"{cfg.max_position_embeddings} tokens and the session's context takes {context_tokens}, so at most "
            f"{left} tokens of turns and answers follow it; pass reserve_tokens <= {left} or leave it unset"
        )
    return int(reserve_tokens)


def question_ids(question, cfg: ModelConfig) -> list[int]:
    """A question given as token ids: integers inside the vocabulary, at least one."""
    if not isinstance(question, (list, tuple, np.ndarray)):
        raise PromptError(f"question must be a string or a list of token ids, got {type(question).__name__}")
    ids = token_list(question, "the question")
    if not ids:
        raise PromptError("empty question: pass a non-empty string or list of token ids")
    bad = [t for t in ids if not 0 <= t < cfg.vocab_size]
    if bad:
        raise PromptError(f"token id {bad[0]} of the question is outside the vocabulary [0, {cfg.vocab_size})")
    return ids

