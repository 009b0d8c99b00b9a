"""The server's counters and gauges, written in the Prometheus text exposition format (``GET /metrics``)."""

from __future__ import annotations

import collections
import threading

PREFIX = "hetero_jax"
# how a prompt too short for the server's budget was served (``sessions.fit_to_prompt``)
SHORT_PROMPT = ("smallest_budget", "full_kv")


def _escape(value) -> str:
    """A label value as the text exposition format writes it (backslash, quote and newline escaped)."""
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class Metrics:
    """Counters since the server started and the last request's rates; safe to update from any thread."""

    def __init__(self):
        self._lock = threading.Lock()
        self.requests = collections.Counter()  # (endpoint, status) -> count
        self.tokens = collections.Counter()  # prompt, cached, prefill, completion
        self.seconds = collections.Counter()  # prefill, decode
        self.turns = collections.Counter()  # new, resumed
        self.recalls = 0
        self.short_prompts = collections.Counter()  # smallest_budget, full_kv (``sessions.fit_to_prompt``)
        self.disconnects = 0
        self.last_prefill_tps = float("nan")
        self.last_decode_tps = float("nan")

    def request(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[(endpoint, int(status))] += 1

    def disconnect(self) -> None:
        with self._lock:
            self.disconnects += 1

    def turn(self, *, prompt_tokens: int, cached_tokens: int, completion_tokens: int, prefill_seconds: float,
             decode_seconds: float, decode_steps: int, resumed: bool, recalls: int, short_prompt: str = "") -> None:
        """One answered request: its prompt tokens (``cached_tokens`` of them reused), the time for the rest, and
        its decode steps; ``short_prompt``: how a prompt too short for the server's budget was served, if so."""
        new = prompt_tokens - cached_tokens
        with self._lock:
            self.tokens["prompt"] += prompt_tokens
            self.tokens["cached"] += cached_tokens
            self.tokens["prefill"] += new
            self.tokens["completion"] += completion_tokens
            self.seconds["prefill"] += prefill_seconds
            self.seconds["decode"] += decode_seconds
            self.tokens["decode_steps"] += decode_steps
            self.turns["resumed" if resumed else "new"] += 1
            self.recalls += recalls
            if short_prompt:
                self.short_prompts[short_prompt] += 1
            if prefill_seconds > 0:
                self.last_prefill_tps = new / prefill_seconds
            if decode_seconds > 0:
                self.last_decode_tps = decode_steps / decode_seconds

    def render(self, store: dict, queue_depth: int, running: bool) -> str:
        """The exposition text; ``store``: ``SessionStore.totals()``."""
        lines: list[str] = []

        def metric(name, kind, help_, samples):
            lines.append(f"# HELP {PREFIX}_{name} {help_}")
            lines.append(f"# TYPE {PREFIX}_{name} {kind}")
            for labels, value in samples:
                lab = "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items()) + "}" if labels else ""
                lines.append(f"{PREFIX}_{name}{lab} {_num(value)}")

        with self._lock:
            metric("requests_total", "counter", "HTTP requests by endpoint and status",
                   [({"endpoint": e, "status": s}, n) for (e, s), n in sorted(self.requests.items())])
            metric("prompt_tokens_total", "counter", "prompt tokens of answered requests",
                   [({}, self.tokens["prompt"])])
            metric("cached_prompt_tokens_total", "counter", "prompt tokens reused from a held conversation's cache",
                   [({}, self.tokens["cached"])])
            metric("prefill_tokens_total", "counter", "prompt tokens computed (prefilled or appended)",
                   [({}, self.tokens["prefill"])])
            metric("prefill_seconds_total", "counter", "seconds computing prompt tokens (compile excluded)",
                   [({}, self.seconds["prefill"])])
            metric("completion_tokens_total", "counter", "tokens generated", [({}, self.tokens["completion"])])
            metric("decode_steps_total", "counter", "decode steps", [({}, self.tokens["decode_steps"])])
            metric("decode_seconds_total", "counter", "seconds in decode steps (compile excluded)",
                   [({}, self.seconds["decode"])])
            metric("prefill_tokens_per_second", "gauge", "the last request's prompt tokens computed per second",
                   [({}, self.last_prefill_tps)])
            metric("decode_tokens_per_second", "gauge", "the last request's decode steps per second",
                   [({}, self.last_decode_tps)])
            metric("turns_total", "counter", "answered chat turns, new conversations and resumed ones",
                   [({"kind": k}, self.turns[k]) for k in ("new", "resumed")])
            metric("short_prompt_requests_total", "counter", "answered requests whose prompt was too short for "
                   "the server's budget, by how they were served: the policy's smallest budget that fits, or full KV",
                   [({"served": k}, self.short_prompts[k]) for k in SHORT_PROMPT])
            metric("recalls_total", "counter", "KV recalls from host memory (HeteroCache)", [({}, self.recalls)])
            metric("client_disconnects_total", "counter", "requests whose client left before the answer was complete",
                   [({}, self.disconnects)])
        metric("sessions_held", "gauge", "conversations held between requests", [({}, store["sessions"])])
        metric("session_evictions_total", "counter", "held conversations evicted (least recently used)",
               [({}, store["evictions"])])
        metric("kv_bytes_device", "gauge", "device KV bytes of the held conversations",
               [({}, store["kv_bytes_device"])])
        metric("kv_bytes_host", "gauge", "host KV bytes of the held conversations", [({}, store["kv_bytes_host"])])
        metric("queue_depth", "gauge", "requests waiting for the engine", [({}, queue_depth)])
        metric("engine_busy", "gauge", "1 while the engine runs a request", [({}, int(running))])
        return "\n".join(lines) + "\n"


def _num(v) -> str:
    if isinstance(v, float):
        if v != v:
            return "NaN"
        return repr(v)
    return str(int(v))
