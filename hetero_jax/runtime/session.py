"""``Session``: a long context prefilled once, then questions answered in turn."""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Sequence

import numpy as np

from hetero_jax.errors import PromptError, SessionBusyError, SessionError
from hetero_jax.io.tokenizer import check_unicode
from hetero_jax.runtime.compile_cache import compile_seconds
from hetero_jax.runtime.engine import Engine, decode_loop, make_results
from hetero_jax.runtime.prompts import (DEFAULT_RESERVE, check_model, check_request, check_session_args, question_ids,
                                        session_reserve, stop_token_ids, token_list)
from hetero_jax.runtime.results import GenerationResult

_MARKER = "\x00HETERO_JAX_TURN\x00"


@dataclasses.dataclass(frozen=True)
class Transcript:
    """What a session's next turn is rendered from; a turn makes a new one (``ask``, then ``answered``), which
    the session keeps only once the turn has succeeded.

    ``context_text``: the context as text (None for token ids); ``messages``: the chat history; ``rendered``:
    the text the cache holds (chat template applied); ``carry``: the context's last pre-tokens, left out of
    the prefill and tokenised with the first turn, so the turn's tokens are those of the whole text (a
    context ending in a space or a newline tokenises with the question's line break); ``unfed``: the last
    answer token, not yet in the cache; ``turns``: turns answered.
    """

    context_text: str | None
    chat: bool
    rendered: str | None
    carry: str = ""
    messages: tuple = ()
    unfed: tuple = ()
    turns: int = 0

    def ask(self, tok, cfg, question) -> tuple[list[int], "Transcript"]:
        """Tokens that close the previous turn (if any) and open this one, and the transcript after them."""
        unfed = list(self.unfed)
        done = dict(unfed=(), carry="", rendered=None if self.rendered is None else self.rendered + self.carry)
        if not isinstance(question, str):
            if self.chat and self.context_text is not None:  # the chat template renders text turns only
                raise PromptError("a chat Session over a text context takes text questions (the chat template "
                                  "renders each turn from its text); pass the question as text, or open the "
                                  "Session with chat=False to feed token ids")
            ids = unfed + (tok.encode(self.carry) if self.carry else []) + question_ids(question, cfg)
            return ids, dataclasses.replace(self, **done)
        if not question.strip():
            raise PromptError("empty question: the question text has no content")
        check_unicode(question, "the question")
        if self.context_text is None and self.chat:
            raise PromptError("a text question in a chat Session over token ids: the chat template needs the "
                              "context's text; pass the context as text, the question as token ids, or open the "
                              "Session with chat=False (the question's text is then appended as it is)")
        if self.context_text is None or not self.chat:
            sep = "\n\n" if (self.turns or self.context_text) else ""
            ids = unfed + tok.encode(self.carry + sep + question, add_special_tokens=False)
            return ids, dataclasses.replace(self, **done)
        if not self.turns:
            msgs = ({"role": "user", "content": self.context_text + "\n\n" + question},)
        else:
            msgs = self.messages + ({"role": "user", "content": question},)
        rendered = tok.apply_chat_template(list(msgs), add_generation_prompt=True)
        held = len(self.rendered)  # the text the cache holds ends here
        if not rendered.startswith(self.rendered):
            # a template that trims messages (Llama 3's `| trim`) drops the last answer's trailing whitespace
            # once it is history: the cache keeps the answer as generated, and the turn feeds what the template
            # writes after the trimmed text
            last = self.messages[-1]["content"] if self.messages and self.messages[-1]["role"] == "assistant" else ""
            cut = len(last) - len(last.rstrip())
            if not (cut and last.strip() and rendered.startswith(self.rendered[:held - cut])):
                raise PromptError("the chat template does not render turns incrementally (it renders the history "
                                  "differently once a turn is added, changing an earlier message's text); use "
                                  "chat=False, or open a new Session")
            held -= cut
        ids = unfed + tok.encode(rendered[held:], add_special_tokens=False)  # the carry included
        return ids, dataclasses.replace(self, messages=msgs, rendered=rendered, unfed=(), carry="")

    def answered(self, tok, answer_ids: list[int], all_fed: bool) -> "Transcript":
        """The transcript once the answer ``answer_ids`` was generated (``all_fed``: every answer token is in the
        cache, as when it ended at EOS or a stop token). Otherwise its last token is not: it opens the next turn."""
        t = dataclasses.replace(self, turns=self.turns + 1,
                                unfed=(answer_ids[-1],) if answer_ids and not all_fed else ())
        if self.chat and self.context_text is not None:
            answer = tok.decode(answer_ids)
            t = dataclasses.replace(t, messages=t.messages + ({"role": "assistant", "content": answer},),
                                    rendered=t.rendered + answer)
        return t


