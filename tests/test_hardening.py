"""Bad input at the public boundary (issue 20): every refusal is a HeteroJaxError whose message names the
value and what is allowed, raised before any compute, and a refused call changes nothing.

Runs on an in-memory tiny model (token-id prompts) except the chat-session test, which needs a real
tokenizer and chat template (the tiny converted Llama).
"""

from __future__ import annotations

import math
import re
import threading
import warnings

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

import hetero_jax
from hetero_jax.model.cache import layer_rows
from hetero_jax.model.config import ModelConfig
from hetero_jax.errors import HeteroJaxError, PromptError
from hetero_jax import Session
from hetero_jax.policies import (
    CAKE, H2O, REGISTRY, BudgetError, ContextKeeper, FreeKV, FullKV, HCAttention, HeteroCache, PolicyError, PyramidKV,
    Quest, SnapKV, StreamingLLM, SyncKV, UnknownPolicyError, make_policy, smallest_rho, tokens_for,
)
from hetero_jax.profile.clustering import Role, budget_grid, smallest_working_rho
from hetero_jax.profile import HeadProfile
from tiny_model import tiny_model, random_prompt

A, V, P, S = Role.ANCHOR, Role.VOLATILE, Role.PIVOT, Role.SATELLITE

MODEL = tiny_model(256)
CFG, PARAMS = MODEL.config, MODEL.params


def make_profile(roles, clusters, seed=0):
    roles = np.asarray(roles, np.int8)
    weights = np.full(roles.shape, np.nan)
    comp = np.isin(roles, [A, S])
    if comp.any():
        w = np.random.default_rng(seed).uniform(0.3, 2.0, comp.sum())
        weights[comp] = w / w.mean()
    return HeadProfile(roles=roles, clusters=clusters, weights=weights, architecture="llama",
                       head_dim=CFG.head_dim)


# layer 0: pivot 1 with satellites 0, 2; layer 1: anchor, volatile, anchor; layer 2: satellite 0 of pivot 2
PROFILE = make_profile([[S, P, S], [A, V, A], [S, A, P]], (((1, (0, 2)),), (), ((2, (0,)),)))




# ------------------------------------------------------------------ generate
@pytest.mark.parametrize("kw, needle", [
    ({"temperature": float("nan")}, "temperature must be a finite number >= 0 (0 = greedy, > 0 samples), got nan"),
    ({"temperature": -0.5}, "temperature must be a finite number >= 0 (0 = greedy, > 0 samples), got -0.5"),
    ({"temperature": float("inf")}, "got inf"),
    ({"temperature": "0.7"}, "got '0.7'"),
    ({"top_p": float("nan")}, "top_p must be a number in (0, 1], got nan"),
    ({"top_p": "1"}, "top_p must be a number in (0, 1], got '1'"),
    ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
    ({"max_new_tokens": 2.5}, "max_new_tokens must be an integer >= 0, got 2.5"),
    ({"max_new_tokens": "5"}, "max_new_tokens must be an integer >= 0, got '5'"),
    ({"max_new_tokens": True}, "max_new_tokens must be an integer >= 0, got True"),
    ({"max_new_tokens": -1}, "max_new_tokens must be >= 0, got -1"),
    ({"seed": 2**64}, f"seed must be an integer in [-2**63, 2**63), got {2**64}"),
    ({"seed": 1.5}, "seed must be an integer in [-2**63, 2**63), got 1.5"),
    ({"stop": ""}, "stop strings must be non-empty"),
    ({"stop": ["ok", ""]}, "stop strings must be non-empty"),
    ({"stop": 5}, "stop must be a string, a list of strings or None, got 5"),
    ({"stop": ["a", 3]}, "stop must be a string, a list of strings or None, got ['a', 3]"),
    ({"on_token": 5}, "on_token must be a function taking the new text, or None; got 5"),
    ({"policy": "snapkv"}, "policy must be a hetero_jax.policies.Policy"),
])
def test_generate_refuses_bad_arguments_before_compute(kw, needle, no_compute):
    with pytest.raises(PromptError) as ei:
        hetero_jax.generate(MODEL, random_prompt(10), **{"chat": False, **kw})
    assert needle in str(ei.value), str(ei.value)


@pytest.mark.parametrize("prompt, needle", [
    ([1, 2.0, 3], "token ids must be integers: the prompt has 2.0 (float) at position 1"),
    (np.array([1.0, 2.0]), "token ids must be integers: the prompt has 1.0 (float) at position 0"),
    ([[1, 2], [3, 4.5]], "token ids must be integers: prompt 1 has 4.5 (float) at position 1"),
    ([[1, 2], [3, [4]]], "token ids must be integers: prompt 1 has [4] (list) at position 1"),
    ([[1, 2], ["a"]], "token ids must be integers: prompt 1 has 'a' (str) at position 0"),
    ([[True, 2]], "token ids must be integers: prompt 0 has True (bool) at position 0"),
    ([np.ones((2, 2), np.int32)], "prompt 0 must be a flat list of token ids, got an array of shape (2, 2)"),
    ([-1, 5], "token id -1 is outside the vocabulary [0, 101)"),
    ([[5, 6], [101]], "token id 101 is outside the vocabulary [0, 101)"),
    (None, "unsupported prompt type NoneType"),
    ({"a": 1}, "unsupported prompt type dict"),
])
def test_generate_refuses_malformed_token_lists(prompt, needle, no_compute):
    with pytest.raises(PromptError) as ei:
        hetero_jax.generate(MODEL, prompt, chat=False)
    assert needle in str(ei.value), str(ei.value)


