"""``Session``: a long context prefilled once, then questions answered in turn."""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from hetero_jax.errors import PromptError
from hetero_jax.runtime.compile_cache import compile_seconds
from hetero_jax.runtime.engine import Engine, decode_loop, make_results
from hetero_jax.runtime.prompts import check_request, check_session_args, question_ids, token_list
from hetero_jax.runtime.results import GenerationResult


class Session:
    """A long context prefilled once, then several questions answered in turn.

    Each turn is appended to the cache as an extension (on the tail of every
    head, like generated tokens) in chunked passes (``Engine.extend``), then
    answered. The policy's prefill selection sees only the context; HeteroCache
    re-selects its compressed heads from each turn's queries before the answer.
    ``generate`` is one turn of this with the question inside the prompt.
    """

    def __init__(self, model, context: str | Sequence[int], policy=None, *, chat: bool = True, seed: int = 0,
                 reserve_tokens: int = 512):
        check_session_args(model, context, chat, seed, reserve_tokens)
        self.model, self.chat = model, chat
        tok = model.tokenizer
        self.messages: list[dict] = []
        if isinstance(context, str):
            if not context.strip():
                raise PromptError("empty context: the session's context text has no content")
            if chat:
                marker = "\x00HETERO_JAX_TURN\x00"
                rendered = tok.apply_chat_template([{"role": "user", "content": context + marker}])
                self._prefix_text = rendered[: rendered.index(marker)]
                ids = tok.encode(self._prefix_text, add_special_tokens=False)
            else:
                self._prefix_text = context
                ids = tok.encode_prompt(context, chat=False)
            self._context_text = context
        else:
            ids = token_list(context, "the context")
            self._prefix_text = None
            self._context_text = None
        self.engine = Engine(model, [ids], policy, tail_capacity=reserve_tokens, seed=seed)
        self.context_tokens = len(ids)
        self._rendered = self._prefix_text
        self._unfed: list[int] = []
        self.turns: list[GenerationResult] = []

    def _turn_ids(self, question: str | Sequence[int]) -> tuple[list[int], list[dict], str | None]:
        """Tokens that close the previous turn (if any) and open this one, with the chat history and
        rendered text after it; ``ask`` commits them only once the turn is accepted."""
        tok = self.model.tokenizer
        unfed = self._unfed
        if not isinstance(question, str):
            return unfed + question_ids(question, self.engine.cfg), self.messages, self._rendered
        if not question.strip():
            raise PromptError("empty question: the question text has no content")
        if self._context_text is None or not self.chat:
            sep = "\n\n" if (self.turns or self._context_text) else ""
            return unfed + tok.encode(sep + question, add_special_tokens=False), self.messages, self._rendered
        if not self.turns:
            msgs = [{"role": "user", "content": self._context_text + "\n\n" + question}]
        else:
            msgs = self.messages + [{"role": "user", "content": question}]
        rendered = tok.apply_chat_template(msgs, add_generation_prompt=True)
        if not rendered.startswith(self._rendered):
            raise PromptError("the chat template does not render turns incrementally; use chat=False")
        new_text = rendered[len(self._rendered):]
        return unfed + tok.encode(new_text, add_special_tokens=False), msgs, rendered

    def ask(self, question, *, max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
            stop=None, on_token=None) -> GenerationResult:
        """Append ``question`` (text or token ids) and generate the answer."""
        stops = check_request(max_new_tokens, temperature, top_p, stop=stop, on_token=on_token)
        eng = self.engine
        ids, messages, rendered = self._turn_ids(question)
        room = eng.positions_left - len(ids)
        if room < 1:
            raise PromptError(
                f"the question ({len(ids)} tokens) does not fit: {eng.positions_left} positions are left in the "
                f"model's {eng.cfg.max_position_embeddings}-token context; ask a shorter question or start a new "
                "session (this one is unchanged)"
            )
        # every check passed: the turn is accepted (a refused one leaves the session as it was)
        self._unfed, self.messages, self._rendered = [], messages, rendered
        budget = min(max_new_tokens, room)
        eng.reserve(len(ids) + budget + 1)
        # All but the turn's last token go in chunked passes (the policy re-selects from their queries,
        # HeteroCache's after_extend); the last one is a decode step, so the answer's first token is
        # sampled with the new selection in place.
        before = compile_seconds()
        t0 = time.perf_counter()
        if len(ids) > 1:
            eng.extend(ids[:-1])
        nxt, _ = eng.step(np.asarray(ids[-1:], np.int32), temperature, top_p)
        extend_s = time.perf_counter() - t0 - (compile_seconds() - before)  # compile excluded, as in decode
        out_ids, texts, reasons, decode_s = decode_loop(eng, nxt, budget, temperature=temperature, top_p=top_p,
                                                         stops=stops, on_token=on_token)
        if budget < max_new_tokens:
            reasons = ["context" if r == "max_new_tokens" else r for r in reasons]
        # the answer is in the cache except its last token when it did not end at EOS:
        # that one opens the next turn
        if out_ids[0] and reasons[0] != "eos":
            self._unfed = [out_ids[0][-1]]
        if self.chat and self._context_text is not None:
            answer = self.model.tokenizer.decode(out_ids[0])
            self.messages = self.messages + [{"role": "assistant", "content": answer}]
            self._rendered = self._rendered + answer
        res = make_results(eng, out_ids, texts, reasons, decode_s, [self.context_tokens], extend_s)[0]
        self.turns.append(res)
        return res