def open_context(tok, context, chat: bool) -> tuple[list[int], Transcript]:
    """The context's token ids and the transcript a session starts from; checks before any compute."""
    if isinstance(context, str):
        if not context.strip():
            raise PromptError("empty context: the session's context text has no content")
        check_unicode(context, "the context")
        if chat:
            rendered = tok.apply_chat_template([{"role": "user", "content": context + _MARKER}])
            if _MARKER not in rendered:
                raise PromptError("the chat template changes the message text, so the context cannot be "
                                  "prefilled apart from the first question; use chat=False")
            prefix = rendered[: rendered.index(_MARKER)]
            # carried text stays inside the context (a template may strip its leading space, or escape it)
            body = context.lstrip()
            cut = tok.settled_length(prefix, start=len(prefix) - len(body)) if prefix.endswith(body) else len(prefix)
            return (tok.encode(prefix[:cut], add_special_tokens=False),
                    Transcript(context, True, prefix[:cut], carry=prefix[cut:]))
        cut = tok.settled_length(context) or len(context)  # none settled: the whole context is prefilled
        return (tok.encode_prompt(context[:cut], chat=False),
                Transcript(context, False, context[:cut], carry=context[cut:]))
    return token_list(context, "the context"), Transcript(None, chat, None)


def check_turns_fit(model, context, questions: Sequence, *, chat: bool = True) -> None:
    """Every question of a scripted session fits the model's context, checked before any compute.

    The rule is ``Session.ask``'s (a turn's tokens must leave at least one position for its answer), applied
    to the questions in order as if every answer were empty: answers only take more positions, so a turn
    refused here would be refused by the session, after the turns before it were computed.
    """
    check_model(model)
    tok, cfg = model.tokenizer, model.config
    ids, t = open_context(tok, context, chat)
    total = cfg.max_position_embeddings
    used = len(ids)
    if used >= total:
        raise PromptError(f"the context has {used} tokens but the model's context is {total} tokens (room is "
                          "needed for the questions and answers); shorten the context")
    for i, q in enumerate(questions, 1):
        q_ids, t = t.ask(tok, cfg, q)
        if used + len(q_ids) + 1 > total:
            raise PromptError(
                f"turn {i} ({len(q_ids)} tokens) does not fit: the context ({len(ids)} tokens)"
                + (f" and turns 1-{i - 1} ({used - len(ids)} tokens, answers not counted)" if i > 1 else "")
                + (" leave" if i > 1 else " leaves")
                + f" {total - used} positions of the model's {total}-token context, and its answer needs at least "
                "one; shorten or drop that question (nothing was computed)"
            )
        used += len(q_ids)
        t = t.answered(tok, [], all_fed=True)


