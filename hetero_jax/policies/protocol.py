"""What a policy's prefill hands the engine: the plan (``build_layer`` per layer, then ``finish``) and the
per-request ``DecodeState`` whose hooks the engine runs around every decode step, the same for every policy."""

from __future__ import annotations

import jax
import numpy as np

from hetero_jax.model.cache import KVCache, kept_prompt_tokens, kv_bytes
from hetero_jax.model.config import ModelConfig
from hetero_jax.model.sharding import to_host


def achieved_rho(cache: KVCache, cfg: ModelConfig, extra_rows=0) -> np.ndarray:
    """[B] prompt KV kept on the device (+ ``extra_rows`` [B] token-equivalents of policy state the budget counts)
    / the prompt's full KV (tokens x KV heads x layers)."""
    full = to_host(cache.prompt_lens).astype(np.float64) * cfg.num_kv_heads * cfg.num_layers
    return (kept_prompt_tokens(cache) + extra_rows) / full


class PrefillPlan:
    """A policy's prefill for one batch: ``prompt_counts`` before any compute, ``build_layer`` per layer,
    then ``finish``.

    ``prompt_counts()`` gives the prompt rows every head keeps, [layers, B, Hkv] in layout order (the
    pool is allocated from them, ``cache.pool_offsets``), or None when they are decided at the end; then
    ``cut(outputs) -> (outputs, counts)`` gives the final blocks and counts (CAKE).
    ``build_layer(li, layer, x_in, k_buf, v_buf, lens)`` gets the layer's params, input hidden states
    [B, Tp, H] and full prompt K/V [B, Hkv, Tp, D] and returns a ``cache.LayerPrefill``: row blocks that
    cover the layer's heads (each head's kept rows, at least its count) and the layer's state record;
    ``finish(cache)`` returns ``(cache, DecodeState)``.
    """

    def prompt_counts(self):
        raise NotImplementedError

    def build_layer(self, li, layer, x_in, k_buf, v_buf, lens):
        raise NotImplementedError

    def finish(self, cache):
        raise NotImplementedError


class DecodeState:
    """Host-side, per-request decode state that a prefill plan's ``finish`` returns.

    The engine runs these hooks around every jitted decode step, for every policy (the defaults do
    nothing): no policy-specific branch exists in the engine. Counters that change while decoding live
    here, never on the (frozen) policy.
    """

    wants_turn_queries = False  # after_extend needs the turn's queries
    # after_extend may move the prompt rows the heads attend: the engine then appends the turn again
    # over the new rows (its first pass was computed over the old ones)
    reencodes_turn = False
    # the hooks or the policy's attend may rewrite prompt rows of the pool (recalls, fetched pages): undoing a
    # session's failed turn then needs a copy of the pool taken before it (False: a turn only appends to the
    # tail, and the lengths alone undo it). True unless a state declares otherwise, so a new policy is safe.
    writes_prompt_rows = True

    def fresh(self) -> "DecodeState":
        """A new state as this one was right after prefill (counters zero; the same host copies)."""
        return type(self)()

    def before_step(self, step: int, cache):
        """Before step ``step`` is dispatched (host): apply last step's decisions; returns the cache."""
        return cache

    def after_step(self, step: int, extras: tuple, cache) -> None:
        """After step ``step`` was dispatched (host): ``extras`` are the layers' ``attend`` extras (device)."""

    def pool_moved(self, cache) -> None:
        """The pool was repacked (``cache.resize_tail``: a session outgrew its tail rows, or a server trimmed a held one's), so every head's
        offset changed: a state that writes rows by offset reads the new ones here."""

    def after_extend(self, turn_queries: tuple, cache):
        """After a session's turn was appended: turn_queries per layer [B, Nkv, N, G, D]; returns the cache."""
        return cache

    def in_flight(self):
        """Device work the hooks dispatched and nobody waits on (``Engine.drain`` waits for it)."""
        return ()

    def host_arrays(self) -> tuple:
        """Arrays the prefill placed in host memory."""
        return ()

    def host_operands(self) -> tuple:
        """Per layer, host-memory arrays the policy's ``attend`` reads inside the step (``LayerStep.host``), or
        () for none. The engine passes them to every step and turn chunk as an argument it never donates: the
        state keeps owning them."""
        return ()

    def host_bytes(self) -> int:
        return int(sum(a.nbytes for a in self.host_arrays()))

    def host_bytes_by_role(self) -> dict[str, int]:
        return {}

    def achieved_rho(self, cache, cfg) -> np.ndarray:
        """[B] the rho every result reports: prompt tokens kept on the device / the prompt's full KV
        (:func:`achieved_rho`). A policy whose device state is not token rows (HCAttention's codes)
        reports bytes instead."""
        return achieved_rho(cache, cfg)

    def index_bytes(self, cache) -> int:
        """Device bytes of policy state beside the K/V rows (page summaries, K_base, ...): every array of
        the layers' state records."""
        return int(sum(a.nbytes for lc in cache.layers for a in jax.tree.leaves(lc.state)))

    def recalled_bytes(self) -> int:
        """K/V bytes moved from host memory into the pool (recalls, page fetches) since prefill; 0 for a state
        that never fetches."""
        return 0

    def kv_bytes_read(self, cache, steps: int) -> int:
        """K/V and index bytes one decode step reads (device reads plus host fetches), the memory traffic a
        roofline compares, after ``steps`` decode steps: by default the pool as allocated, the state arrays and
        the rows fetched from the host (mean per step), counted twice: read from the host and written into the
        pool."""
        fetched = 2 * self.recalled_bytes() / steps if steps else 0
        return int(kv_bytes(cache) + self.index_bytes(cache) + fetched)

    def stats(self) -> dict:
        """The policy's decode counters (JSON-able)."""
        return {}

    def summary(self) -> str:
        """The counters as a short text for ``GenerationStats.summary`` ('' when there are none)."""
        return ""


class TailOnlyDecode(DecodeState):
    """The state of a policy whose decode only appends to the tail (full KV, the static baselines): no hooks."""

    writes_prompt_rows = False
