"""One tiny random Llama (3 layers, 9 query heads over 3 KV heads) with a stand-in tokenizer, for runtime tests."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hetero_jax.model import spec
from hetero_jax.model.config import ModelConfig
from hetero_jax.io.hub import Model


class TinyTokenizer:
    """Enough of a tokenizer for token-id prompts (and plain-text turns)."""
    eos_token_ids = (0,)

    def decode(self, ids):
        return " ".join(map(str, ids))

    def encode(self, text, add_special_tokens=False):
        return [3 + (ord(c) % 90) for c in text]


def random_prompt(n: int, seed: int = 0, vocab: int = 101) -> list[int]:
    """``n`` token ids drawn from [3, vocab) (ids 0-2 are left to special tokens), reproducible by ``seed``."""
    import numpy as np

    return np.random.default_rng(seed).integers(3, vocab, size=n).tolist()


def random_prompts(lengths, seed: int = 0, vocab: int = 101) -> list[list[int]]:
    """One prompt per length, all drawn from one generator seeded by ``seed``."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=n).tolist() for n in lengths]


def tiny_model(max_position_embeddings: int = 1024, seed: int = 6) -> Model:
    cfg = ModelConfig(architecture="llama", vocab_size=101, hidden_size=48, intermediate_size=64, num_layers=3,
                      num_heads=9, num_kv_heads=3, head_dim=16, rms_norm_eps=1e-5,
                      max_position_embeddings=max_position_embeddings, eos_token_ids=(0,))
    params = jax.tree.map(jnp.asarray, spec.init_params(cfg, seed=seed, scale=0.3))
    return Model(config=cfg, params=params, tokenizer=TinyTokenizer(), path="", name="tiny")


def greedy_with_logits(model: Model, policy, prompts, steps: int = 5, extras: list | None = None):
    """An Engine over ``prompts`` (a batch when more than one), greedy for ``steps`` decode steps:
    (tokens [B, steps + 1], logits [B, steps, V], engine). ``extras``: gets each step's policy extras (per
    layer, their first array, as numpy)."""
    import numpy as np

    from hetero_jax.runtime import Engine

    eng = Engine(model, prompts, policy, tail_capacity=steps + 2, is_batch=len(prompts) > 1)
    if extras is not None:
        orig = eng.state.after_step
        eng.state.after_step = lambda s, e, c: (extras.append([np.asarray(x[0]) for x in e]), orig(s, e, c))
    tok = eng.first_tokens(0.0, 1.0)
    toks, logits = [tok], []
    for _ in range(steps):
        tok, lg = eng.step_with_logits(tok)
        toks.append(tok)
        logits.append(lg)
    return np.stack(toks, 1), np.stack(logits, 1), eng
