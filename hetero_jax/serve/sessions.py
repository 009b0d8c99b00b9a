"""Conversations the server holds between requests, and the chat turn that resumes or starts one.

How a chat request maps onto a ``Session`` (docs/serve.md):

- The checkpoint's chat template renders the request's messages (system messages included, with the generation
  prompt) to text, tokenised as ``generate`` tokenises a chat prompt.
- A new conversation: every token but the last is the Session's context (prefilled with the policy's selection,
  as ``generate`` prefills a prompt), and the last token is the first question (one decode step), so the policy
  selects over the whole conversation and the answer is ``generate``'s for the same messages.
- A request whose messages are a held conversation's (its messages and the answer the server gave, exactly)
  followed by new ones resumes it: the tokens the template adds after the held text (the previous answer's end
  marker, the new messages, the generation prompt) are the turn, appended in chunks and re-selected over
  (``Session.ask``), and ``usage.prompt_tokens_details.cached_tokens`` counts the positions already cached.
  Anything else starts a new conversation.
- Conversations are keyed by the request's ``user`` and policy as well: two users never share a cache.

A turn that fails leaves its conversation held as it was (``Session.ask`` restores it). Held conversations are
evicted least recently used beyond ``max_sessions`` or the device / host KV byte bounds.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import logging
import re
import threading

from hetero_jax.errors import ConfigError, SessionError
from hetero_jax.model.cache import kv_bytes
from hetero_jax.policies import BudgetError, FullKV, PolicyError
from hetero_jax.runtime.compile_cache import tail_capacity_for
from hetero_jax.runtime.prompts import stop_token_ids
from hetero_jax.runtime.session import Session
from hetero_jax.serve.metrics import SHORT_PROMPT
from hetero_jax.serve.schema import RequestError

log = logging.getLogger("hetero_jax.serve")

_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgt]i?b?|b)?\s*", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20, "gi": 2**30,
          "gib": 2**30, "ti": 2**40, "tib": 2**40}


def parse_size(text: str, flag: str) -> int:
    """A byte count written as ``8GiB``, ``512MB``, ``1.5GiB`` or a plain number; ConfigError naming ``flag``."""
    m = _SIZE.fullmatch(str(text))
    if not m:
        raise ConfigError(f"{flag} {text!r} is not a size: write a number of bytes or one with a unit, e.g. 8GiB, "
                          "512MiB, 2GB")
    size = float(m.group(1)) * _UNITS[(m.group(2) or "").lower()]
    if size != int(size):  # "0.5" read as bytes would be 0: a unit was most likely left out
        raise ConfigError(f"{flag} {text!r} is not a whole number of bytes; give a unit for a fraction (e.g. "
                          f"{m.group(1)}GiB) or whole bytes")
    return int(size)


def _digest(prev: bytes, message: tuple[str, str]) -> bytes:
    return hashlib.sha256(prev + json.dumps(message).encode()).digest()


def identity(x):
    """What ``==`` compares of ``x``: a dataclass as its class and compared fields, in depth (a policy's repr
    leaves out fields it compares, such as HCAttention's codebook keys), tuples and lists item by item."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return (type(x).__module__, type(x).__qualname__,
                tuple((f.name, identity(getattr(x, f.name))) for f in dataclasses.fields(x) if f.compare))
    if isinstance(x, (tuple, list)):
        return type(x).__name__, tuple(identity(v) for v in x)
    return x


def digests(owner: tuple, messages) -> list[bytes]:
    """The key of every prefix of ``messages`` under ``owner`` (the user and the policy, as ``==`` tells them
    apart): [key of messages[:1], ..., key of messages]."""
    h = hashlib.sha256(repr(identity(owner)).encode()).digest()
    out = []
    for m in messages:
        h = _digest(h, m)
        out.append(h)
    return out


@dataclasses.dataclass
class Conversation:
    """A held conversation: its Session and what its cache holds.

    ``messages``: the request's messages and the answer given; ``rendered``: that conversation as the chat
    template writes it (the cache holds exactly its tokens, but for the answer's last token when the answer did
    not end at EOS: ``unfed`` 1, fed first in the next turn); ``kv_device`` / ``kv_host``: bytes its cache holds
    (the last turn's ``GenerationStats``); ``recalls``: the policy's recall count so far."""

    session: Session
    owner: tuple
    messages: tuple
    rendered: str
    unfed: int
    kv_device: int
    kv_host: int
    recalls: int = 0

    @property
    def key(self) -> bytes:
        return digests(self.owner, self.messages)[-1]


