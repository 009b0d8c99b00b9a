"""Calibration of HeteroCache head profiles on a model (issue 4, calibration half)."""

from __future__ import annotations

import dataclasses
import math
import re

import jax.numpy as jnp
import numpy as np
import pytest

from hetero_jax.model import transformer as M
from hetero_jax.model.cache import layer_rows
from hetero_jax.model.config import ModelConfig
from hetero_jax.profile import ProfileError, load_profile
from hetero_jax.profile.calibrate import (
    calibrate_tokens,
    calibration_windows,
    copy_positions,
    default_top_k,
    pydoc_text,
)
from hetero_jax.profile import default_profile, shipped_profile_path, weights_fingerprint
from hetero_jax.profile.metrics import overlap_masks, similarity_matrix, topk_mask
from hetero_jax.model.spec import init_params

# 2 layers, 3 KV heads x group 3 (odd GQA), small vocab.
TINY = ModelConfig(architecture="llama", vocab_size=96, hidden_size=72, intermediate_size=96, num_layers=2,
                   num_heads=9, num_kv_heads=3, head_dim=16, max_position_embeddings=256)


@pytest.fixture(scope="module")
def tiny_params():
    params = init_params(TINY, seed=3)
    # Sharpen q/k so attention is far from uniform (top-k is not decided by rounding noise).
    for layer in params["layers"]:
        layer["q_proj"] = layer["q_proj"] * 12
        layer["k_proj"] = layer["k_proj"] * 12
    return params


@pytest.fixture(scope="module")
def tiny_samples():
    rng = np.random.default_rng(7)
    return [rng.integers(0, TINY.vocab_size, 61), rng.integers(0, TINY.vocab_size, 48)]


# ------------------------------------------------------------ numpy reference
def _np_pooled_mean(q, k, length):
    """q [G, D], k [T, D] (first ``length`` valid) -> pooled, GQA-mean scores [length] (float64)."""
    q = np.asarray(q, np.float64)
    k = np.asarray(k, np.float64)[:length]
    s = q @ k.T / math.sqrt(q.shape[-1])  # [G, T]
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    padded = np.pad(p, ((0, 0), (2, 2)))  # zero padding, divide by 5 (count_include_pad)
    pooled = sum(padded[:, i:i + length] for i in range(5)) / 5.0
    return pooled.mean(0)


def _reference_overlaps(params, toks, top_k, steps):
    """Straightforward per-sample recomputation: [S, L, H] overlaps and the K_prefill sets' [L, H, H] similarity."""
    T = len(toks)
    tokens = np.asarray(toks, np.int32)[None]
    lens = np.array([T], np.int32)
    prefill = {}

    def observe(li, layer, x_in, k_buf, v_buf, lens_dev):
        q = np.asarray(M.prompt_queries(layer, x_in, (lens_dev - 1)[:, None], TINY))[0, :, 0]  # [H, G, D]
        k = np.asarray(k_buf)[0]
        prefill[li] = np.stack([topk_mask(_np_pooled_mean(q[h], k[h], T), top_k) for h in range(TINY.num_kv_heads)])

    logits, cache = M.prefill(params, TINY, tokens, lens, chunk=T, tail_capacity=steps + 1, observe=observe)
    tok = jnp.argmax(logits, -1).astype(jnp.int32)
    sim = np.stack([similarity_matrix(prefill[li]) for li in range(TINY.num_layers)])
    ovs = []
    for _ in range(steps):
        logits, cache, queries = M.decode_step(params, cache, tok, TINY, return_queries=True)
        tok = jnp.argmax(logits, -1).astype(jnp.int32)
        row = []
        for li, q in enumerate(queries):
            k = np.asarray(layer_rows(cache, li)[0])[0]  # every head's prompt keys (full KV)
            q = np.asarray(q)[0]
            masks = np.stack([topk_mask(_np_pooled_mean(q[h], k[h], T), top_k) for h in range(TINY.num_kv_heads)])
            row.append(overlap_masks(masks, prefill[li]))
        ovs.append(row)
    return np.array(ovs), sim


