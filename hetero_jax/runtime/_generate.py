"""``generate``: one prompt or a batch, prefilled and decoded by an :class:`Engine`."""

from __future__ import annotations

from typing import Callable, Sequence

from hetero_jax.errors import PromptError
from hetero_jax.runtime.compile_cache import TAIL_START, tail_capacity_for
from hetero_jax.runtime.engine import Engine, decode_loop, make_results
from hetero_jax.runtime.prompts import as_token_batches, check_flag, check_model, check_request, stop_token_ids


def generate(
    model,
    prompt,
    policy=None,
    *,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    stop: Sequence[str] | str | None = None,
    chat: bool = True,
    on_token: Callable[[str], None] | None = None,
):
    """Generate a continuation for one prompt or a batch.

    ``prompt``: a string, a list of strings (a batch), token ids, or a list of
    token-id lists (``chat`` applies the chat template to text; token ids are used as given). ``policy``: a policy object (the engine refuses None; ``hetero_jax.generate``, above
    policies/, fills in full KV for it). Greedy at temperature 0 (or below ``sampling.GREEDY_BELOW``).
    Each prompt stops at EOS, at any ``stop`` string (one that is a special token's text, e.g. "<|im_end|>",
    also at that token, which the answer leaves out as it does EOS), after ``max_new_tokens`` or at the end of
    the context (its own, as if alone). ``on_token(text_delta)`` streams a single prompt's new text: held back
    while it could still become a stop string or ends inside a character, so the deltas joined are the result's
    text (the decode of its tokens). The one exception: bytes that are not valid UTF-8 from a byte-fallback
    tokenizer, whose decode turns a whole run of bytes into U+FFFD, an earlier streamed character included.
    Returns a :class:`GenerationResult` (a list of them for a batch).
    """
    stops = check_request(max_new_tokens, temperature, top_p, seed=seed, stop=stop, on_token=on_token)
    check_flag("chat", chat)
    check_model(model)
    stop_token_ids(model.tokenizer, stops)  # refuses, before any compute, a stop string that could never match
    batch, is_batch = as_token_batches(model, prompt, chat)
    if on_token is not None and is_batch:
        raise PromptError("on_token streams a single prompt; pass one prompt or on_token=None")
    # each prompt's own room: a short one batched with a long one runs as far as it would alone
    budgets = [min(max_new_tokens, model.config.max_position_embeddings - len(b)) for b in batch]
    # every sequence is stepped until the longest budget ends; the tail starts at TAIL_START tokens and grows
    # while the answer runs (``decode_loop``), so an answer far shorter than its budget holds only its own rows
    engine = Engine(model, batch, policy, tail_capacity=tail_capacity_for(min(max(budgets), TAIL_START)), seed=seed,
                    is_batch=is_batch)
    first = engine.first_tokens(temperature, top_p)
    # pipelined: the engine is not used after this answer, so a step dispatched past its end costs nothing else
    out_ids, texts, reasons, decode_s = decode_loop(engine, first, budgets, temperature=temperature, top_p=top_p,
                                                     stops=stops, on_token=on_token, pipelined=True,
                                                     max_new_tokens=max_new_tokens)
    results = make_results(engine, out_ids, texts, reasons, decode_s, [len(b) for b in batch])
    return results if is_batch else results[0]
