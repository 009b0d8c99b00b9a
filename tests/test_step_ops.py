"""benchmarks/bench_step_ops.py on the CPU: the HLO-text counter, the synthetic prefill and the step compile
(its modules step_ops_hlo, step_ops_compile, step_ops_policies and step_ops_report).

No CUDA plugin here: the step is compiled for XLA:CPU on a tiny model; the H100 compile is the benchmark's
(``make step-ops``).
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import step_ops_compile as C  # noqa: E402
import step_ops_hlo as H  # noqa: E402
import step_ops_policies as Pol  # noqa: E402
import step_ops_report as R  # noqa: E402
from hetero_jax.policies import FullKV, HeteroCache, SnapKV  # noqa: E402
from hetero_jax.profile.clustering import Role  # noqa: E402
from hetero_jax.profile import HeadProfile  # noqa: E402
from tiny_model import random_prompt, tiny_model  # noqa: E402

A, V, P, S = Role.ANCHOR, Role.VOLATILE, Role.PIVOT, Role.SATELLITE

# A hand-written GPU module: what the counter must find (``H.COUNTING_RULE``).
HLO = """HloModule jit_step, is_scheduled=true, entry_computation_layout={(f32[8]{0})->f32[8]{0}}

%fused_add (p0: f32[8]) -> f32[8] {
  %p0 = f32[8]{0} parameter(0)
  ROOT %add.1 = f32[8]{0} add(%p0, %p0)
}

%nested_operand (p0: f32[8,8]) -> f32[8,8] {
  %p0 = f32[8,8]{1,0} parameter(0)
  ROOT %neg = f32[8,8]{1,0} negate(%p0)
}