def test_matches_numpy_reference(tiny_params, tiny_samples):
    top_k, steps = 9, 4
    prof, stats = calibrate_tokens(TINY, tiny_params, tiny_samples, top_k=top_k, decode_steps=steps,
                                   progress=False, batch_size=2, return_stats=True)
    assert stats.overlaps.shape == (2, steps, TINY.num_layers, TINY.num_kv_heads)
    ref_stab, ref_sim = [], []
    for i, toks in enumerate(tiny_samples):
        ov, sim = _reference_overlaps(tiny_params, toks, top_k, steps)
        np.testing.assert_allclose(stats.overlaps[i], ov, atol=1e-6)
        np.testing.assert_allclose(stats.similarity_matrix[i], sim, atol=1e-6)
        ref_stab.append(np.median(ov, axis=0))
        ref_sim.append(sim)
    np.testing.assert_allclose(prof.stability, np.mean(ref_stab, axis=0), atol=1e-6)
    np.testing.assert_allclose(prof.similarity_matrix, np.mean(ref_sim, axis=0), atol=1e-6)
    s = prof.settings
    assert (s.top_k, s.decode_steps, s.samples, s.tau_stable, s.tau_sim) == (top_k, steps, 2, 0.5, 0.5)
    assert prof.weights_fingerprint == weights_fingerprint(tiny_params)
    assert (prof.architecture, prof.head_dim) == ("llama", 16)


def _reference_copy_argmax(params, toks, positions):
    """Copy phase recomputed step by step: full-KV prefill, then feed toks[p] for p in ``positions``;
    the argmax of every query head's raw q.k over the prompt keys, int [C, L, H, G]."""
    T = len(toks)
    logits, cache = M.prefill(params, TINY, np.asarray(toks, np.int32)[None], np.array([T], np.int32), chunk=T,
                              tail_capacity=len(positions) + 1)
    out = []
    for p in positions:
        _, cache, queries = M.decode_step(params, cache, jnp.asarray([toks[p]], jnp.int32), TINY, return_queries=True)
        row = []
        for li, q in enumerate(queries):
            k = np.asarray(layer_rows(cache, li)[0], np.float64)[0, :, :T]  # [H, T, D]
            s = np.einsum("hgd,htd->hgt", np.asarray(q, np.float64)[0], k)
            row.append(s.argmax(-1))
        out.append(row)
    return np.array(out)


def test_copy_positions_hand_computed():
    # 61 tokens, 8 steps, 4 runs of 2 centred at round(61 * i / 5) = 12, 24, 37, 49
    assert copy_positions(np.array([61]), 8).tolist() == [[11, 12, 23, 24, 36, 37, 48, 49]]
    # 9 steps: the first run is one longer; a single run sits in the middle
    assert copy_positions(np.array([48]), 9).tolist() == [[9, 10, 11, 18, 19, 28, 29, 37, 38]]
    assert copy_positions(np.array([10, 20]), 2, spans=1).tolist() == [[4, 5], [9, 10]]