@pytest.mark.parametrize("model", ["smollm2-135m", None, CFG])
def test_generate_and_session_need_a_loaded_model(model, no_compute):
    for call in (lambda: hetero_jax.generate(model, [1, 2], chat=False), lambda: Session(model, [1, 2])):
        with pytest.raises(PromptError, match=r"model must be a loaded model from hetero_jax.load\(NAME_OR_DIR\)"):
            call()


def test_temperature_zero_and_positive_still_work():
    """The checks refuse only what is wrong: greedy, sampling and a real stop string still run."""
    g = hetero_jax.generate(MODEL, random_prompt(12), chat=False, max_new_tokens=3)
    s = hetero_jax.generate(MODEL, random_prompt(12), chat=False, max_new_tokens=3, temperature=0.8, seed=2**63 - 1)
    assert len(g.token_ids) >= 1 and len(s.token_ids) >= 1


# ------------------------------------------------------------------ sessions
def _state(sess):
    c = sess.engine.cache
    return dict(messages=list(sess.messages), rendered=sess._rendered, unfed=list(sess._unfed),
                turns=len(sess.turns), steps=sess.engine.steps, seq=np.asarray(c.seq_lens).tolist(),
                tail=np.asarray(c.tail_lens).tolist())


@pytest.mark.parametrize("context, needle", [
    (None, "context must be a string or a list of token ids, got NoneType"),
    (3, "context must be a string or a list of token ids, got int"),
    ([1, 2.5], "token ids must be integers: the context has 2.5 (float) at position 1"),
    ([1, -4], "token id -4 is outside the vocabulary [0, 101)"),
    ("   ", "empty context"),
    ("caf\udce9", "the context is not valid text: character 3 is the lone surrogate U+DCE9 (the byte 0xe9)"),
])
def test_session_refuses_a_bad_context_before_compute(context, needle, no_compute):
    with pytest.raises(PromptError) as ei:
        Session(MODEL, context, chat=False)
    assert needle in str(ei.value)


@pytest.mark.parametrize("kw, needle", [
    ({"seed": 2**70}, "seed must be an integer in [-2**63, 2**63)"),
    ({"reserve_tokens": 0}, "reserve_tokens must be an integer >= 1, got 0"),
    ({"chat": "yes"}, "chat must be True or False, got 'yes'"),
])
def test_session_refuses_bad_options(kw, needle, no_compute):
    with pytest.raises(PromptError) as ei:
        Session(MODEL, random_prompt(20), **{"chat": False, **kw})
    assert needle in str(ei.value)


@pytest.fixture
def sess():
    s = Session(MODEL, random_prompt(150, 1), HeteroCache(profile=PROFILE, budget=0.6, window=3), chat=False,
                reserve_tokens=8)
    s.ask(random_prompt(5, 2), max_new_tokens=3)  # leaves the answer's last token unfed: a refusal must keep it
    return s


@pytest.mark.parametrize("question, kw, needle", [
    (random_prompt(120, 3), {}, "the question (120 tokens) does not fit"),  # and the unfed answer token
    ([5, -1], {}, "token id -1 of the question is outside the vocabulary [0, 101)"),
    ([5, 101], {}, "token id 101 of the question is outside the vocabulary [0, 101)"),
    ([5, 2.5], {}, "token ids must be integers: the question has 2.5 (float) at position 1"),
    ([], {}, "empty question"),
    (None, {}, "question must be a string or a list of token ids, got NoneType"),
    ("  ", {}, "empty question"),
    ("caf\udce9", {}, "the question is not valid text: character 3 is the lone surrogate U+DCE9 (the byte 0xe9)"),
    ([5, 6], {"stop": "\ud800"}, "the stop string '\\ud800' is not valid text: character 0 is the lone surrogate "
                                  "U+D800, which"),
    ([5, 6], {"temperature": float("nan")}, "temperature must be a finite number >= 0"),
    ([5, 6], {"temperature": -1.0}, "temperature must be a finite number >= 0"),
    ([5, 6], {"stop": ""}, "stop strings must be non-empty"),
    ([5, 6], {"max_new_tokens": 1.5}, "max_new_tokens must be an integer >= 0, got 1.5"),
])
def test_a_refused_turn_leaves_the_session_unchanged_and_usable(sess, question, kw, needle):
    before = _state(sess)
    twin = Session(MODEL, random_prompt(150, 1), HeteroCache(profile=PROFILE, budget=0.6, window=3), chat=False,
                   reserve_tokens=8)
    twin.ask(random_prompt(5, 2), max_new_tokens=3)
    with pytest.raises(PromptError) as ei:
        sess.ask(question, **kw)
    assert needle in str(ei.value), str(ei.value)
    assert _state(sess) == before
    # the next turn answers, exactly as in a session that never saw the refused one
    assert sess.ask(random_prompt(4, 7), max_new_tokens=4).token_ids == twin.ask(random_prompt(4, 7), max_new_tokens=4).token_ids


