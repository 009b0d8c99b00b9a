"""HeteroCache's token scores: the pooled attention of the prompt's last token or window (prefill), of a
session turn's queries (re-selection), and a pivot's K_base from one query."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

import pallas_kernels
from pallas_kernels import avg_pool, gqa_reduce
from hetero_jax.model.transformer import prompt_queries
from hetero_jax.model.scoring import attention_probs, finalize_scores, observation_window_probs, select_topk


@functools.partial(jax.jit, static_argnames=("cfg",))
def last_token_scores(layer, x_in, keys, prompt_lens, cfg):
    """Pooled last-prompt-token attention, GQA max: [B, Hkv, Tp] (MASK_VALUE beyond the prompt)."""
    q = prompt_queries(layer, x_in, (prompt_lens - 1)[:, None], cfg)  # [B, Hkv, 1, G, D]
    lengths = jnp.broadcast_to(prompt_lens[:, None], keys.shape[:2])
    return pallas_kernels.scores(q, keys, lengths, gqa="max")[:, :, 0]


@functools.partial(jax.jit, static_argnames=("cfg", "window"))
def window_scores(layer, x_in, keys, prompt_lens, cfg, window: int):
    """Pooled attention of the last ``window`` prompt queries, summed (causal), GQA max: [B, Hkv, Tp]."""
    probs, _ = observation_window_probs(layer, x_in, keys, prompt_lens, window, cfg)  # [B, Hkv, W, G, Tp]
    return finalize_scores(gqa_reduce(avg_pool(probs.sum(axis=2)), "max", axis=2), prompt_lens)


@functools.partial(jax.jit, static_argnames=("block",))
def turn_scores(q_rows, row_valid, keys, prompt_lens, block: int = 16):
    """Pooled attention of a turn's queries over the prompt, summed, GQA max: [B, H, Tp] (MASK_VALUE beyond it).

    q_rows: [B, H, N, G, D] (N a multiple of ``block``); row_valid: [N] bool (padding rows count 0);
    keys: [B, H, Tp, D]; prompt_lens: [B]. The scoring of prefill's observation window
    (``window_scores``: softmax per query, summed over the queries, 5-tap pooling, GQA max); every prompt
    key precedes the turn, so no causal mask. Blocks of ``block`` queries keep [B, H, block, G, Tp] at most.
    """
    B, H, N, G, D = q_rows.shape
    last = jnp.broadcast_to((prompt_lens - 1)[:, None], (B, block))  # every prompt key visible

    def body(acc, xs):
        q, ok = xs  # [B, H, block, G, D], [block]
        p = attention_probs(q, keys, last, prompt_lens)  # [B, H, block, G, Tp]
        return acc + jnp.where(ok[None, None, :, None, None], p, 0.0).sum(axis=2), None

    qb = q_rows.reshape(B, H, N // block, block, G, D).transpose(2, 0, 1, 3, 4, 5)
    acc, _ = jax.lax.scan(body, jnp.zeros((B, H, G, keys.shape[2]), jnp.float32),
                          (qb, row_valid.reshape(N // block, block)))
    return finalize_scores(gqa_reduce(avg_pool(acc), "max", axis=2), prompt_lens)


@functools.partial(jax.jit, static_argnames=("l_base",))
def turn_k_base(q_last, keys, lengths, l_base: int):
    """A pivot's K_base from one query: top-L_base of its pooled scores (GQA max). q_last [B, Np, 1, G, D]."""
    return top_positions(pallas_kernels.scores(q_last, keys, lengths, gqa="max")[:, :, 0], l_base)


def top_positions(scores, width: int):
    """The positions of the top-min(width, T) scores [B, N, T], best first, padded with -1 to ``width``
    (K_base's bucketed width, which may pass the T scored positions). int32 [B, N, width]."""
    k = min(width, scores.shape[-1])
    idx = jax.lax.top_k(scores, k)[1].astype(jnp.int32)
    return jnp.pad(idx, ((0, 0), (0, 0), (0, width - k)), constant_values=-1)


select_rows = jax.jit(select_topk, static_argnames=("cap",))
