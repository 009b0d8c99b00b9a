"""Next-token sampling: greedy at temperature 0 (or below ``GREEDY_BELOW``), nucleus (top-p) otherwise."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import MASK_VALUE

# Temperatures below this are greedy. At 1e-5 a draw already takes the argmax unless another logit is within
# about 1e-4 of it, and far smaller ones break float32: logits / 1e-40 divides by a subnormal that XLA flushes
# to zero, and every token came out as id 0.
GREEDY_BELOW = 1e-5


def is_greedy(temperature: float) -> bool:
    """True when ``temperature`` decodes greedily (0, or below ``GREEDY_BELOW``)."""
    return temperature < GREEDY_BELOW


def sampling_mode(temperature: float, top_p: float) -> str:
    """What a compiled step must know of a sampling setting: "greedy", "sample" or "nucleus" (top_p < 1: the
    sort). The values themselves are operands, so a server's clients choosing their own temperature and top_p
    share three executables instead of compiling one each."""
    return "greedy" if is_greedy(temperature) else "nucleus" if top_p < 1.0 else "sample"


def _threefry(key: jax.Array) -> jax.Array:
    """The raw key [2] uint32 (``engine.seed_key``) as a threefry key, whatever generator the process defaults to
    (``JAX_DEFAULT_PRNG_IMPL=rbg`` reads raw keys as 4 words): a seed samples the same tokens everywhere."""
    return jax.random.wrap_key_data(key, impl="threefry2x32")


def draw_key(key: jax.Array, mode: str) -> tuple[jax.Array, jax.Array]:
    """(the next key, the key this token samples with): ``jax.random.split(key)`` when sampling; a greedy
    token draws nothing, so (key, key). Eager or traced (in a jitted step the split is a loop on a CPU, which
    a greedy step's compile need not carry)."""
    if mode == "greedy":
        return key, key
    nxt, use = jax.random.split(_threefry(key))
    return jax.random.key_data(nxt), jax.random.key_data(use)


def sample(logits: jax.Array, key: jax.Array, temperature, top_p, mode: str | None = None) -> jax.Array:
    """logits [B, V] float32 -> tokens [B]. Greedy at temperature 0 (or below ``GREEDY_BELOW``); nucleus
    sampling otherwise. ``temperature`` and ``top_p`` may be traced scalars when ``mode``
    (:func:`sampling_mode` of their values) is given.

    Every row draws with the same ``key``, so a row samples what its prompt samples alone with that key, and
    identical prompts in one batch sample identical tokens.
    """
    mode = sampling_mode(temperature, top_p) if mode is None else mode
    if mode == "greedy":
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if mode == "nucleus":
        sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        cum = jnp.cumsum(probs, axis=-1)
        # keep the smallest prefix whose mass reaches top_p, and every token tied with its last one: the cut is
        # a logit value, so no tie is broken by the sort's order. At least the top token: a top_p that float32
        # holds as 0 (below ~1e-38) counts none, and index -1 would cut at the smallest logit, masking nothing
        n_keep = jnp.maximum(jnp.sum(cum - probs < top_p, axis=-1), 1)
        cutoff = jnp.take_along_axis(sorted_logits, (n_keep - 1)[:, None], axis=-1)
        logits = jnp.where(logits < cutoff, MASK_VALUE, logits)
    # one [V] draw per row with the key unbatched: a [B, V] draw would give row b other noise than alone
    return jax.vmap(lambda row: jax.random.categorical(_threefry(key), row))(logits).astype(jnp.int32)
