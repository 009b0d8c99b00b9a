"""The tiny model, prompts and policies shared by tests/test_multihost.py and its worker processes."""

import jax
import jax.numpy as jnp
import numpy as np

from hetero_jax.model import spec
from hetero_jax.model.config import ModelConfig
from hetero_jax.io.hub import Model
from hetero_jax.profile.clustering import Role
from hetero_jax.profile import HeadProfile
from tiny_model import TinyTokenizer

CFG = ModelConfig(architecture="llama", vocab_size=101, hidden_size=48, intermediate_size=64, num_layers=2,
                  num_heads=6, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, max_position_embeddings=1024,
                  eos_token_ids=(0,))
RNG = np.random.default_rng(0)
PROMPTS = [RNG.integers(3, 100, 150).tolist(), RNG.integers(3, 100, 110).tolist()]
POLICIES = [("full",), ("snapkv", 0.6)]
PROFILE = HeadProfile(roles=np.array([[Role.ANCHOR, Role.VOLATILE], [Role.SATELLITE, Role.PIVOT]], np.int8),
                      clusters=((), ((1, (0,)),)), weights=np.array([[1.0, np.nan], [1.0, np.nan]]),
                      architecture="llama", head_dim=16)


def two_head_model() -> Model:
    params = jax.tree.map(jnp.asarray, spec.init_params(CFG, seed=3, scale=0.3))
    return Model(config=CFG, params=params, tokenizer=TinyTokenizer(), path="", name="tiny-2kv")