def test_refused_chat_turn_keeps_the_history(tiny_checkpoint):
    """The reported case: a chat session refuses an over-long question; the question used to stay in the
    history, and every later ask failed with 'the chat template does not render turns incrementally'."""
    pytest.importorskip("transformers")
    model = hetero_jax.load(tiny_checkpoint("llama")[1])
    context = "the quick brown fox jumps over the lazy dog. " * 6
    s, twin = Session(model, context), Session(model, context)
    s.ask("who jumps?", max_new_tokens=3)
    twin.ask("who jumps?", max_new_tokens=3)
    before = _state(s)
    too_long = "tell me about the dog " * 200
    with pytest.raises(PromptError, match=r"does not fit: \d+ positions are left .* \(this one is unchanged\)"):
        s.ask(too_long)
    assert _state(s) == before and too_long not in s._rendered
    assert s.ask("and the fox?", max_new_tokens=4).text == twin.ask("and the fox?", max_new_tokens=4).text


# ------------------------------------------------------------------ policies
@pytest.mark.parametrize("make, needle", [
    (lambda: SnapKV(budget=0.3, window=0), "SnapKV: window must be an integer >= 1 (prompt queries in the "
                                           "observation window), got 0"),
    (lambda: SnapKV(budget=0.3, window=2.5), "SnapKV: window must be an integer >= 1"),
    (lambda: SnapKV(budget=0.3, gqa="median"), "SnapKV: gqa must be one of 'max', 'mean', got 'median'"),
    (lambda: SnapKV(budget=0.3, pool_kernel=4), "SnapKV: pool_kernel must be odd"),
    (lambda: SnapKV(budget=0.3, pool_kernel=0), "SnapKV: pool_kernel must be an integer >= 1, got 0"),
    (lambda: PyramidKV(budget=0.3, beta=0), "PyramidKV: beta must be a finite number in [1, inf), got 0"),
    (lambda: PyramidKV(budget=0.3, beta=float("nan")), "PyramidKV: beta must be a finite number in [1, inf)"),
    (lambda: PyramidKV(budget=0.3, window=-1), "PyramidKV: window must be an integer >= 1"),
    (lambda: H2O(budget=0.3, query_chunk=0), "H2O: query_chunk must be an integer >= 1, got 0"),
    (lambda: H2O(budget=0.3, window=0), "H2O: window must be an integer >= 1 (recent tokens always kept), got 0"),
    (lambda: H2O(budget=0.3, gqa="sum"), "H2O: gqa must be one of 'max', 'mean', got 'sum'"),
    (lambda: StreamingLLM(budget=0.3, sinks=-1), "StreamingLLM: sinks must be an integer >= 0, got -1"),
    (lambda: CAKE(budget=0.3, gamma=float("inf")), "CAKE: gamma must be a finite number in [0, inf), got inf"),
    (lambda: CAKE(budget=0.3, tau1=0.0), "CAKE: tau1 must be a finite number in (0, inf), got 0.0"),
    (lambda: HeteroCache(profile=PROFILE, window=2.5), "HeteroCache: window must be an integer >= 1 (decode steps "
                                                       "between drift checks), got 2.5"),
    (lambda: HeteroCache(profile=PROFILE, tau_drift=float("nan")), "HeteroCache: tau_drift must be a finite number"),
    (lambda: HeteroCache(profile=PROFILE, tau_drift="0.5"), "got '0.5'"),
    (lambda: HeteroCache(profile=3), "HeteroCache: profile must be a HeadProfile, a path to a profile JSON or None"),
    (lambda: SnapKV(budget=True), "SnapKV: budget rho must be a number in (0, 1], the fraction of the prompt's KV "
                                  "kept on the device; got True of type bool"),
    (lambda: FreeKV(sinks=-1), "FreeKV: sinks must be an integer >= 0 or None (B_c / 16), got -1"),
    (lambda: Quest(offload="yes"), "Quest: offload must be True or False, got 'yes'"),
    (lambda: Quest(full_layers=-1), "Quest: full_layers must be an integer >= 0, got -1"),
    (lambda: HCAttention(tau=0.0), "HCAttention: tau must be a finite number in (0, 1], got 0.0"),
    (lambda: HCAttention(renormalize=1), "HCAttention: renormalize must be True or False, got 1"),
    (lambda: SyncKV(m=0), "SyncKV: m must be an integer >= 1 (decode steps between anticipations), got 0"),
    (lambda: SyncKV(static_ratio=1.5), "SyncKV: static_ratio must be a finite number in [0, 1], got 1.5"),
    (lambda: ContextKeeper(recent=0), "ContextKeeper: recent must be an integer >= 1, got 0"),
])
def test_policy_arguments_are_checked_at_construction(make, needle):
    with pytest.raises(PolicyError if "budget rho" not in needle else BudgetError) as ei:
        make()
    assert needle in str(ei.value), str(ei.value)