class SessionStore:
    """Held conversations, least recently used first, within ``max_sessions`` and the byte bounds (None: no
    bound). Only the engine worker changes it; the lock keeps the totals that /metrics reads consistent."""

    def __init__(self, max_sessions: int, max_device_bytes: int | None = None, max_host_bytes: int | None = None):
        self.max_sessions, self.max_device, self.max_host = max_sessions, max_device_bytes, max_host_bytes
        self._held: collections.OrderedDict[bytes, Conversation] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.evictions = 0

    def take(self, owner: tuple, messages) -> Conversation | None:
        """Remove and return the held conversation whose messages are the longest proper prefix of ``messages``
        (None if there is none); the caller puts it back when done."""
        keys = digests(owner, messages)
        with self._lock:
            for k in reversed(keys[:-1]):
                conv = self._held.pop(k, None)
                if conv is not None:
                    return conv
        return None

    def put(self, conv: Conversation) -> int:
        """Hold ``conv`` as the most recent; evict the least recent beyond the bounds. A ``conv`` that alone
        exceeds a bound is not held and evicts nothing else (the others' caches would go for nothing). Returns
        how many were evicted (that one counts)."""
        evicted = 0
        with self._lock:
            if self._beyond(1, conv.kv_device, conv.kv_host):
                self._held.pop(conv.key, None)
                self.evictions += 1
                return 1
            self._held[conv.key] = conv
            self._held.move_to_end(conv.key)
            while self._held and self._over():
                self._held.popitem(last=False)
                evicted += 1
            self.evictions += evicted
        return evicted

    def _over(self) -> bool:
        return self._beyond(len(self._held), *self._bytes())

    def _beyond(self, sessions: int, dev: int, host: int) -> bool:
        """Whether ``sessions`` conversations holding ``dev`` and ``host`` KV bytes pass a bound."""
        return (sessions > self.max_sessions or (self.max_device is not None and dev > self.max_device)
                or (self.max_host is not None and host > self.max_host))

    def _bytes(self) -> tuple[int, int]:
        return (sum(c.kv_device for c in self._held.values()), sum(c.kv_host for c in self._held.values()))

    def totals(self) -> dict:
        """Held conversations, their device and host KV bytes, and evictions so far."""
        with self._lock:
            dev, host = self._bytes()
            return {"sessions": len(self._held), "kv_bytes_device": dev, "kv_bytes_host": host,
                    "evictions": self.evictions}


@dataclasses.dataclass(frozen=True)
class Turn:
    """One answered chat turn: the answer, why it ended, the token counts of ``usage`` and the measured costs.
    ``prefill_seconds``: the new prompt tokens' time (a new conversation's prefill and its first step, or a
    resumed one's appended turn), compile excluded; ``decode_seconds``: the answer's decode steps."""

    text: str
    token_ids: tuple
    stop_reason: str
    prompt_tokens: int
    cached_tokens: int
    resumed: bool
    prefill_seconds: float
    decode_seconds: float
    decode_steps: int
    recalls: int
    short_prompt: str = ""  # "", or how a prompt too short for the server's budget was served (``fit_to_prompt``)


def fit_to_prompt(model, policy, prompt_len: int, error: BudgetError):
    """(policy, how) for a prompt the server's own policy refused as too short for its budget (``error``): the
    same policy at the smallest budget above its own that fits the prompt ("smallest_budget": the method's
    least layout), else full KV ("full_kv": no budget fits, so the whole prompt is smaller than that layout).
    A PolicyError (the policy does not fit the model) is raised as it is."""
    if isinstance(error, PolicyError):
        raise error
    try:
        rho = policy.smallest_budget(model, prompt_len, at_least=policy.budget)
    except BudgetError:
        log.info("a %d-token prompt is shorter than %s's least layout: served with full KV", prompt_len,
                 type(policy).__name__)
        return FullKV(), SHORT_PROMPT[1]
    log.info("a %d-token prompt is too short for %s at rho=%g: served at rho=%g", prompt_len,
             type(policy).__name__, policy.budget, rho)
    return dataclasses.replace(policy, budget=rho), SHORT_PROMPT[0]


def run_fitted(model, policy, prompt_len: int, fit: bool, run):
    """(``run(policy)``, ""); where ``fit`` and ``run`` refuses the prompt as too short for the policy's budget
    (a BudgetError, raised by the plan's checks before any compute), (``run`` at ``fit_to_prompt``'s policy,
    how it was served)."""
    try:
        return run(policy), ""
    except BudgetError as e:
        if not fit:
            raise
        fitted, how = fit_to_prompt(model, policy, prompt_len, e)
        return run(fitted), how