def test_copy_phase_matches_numpy_reference(tiny_params, tiny_samples):
    """Copy hits = some query head's argmax over the prompt lands on the re-fed token's position; the
    copy score is their mean; heads at or above tau_copy are kept whole."""
    steps = 8
    prof, stats = calibrate_tokens(TINY, tiny_params, tiny_samples, decode_steps=2, copy_steps=steps,
                                   progress=False, batch_size=2, return_stats=True, tau_copy=None)
    assert stats.copy_hits.shape == (2, steps, TINY.num_layers, TINY.num_kv_heads)
    for i, toks in enumerate(tiny_samples):
        pos = stats.copy_positions[i]
        np.testing.assert_array_equal(pos, copy_positions(np.array([len(toks)]), steps)[0])
        am = _reference_copy_argmax(tiny_params, toks, pos)  # [C, L, H, G]
        np.testing.assert_array_equal(stats.copy_hits[i], (am == pos[:, None, None, None]).any(-1))
    np.testing.assert_allclose(prof.copy_score, stats.copy_hits.mean(axis=(0, 1)))
    assert prof.settings.copy_steps == steps and prof.settings.tau_copy is None

    # The jitted step on a source that is some head's argmax: a hit exactly where the reference says.
    toks = tiny_samples[1]
    pos = copy_positions(np.array([len(toks)]), steps)[0]
    am = _reference_copy_argmax(tiny_params, toks, pos[:1])[0]  # [L, H, G]
    from hetero_jax.profile.calibrate import _copy_step_jit

    T = len(toks)
    _, cache = M.prefill(tiny_params, TINY, np.asarray(toks, np.int32)[None], np.array([T], np.int32), chunk=T,
                         tail_capacity=2)
    src = int(am[1, 2, 0])
    _, hit = _copy_step_jit(tiny_params, cache, jnp.asarray([toks[pos[0]]], jnp.int32),
                            jnp.asarray([src], jnp.int32), cfg=TINY)
    np.testing.assert_array_equal(np.asarray(hit)[:, 0], (am == src).any(-1))
    assert np.asarray(hit)[1, 0, 2]

    # The rule, on the calibrated scores (tau_stable 0 and tau_sim 1: every head an anchor first, no two heads
    # here sharing their whole top-k set): a threshold at the top score makes exactly the heads that reach it
    # volatile.
    base = prof.reclustered(tau_stable=0.0, tau_sim=1.0)
    assert (base.roles == 1).all()
    tau = float(prof.copy_score.max())
    kept = base.reclustered(tau_copy=tau)
    assert 0 < (prof.copy_score >= tau).sum() < prof.copy_score.size
    np.testing.assert_array_equal(kept.roles, np.where(prof.copy_score >= tau, 2, 1))
    assert kept.settings.tau_copy == tau
    comp = kept.roles == 1
    np.testing.assert_allclose(kept.weights[comp].mean(), 1.0)
    none = calibrate_tokens(TINY, tiny_params, tiny_samples, decode_steps=2, copy_steps=0, progress=False)
    assert np.isnan(none.copy_score).all() and none.settings.copy_steps == 0
    np.testing.assert_array_equal(none.roles, prof.roles)
    with pytest.raises(ProfileError, match="no copy scores"):
        none.reclustered(tau_copy=0.5)


def test_deterministic(tiny_params, tiny_samples, tmp_path):
    kw = dict(decode_steps=3, progress=False, seed=5)
    a = calibrate_tokens(TINY, tiny_params, tiny_samples, **kw)
    b = calibrate_tokens(TINY, tiny_params, tiny_samples, **kw)
    assert a == b
    assert a.settings.top_k == default_top_k(48) == 10  # 20% (the authors' release)
    a.to_json(tmp_path / "a.json")
    b.to_json(tmp_path / "b.json")
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()


def test_clear_errors(tiny_params, tiny_samples):
    with pytest.raises(ProfileError, match="no calibration data"):
        calibrate_tokens(TINY, tiny_params, [], progress=False)
    with pytest.raises(ProfileError, match="too short for top_k"):
        calibrate_tokens(TINY, tiny_params, tiny_samples, top_k=48, decode_steps=1, progress=False)
    with pytest.raises(ProfileError, match=r"fewer than tokens=100\b"):
        calibrate_tokens(TINY, tiny_params, tiny_samples, tokens=100, decode_steps=1, progress=False)
    with pytest.raises(ProfileError, match="exceeds the model's context"):
        calibrate_tokens(TINY, tiny_params, tiny_samples, decode_steps=250, progress=False)
    with pytest.raises(ProfileError, match="copy_steps=48 needs samples longer"):
        calibrate_tokens(TINY, tiny_params, tiny_samples, decode_steps=1, copy_steps=48, progress=False)
    with pytest.raises(ProfileError, match="copy_steps must be a non-negative integer"):
        calibrate_tokens(TINY, tiny_params, tiny_samples, decode_steps=1, copy_steps=-1, progress=False)
    with pytest.raises(ProfileError, match="tau_copy must lie in"):
        calibrate_tokens(TINY, tiny_params, tiny_samples, decode_steps=1, tau_copy=1.5, progress=False)


class _CharTokenizer:
    """Tokenizer stand-in: one id per character, BOS = 1."""

    def encode(self, text, add_special_tokens=False):
        return ([1] if add_special_tokens else []) + [2 + (ord(c) % 90) for c in text]


def test_calibrate_texts_equals_token_samples(tiny_params):
    """``calibrate`` = tokenize plainly (BOS kept) + ``calibrate_tokens`` with the model's name."""
    from types import SimpleNamespace

    from hetero_jax.profile.calibrate import calibrate

    model = SimpleNamespace(config=TINY, params=tiny_params, tokenizer=_CharTokenizer(), name="tiny")
    texts = ["the quick brown fox jumps over the lazy dog, twice over", "pack my box with five dozen jugs"]
    kw = dict(decode_steps=2, progress=False, seed=1)
    got = calibrate(model, texts, data_description="two pangrams", **kw)
    ids = [[1] + [2 + (ord(c) % 90) for c in t] for t in texts]
    want = calibrate_tokens(TINY, tiny_params, ids, model_name="tiny", data_description="two pangrams", **kw)
    assert got == want and got.model_name == "tiny"
    with pytest.raises(ProfileError, match=r"calibration text\(s\) \[1\] are empty"):
        calibrate(model, ["some text", "  "], **kw)