def test_a_profile_path_is_loaded_by_the_profiled_policies(tmp_path):
    """HeteroCache and ProfiledSnapKV refused a path (only SyncKV loaded one), so `--option profile=PATH` and a
    server's flag could not name a profile for them."""
    from hetero_jax.policies import ProfiledSnapKV
    from hetero_jax.profile.official import load_profile
    from hetero_jax.profile.schema import ProfileError

    path = tmp_path / "p.json"
    PROFILE.to_json(path)
    for cls in (HeteroCache, ProfiledSnapKV):
        assert cls(budget=0.5, profile=str(path)).profile == load_profile(str(path))
        with pytest.raises(ProfileError, match="profile file not found: 'no/such/p.json'"):
            cls(budget=0.5, profile="no/such/p.json")


def test_optional_and_boolean_parameters_accept_their_values():
    assert FreeKV(sinks=None, window=0).sinks is None
    assert Quest(offload=np.bool_(True)).offload and not HCAttention(renormalize=False).renormalize


@pytest.mark.parametrize("args, kw, cls, needle", [
    (("nope",), {}, UnknownPolicyError, "unknown policy 'nope'; known policies: full, streamingllm, snapkv"),
    ((None,), {}, UnknownPolicyError, "policy name must be a string, got None; known policies:"),
    (("snapkv", 0.3), {"windw": 3}, PolicyError, "SnapKV has no option 'windw'; its options are: window, "
                                                 "pool_kernel, gqa"),
    (("heterocache", 0.3), {"profile_key": "x"}, PolicyError, "HeteroCache has no option 'profile_key'"),
    (("full", 0.5), {}, BudgetError, "the full policy keeps the whole prompt"),
    (("full", 1.5), {}, BudgetError, "budget rho=1.5 is out of range"),  # it was told to give no budget
    # --policy snapkv --option budget=0.3 was a TypeError (two values for make_policy's budget)
    (("snapkv", 0.3), {"budget": 0.3}, PolicyError, "the budget is not an option (got budget=0.3); give it as "
                                                    "make_policy's second argument (--budget on the command line)"),
    # --policy snapkv:window=4 --option window=2 ran with window=2, silently
    (("snapkv:window=4", 0.3), {"window": 2}, PolicyError, "the policy option 'window' is given twice: window=4 in "
                                                           "the name snapkv:window=4 and window=2 as an option"),
    (("h2o", float("nan")), {}, BudgetError, "budget rho=nan is out of range"),
])
def test_make_policy_refuses_with_project_errors(args, kw, cls, needle):
    with pytest.raises(cls) as ei:
        make_policy(*args, **kw)
    assert needle in str(ei.value), str(ei.value)
    assert isinstance(ei.value, HeteroJaxError)
    if cls is UnknownPolicyError:
        assert isinstance(ei.value, KeyError)  # what make_policy raised before: old handlers keep working


# ------------------------------------------------------------------ budgets at the boundary
def test_heterocache_names_the_exact_smallest_rho():
    """The named rho runs; 0.0001 below it is refused (the old message named the rho with L_base = 1 while
    any L_base > 0 ran, each compressed head then kept 1 token: more than the request)."""
    for L in (20, 77, 150, 200):
        with pytest.raises(BudgetError, match=r"smallest rho that works is (\d\.\d{4})\b") as ei:
            HeteroCache(profile=PROFILE, budget=0.3).check_budget(L)
        rho = float(re.search(r"smallest rho that works is (\d\.\d{4})", str(ei.value)).group(1))
        HeteroCache(profile=PROFILE, budget=rho).check_budget(L)  # runs
        with pytest.raises(BudgetError, match="smallest rho that works is " + re.escape(f"{rho:.4f}") + r"\b"):
            HeteroCache(profile=PROFILE, budget=round(rho - 1e-4, 4)).check_budget(L)
    # and it runs end to end at the boundary, within its budget (+ at most one token per head)
    L = 77
    rho = smallest_working_rho(9, 3, 6, L)
    eng = hetero_jax.generate(MODEL, random_prompt(L, 5), HeteroCache(profile=PROFILE, budget=rho), chat=False,
                              max_new_tokens=1)
    assert eng.stats.achieved_rho <= rho + 1 / L


