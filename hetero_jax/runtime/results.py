"""What ``generate`` and ``Session.ask`` return: the text, the tokens and the measured costs."""

from __future__ import annotations

import dataclasses

import numpy as np

from hetero_jax.model.sharding import imbalance


@dataclasses.dataclass
class GenerationStats:
    # in a Session every turn repeats the context's prompt_tokens and prefill_seconds (the prefill happened once,
    # before the first turn); a turn's own prompt work is turn_tokens and extend_seconds
    prompt_tokens: int
    generated_tokens: int
    prefill_seconds: float
    decode_seconds: list[float]  # per decode step, wall time until its tokens were on the host (generate pipelines)
    kv_bytes_device: int  # bytes of K/V arrays allocated on the device (whole batch)
    kv_bytes_used: int  # bytes of K/V holding valid tokens at the end (whole batch)
    kv_bytes_host: int  # bytes of K/V kept in host memory (0 without offload)
    kv_bytes_host_by_role: dict  # HeteroCache: host bytes per head role ({} without offload)
    kv_bytes_index: int  # device bytes of policy state beside the K/V groups (page summaries, K_base, ...)
    kv_bytes_read_per_step: int  # K/V + index bytes one decode step reads (device reads + host fetches)
    kv_bytes_prompt: int  # of which the prompt's head groups
    kv_bytes_tail: int  # of which the tail (tokens added after prefill)
    stop_reason: str  # "eos", "stop", "max_new_tokens" or "context"
    # XLA compilation in this call (excluded from the timings above); a Session's first turn also counts the
    # context's prefill, later turns only their own
    compile_seconds: float = 0.0
    extend_seconds: float = 0.0  # session turns: appending the question before decoding (compile excluded)
    # session turns: the turn's number (1 = the first; 0 outside a Session) and the tokens it appended before
    # decoding (the question with its chat markup, and the last answer's final token when it was not yet cached)
    turn: int = 0
    turn_tokens: int = 0
    # the policy's decode counters (HeteroCache: checks, triggers, recalls, bytes); in a Session, totals
    # since the context's prefill
    policy_stats: dict = dataclasses.field(default_factory=dict)
    policy_summary: str = ""  # those counters as text
    policy: str = "FullKV(budget=1.0)"
    # prompt KV kept on the device / full prompt KV (tokens x KV heads x layers); in bytes for a policy that keeps
    # no token rows (HCAttention: keys or codes + codebook / full K+V bytes)
    achieved_rho: float = 1.0
    # on a mesh: K/V bytes each device holds (str(device) -> bytes, measured from the shards; replicated
    # groups count on every device) and the host bytes held for each device; {} on one device
    kv_bytes_per_device: dict = dataclasses.field(default_factory=dict)
    host_bytes_per_device: dict = dataclasses.field(default_factory=dict)

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else float("nan")

    def _host_roles_text(self) -> str:
        roles = {k: v for k, v in self.kv_bytes_host_by_role.items() if v}
        if not roles:
            return ""
        return " (" + ", ".join(f"{k}s {v / 2**20:.1f}" for k, v in roles.items()) + ")"

    def decode_ms_percentile(self, q: float) -> float:
        return 1e3 * float(np.percentile(self.decode_seconds, q)) if self.decode_seconds else float("nan")

    @property
    def decode_ms_per_token(self) -> float:
        return 1e3 * float(np.mean(self.decode_seconds)) if self.decode_seconds else float("nan")

    def _decode_text(self) -> str:
        return f"{self.decode_ms_per_token:.1f} ms/tok" if self.decode_seconds else "no steps"

    def _prompt_text(self) -> str:
        prefill = f"prefill {self.prefill_seconds:.2f} s ({self.prefill_tokens_per_second:.0f} tok/s)"
        if not self.turn:
            return f"prompt {self.prompt_tokens} tok, {prefill}"
        # a session's context was prefilled once, before turn 1: later turns name it, not its time again
        context = (f"context {self.prompt_tokens} tok, {prefill}" if self.turn == 1
                   else f"context {self.prompt_tokens} tok (prefilled once, before turn 1)")
        return f"{context} | turn {self.turn}: {self.turn_tokens} tok, extend {self.extend_seconds:.2f} s"

    def summary(self) -> str:
        return (
            f"{self._prompt_text()} | generated {self.generated_tokens} tok, "
            f"decode {self._decode_text()} | KV device {self.kv_bytes_device / 2**20:.1f} MiB "
            f"(used {self.kv_bytes_used / 2**20:.1f} MiB), host {self.kv_bytes_host / 2**20:.1f} MiB{self._host_roles_text()} | "
            f"rho {self.achieved_rho:.3f}{' | ' + self.policy_summary if self.policy_summary else ''}"
            f"{self._devices_text()} | compile {self.compile_seconds:.1f} s | stop: {self.stop_reason}"
        )

    def _devices_text(self) -> str:
        if not self.kv_bytes_per_device:
            return ""
        dev = np.asarray(list(self.kv_bytes_per_device.values()), np.float64)
        return (f" | {dev.size} devices: KV max {dev.max() / 2**20:.1f} MiB/device "
                f"(max/mean {imbalance(self.kv_bytes_per_device):.2f})")


@dataclasses.dataclass
class GenerationResult:
    text: str
    token_ids: list[int]  # generated tokens only (EOS excluded; a stop string's cut is in .text only)
    stats: GenerationStats

