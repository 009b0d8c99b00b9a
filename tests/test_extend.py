"""Chunked turns: ``model.extend`` appends C tokens in one pass, equal to C decode steps."""

import jax.numpy as jnp
import numpy as np
import pytest

import hetero_jax
from hetero_jax.model import transformer as M
from hetero_jax.model.cache import layer_rows
from hetero_jax.runtime import Engine
from hetero_jax.policies import FullKV, SnapKV


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, tiny_checkpoint):
    return hetero_jax.load(tiny_checkpoint(request.param)[1])


def tail_rows(cache, li, n):
    """Layer ``li``'s first ``n`` tail rows of every head, k and v [B, H, n, D] (each head's tail follows its
    prompt rows in its region of the pool)."""
    k, v, _, _ = (np.asarray(a) for a in layer_rows(cache, li, with_tail=True))
    start = np.asarray(cache.layers[li].lengths)  # [B, H] prompt rows
    take = lambda a: np.stack([np.stack([a[b, h, start[b, h]: start[b, h] + n] for h in range(a.shape[1])])  # noqa: E731
                               for b in range(a.shape[0])])
    return take(k), take(v)


def _engine(model, policy, prompt, tail=64):
    return Engine(model, [prompt], policy, tail_capacity=tail)


@pytest.mark.parametrize("policy", [FullKV(), SnapKV(budget=0.4, window=4)], ids=["full", "snapkv"])
@pytest.mark.parametrize("pad", [0, 5])
def test_extend_equals_token_by_token(tiny, policy, pad):
    """Logits of every appended token, the tail and the next decode step agree within 1e-4 (the
    compressed SnapKV cache included), whatever padding follows the real tokens in the chunk."""
    rng = np.random.default_rng(1)
    cfg = tiny.config
    prompt = rng.integers(3, cfg.vocab_size, 37).tolist()
    turn = rng.integers(3, cfg.vocab_size, 11).tolist()
    ref = _engine(tiny, policy, prompt)
    ext = _engine(tiny, policy, prompt)
    # the reference gets a few decode steps first, so the chunk starts on a non-empty tail
    for t in turn[:3]:
        ref.step_with_logits([t])
        ext.step_with_logits([t])
    want = [ref.step_with_logits([t])[1][0] for t in turn[3:]]
    chunk = turn[3:] + [0] * pad
    logits, cache, queries = M.extend_jit(tiny.params, ext.cache, jnp.asarray([chunk], jnp.int32),
                                          jnp.asarray([len(turn) - 3], jnp.int32), cfg)
    np.testing.assert_allclose(np.asarray(logits[0]), want[-1], atol=1e-4, rtol=1e-4)
    assert int(cache.seq_lens[0]) == int(ref.cache.seq_lens[0]) == len(prompt) + len(turn)
    assert int(cache.tail_lens[0]) == int(ref.cache.tail_lens[0]) == len(turn)
    np.testing.assert_array_equal(np.asarray(cache.tail_positions[0, : len(turn)]),
                                  np.asarray(ref.cache.tail_positions[0, : len(turn)]))
    assert (np.asarray(cache.tail_positions[0, len(turn):]) == -1).all()  # padding holds no position
    for li in range(cfg.num_layers):
        for got, want_rows in zip(tail_rows(cache, li, len(turn)), tail_rows(ref.cache, li, len(turn))):
            np.testing.assert_allclose(got, want_rows, atol=1e-4, rtol=1e-4)
    assert len(queries) == cfg.num_layers
    assert queries[0].shape == (1, cfg.num_kv_heads, len(chunk), cfg.group_size, cfg.head_dim)
    # and the step after the chunk continues identically
    ext.cache = cache
    nxt = int(np.argmax(want[-1]))
    np.testing.assert_allclose(ext.step_with_logits([nxt])[1], ref.step_with_logits([nxt])[1], atol=1e-4,
                               rtol=1e-4)


def test_engine_extend_matches_steps_across_chunks(tiny):
    """``Engine.extend`` splits a long turn into bucketed chunks; the result equals one step per token."""
    rng = np.random.default_rng(2)
    cfg = tiny.config
    prompt = rng.integers(3, cfg.vocab_size, 20).tolist()
    turn = rng.integers(3, cfg.vocab_size, 45).tolist()
    ref = _engine(tiny, FullKV(), prompt, tail=16)
    ext = _engine(tiny, FullKV(), prompt, tail=16)
    ref.reserve(len(turn))
    for t in turn:
        _, want = ref.step_with_logits([t])
    logits = ext.extend(turn, max_chunk=16)  # 3 chunks of 16 (the last padded), tail grown to fit
    np.testing.assert_allclose(logits[0], want[0], atol=1e-4, rtol=1e-4)
    assert int(ext.cache.seq_lens[0]) == len(prompt) + len(turn)
    assert ext.steps == 0  # an extension is not a decode step: no decode hook ran