@settings(max_examples=60, deadline=None)
@given(roles=st.lists(st.sampled_from([A, V]), min_size=6, max_size=24),  # the budget sees compressed vs full
       L=st.integers(1, 5000), frac=st.floats(0.0, 1.0), seed=st.integers(0, 5))
def test_achieved_rho_never_exceeds_the_request_by_more_than_a_token_per_head(roles, L, frac, seed):
    roles = np.asarray(roles).reshape(-1, 3 if len(roles) % 3 == 0 else 1)
    n_comp = int(np.isin(roles, [A, S]).sum())
    N = roles.size
    assume(n_comp > 0)  # all volatile: nothing to budget (refused below rho 1, test_heterocache)
    prof = make_profile(roles, tuple(() for _ in range(roles.shape[0])), seed=seed)
    lo = smallest_working_rho(N, N - n_comp, n_comp, L)
    rho = round(lo + (1.0 - lo) * frac, 4)
    grid = budget_grid(rho, prof.roles, prof.weights, L)
    assert grid.min() >= 1 and grid.max() <= L
    assert grid.sum() <= rho * N * L + N  # one token per head at most
    if lo > 1e-4 and lo < 1.0:
        with pytest.raises(BudgetError):
            HeteroCache(profile=prof, budget=round(lo - 1e-4, 4)).check_budget(L)


@settings(max_examples=60, deadline=None)
@given(L=st.integers(1, 3000), m=st.integers(1, 3000))
def test_baseline_smallest_rho_is_exact(L, m):
    m = min(m, L)
    rho = smallest_rho(m, L)
    assert tokens_for(rho, L) >= m
    if rho > 1e-4:
        assert tokens_for(round(rho - 1e-4, 4), L) < m


# ------------------------------------------------------------------ host store fault
def test_a_failed_recall_transfer_leaves_the_cache_and_the_session_usable(monkeypatch):
    """Inject a failure into the jax.device_put of recalled rows, midway through a send (after one array went
    over) on the recall's background thread: the failure is reported where the recall would land, all or
    nothing, so the pool and K_base are the ones before its plan and the turn answers exactly as a session
    whose pivots never drift (no recall at all). Once transfers work again the next turn recalls."""
    # q1's answer must run past a check and its landing (window 2): this random model ends some answers at once
    context, q1, q2 = random_prompt(150, 1), random_prompt(6, 8), random_prompt(5, 3)
    drifting = HeteroCache(profile=PROFILE, budget=0.6, window=2, tau_drift=1.5)  # tau > 1: every check drifts
    calm = HeteroCache(profile=PROFILE, budget=0.6, window=2, tau_drift=-1.0)  # overlap >= 0: never drifts
    sess = Session(MODEL, context, drifting, chat=False, reserve_tokens=8)
    twin = Session(MODEL, context, calm, chat=False, reserve_tokens=8)
    ctl = sess.engine.state

    real_put, puts, failing = jax.device_put, [0], [True]

    def flaky(x, *a, **k):  # the recall's host rows (its sending thread only); the 2nd of each send fails
        if failing[0] and threading.current_thread().name.startswith("recall-send") and isinstance(x, np.ndarray):
            puts[0] += 1
            if puts[0] % 2 == 0:
                raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: injected transfer failure")
        return real_put(x, *a, **k)

    lands, real_before = [], ctl.before_step

    def spy(step, cache):
        rec = ctl.recall
        out = real_before(step, cache)
        if rec is not None:  # a landing: same pool, and each drifted layer's K_base from before the plan
            lands.append(out.pool is cache.pool and all(
                np.array_equal(np.asarray(out.layers[li].state.k_base), np.asarray(state.k_base))
                for li, state in rec.old_base.items()))
        return out

    monkeypatch.setattr(jax, "device_put", flaky)
    monkeypatch.setattr(ctl, "before_step", spy)
    with pytest.warns(RuntimeWarning, match=r"recall at decode step \d+ failed \(JaxRuntimeError: RESOURCE_EXHAUSTED: "
                                            r"injected transfer failure\); the device cache is unchanged"):
        got = sess.ask(q1, max_new_tokens=6)
    assert len(got.token_ids) > 3 and puts[0] >= 2 and ctl.stats()["recall_failures"] >= 1
    assert lands and all(lands)  # every landing failed and handed back the pool and the K_base before its plan
    assert ctl.stats()["recalls"] == 0 and ctl.stats()["bytes_recalled"] == 0 and ctl.recall_steps == []
    assert got.token_ids == twin.ask(q1, max_new_tokens=6).token_ids  # as if no recall had been attempted
    failing[0] = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        res = sess.ask(q2, max_new_tokens=5)
    assert len(res.token_ids) >= 1 and ctl.stats()["recalls"] > 0


@pytest.mark.parametrize("policy, transfer", [
    (FreeKV(budget=0.6, page_size=8), True), (FreeKV(budget=0.6, page_size=8), False),
    (HeteroCache(profile=PROFILE, budget=0.6, window=2, tau_drift=1.5), False)],
    ids=["freekv-transfer-error", "freekv-defect", "heterocache-defect"])