class Conversations:
    """Chat turns over held conversations (one model); called from the engine worker only."""

    def __init__(self, model, store: SessionStore):
        self.model, self.store = model, store
        self.tok = model.tokenizer
        self.context = model.config.max_position_embeddings

    def render(self, messages) -> str:
        """The conversation as the model's chat template writes it, ready for the answer."""
        return self.tok.apply_chat_template([{"role": r, "content": c} for r, c in messages],
                                            add_generation_prompt=True)

    def prepare(self, messages, sampling) -> tuple[str, list[int]]:
        """The request's own checks, made before it is queued (they read no held conversation, so any thread may
        run them): a stop string that could never match, a template that refuses the messages, a conversation
        longer than the context or shorter than two tokens. Returns (the rendered conversation, its ids)."""
        stop_token_ids(self.tok, sampling.stop)
        rendered = self.render(messages)
        ids = self.tok.encode(rendered, add_special_tokens=False)
        if len(ids) + 1 > self.context:
            raise RequestError(f"the conversation is {len(ids)} tokens long but the model's context is "
                               f"{self.context} tokens, and the answer needs at least one more; shorten the "
                               "messages", param="messages", code="context_length_exceeded")
        if len(ids) < 2:
            raise RequestError("the chat template renders these messages to fewer than two tokens; send more text",
                               param="messages")
        return rendered, ids

    def answer(self, messages, policy, sampling, user: str, max_tokens: int, on_token=None, *,
               fit_short: bool = False, prepared: tuple[str, list[int]] | None = None) -> Turn:
        """Answer the conversation ``messages`` ((role, content), ...): resume the held one it extends, else
        start one. ``max_tokens``: the answer's cap (fewer when the context runs out). ``fit_short``: a new
        conversation too short for ``policy``'s budget starts at the least that fits (``fit_to_prompt``).
        ``prepared``: what ``prepare`` returned for these messages (else it runs here)."""
        rendered, ids = self.prepare(messages, sampling) if prepared is None else prepared
        owner = (user, policy)
        conv = self.store.take(owner, messages)
        if conv is not None:
            if rendered.startswith(conv.rendered):  # the template renders the conversation incrementally
                added = self.tok.encode(rendered[len(conv.rendered):], add_special_tokens=False)
                try:
                    return self._turn(conv, messages, rendered, added, sampling, max_tokens, on_token, resumed=True)
                except SessionError:  # its cache was lost when an earlier turn failed: prefill it all again
                    conv = None
            else:
                self.store.put(conv)  # it still serves its own continuations
                conv = None
        # the tail the first answer needs, in TAIL_QUANTUM steps as generate allocates it (Session's default of
        # 512 would grow, and recompile, on the first turn of a 512-token answer)
        reserve = min(tail_capacity_for(max_tokens + 2), self.context - (len(ids) - 1))
        sess, short = run_fitted(self.model, policy, len(ids) - 1, fit_short, lambda p: Session(
            self.model, ids[:-1], p, chat=False, seed=sampling.seed, reserve_tokens=reserve))
        conv = Conversation(sess, owner, (), "", 0, 0, 0)  # held under the server's policy: its turns resume it
        turn = self._turn(conv, messages, rendered, ids[-1:], sampling, max_tokens, on_token, resumed=False,
                          fresh_prefill=sess.engine.prefill_seconds)
        return dataclasses.replace(turn, short_prompt=short)

    def _turn(self, conv: Conversation, messages, rendered: str, ids: list[int], sampling, max_tokens: int,
              on_token, *, resumed: bool, fresh_prefill: float = 0.0) -> Turn:
        sess = conv.session
        held = self.context - sess.engine.positions_left  # positions in the cache (a new one: its context)
        cached = held if resumed else 0
        if held + conv.unfed + len(ids) + 1 > self.context:
            if resumed:
                self.store.put(conv)
            raise RequestError(f"the conversation is {held + conv.unfed + len(ids)} tokens long but the model's "
                               f"context is {self.context} tokens, and the answer needs at least one more; shorten "
                               "the messages or start a new conversation", param="messages",
                               code="context_length_exceeded")
        try:
            res = sess.ask(ids, max_new_tokens=max_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
                           stop=list(sampling.stop) or None, on_token=on_token)
        except SessionError:  # lost (nothing else asks this Session): not held again
            raise
        except BaseException:
            if resumed:  # the Session restored itself (and gave back the tail rows the turn reserved)
                self._hold(conv)  # the conversation is held again as it was
            raise
        st = res.stats
        answer = self.tok.decode(res.token_ids)
        recalls = int(st.policy_stats.get("recalls", 0))
        turn = Turn(text=res.text, token_ids=tuple(res.token_ids), stop_reason=st.stop_reason,
                    prompt_tokens=held + conv.unfed + len(ids), cached_tokens=cached, resumed=resumed,
                    prefill_seconds=fresh_prefill + st.extend_seconds, decode_seconds=float(sum(st.decode_seconds)),
                    decode_steps=len(st.decode_seconds), recalls=recalls - conv.recalls)
        # held only when the client can send the answer back as the cache holds it (a stop string cuts the text
        # it gets, while the cache holds the tokens past the cut)
        if res.text == answer:
            conv.messages = tuple(messages) + (("assistant", answer),)
            conv.rendered = rendered + answer
            conv.unfed = sess.pending_tokens  # 0 after EOS or a stop token, else the last token
            conv.kv_host, conv.recalls = int(st.kv_bytes_host), recalls
            self._hold(conv)
        return turn

    def _hold(self, conv: Conversation) -> None:
        """Hold ``conv`` with the rows it uses, not the room a turn's max_tokens reserved (the next turn reserves
        its own), its device bytes measured as held."""
        conv.session.engine.trim(conv.unfed)
        conv.kv_device = kv_bytes(conv.session.engine.cache)
        self.store.put(conv)
