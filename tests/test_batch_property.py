"""Batches equal single runs, for every registered policy (issue 37): random mixes of prompt lengths (1 to 300
tokens, 2 to 4 prompts: a batch of one is the reference itself) on the tiny model (9 query heads over 3 KV heads:
odd GQA), the same forced tokens fed to the batch and to each prompt alone; each sequence's logits after prefill
and at every decode step equal those of its prompt alone within 1e-4 (float32), and a prompt refused alone
refuses the batch too. The issue's case (60 and 200 tokens) is an explicit example for every policy.

Where a policy has decode-time decisions (HeteroCache's drift checks and recalls, FreeKV's page
recalls, HCAttention's mass cut, SyncKV's anticipation, Quest's page choice) the drawn settings include
thresholds at which they fire for some sequences and steps and not others.

One thing may differ that no batch semantics decides: a selection whose cut falls on a tie (a prompt of a few
tokens pools every score alike) is decided by float rounding, which differs between batch shapes. Such a
prompt differs from its alone run in a batch of copies of itself too (no other length or decision beside it);
only then is it skipped (counted in the statistics, ``--hypothesis-show-statistics``).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, event, example, given, note, settings, strategies as st

from hetero_jax.errors import HeteroJaxError
from hetero_jax.policies import (CAKE, H2O, REGISTRY, ContextKeeper, FreeKV, FullKV, HCAttention, HeteroCache,
                                 ProfiledSnapKV, PyramidKV, Quest, SnapKV, StreamingLLM, SyncKV)
from hetero_jax.profile.clustering import Role
from hetero_jax.policies.contextkeeper.ranking import CARanking
from hetero_jax.profile import HeadProfile, ProfileSettings
from hetero_jax.runtime import Engine
from tiny_model import random_prompts, tiny_model

A, V, P, S = Role.ANCHOR, Role.VOLATILE, Role.PIVOT, Role.SATELLITE
MODEL = tiny_model(512)
CFG = MODEL.config
STEPS = 8  # decode steps: two HeteroCache checks at window 3 (their recalls land before steps 4 and 7), FreeKV recalls


def _profile(roles, clusters, weights=None):
    roles = np.asarray(roles, np.int8)
    if weights is None:
        weights = np.full(roles.shape, np.nan)
        comp = np.isin(roles, [A, S])
        w = np.random.default_rng(0).uniform(0.6, 1.4, comp.sum())
        weights[comp] = w / w.mean()
    return HeadProfile(roles=roles, clusters=clusters, weights=weights, architecture="llama", head_dim=CFG.head_dim)


# tests/test_heterocache.py's profile (pivots with satellites in layers 0 and 2) and tests/test_synckv.py's
HETERO_PROFILE = _profile([[S, P, S], [A, V, A], [S, A, P]], (((1, (0, 2)),), (), ((2, (0,)),)))
SYNC_PROFILE = _profile([[S, P, S], [P, S, S], [S, S, P]], (((1, (0, 2)),), ((0, (1, 2)),), ((2, (0, 1)),)),
                        weights=np.where(np.asarray([[S, P, S], [P, S, S], [S, S, P]]) == S, 1.0, np.nan))
# with copy heads (tests/test_heterocache.py's COPY_PROFILE): layer 1's volatile and a volatile beside pivot 2
_COPY = np.zeros((3, 3))
_COPY[1, 1] = _COPY[2, 1] = 0.5
COPY_PROFILE = dataclasses.replace(_profile([[S, P, S], [A, V, A], [S, V, P]], (((1, (0, 2)),), (), ((2, (0,)),))),
                                   copy_score=_COPY, settings=ProfileSettings(tau_copy=0.3))
# tests/test_contextkeeper.py's hand-set ranking
RANKING = CARanking(scores=np.array([[0.5, 0.1, 0.2], [0.4, 0.3, 0.9], [0.1, 0.2, 0.8]]),
                    votes=np.array([[2, 3, 0], [2, 0, 3], [3, 0, 1]]), model="tiny", head_dim=CFG.head_dim)


@functools.lru_cache(maxsize=None)
def _codebook():
    from hetero_jax.policies.hcattention.codebook import train_codebook

    samples = random_prompts([100, 100], seed=11)
    return train_codebook(MODEL, samples, sub_dim=4, size=32, batch=500, steps=20)


def _hc_codebook(lens, tau):
    """HCAttention on its codebook's operating point for the first prompt (a prompt whose point lies more than
    5% away is refused, alone and in the batch alike)."""
    probe = HCAttention(codebook=_codebook(), kv_itemsize=4)
    rho = round(probe.operating_points(CFG, lens[0])[1].rho, 4)
    return HCAttention(budget=min(1.0, rho), tau=tau, codebook=_codebook())


# per registered policy, the variants drawn from (lens -> policy): budgets, and the thresholds of its decode-time
# decisions set where they fire for some sequences and steps and not others
VARIANTS = {
    "full": [lambda lens: FullKV()],
    "streamingllm": [lambda lens, r=r: StreamingLLM(budget=r) for r in (0.3, 0.6)],
    # an 8-query window, so prompts from 8 / rho tokens up run (a window of 32 refuses every shorter one)
    **{name: [lambda lens, r=r, cls=cls: cls(budget=r, window=8) for r in (0.3, 0.6)]
       for name, cls in (("snapkv", SnapKV), ("pyramidkv", PyramidKV), ("h2o", H2O), ("cake", CAKE))},
    # per-head budgets from HeteroCache's profile: a prompt whose lightest head gets under the window is refused
    "profiledsnapkv": [lambda lens, r=r: ProfiledSnapKV(profile=HETERO_PROFILE, budget=r, window=8)
                       for r in (0.5, 0.7)],
    # tau 0.3-0.6 on the normalised overlap: some checks drift and recall, some do not (the tiny model's
    # medians spread over -0.15 to 0.5); window 3: checks after steps 2 and 5, their recalls landing at 4 and 7
    "heterocache": [lambda lens, r=r, t=t: HeteroCache(profile=HETERO_PROFILE, budget=r, window=3, tau_drift=t)
                    for r in (0.5, 0.7) for t in (0.3, 0.45, 0.6)]
                   # a copy window per sequence, following its copy heads over the forced prompt span
                   + [lambda lens, t=t: HeteroCache(profile=COPY_PROFILE, budget=0.5, window=3, tau_drift=t,
                                                    copy_window=8) for t in (0.3, 0.6)],
    "quest": [lambda lens, r=r, o=o: Quest(budget=r, page_size=8, full_layers=1, offload=o)
              for r in (0.4, 0.7) for o in (False, True)],
    # default sinks and window (B_c / 16: per sequence) and explicit ones
    "freekv": [lambda lens, r=r, kw=kw: FreeKV(budget=r, page_size=8, **kw) for r in (0.6, 0.8)
               for kw in (dict(), dict(sinks=4, window=8))],
    "contextkeeper": [lambda lens, r=r: ContextKeeper(ranking=RANKING, budget=r, sink=4, recent=8) for r in (0.3, 0.6)],
    "synckv": [lambda lens, r=r: SyncKV(profile=SYNC_PROFILE, budget=r, m=3) for r in (0.6, 0.8)],
    # the mass cut at tau: k* per sequence, head and step
    "hcattention": [lambda lens, t=t: HCAttention(budget=0.5, tau=t) for t in (0.5, 0.9)]
                   + [lambda lens, t=t: _hc_codebook(lens, t) for t in (0.5, 0.9)],
}


def run(policy, prompts, tokens):
    """Prefill ``prompts`` as one batch and feed ``tokens`` [B, STEPS] (forced, so that every run sees the same
    inputs): logits [B, STEPS + 1, V] float32 (after prefill, then after each step)."""
    eng = Engine(MODEL, prompts, policy, tail_capacity=STEPS + 2, is_batch=len(prompts) > 1)
    out = [np.asarray(eng.logits, np.float32)]
    for s in range(STEPS):
        out.append(eng.step_with_logits(tokens[:, s])[1])
    return np.stack(out, 1)


def test_every_registered_policy_is_covered():
    assert set(VARIANTS) == set(REGISTRY)


def _close(a, b) -> bool:
    return bool(np.abs(a - b).max() <= TOL)


TOL = 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(REGISTRY))
@settings(max_examples=2, deadline=None, derandomize=True, database=None, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@example(lens=[60, 200], pick=0, seed=0)  # the case
@given(lens=st.lists(st.integers(1, 300), min_size=2, max_size=4), pick=st.integers(0, 2**16),
       seed=st.integers(0, 2**16))
def test_batch_equals_each_prompt_alone(name, lens, pick, seed):
    """(No shrinking: each example compiles and runs a few engines; a failure reports its draw as it is.)"""
    variants = VARIANTS[name]
    policy = variants[pick % len(variants)](lens)
    note(f"policy {policy!r}")
    prompts = random_prompts(lens, seed=seed, vocab=CFG.vocab_size)
    tokens = np.random.default_rng(seed + 1).integers(3, CFG.vocab_size, size=(len(lens), STEPS))
    for b, p in enumerate(prompts):  # where the prompt is long enough the answer copies a span of it
        if len(p) >= 2 * STEPS:
            tokens[b] = p[len(p) // 2 : len(p) // 2 + STEPS]
    alone, refused = [], []
    for i, p in enumerate(prompts):
        try:
            alone.append(run(policy, [p], tokens[i : i + 1])[0])
        except HeteroJaxError as e:  # refused before any compute, for this prompt on its own
            refused.append(type(e))
            alone.append(None)
    if refused:  # a batch holding a refused prompt is refused the same way
        with pytest.raises(tuple(refused)):
            run(policy, prompts, tokens)
    keep = [i for i, a in enumerate(alone) if a is not None]
    event(f"{len(keep)} of {len(lens)} prompts run")
    if not keep:
        return
    batch = run(policy, [prompts[i] for i in keep], tokens[keep])
    for j, i in enumerate(keep):
        if _close(batch[j], alone[i]):
            continue
        # Differing: only a selection that float rounding decides may do that. Copies of the prompt alone in a
        # batch as large (no other length, budget or decision beside it) show whether the batch's rounding alone
        # moves it; if they do not, the other sequences did: a batch bug.
        copies = run(policy, [prompts[i]] * len(keep), tokens[[i] * len(keep)])
        gap = np.abs(batch[j] - alone[i]).max(-1)  # per step
        assert not _close(copies[0], alone[i]), (
            f"{policy!r}: prompt {i} of lengths {lens} differs in a batch by {gap.max():.3g} (steps "
            f"{np.flatnonzero(gap > TOL)})")
        event(f"rounding decides prompt {i} of {lens} (pick {pick}, seed {seed}): skipped")