def test_between_step_rows_survive_a_failed_transfer_and_let_a_defect_through(monkeypatch, policy, transfer):
    """The rows a policy moves between steps (FreeKV's pages, HeteroCache's recall): a transfer's failure (the
    runtime's error) is counted and warned about and decoding goes on (HeteroCache's: the test above); any other
    error is a defect and reaches the caller (it was once counted as a failed transfer, which hid a multi-process
    defect)."""
    from hetero_jax.policies import speculative
    from hetero_jax.runtime import Engine

    # FreeKV's pages cross between steps where the host recalls them (a GPU, a mesh); on one CPU device the step
    # moves them itself, with no transfer to fail
    monkeypatch.setattr(speculative, "recall_in_step", lambda cache: False)
    eng = Engine(MODEL, [random_prompt(160, 3)], policy, tail_capacity=12)
    tok = eng.first_tokens(0.0, 1.0)
    real_put = jax.device_put
    error = (jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: injected transfer failure") if transfer
             else RuntimeError("injected defect"))

    def flaky(x, *a, **k):
        if isinstance(x, np.ndarray):  # host rows on their way to the device
            raise error
        return real_put(x, *a, **k)

    monkeypatch.setattr(jax, "device_put", flaky)
    if transfer:
        with pytest.warns(RuntimeWarning, match=r"failed \(JaxRuntimeError: RESOURCE_EXHAUSTED: injected"):
            for _ in range(8):
                tok, _ = eng.step(tok, 0.0, 1.0)
        assert eng.state.stats()["recall_failures"] >= 1
    else:
        with pytest.raises(RuntimeError, match="injected defect"):
            for _ in range(8):
                tok, _ = eng.step(tok, 0.0, 1.0)


def test_a_failed_reselection_transfer_keeps_the_previous_rows_and_the_session_usable(monkeypatch):
    """A turn's re-selection whose host -> device transfer fails midway hands back the cache it was given
    (the previous rows, K_base included) with a RuntimeWarning; the turn is answered from those rows, and
    the next turn re-selects."""
    context, q1, q2 = random_prompt(150, 4), random_prompt(6, 5), random_prompt(5, 6)
    sess = Session(MODEL, context, HeteroCache(profile=PROFILE, budget=0.6, window=50), chat=False, reserve_tokens=8)
    ctl = sess.engine.state
    real_put, puts, failing = jax.device_put, [0], [True]

    def flaky(x, *a, **k):
        if failing[0] and isinstance(x, np.ndarray):  # the re-selected rows; the 2nd transfer fails
            puts[0] += 1
            if puts[0] == 2:
                raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: injected transfer failure")
        return real_put(x, *a, **k)

    seen, real_reselect = [], ctl._reselect

    def spy(queries, cache):
        seen.append(cache)
        return real_reselect(queries, cache)

    monkeypatch.setattr(jax, "device_put", flaky)
    monkeypatch.setattr(ctl, "_reselect", spy)
    rows = lambda: [np.asarray(a) for li in range(len(sess.engine.cache.layers))  # noqa: E731
                    for a in layer_rows(sess.engine.cache, li)]  # every head's prompt rows and positions
    before = rows()
    with pytest.warns(RuntimeWarning, match=r"re-selection after a turn failed \(JaxRuntimeError: RESOURCE_EXHAUSTED"):
        got = sess.ask(q1, max_new_tokens=3)
    assert len(got.token_ids) >= 1 and ctl.stats()["reselect_failures"] == 1
    assert ctl.stats()["reselections"] == 0 and ctl.stats()["bytes_reselected"] == 0
    after = rows()
    assert all(np.array_equal(a, b) for a, b in zip(before, after))  # the prompt rows are the prefill's
    failing[0] = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sess.ask(q2, max_new_tokens=3)
    assert ctl.stats()["reselections"] == 1 and ctl.stats()["bytes_reselected"] > 0


# ------------------------------------------------------------------ property: only HeteroJaxError
ANY = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True),
                st.text(max_size=4), st.lists(st.integers(-3, 200), max_size=3),
                st.dictionaries(st.text(max_size=2), st.integers(), max_size=2), st.builds(object))