def test_windows_deterministic_and_errors():
    text = "".join(chr(65 + (i * 7) % 53) for i in range(500))  # 500 ids -> 50 windows of 10 after BOS
    w1 = calibration_windows(_CharTokenizer(), text, 11, 3, seed=4)
    assert w1 == calibration_windows(_CharTokenizer(), text, 11, 3, seed=4)
    assert all(len(w) == 11 and w[0] == 1 for w in w1)
    assert w1 != calibration_windows(_CharTokenizer(), text, 11, 3, seed=5)
    with pytest.raises(ProfileError, match="room for"):
        calibration_windows(_CharTokenizer(), "abc", 11, 1)
    with pytest.raises(ProfileError, match="empty"):
        calibration_windows(_CharTokenizer(), "   ", 11, 1)
    assert len(pydoc_text()) > 100_000


# ------------------------------------------------------------ shipped profile
def test_shipped_profile_refuses_other_shapes():
    path = shipped_profile_path("smollm2-135m")
    assert path is not None, "the SmolLM2 profile must ship as package data"
    prof = load_profile(path)
    assert prof.roles.shape == (30, 3) and prof.head_dim == 64 and prof.architecture == "llama"
    prof.check_compatible({"architecture": "llama", "num_layers": 30, "num_kv_heads": 3, "head_dim": 64})
    with pytest.raises(ProfileError, match=r"\b30 layers x 3 KV heads"):
        prof.check_compatible(TINY)
    with pytest.raises(ProfileError):
        prof.check_compatible(dataclasses.replace(TINY, num_layers=30, num_kv_heads=3, head_dim=128))
    with pytest.raises(ProfileError, match="calibrated on weights"):
        prof.check_compatible({"num_layers": 30, "num_kv_heads": 3, "head_dim": 64}, "sha256:0000")
    assert default_profile(TINY) is None


@pytest.mark.slow
@pytest.mark.real_model
def test_shipped_profile_reproduces(smollm2_dir):
    import hetero_jax

    path = shipped_profile_path("smollm2-135m")
    shipped = load_profile(path)
    s = shipped.settings
    import sys

    data = s.calibration_data
    py = f"Python {sys.version_info[0]}.{sys.version_info[1]} "
    if py not in data:  # pydoc_data.topics differs between Python releases
        pytest.skip(f"shipped profile was calibrated on another Python's pydoc topics: {data}")
    model = hetero_jax.load(smollm2_dir, progress=False)
    assert default_profile(model) == shipped
    batch = int(data.rsplit("batch_size ", 1)[1])
    windows = calibration_windows(model.tokenizer, pydoc_text(), s.tokens_per_sample, s.samples, seed=s.seed)
    prof = calibrate_tokens(model.config, model.params, windows, top_k=s.top_k, decode_steps=s.decode_steps,
                            tau_stable=s.tau_stable, tau_sim=s.tau_sim, seed=s.seed, tokens=s.tokens_per_sample,
                            progress=False, batch_size=batch, copy_steps=s.copy_steps, tau_copy=s.tau_copy)
    np.testing.assert_array_equal(prof.roles, shipped.roles)
    assert prof.clusters == shipped.clusters
    np.testing.assert_allclose(prof.stability, shipped.stability, atol=1e-9)
    np.testing.assert_allclose(prof.copy_score, shipped.copy_score, atol=1e-9)
    # the copy rule is what keeps layer 7 head 2 and layer 14 head 1 whole (README, "Where the misses came from")
    plain = shipped.reclustered(tau_copy=1.0)
    assert sorted(zip(*np.nonzero(plain.roles != shipped.roles))) == [(7, 2), (14, 1)]
    assert shipped.roles[7, 2] == shipped.roles[14, 1] == 2


