"""Policy constructors, policy specs, bound rankings/profiles/codebooks and the kernel backend setting (issue 37):
each bad input is the project's own error naming the value and the fix, raised before any compute; the short
prompts that crashed are answered as full KV answers them."""

from __future__ import annotations

import json
import re
import warnings

import numpy as np
import pytest

import hetero_jax
import pallas_kernels
from hetero_jax.errors import ConfigError
from hetero_jax.policies import (
    REGISTRY, BudgetError, ContextKeeper, FreeKV, HCAttention, HeteroCache, PolicyError, ProfiledSnapKV, Quest, SnapKV,
    UnknownOptionError, make_policy,
)
from hetero_jax.policies.contextkeeper.ranking import CARanking, load_ranking
from hetero_jax.profile import HeadProfile, ProfileError
from tiny_model import random_prompt, tiny_model

MODEL = tiny_model(256)
CFG = MODEL.config


# ------------------------------------------------------------------ constructors and specs
@pytest.mark.parametrize("cls", list(REGISTRY.values()), ids=list(REGISTRY))
def test_unknown_constructor_option_names_the_options(cls):
    with pytest.raises(UnknownOptionError) as e:
        cls(recall=1)
    msg = str(e.value)
    assert msg.startswith(f"{cls.__name__} has no option 'recall'; its options are: budget")
    for f in ("budget",) + tuple(f.name for f in __import__("dataclasses").fields(cls) if f.init):
        assert f in msg
    assert isinstance(e.value, TypeError) and isinstance(e.value, PolicyError)  # old handlers keep working


def test_heterocache_recall_typo():
    with pytest.raises(UnknownOptionError, match=re.escape("HeteroCache has no option 'recall'; its options are: "
                                                           "budget, profile, window, tau_drift")):
        HeteroCache(budget=0.3, recall=True)


def test_too_many_positional_arguments():
    with pytest.raises(UnknownOptionError, match=re.escape("SnapKV takes at most 4 positional argument(s) (got 5)")):
        SnapKV(0.3, 32, 5, "max", 1)


def test_option_given_twice_in_a_spec():
    with pytest.raises(PolicyError, match=re.escape("the policy option 'page_size' is given twice (page_size=16 "
                                                    "and 'page_size=8'); give each option once")):
        make_policy("quest:page_size=16,page_size=8", 0.3)
    with pytest.raises(PolicyError, match="given twice"):
        make_policy("snapkv:window=8,window=8", 0.3)  # even with the same value: one of them is a slip


@pytest.mark.parametrize("budget", [np.float32(0.25), np.float64(0.25), 0.25])
def test_numpy_budget_is_the_number_it_stands_for(budget):
    p = SnapKV(budget=budget)
    assert type(p.budget) is float and p.budget == 0.25
    assert p == SnapKV(budget=0.25) and hash(p) == hash(SnapKV(budget=0.25))


@pytest.mark.parametrize("budget, needle", [
    ("0.3", "budget rho must be a number in (0, 1], the fraction of the prompt's KV kept on the device; got '0.3' "
            "of type str"),
    (True, "got True of type bool"),
    (np.float32(1.5), "budget rho=1.5 is out of range"),
    (np.float32("nan"), "budget rho=nan is out of range"),
])
def test_bad_budget_types(budget, needle):
    with pytest.raises(BudgetError, match=re.escape(needle)):
        SnapKV(budget=budget)


# ------------------------------------------------------------------ short prompts
@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize("n", [1, 7])
def test_quest_prompt_shorter_than_a_page_answers_as_full_kv(n, offload):
    """A prompt shorter than one page has no page to select: Quest keeps all of it (it crashed on the page axis)."""
    prompt = random_prompt(n, seed=n)
    want = hetero_jax.generate(MODEL, prompt, max_new_tokens=4).token_ids
    got = hetero_jax.generate(MODEL, prompt, policy=Quest(budget=1.0, offload=offload), max_new_tokens=4).token_ids
    assert got == want