NAN_INF = st.sampled_from([float("nan"), float("inf"), float("-inf")])
NOT_NUMBER = st.one_of(st.none(), st.text(max_size=3), st.lists(st.integers(), max_size=2), st.builds(object))
# values that are wrong for each argument by construction, so every call below must be refused
BAD_ARGS = {
    "max_new_tokens": st.one_of(st.integers(max_value=-1), st.floats(allow_nan=True), st.booleans(), NOT_NUMBER),
    "temperature": st.one_of(st.floats(max_value=-1e-6), NAN_INF, st.booleans(), NOT_NUMBER),
    "top_p": st.one_of(st.floats(max_value=0.0), st.floats(min_value=1.0, exclude_min=True), NAN_INF, NOT_NUMBER),
    "seed": st.one_of(st.integers(min_value=2**63), st.integers(max_value=-(2**63) - 1), st.floats(), NOT_NUMBER),
    "stop": st.one_of(st.just(""), st.lists(st.just(""), min_size=1, max_size=2), st.integers(), st.floats(),
                      st.lists(st.integers(), min_size=1, max_size=2)),
    "on_token": st.one_of(st.integers(), st.text(max_size=3), st.floats()),
}
BAD_PROMPT = st.one_of(
    st.none(), st.floats(), st.integers(), st.just([]), st.just([[]]), st.text(alphabet=" \n\t", max_size=5),
    st.lists(st.floats(allow_nan=True), min_size=1, max_size=3),
    st.lists(st.integers(max_value=-1), min_size=1, max_size=3),
    st.lists(st.integers(min_value=CFG.vocab_size), min_size=1, max_size=3),
    st.lists(st.lists(st.one_of(st.floats(), st.text(min_size=1, max_size=2), st.none()), min_size=1, max_size=2),
             min_size=1, max_size=2),
    st.integers(0, CFG.max_position_embeddings).map(lambda n: [5] * (CFG.max_position_embeddings + n)),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_property_generate_refuses_malformed_arguments_with_project_errors(data, no_compute):
    keys = data.draw(st.lists(st.sampled_from(sorted(BAD_ARGS) + ["prompt", "policy"]), min_size=1, max_size=3,
                              unique=True))
    kw = {k: data.draw(BAD_ARGS[k]) for k in keys if k in BAD_ARGS}
    prompt = data.draw(BAD_PROMPT) if "prompt" in keys else random_prompt(8)
    if "policy" in keys:
        kw["policy"] = data.draw(st.one_of(st.text(max_size=5), st.integers(), st.floats(), st.just(SnapKV)))
    with pytest.raises(HeteroJaxError):
        hetero_jax.generate(MODEL, prompt, chat=False, **kw)


@pytest.fixture(scope="module")
def shared_session():
    s = Session(MODEL, random_prompt(150, 1), HeteroCache(profile=PROFILE, budget=0.6, window=3), chat=False,
                reserve_tokens=8)
    s.ask(random_prompt(5, 2), max_new_tokens=3)
    return s


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_property_session_ask_refuses_malformed_arguments_and_changes_nothing(data, shared_session, monkeypatch):
    sess = shared_session
    monkeypatch.setattr(sess.engine, "step", lambda *a, **k: (_ for _ in ()).throw(AssertionError("computed")))
    keys = data.draw(st.lists(st.sampled_from(sorted(BAD_ARGS) + ["question"]), min_size=1, max_size=3,
                              unique=True))
    kw = {k: data.draw(BAD_ARGS[k]) for k in keys if k in BAD_ARGS and k != "seed"}
    if not kw and "question" not in keys:
        keys.append("question")
    question = data.draw(BAD_PROMPT.filter(lambda p: not (isinstance(p, list) and p and isinstance(p[0], list)))) \
        if "question" in keys else [5, 6]
    if isinstance(question, list) and len(question) > 200:
        question = question + [5] * 200  # too long for what is left of the context
    before = _state(sess)
    with pytest.raises(HeteroJaxError):
        sess.ask(question, **kw)
    assert _state(sess) == before


POLICY_FIELDS = [(cls, f.name) for cls in REGISTRY.values() for f in __import__("dataclasses").fields(cls)
                 if f.init and f.name != "profile"]


@settings(max_examples=300, deadline=None)
@given(field=st.sampled_from(POLICY_FIELDS), value=ANY)
def test_property_policy_constructors_raise_only_project_errors(field, value):
    cls, name = field
    extra = {"profile": PROFILE} if cls is HeteroCache else {}
    try:
        p = cls(**{name: value}, **extra)
    except HeteroJaxError:
        return
    # accepted: then it is a usable value of the right kind
    v = getattr(p, name)
    default = next(f.default for f in __import__("dataclasses").fields(cls) if f.name == name)
    assert isinstance(v, bool) == isinstance(default, bool)  # a flag stays a flag, a number is no bool
    if name == "budget":
        assert 0 < v <= 1
    elif isinstance(v, (int, float)) and not isinstance(v, bool) and name not in ("tau_drift", "tau"):
        assert math.isfinite(v) and v >= 0  # thresholds on a cosine / overlap scale may be negative
    elif name in ("tau_drift", "tau") and v is not None:
        assert math.isfinite(v)


@settings(max_examples=200, deadline=None)
@given(name=st.one_of(st.sampled_from(sorted(REGISTRY)), ANY), budget=ANY,
       kwargs=st.dictionaries(st.sampled_from(["window", "gqa", "beta", "sinks", "nope", "query_chunk", "gamma"]),
                              ANY, max_size=2))
def test_property_make_policy_raises_only_project_errors(name, budget, kwargs):
    try:
        p = make_policy(name, budget, **kwargs)
    except HeteroJaxError:
        return
    assert p.name == name.split(":")[0].lower().replace("-", "").replace("_", "")


HF_CFG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 8,
          "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 320, "intermediate_size": 128,
          "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "eos_token_id": 2,
          "bos_token_id": 1, "tie_word_embeddings": False, "head_dim": 8,
          "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 64}}


@settings(max_examples=300, deadline=None)
@given(changes=st.dictionaries(st.sampled_from(sorted(HF_CFG) + ["rope_scaling.factor",
                                                                 "rope_scaling.original_max_position_embeddings",
                                                                 "rope_parameters"]), ANY, min_size=1, max_size=3))
def test_property_config_values_raise_only_config_errors(changes):
    from hetero_jax.errors import ConfigError

    cfg = {**HF_CFG, "rope_scaling": dict(HF_CFG["rope_scaling"])}
    for k, v in changes.items():
        if k.startswith("rope_scaling."):
            if isinstance(cfg.get("rope_scaling"), dict):
                cfg["rope_scaling"][k.split(".")[1]] = v
        else:
            cfg[k] = v
    try:
        c = ModelConfig.from_hf_dict(cfg)
    except ConfigError:
        return
    assert min(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.num_layers, c.vocab_size) >= 1
    assert c.max_position_embeddings >= 2 and c.rms_norm_eps > 0 and c.rope_theta > 0


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(context=BAD_PROMPT.filter(lambda p: not (isinstance(p, list) and p and isinstance(p[0], list))),
       policy=st.one_of(st.none(), st.text(max_size=3), st.integers()))
def test_property_session_constructor_raises_only_project_errors(context, policy, no_compute):
    with pytest.raises(HeteroJaxError):
        Session(MODEL, context, policy if policy is not None else None, chat=False)


@pytest.mark.parametrize("trim", [True, False])
def test_the_last_engines_end_gives_the_c_heaps_free_memory_back(monkeypatch, trim):
    """``runtime.heap``: when the last engine is freed, ``release_free_memory`` runs once (glibc's
    ``malloc_trim``; a grid that drops its caches every case otherwise grows by the buffers glibc keeps), not
    while another engine lives, and not with ``HETERO_JAX_MALLOC_TRIM`` off."""
    import ctypes.util
    import gc

    from hetero_jax.runtime import Engine, heap

    gc.collect()
    monkeypatch.setattr(heap, "_live", [0])
    monkeypatch.setitem(heap.flags(), "trim", trim)
    calls = []
    monkeypatch.setattr(heap, "release_free_memory", lambda: calls.append(1) or True)
    a = Engine(MODEL, [random_prompt(40, 1)], FullKV(), tail_capacity=4)
    b = Engine(MODEL, [random_prompt(40, 2)], FullKV(), tail_capacity=4)
    del a
    assert heap.live_engines() == 1 and calls == []
    del b
    assert heap.live_engines() == 0 and calls == ([1] if trim else [])
    monkeypatch.undo()
    # the real call: glibc here (Linux), which answers whether it released anything; elsewhere False
    glibc = "libc.so" in (ctypes.util.find_library("c") or "libc.so")
    assert isinstance(heap.release_free_memory(), bool) and (heap._LIBC[0] is not None) == glibc


@pytest.mark.parametrize("policy", [FullKV(), HeteroCache(profile=PROFILE, budget=0.6, window=2, tau_drift=1.5)],
                         ids=["full", "heterocache-recalling"])
def test_engines_freeze_the_heap_and_are_freed_without_the_collector(monkeypatch, policy):
    """``runtime.heap``: a compile while an engine lives freezes the heap (``gc.freeze``, so decoding meets no
    full collection), and the last engine's end unfreezes it. That is safe only because a session, its
    engine, cache and decode state (HeteroCache after recalls) are freed by reference counting alone:
    with the collector off, dropping the last reference frees them."""
    import gc
    import weakref

    from hetero_jax.runtime import compiled, heap

    heap.unfreeze()
    gc.collect()  # engines other tests left in cycles (a kept traceback's frames) go now, from the real count
    monkeypatch.setattr(heap, "_live", [0])  # engines of other tests stay out of the count
    sess = Session(MODEL, random_prompt(150, 1), policy, chat=False, reserve_tokens=8)
    sess.ask(random_prompt(6, 8), max_new_tokens=6)
    if isinstance(policy, HeteroCache):
        assert sess.engine.state.stats()["recalls"] > 0
    assert heap.live_engines() == 1
    compiled(jax.jit(lambda x: x * 3 + 1), np.arange(5.0))  # a compile nothing else in the process made
    assert gc.get_freeze_count() > 0
    refs = [weakref.ref(o) for o in (sess, sess.engine, sess.engine.state)]
    gc.disable()
    try:
        del sess
        assert [r() is None for r in refs] == [True] * 3
        assert heap.live_engines() == 0 and gc.get_freeze_count() == 0
    finally:
        gc.enable()
