"""The tiny model, prompts and policies shared by tests/test_multihost.py and its worker processes.

Six KV heads, so that two and three processes each hold whole heads (tensor parallel over processes); every
policy with host copies runs with options under which its host machinery works on this model: HeteroCache's
drift check fires at every check (tau_drift > 1), SyncKV refreshes, FreeKV and offloaded Quest recall pages,
HCAttention sums values on the host."""

import jax
import jax.numpy as jnp
import numpy as np

from hetero_jax.io.hub import Model
from hetero_jax.model import spec
from hetero_jax.model.config import ModelConfig
from hetero_jax.policies import (FreeKV, FullKV, HCAttention, HeteroCache, Quest, SnapKV, SyncKV)
from hetero_jax.profile import HeadProfile
from hetero_jax.profile.clustering import Role
from tiny_model import TinyTokenizer

CFG = ModelConfig(architecture="llama", vocab_size=101, hidden_size=48, intermediate_size=64, num_layers=2,
                  num_heads=18, num_kv_heads=6, head_dim=8, rms_norm_eps=1e-5, max_position_embeddings=1024,
                  eos_token_ids=(0,))
RNG = np.random.default_rng(0)
PROMPTS = [RNG.integers(3, 100, 150).tolist(), RNG.integers(3, 100, 110).tolist()]
STEPS = 6
# a session: a context and two questions, asked one after the other (one chunk size: one extend executable)
CONTEXT, QUESTIONS = PROMPTS[0], (RNG.integers(3, 100, 9).tolist(), RNG.integers(3, 100, 14).tolist())

A, V, S, P = Role.ANCHOR, Role.VOLATILE, Role.SATELLITE, Role.PIVOT


def _profile(roles, clusters) -> HeadProfile:
    roles = np.asarray(roles, np.int8)
    weights = np.where((roles == A) | (roles == S), 1.0, np.nan)
    return HeadProfile(roles=roles, clusters=clusters, weights=weights, architecture="llama", head_dim=CFG.head_dim)


# layer 0: pivot 3 watches satellites 2 and 4; layer 1: pivot 1 watches 0 and 5
PROFILE = _profile([[A, V, S, P, S, A], [S, P, A, V, A, S]], (((3, (2, 4)),), ((1, (0, 5)),)))
SYNC_PROFILE = _profile([[S, P, S, S, P, S], [P, S, S, P, S, S]],
                        (((1, (0, 2)), (4, (3, 5))), ((0, (1, 2)), (3, (4, 5)))))

POLICIES = {
    "full": FullKV(), "snapkv": SnapKV(budget=0.6),
    "heterocache": HeteroCache(profile=PROFILE, budget=0.6, window=2, tau_drift=1.5),
    "synckv": SyncKV(profile=SYNC_PROFILE, budget=0.6, m=3),
    "freekv": FreeKV(budget=0.7, page_size=8), "quest-offload": Quest(budget=0.7, page_size=8, full_layers=1, offload=True),
    "hcattention": HCAttention(budget=0.5),
}
# what each policy's stats must show, so that the run is known to have used its host copy
EXERCISED = {"heterocache": ("recalls",), "synckv": ("recalls",), "freekv": ("pages_recalled",),
             "quest-offload": ("pages_recalled",), "hcattention": ("host_value_bytes_read_per_step",)}


def tiny_model() -> Model:
    params = jax.tree.map(jnp.asarray, spec.init_params(CFG, seed=3, scale=0.3))
    return Model(config=CFG, params=params, tokenizer=TinyTokenizer(), path="", name="tiny-6kv")


def counters(eng) -> dict:
    """The decode state's counters, without wall-clock ones."""
    return {k: v for k, v in eng.state.stats().items() if "seconds" not in k and not k.endswith("_ms_per_step")
            and not k.endswith("_s") and k != "placement"}


def session_answers(model, name) -> list[list[int]]:
    """The answers of a session over CONTEXT to each of QUESTIONS in turn."""
    from hetero_jax.runtime import Session

    sess = Session(model, CONTEXT, POLICIES[name], chat=False, reserve_tokens=8)
    return [sess.ask(q, max_new_tokens=4).token_ids for q in QUESTIONS]