def test_quest_offload_names_no_impossible_rho(no_compute):
    with pytest.raises(BudgetError) as e:
        hetero_jax.generate(MODEL, random_prompt(20), policy=Quest(budget=1.0, offload=True), max_new_tokens=2)
    msg = str(e.value)
    assert msg.startswith("Quest(offload=True): no budget fits a 20-token prompt with 16-token pages")
    assert "use a smaller page_size, offload=False, or a longer prompt" in msg
    assert "smallest budget that works" not in msg


def test_freekv_short_prompt_names_its_window(no_compute):
    with pytest.raises(BudgetError, match=re.escape("FreeKV: a 7-token prompt is too short for 4 sinks + a 4-token "
                                                    "window + one 32-token page (40 tokens)")):
        hetero_jax.generate(MODEL, random_prompt(7), policy=FreeKV(budget=0.5), max_new_tokens=2)


# ------------------------------------------------------------------ rankings, profiles, codebooks of another model
def _ranking(fingerprint):
    rng = np.random.default_rng(0)
    return CARanking(scores=rng.random((CFG.num_layers, CFG.num_kv_heads)),
                     votes=rng.integers(0, 4, (CFG.num_layers, CFG.num_kv_heads)), model="tiny",
                     head_dim=CFG.head_dim, weights_fingerprint=fingerprint)


def test_contextkeeper_ranking_of_other_weights_is_refused(no_compute):
    with pytest.raises(ProfileError) as e:
        ContextKeeper(budget=0.5, ranking=_ranking("sha256:0000000000000000")).bind(MODEL)
    msg = str(e.value)
    assert "was calibrated on weights sha256:0000000000000000, but the model's weights are sha256:" in msg
    assert "(same shape 3 layers x 3 KV heads): it ranks another model's heads" in msg


def test_contextkeeper_ranking_fingerprint_round_trip(tmp_path):
    from hetero_jax.policies.contextkeeper.ranking import model_fingerprint

    fp = model_fingerprint(MODEL)
    r = _ranking(fp)
    path = tmp_path / "ranking.json"
    r.save(path)
    assert json.loads(path.read_text())["weights_fingerprint"] == fp
    back = load_ranking(path)
    assert back.weights_fingerprint == fp
    assert ContextKeeper(budget=0.5, ranking=back).bind(MODEL).ranking is back  # its own weights: accepted
    assert ContextKeeper(budget=0.5, ranking=_ranking(None)).bind(MODEL)  # none recorded: shape only


def test_profile_with_grids_of_two_models_says_so():
    from hetero_jax.profile.clustering import Role

    roles = np.full((3, 3), int(Role.VOLATILE), np.int8)
    with pytest.raises(ProfileError) as e:
        HeadProfile(roles=roles, clusters=((), (), ()), weights=np.full((3, 3), np.nan), copy_score=np.zeros((4, 3)),
                    architecture="llama", head_dim=16)
    assert str(e.value) == (
        "this profile does not describe one model: its roles cover 3 layers x 3 KV heads but its copy_score covers "
        "4 layers x 3 KV heads (a file assembled from another model's profile, or edited by hand); calibrate a "
        "profile for the model with `hetero-jax profile` instead of editing one")


def test_hcattention_given_a_json_file(tmp_path, no_compute):
    path = tmp_path / "ranking.json"
    _ranking(None).save(path)
    before = path.read_bytes()
    with pytest.raises(ProfileError) as e:
        HCAttention(budget=0.5, codebook=str(path)).bind(MODEL)
    msg = str(e.value)
    assert "is a JSON document (a head profile or a ContextKeeper ranking?)" in msg
    assert "`hetero-jax profile --method hcattention`" in msg and "pickled" not in msg
    assert path.read_bytes() == before
    other = tmp_path / "notes.txt"
    other.write_text("hello")
    with pytest.raises(ProfileError, match=re.escape("is not an .npz archive")):
        HCAttention(budget=0.5, codebook=str(other)).bind(MODEL)


