"""Next-token sampling: greedy at temperature 0, nucleus (top-p) otherwise."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import MASK_VALUE


def draw_key(key: jax.Array, temperature: float) -> tuple[jax.Array, jax.Array]:
    """(the next key, the key this token samples with): ``jax.random.split(key)`` when sampling; a greedy
    token draws nothing, so (key, key). Eager or traced (in a jitted step the split is a loop on a CPU, which
    a greedy step's compile need not carry)."""
    return tuple(jax.random.split(key)) if temperature > 0.0 else (key, key)


def sample(logits: jax.Array, key: jax.Array, temperature: float, top_p: float) -> jax.Array:
    """logits [B, V] float32 -> tokens [B]. Greedy at temperature 0; nucleus sampling otherwise."""
    if temperature <= 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_p < 1.0:
        sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        cum = jnp.cumsum(probs, axis=-1)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        n_keep = jnp.sum(cum - probs < top_p, axis=-1)
        cutoff = jnp.take_along_axis(sorted_logits, (n_keep - 1)[:, None], axis=-1)
        logits = jnp.where(logits < cutoff, MASK_VALUE, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)