# ------------------------------------------------------------ exact overlaps, chance level, argument checks
def test_overlaps_are_exact_ratios_of_counts(tiny_params, tiny_samples):
    """Each overlap is |A & B| / k for top-k sets, so k * O is an integer and O is that count over k divided in
    float64 (a float32 division gives 0.699999988 for 7 / 10)."""
    top_k = 9
    _, stats = calibrate_tokens(TINY, tiny_params, tiny_samples, top_k=top_k, decode_steps=4, progress=False,
                                batch_size=2, return_stats=True)
    for got in (stats.overlaps, stats.similarity_matrix):
        np.testing.assert_array_equal(got, np.rint(got * top_k) / top_k)
    _, sk = calibrate_tokens(TINY, tiny_params, tiny_samples, top_k=top_k, decode_steps=2, progress=False,
                             batch_size=2, return_stats=True, scoring="synckv")
    np.testing.assert_array_equal(sk.similarity_steps, np.rint(sk.similarity_steps * top_k) / top_k)


# A random model and samples on which a head's decode-step top-10 shares exactly 7 tokens with its prefill set
# (seed 6), and two heads' prefill sets share exactly 7 of 10 (seed 2).
TIE = ModelConfig(architecture="llama", vocab_size=64, hidden_size=48, intermediate_size=64, num_layers=2,
                  num_heads=6, num_kv_heads=2, head_dim=16, max_position_embeddings=256)


def test_a_tie_at_the_threshold_meets_it():
    params = init_params(TIE, seed=11)
    for layer in params["layers"]:
        layer["q_proj"] = layer["q_proj"] * 4
        layer["k_proj"] = layer["k_proj"] * 4
    kw = dict(top_k=10, decode_steps=1, copy_steps=0, progress=False, return_stats=True)
    prof, stats = calibrate_tokens(TIE, params, [np.random.default_rng(6).integers(1, 64, 50)], tau_stable=0.7,
                                   tau_sim=1.0, **kw)
    assert round(stats.overlaps[0, 0, 1, 0] * 10) == 7  # S = 7 / 10 = tau_stable: an anchor (S >= tau)
    assert prof.stability[1, 0] == 0.7 and prof.roles[1, 0] == 1
    prof, stats = calibrate_tokens(TIE, params, [np.random.default_rng(2).integers(1, 64, 50)], tau_sim=0.7, **kw)
    assert round(stats.similarity_matrix[0, 1, 0, 1] * 10) == 7  # O = tau_sim: an edge, so a cluster
    assert prof.similarity_matrix[1, 0, 1] == 0.7 and prof.clusters[1] == ((0, (1,)),)


def test_unequal_lengths_record_the_chance_level(tiny_params):
    """60 + 90 tokens, top_k 12 (20% of 60): chance levels 12/60 and 12/90 average 1/6 = 12/72, so 72 tokens are
    recorded, and HeteroCache's drift threshold keeps its chance correction (0.5 - 1/6) / (1 - 1/6) = 0.4."""
    from hetero_jax.policies.heterocache.policy import HeteroCache

    rng = np.random.default_rng(4)
    samples = [rng.integers(0, TINY.vocab_size, 60), rng.integers(0, TINY.vocab_size, 90)]
    prof = calibrate_tokens(TINY, tiny_params, samples, decode_steps=1, copy_steps=0, progress=False, batch_size=2)
    assert (prof.settings.top_k, prof.settings.tokens_per_sample) == (12, 72)
    assert HeteroCache(profile=prof).drift_threshold == pytest.approx(0.4, abs=1e-12)
    from hetero_jax.profile.calibrate import chance_length

    assert chance_length([100, 100]) == 100 and chance_length([100, 101]) == 100 and chance_length([60, 90]) == 72


def test_bad_batch_size_or_tokens_are_refused_before_the_bar(tiny_params, tiny_samples, capsys):
    with pytest.raises(ProfileError, match="batch_size must be a positive integer, got 0"):
        calibrate_tokens(TINY, tiny_params, tiny_samples, decode_steps=1, batch_size=0, progress=True)
    assert capsys.readouterr().err == ""  # no stray progress bar
    for bad in (20.5, True, "20"):
        with pytest.raises(ProfileError, match=r"tokens must be an integer >= 2 \(the prompt tokens kept of each "
                                               rf"sample\), got {re.escape(repr(bad))}"):
            calibrate_tokens(TINY, tiny_params, tiny_samples, tokens=bad, decode_steps=1, progress=False)