class Session:
    """A long context prefilled once, then several questions answered in turn.

    Each turn is appended to the cache as an extension (on the tail of every
    head, like generated tokens) in chunked passes (``Engine.extend``), then
    answered. The policy's prefill selection sees only the context; HeteroCache
    re-selects its compressed heads from each turn's queries before the answer.
    ``generate`` is one turn of this with the question inside the prompt.

    A turn that fails, whatever fails (a refused question, an ``on_token`` that
    raises, a KeyboardInterrupt, a policy's recall), leaves the session as it
    was: the history, the cache and the decode state are committed only when
    the answer is complete. One question at a time: an ``ask`` from another
    thread while one runs is refused (``SessionBusyError``).
    """

    def __init__(self, model, context: str | Sequence[int], policy=None, *, chat: bool = True, seed: int = 0,
                 reserve_tokens: int | None = None):
        """``policy``: a policy object (the engine refuses None; ``hetero_jax.Session``, above policies/, fills
        in full KV for it). ``reserve_tokens``: tail rows allocated up front for turns and answers (the tail
        grows when they outgrow it); None: 512, or the positions the context leaves if fewer."""
        check_session_args(model, context, chat, seed, reserve_tokens)
        self.model, self.chat = model, chat
        ids, self._t = open_context(model.tokenizer, context, chat)
        cfg = getattr(model, "config", None)
        if cfg is not None:  # a tokenizer-only stand-in (benchmarks' probe) has no context length
            check_model(model)
            reserve_tokens = session_reserve(reserve_tokens, cfg, len(ids))
        elif reserve_tokens is None:
            reserve_tokens = DEFAULT_RESERVE
        self.engine = Engine(model, [ids], policy, tail_capacity=reserve_tokens, seed=seed)
        self.context_tokens = len(ids)
        self.turns: list[GenerationResult] = []
        self._lock = threading.Lock()
        self._owner: int | None = None  # the thread answering now
        self._lost: str | None = None  # why the cache cannot be used any more (a turn's failure could not be undone)

    def __copy__(self):
        raise SessionError("a Session cannot be copied: a copy would share the cache (donated to each step), so "
                           "asking it would change the original's answers. Open a second Session on the same "
                           "context to branch a conversation")

    def __deepcopy__(self, memo):
        self.__copy__()

    # the history, read-only views of the committed transcript
    @property
    def messages(self) -> list[dict]:
        """The chat history as the cache holds it: ``{"role", "content"}`` dicts, the first user message with the
        context. An answer is every token generated, so one cut by a ``stop`` string keeps the stop string (and
        any text its last token carried past it) here, while that turn's ``text`` ends before it. Empty for a
        session without the chat template (``chat=False`` or a token-id context)."""
        return list(self._t.messages)

    @property
    def _rendered(self) -> str | None:
        return self._t.rendered

    @property
    def _unfed(self) -> list[int]:
        return list(self._t.unfed)

    @property
    def pending_tokens(self) -> int:
        """Tokens of the last answer not yet in the cache (0 or 1): the next turn feeds them first. An answer
        that ended at EOS or at a special token a stop string names is all in the cache; one cut by its
        token budget or a stop string's text leaves its last token to open the next turn."""
        return len(self._t.unfed)

    def ask(self, question, *, max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
            stop=None, on_token=None) -> GenerationResult:
        """Append ``question`` (text or token ids) and generate the answer."""
        # one turn at a time: a second thread would step the same donated cache (its arrays deleted under the
        # first) and interleave two histories; refuse it at once rather than queue behind a long answer
        if not self._lock.acquire(blocking=False):
            if self._owner == threading.get_ident():  # from inside its own on_token
                raise SessionBusyError("Session.ask was called from this Session's own on_token while it answers; "
                                       "ask the next question after ask returns")
            raise SessionBusyError("this Session is answering another question in another thread; wait for that "
                                   "answer or open a second Session")
        self._owner = threading.get_ident()
        try:
            return self._ask(question, max_new_tokens, temperature, top_p, stop, on_token)
        finally:
            self._owner = None
            self._lock.release()

    def _ask(self, question, max_new_tokens, temperature, top_p, stop, on_token) -> GenerationResult:
        if self._lost is not None:
            raise SessionError(self._lost)
        stops = check_request(max_new_tokens, temperature, top_p, stop=stop, on_token=on_token)
        eng, tok = self.engine, self.model.tokenizer
        stop_token_ids(tok, stops)  # refuses, before any compute, a stop string that could never match
        eng.begin_call()  # the turn reports its own compiles (and, on the first turn, the context's prefill)
        ids, t = self._t.ask(tok, eng.cfg, question)
        room = eng.positions_left - len(ids)
        if room < 1:
            carried = len(self._t.unfed)  # the last answer's final token, fed first in this turn
            held = ", one of them for the last answer's final token" if carried else ""
            if eng.positions_left - carried < 2:  # not even a one-token question and its answer fit
                raise PromptError(
                    f"this session has reached the end of the model's {eng.cfg.max_position_embeddings}-token "
                    f"context ({eng.positions_left} position(s) left{held}): no question fits; start a new "
                    "session (this one is unchanged)")
            raise PromptError(
                f"the question ({len(ids) - carried} tokens) does not fit: {eng.positions_left} positions are left "
                f"in the model's {eng.cfg.max_position_embeddings}-token context{held}, and the answer needs one "
                "more; ask a shorter question or start a new session (this one is unchanged)"
            )
        budget = min(max_new_tokens, room)
        capacity = eng.cache.tail_capacity
        eng.reserve(len(ids) + budget + 1, doubling=True)  # may grow the tail: more room, the same answers
        saved = eng.checkpoint()
        try:
            res, t = self._answer(ids, t, budget, max_new_tokens, temperature, top_p, stops, on_token)
        except BaseException:
            # whatever failed (on_token, Ctrl-C, the template, a recall), the turn did not happen: the cache as
            # it was, the tail rows this turn reserved given back
            if eng.restore(saved):
                eng.shrink_tail(capacity)
            else:
                self._lost = ("this Session's cache was lost when a turn failed inside a device call (its arrays "
                              "had been handed to the call); open a new Session")
            raise
        self._t = t
        self.turns.append(res)
        eng.compile_counted()
        return res

    def _answer(self, ids, t: Transcript, budget, max_new_tokens, temperature, top_p, stops, on_token):
        """Feed the turn and decode its answer: (result, transcript after it). Changes only the engine."""
        eng = self.engine
        # All but the turn's last token go in chunked passes (the policy re-selects from their queries,
        # HeteroCache's after_extend); the last one is a decode step, so the answer's first token is
        # sampled with the new selection in place.
        before = compile_seconds()
        t0 = time.perf_counter()
        if len(ids) > 1:
            eng.extend(ids[:-1])
        nxt, _ = eng.step(np.asarray(ids[-1:], np.int32), temperature, top_p)
        extend_s = time.perf_counter() - t0 - (compile_seconds() - before)  # compile excluded, as in decode
        fed = eng.steps
        out_ids, texts, reasons, decode_s = decode_loop(eng, nxt, budget, temperature=temperature, top_p=top_p,
                                                         stops=stops, on_token=on_token, max_new_tokens=max_new_tokens)
        res = make_results(eng, out_ids, texts, reasons, decode_s, [self.context_tokens], extend_s)[0]
        res.stats = dataclasses.replace(res.stats, turn=t.turns + 1, turn_tokens=len(ids))
        # a decode step fed each token sampled before the last: every answer token is in the cache when the last
        # one sampled is not the answer's (EOS, or a special token a stop string names: stop reason "stop")
        return res, t.answered(self.model.tokenizer, out_ids[0], eng.steps - fed == len(out_ids[0]))