# ------------------------------------------------------------------ the kernel backend setting
@pytest.mark.parametrize("value, needle", [
    ("bogus", "HETERO_JAX_KERNELS must be one of auto, pallas, native, reference, interpret, got 'bogus'; unset "
              "HETERO_JAX_KERNELS to let auto choose"),
    ("pallas", "the kernel backend is 'pallas' (HETERO_JAX_KERNELS or use_kernels), whose Triton kernels need a "
               "GPU, and jax sees none"),
])
def test_kernel_setting_this_process_cannot_run(monkeypatch, no_compute, value, needle):
    if value == "pallas" and pallas_kernels.gpu_available():
        pytest.skip("a GPU is visible: pallas runs")
    monkeypatch.setenv("HETERO_JAX_KERNELS", value)
    with pytest.raises(ConfigError, match=re.escape(needle)):
        hetero_jax.generate(MODEL, random_prompt(5), max_new_tokens=2)


def test_head_dim_the_kernels_do_not_take_falls_back_to_the_reference():
    """head_dim 24 is no power of two: 'interpret' (the Pallas kernel) becomes the plain-JAX reference, with a
    warning, and gives the reference's numbers."""
    import jax
    import jax.numpy as jnp

    pallas_kernels._util._warned_head_dims.discard(24)
    with pytest.warns(RuntimeWarning, match=re.escape("head_dim 24 is not a power of two >= 16")):
        assert pallas_kernels.resolve_backend("interpret", head_dim=24) == "reference"
    assert pallas_kernels.resolve_backend("interpret", head_dim=32) == "interpret"
    B, H, G, D, P = 2, 3, 2, 24, 40
    ks = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(ks[0], (B, H, 1, G, D), jnp.float32)
    k_pool = jax.random.normal(ks[1], (B, P, D), jnp.float32)
    v_pool = jax.random.normal(ks[2], (B, P, D), jnp.float32)
    offsets = jnp.array([[0, 10, 20], [0, 13, 26]], jnp.int32)
    lengths = jnp.array([[10, 7, 1], [13, 13, 12]], jnp.int32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        got = pallas_kernels.pool_attention(q, k_pool, v_pool, offsets, lengths, max_len=16, backend="interpret")
    want = pallas_kernels.pool_attention_reference(q, k_pool, v_pool, offsets, lengths, max_len=16)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("offload", [False, True])
def test_quest_with_no_sparse_layer_is_refused(offload):
    """full_layers past the model left Quest nothing to select (offloaded: a ZeroDivisionError); FreeKV's
    skip_layers was already refused so."""
    policy = Quest(budget=0.5, page_size=16, full_layers=CFG.num_layers, offload=offload)
    with pytest.raises(PolicyError, match=rf"Quest: full_layers={CFG.num_layers} leaves no layer of the model's "
                                          rf"{CFG.num_layers} to select pages in; it must be below num_layers"):
        hetero_jax.generate(MODEL, random_prompt(120), policy, max_new_tokens=1, chat=False)


@pytest.mark.parametrize("cls", [HeteroCache, ProfiledSnapKV])
def test_a_synckv_grouping_is_no_heterocache_profile(cls):
    """The reverse (SyncKV given a HeteroCache profile) was refused; this way the R-heads silently became
    HeteroCache's full heads."""
    import os

    from hetero_jax.profile import load_profile

    SYNC_GROUPING = load_profile(os.path.join(os.path.dirname(hetero_jax.__file__), "data",
                                              "smollm2-135m.synckv.json"))  # the shipped SyncKV grouping
    assert SYNC_GROUPING.settings.method == "synckv"
    with pytest.raises(ProfileError, match=f"{cls.__name__} needs a HeteroCache role profile, but this profile is a "
                                           "SyncKV head grouping"):
        cls(budget=0.5, profile=SYNC_GROUPING)