%gemm_computation (p0: f32[8,8], p1: f32[8,8]) -> f32[8,8] {
  %p0 = f32[8,8]{1,0} parameter(0)
  %p1 = f32[8,8]{1,0} parameter(1)
  %inner = f32[8,8]{1,0} fusion(%p0), kind=kLoop, calls=%nested_operand
  ROOT %dot = f32[8,8]{1,0} dot(%inner, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%region_add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%fused_reduce (p0: f32[8]) -> f32[] {
  %p0 = f32[8]{0} parameter(0)
  %c0 = f32[] constant(0)
  ROOT %r = f32[] reduce(%p0, %c0), dimensions={0}, to_apply=%region_add
}

%body (t: (s32[], f32[8])) -> (s32[], f32[8]) {
  %t = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = f32[8]{0} get-tuple-element(%t), index=1
  %f1 = f32[8]{0} fusion(%x), kind=kLoop, calls=%fused_add
  %f2 = f32[] fusion(%f1), kind=kInput, calls=%fused_reduce
  %inc = s32[] fusion(%i), kind=kLoop, calls=%fused_add
  ROOT %out = (s32[], f32[8]{0}) tuple(%inc, %f1)
}

%cond (t: (s32[], f32[8])) -> pred[] {
  %t = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  ROOT %lt = pred[] fusion(%i), kind=kLoop, calls=%fused_add
}

%branch_big (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  %b1 = f32[8]{0} fusion(%x), kind=kLoop, calls=%fused_add
  ROOT %b2 = f32[8]{0} fusion(%b1), kind=kLoop, calls=%fused_add
}

%branch_small (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  ROOT %b1 = f32[8]{0} fusion(%x), kind=kLoop, calls=%fused_add
}

ENTRY %main (a: f32[8], m: f32[8,8], p: pred[]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %m = f32[8,8]{1,0} parameter(1)
  %p = pred[] parameter(2)
  %k = f32[] constant(1)
  %bc = f32[8,8]{1,0} bitcast(%m)
  %loop = f32[8]{0} fusion(%a), kind=kLoop, calls=%fused_add, metadata={op_name="jit(decode_step_jit)/slice" stack_frame_id=3}
  %gemm = f32[8,8]{1,0} fusion(%bc, %m), kind=kCustom, calls=%gemm_computation, backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
  %cublas = (f32[8,8]{1,0}, s8[1024]{0}) custom-call(%m, %m), custom_call_target="__cublas$gemm"
  %pallas = (f32[8]{0}, f32[8]{0}) custom-call(%a, %m), custom_call_target="__gpu$xla.gpu.triton", backend_config={"name":"k"}
  %cb = f32[8]{0} custom-call(%a), custom_call_target="xla_ffi_python_gpu_callback"
  %topk = f32[8]{0} custom-call(%a), custom_call_target="__gpu$TopK"
  %cp = f32[8]{0} copy(%a)
  %cs = (f32[8]{0}, f32[8]{0}, u32[]) copy-start(%a)
  %cd = f32[8]{0} copy-done(%cs)
  %srt = f32[8]{0} sort(%a), dimensions={0}, to_apply=%region_add
  %init = (s32[], f32[8]{0}) tuple(%k, %a)
  %w = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%body, metadata={op_name="jit(decode_step_jit)/jit(topk_membership)/while"}, backend_config={"known_trip_count":{"n":"5"},"known_init_step":{"init":"0","step":"1"}}
  %w2 = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%body
  %cnd = f32[8]{0} conditional(%p, %a, %a), true_computation=%branch_big, false_computation=%branch_small
  %g = f32[8]{0} get-tuple-element(%w), index=1
  ROOT %t = (f32[8]{0}, f32[8]{0}) tuple(%g, %cnd)
}
"""


def test_counter_on_a_hand_written_module():
    comps, entry = H.parse_hlo(HLO)
    assert entry == "main" and "gemm_computation" in comps and len(comps) == 10
    c = H.count_step_ops(HLO)
    # ENTRY: loop + gemm; known-trip loop: 3 body fusions x 5; unknown loop: 3 body + 1 condition; big branch: 2
    assert c["fusions"] == 2 + 15 + 4 + 2
    # body per trip: 2 kLoop + 1 kInput; the condition and both branch fusions kLoop
    assert c["fusions_by_kind"] == {"kCustom:__triton_nested_gemm_fusion": 1, "kInput": 5 + 1, "kLoop": 1 + 10 + 3 + 2}
    assert c["gemm_fusions"] == 1 and c["gemms"] == 2  # the Triton GEMM fusion and the cuBLAS call
    assert c["custom_calls_by_kind"] == {"cublas": 1, "host_callback": 1, "other": 1, "pallas_triton": 1}
    assert c["custom_calls_by_target"]["__gpu$TopK"] == 1
    assert c["pallas_calls"] == 1 and c["host_callbacks"] == 1
    assert (c["copies"], c["async_copies"]) == (1, 1)
    assert c["other_ops"] == {"sort": 1}
    assert (c["while_loops"], c["unknown_trip_loops"], c["loop_trips"], c["conditionals"]) == (2, 1, 6, 1)
    assert c["kernels_in_loops"] == 15 + 4
    # fusions 23 + custom calls 4 - 1 callback + copy + copy-start + sort
    assert c["kernels_per_step"] == 23 + 3 + 1 + 1 + 1
    assert c["fusion_substrings"] == HLO.count(" fusion(") == 10  # nested and unrun ones too
    # sources: op_name's function jitted inside the step, else its primitive, else the opcode; a loop's body
    # counts for the loop
    src = c["kernels_by_source"]
    assert src["topk_membership"] == 15 and src["slice"] == 1 and sum(src.values()) == c["kernels_per_step"]


def test_counter_refuses_text_without_entry():
    with pytest.raises(ValueError, match="ENTRY"):
        H.count_step_ops("HloModule m\n")


def test_custom_call_kinds():
    assert H.custom_call_kind("__cublas$lt$matmul") == "cublas"
    assert H.custom_call_kind("__gpu$xla.gpu.triton") == "pallas_triton"
    assert H.custom_call_kind("xla_python_gpu_callback") == "host_callback"
    assert H.custom_call_kind("__cudnn$fmha") == "cudnn"
    assert H.custom_call_kind("Sharding") == "other"


# ----------------------------------------------------------------------------- the tiny model's step
MODEL = tiny_model()
CFG = MODEL.config


def _profile():
    roles = np.asarray([[S, P, S], [A, V, A], [S, A, P]], np.int8)
    comp = np.isin(roles, [A, S])
    weights = np.where(comp, 1.0, np.nan)
    weights[comp] = np.linspace(0.7, 1.3, comp.sum())
    return HeadProfile(roles=roles, clusters=(((1, (0, 2)),), (), ((2, (0,)),)), weights=weights,
                       architecture="llama", head_dim=CFG.head_dim)


POLICIES = {"full": FullKV(), "snapkv": SnapKV(budget=0.5, window=8), "heterocache": HeteroCache(profile=_profile(), budget=0.5)}
LENGTH = 48


def _leaf_shapes(tree):
    return jax.tree.structure(tree), [(tuple(x.shape), jnp.result_type(x)) for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_synthetic_prefill_has_the_real_prefill_structure(name):
    """Same pytree, shapes and dtypes as the engine's prefill of a real prompt of that length: the benchmark's cache
    is what the step would see (this fails when the cache layout changes under the synthetic prefill)."""
    from hetero_jax.runtime.engine import bind_policy, prefill

    policy = bind_policy(MODEL, POLICIES[name])
    syn, _ = C.synthetic_prefill(policy, MODEL, LENGTH, tail_capacity=128)
    plan = policy.make_prefill(CFG, [LENGTH])
    _, cache = prefill(MODEL.params, CFG, [random_prompt(LENGTH)], tail_capacity=128, plan=plan)
    real, _ = plan.finish(cache)
    assert _leaf_shapes(syn) == _leaf_shapes(real)


def test_cpu_step_counts_for_full_kv_and_heterocache():
    mesh = C.cpu_mesh()
    params_abs = C.abstract_params(CFG, "float32", mesh)
    counts = {}
    for name in ("full", "heterocache"):
        policy = POLICIES[name].bind(MODEL)
        cache, _ = C.synthetic_prefill(policy, MODEL, LENGTH, tail_capacity=128)
        cache_abs = C.abstract(cache, mesh)
        assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(cache_abs))
        exe, lower_s, compile_s = C.compile_step(params_abs, cache_abs, CFG, policy, mesh, "reference")
        counts[name] = H.count_step_ops(exe.as_text())
        assert lower_s > 0 and compile_s > 0
        # a greedy step leaves the sampling key to the engine: returned unchanged, XLA would copy it every step
        assert not re.search(r"= u32\[2\]\{0\} copy\(", exe.as_text())
    for c in counts.values():
        assert c["fusions"] > CFG.num_layers and c["kernels_per_step"] >= c["fusions"]
        assert c["pallas_calls"] == 0 and c["host_callbacks"] == 0  # reference kernels, no callback
    # HeteroCache's pivots score every step (their pooled scores and overlaps): more launches than full KV
    assert counts["heterocache"]["kernels_per_step"] > counts["full"]["kernels_per_step"]
    rows = [{"policy": n, "length": LENGTH, **c} for n, c in counts.items()]
    R.add_ratios(rows)
    assert rows[0]["kernels_vs_full"] == 1.0 and rows[1]["kernels_vs_full"] > 1.0
    t = R.target_check(rows)
    assert list(t) == [f"heterocache@{LENGTH}"] and t[f"heterocache@{LENGTH}"]["limit"] == R.HETERO_TARGET


def test_peer_stand_ins_fit_llama_shapes():
    """SyncKV groups, a ContextKeeper ranking and an HCAttention codebook for Llama-3.1-8B's 32 x 8 heads."""
    import bench_latency

    from hetero_jax.policies.synckv import check_synckv_profile

    try:
        prof = Pol.authors_profile()
    except SystemExit as e:  # the authors' profile lives in shared/reference, beside the checkout
        pytest.skip(str(e))
    cfg = bench_latency.synthetic_config(None, Pol.SHAPE, 4096)
    sync = Pol.synckv_profile_from(prof)
    check_synckv_profile(sync)
    assert sync.roles.shape == (32, 8) and not (sync.roles == Role.ANCHOR).any()
    assert int((sync.roles == Role.SATELLITE).sum()) == int((prof.roles == Role.SATELLITE).sum())
    rank = Pol.contextkeeper_ranking_from(prof)
    rank.check_compatible(cfg)
    first = rank.order()[: int(((prof.roles == Role.PIVOT) | (prof.roles == Role.VOLATILE)).sum())]
    assert all(prof.roles[l, h] in (Role.PIVOT, Role.VOLATILE) for l, h in first)
    cb = Pol.random_codebook(cfg)
    cb.check_compatible(cfg)
    assert cb.groups(cfg.head_dim) == 32
    for spec in ("synckv", "contextkeeper", "hcattention@0.125", "hcattention@0.5", "quest:offload=true"):
        policy, _ = Pol.make_policy(spec, 0.3, prof, cfg)
        if hasattr(policy, "kv_itemsize"):  # what bind sets from the bfloat16 weights
            policy = dataclasses.replace(policy, kv_itemsize=2)
        policy.make_prefill(cfg, [4096])  # budgets check out at these shapes


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_gpu_step_is_one_pool_kernel_call_per_layer_and_no_control_flow(name):
    """The decode step lowered for CUDA without a GPU (the Pallas kernels traced): every layer's attention is
    one call of the pool kernel, whatever its heads' lengths, and the step has no loop or conditional (a GPU
    runs a loop's trips as launches and reads a conditional's predicate on the host) and no sort: HeteroCache's
    pivots only hand their logits to the check, which ranks them every W steps. The same structure the H100
    compile of `bench_step_ops` counts; and each weight's product is a GEMM there."""
    import pallas_kernels
    from hetero_jax.runtime import Engine
    from hetero_jax.runtime.engine import decode_step_jit

    eng = Engine(MODEL, [random_prompt(LENGTH)], POLICIES[name], tail_capacity=16)
    # no host operands: on a GPU backend the policies read the host through callbacks (host_store.sums_in_step)
    args = (eng.params, eng.cache, jnp.zeros((1,), jnp.int32), jax.random.PRNGKey(0), ())
    jax.clear_caches()  # the kernel choice is read at trace time
    try:
        with pallas_kernels.use_kernels("pallas"):
            txt = decode_step_jit.trace(*args, cfg=CFG, policy=eng.policy, mode="greedy").lower(
                lowering_platforms=("cuda",)).as_text()
    finally:
        jax.clear_caches()
    assert len(re.findall(r"call @pool_attention\w*\(", txt)) == CFG.num_layers
    assert "__gpu$xla.gpu.triton" in txt
    # one token's projections reach XLA as two-row products: a one-row product with a small weight is
    # rewritten by XLA's GPU compiler into a multiply and a reduce (RESULTS `profile-step-gpu`)
    weight_dots = re.findall(r"stablehlo\.dot_general .*: \(tensor<(\d+)x\d+x\w+>, tensor<\d+x\d+x\w+>\)", txt)
    assert len(weight_dots) == 7 * CFG.num_layers + 1  # q, k, v, o, gate, up, down per layer; the lm_head
    assert set(weight_dots) == {"2"}, weight_dots
    for op in ("stablehlo.while", "stablehlo.case", "stablehlo.if", "stablehlo.sort"):
        assert op not in txt, op
