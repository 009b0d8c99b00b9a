"""Pure helpers of benchmarks/bench_latency.py and benchmarks/bench_fidelity.py (no model, no JAX compute)."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import bench_fidelity  # noqa: E402
import bench_latency  # noqa: E402


# ------------------------------------------------------------ roofline
def test_weight_bytes_tied_and_untied_by_hand():
    # vocab 100, embedding table 400 bytes -> one row is 4 bytes
    # tied: 1000 bytes of params (table included) - table + one row + the table again as lm_head
    assert bench_latency.weight_bytes_per_token(1000, 400, 100, tied_embeddings=True) == 1000 - 400 + 4 + 400
    # untied: the lm_head (400 bytes) is already among the 1400 bytes of params
    assert bench_latency.weight_bytes_per_token(1400, 400, 100, tied_embeddings=False) == 1400 - 400 + 4


def test_weight_bytes_of_a_pytree():
    params = {"embed": np.zeros((10, 8), np.float32),  # 320 bytes, row 32
              "final_norm": np.zeros(8, np.float32),  # 32
              "layers": [{"w": np.zeros((8, 8), np.float32)}]}  # 256
    cfg = SimpleNamespace(vocab_size=10, tie_word_embeddings=True)
    assert bench_latency.model_weight_bytes(params, cfg) == 32 + 256 + 32 + 320


def test_roofline_ratio_hand_computed():
    # SmolLM2-135M float32: 538,060,032 param bytes, embedding 49152 x 576 x 4 bytes (tied)
    embed = 49152 * 576 * 4
    w = bench_latency.weight_bytes_per_token(538_060_032, embed, 49152, tied_embeddings=True)
    assert w == 538_060_032 + 576 * 4
    kv_full, kv_policy = 200 * 2**20, 60 * 2**20
    want = (538_062_336 + 62_914_560) / (538_062_336 + 209_715_200)
    assert bench_latency.roofline_ratio(w, kv_policy, kv_full) == pytest.approx(want, rel=1e-12)
    assert bench_latency.roofline_ratio(1004, 250, 1000) == pytest.approx(1254 / 2004, rel=1e-12)
    assert bench_latency.roofline_ratio(1004, 1000, 1000) == 1.0


def test_within_tolerance():
    assert bench_latency.within_tolerance(0.65, 0.6)  # x1.083
    assert bench_latency.within_tolerance(0.55, 0.6)  # x0.917
    assert not bench_latency.within_tolerance(0.67, 0.6)  # x1.117
    assert not bench_latency.within_tolerance(0.53, 0.6)  # x0.883
    assert not bench_latency.within_tolerance(float("nan"), 0.6)


# ---------------------------------------------------------- percentiles
def test_timing_summary_percentiles():
    seconds = [k / 1000 for k in range(100, 0, -1)]  # 1 .. 100 ms, unsorted
    s = bench_latency.timing_summary(seconds)
    # linear interpolation: position (n - 1) q / 100 in the sorted samples
    assert s["n"] == 100
    assert s["mean_ms"] == pytest.approx(50.5)
    assert s["p50_ms"] == pytest.approx(50.5)
    assert s["p95_ms"] == pytest.approx(95.05)
    assert s["p99_ms"] == pytest.approx(99.01)
    assert s["p99_over_p50"] == pytest.approx(99.01 / 50.5)
    one = bench_latency.timing_summary([0.002])
    assert one["p50_ms"] == one["p99_ms"] == pytest.approx(2.0) and one["p99_over_p50"] == pytest.approx(1.0)
    empty = bench_latency.timing_summary([])
    assert empty["n"] == 0 and math.isnan(empty["p50_ms"])


def _row(label, policy, rho, length, ratio, roof, ttft_ratio, tail):
    return {"label": label, "policy": policy, "rho": rho, "length": length, "weights": "real",
            "decode_ratio_p50": ratio, "roofline_ratio": roof, "measured_over_roofline": ratio / roof,
            "within_10pct": bench_latency.within_tolerance(ratio, roof), "ttft_ratio": ttft_ratio,
            "decode": {"p99_over_p50": tail}}


def test_target_check_uses_longest_context_and_each_threshold():
    runs = [_row("heterocache@0.3", "heterocache", 0.3, 1024, 2.0, 0.9, 2.0, 3.0),  # shorter: ignored
            _row("heterocache@0.3", "heterocache", 0.3, 4096, 0.84, 0.8, 1.05, 1.5),
            _row("heterocache@0.5", "heterocache", 0.5, 8192, 5.0, 0.9, 5.0, 5.0)]  # other rho: ignored
    t = bench_latency.target_check(runs)
    assert t["length"] == 4096 and t["all_met"]
    runs[1] = _row("heterocache@0.3", "heterocache", 0.3, 4096, 0.84, 0.8, 1.06, 1.51)
    t = bench_latency.target_check(runs)
    assert t["decode_within_10pct_of_roofline"]
    assert not t["ttft_at_most_5pct_above_full"] and not t["p99_over_p50_at_most_1_5"] and not t["all_met"]
    assert bench_latency.target_check(runs[2:]) == {"measured": False}


# -------------------------------------------------------- KL, agreement
def _reference(ref_logits, logits, targets):
    """The same quantities in float64 numpy, written out directly."""
    a, b = np.asarray(ref_logits, np.float64), np.asarray(logits, np.float64)
    pa = np.exp(a - a.max(-1, keepdims=True))
    pa /= pa.sum(-1, keepdims=True)
    pb = np.exp(b - b.max(-1, keepdims=True))
    pb /= pb.sum(-1, keepdims=True)
    kl = (pa * (np.log(pa) - np.log(pb))).sum(-1)
    rows = np.arange(len(targets))
    return kl, a.argmax(-1) == b.argmax(-1), -np.log(pa[rows, targets]), -np.log(pb[rows, targets])


def test_next_token_metrics_against_numpy():
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((6, 500)).astype(np.float32) * 3
    pol = ref + rng.standard_normal((6, 500)).astype(np.float32) * 0.5
    pol[0] = ref[0]  # identical row: KL 0, agreement
    pol[1, ref[1].argmax()] -= 100.0  # the top token demoted: disagreement
    targets = rng.integers(0, 500, 6)
    m = bench_fidelity.next_token_metrics(ref, pol, targets)
    kl, agree, nll_ref, nll = _reference(ref, pol, targets)
    assert m["kl"].dtype == np.float32
    np.testing.assert_allclose(m["kl"], kl, rtol=1e-4, atol=1e-6)
    np.testing.assert_array_equal(m["agree"], agree)
    assert m["agree"][0] and not m["agree"][1]
    assert abs(float(m["kl"][0])) < 1e-6
    np.testing.assert_allclose(m["nll_ref"], nll_ref, rtol=1e-5)
    np.testing.assert_allclose(m["nll"], nll, rtol=1e-5)


def test_next_token_metrics_one_step_and_large_logits():
    ref = np.array([1000.0, 0.0, -1000.0], np.float32)  # exp would overflow without the max shift
    pol = np.array([0.0, 1000.0, -1000.0], np.float32)
    m = bench_fidelity.next_token_metrics(ref, pol, 0)
    assert np.isfinite(m["kl"]) and float(m["kl"]) == pytest.approx(1000.0, rel=1e-4)
    assert not bool(m["agree"])
    assert float(m["nll_ref"]) == pytest.approx(0.0, abs=1e-4) and float(m["nll"]) == pytest.approx(1000.0, rel=1e-4)


def test_summarize_steps():
    s = bench_fidelity.summarize_steps([0.0, 0.1, 0.2, 0.3], [True, True, False, True], [2.0, 3.0, 2.5, 2.5],
                                       [2.0, 2.0, 2.0, 2.0])
    assert s["steps"] == 4
    assert s["kl_mean"] == pytest.approx(0.15) and s["kl_median"] == pytest.approx(0.15)
    assert s["kl_p95"] == pytest.approx(0.285)
    assert s["agreement"] == pytest.approx(0.75)
    assert s["nll_delta"] == pytest.approx(0.5)


# ------------------------------------------------------------- presets
def test_presets_set_defaults_and_flags_override_them():
    a = bench_latency.parse_args(["--preset", "cpu", "--decode-steps", "5"])
    assert a.real_lengths == bench_latency.PRESETS["cpu"]["real_lengths"] and a.decode_steps == 5
    a = bench_latency.parse_args([])
    assert a.real_lengths == list(bench_latency.DEFAULT_REAL_LENGTHS) and a.preset is None
    f = bench_fidelity.parse_args(["--preset", "cpu", "--budgets", "0.2"])
    assert f.prompt_tokens == bench_fidelity.PRESETS["cpu"]["prompt_tokens"] and f.budgets == [0.2]


# ------------------------------------------------------ synthetic shapes
def test_llama8b_synthetic_shape_by_hand():
    from hetero_jax.model import spec

    cfg = bench_latency.synthetic_config(None, "llama-3.1-8b", 131072 + 73)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (32, 32, 8, 128)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size) == (4096, 14336, 128256)
    assert not cfg.tie_word_embeddings and cfg.max_position_embeddings == 131072 + 73
    # Llama-3.1-8B's 8,030,261,248 parameters, counted by hand: per layer q, o 4096^2; k, v 4096 x 1024;
    # gate, up, down 4096 x 14336; two norms. Plus the embedding, the untied lm_head and the final norm.
    per_layer = 2 * 4096**2 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
    want = 32 * per_layer + 2 * 128256 * 4096 + 4096
    assert want == 8_030_261_248
    n = sum(int(np.prod(s)) for k, s in spec.param_shapes(cfg).items() if k != "layers")
    n += sum(int(np.prod(s)) for layer in spec.param_shapes(cfg)["layers"] for s in layer.values())
    assert n == want
    a = bench_latency.parse_args(["--preset", "llama8b-gpu"])
    assert a.synthetic_shape == "llama-3.1-8b" and a.synthetic_dtype == "bfloat16" and a.real_lengths == []
    assert bench_latency.parse_args(["--synthetic-lengths", "64"]).synthetic_dtype == "float32"


def test_llama8b_synthetic_profile_is_the_authors_and_fits_the_shape():
    if bench_latency.reference_dir() is None:
        pytest.fail("the authors' profiles were not found: expected ../shared/reference beside the repo "
                    "or $HETERO_JAX_REFERENCE_DIR")
    prof = bench_latency.synthetic_profile("llama-3.1-8b")
    assert prof.weights_fingerprint is None and prof.roles.shape == (32, 8)
    prof.check_compatible(bench_latency.synthetic_config(None, "llama-3.1-8b", 0))
    assert prof.budgets(0.3, 131072).shape == (32, 8)  # rho 0.3 is feasible for that profile


def test_synthetic_profile_missing_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("HETERO_JAX_REFERENCE_DIR", str(tmp_path))
    with pytest.raises(SystemExit, match="--synthetic-profile"):
        bench_latency.synthetic_profile("llama-3.1-8b")


def test_synthetic_model_draws_each_tensor_with_its_shape_and_dtype():
    import jax.numpy as jnp

    from hetero_jax.model import spec
    from hetero_jax.model.config import ModelConfig

    cfg = ModelConfig(architecture="llama", vocab_size=97, hidden_size=48, intermediate_size=80, num_layers=2,
                      num_heads=6, num_kv_heads=2, head_dim=8, max_position_embeddings=64)
    real = SimpleNamespace(config=cfg, name="tiny", tokenizer=None)
    m = bench_latency.synthetic_model(real, 256, seed=3, dtype="bfloat16")
    assert m.config.max_position_embeddings == 256 and m.name == "tiny-synthetic"
    spec.check_params(m.config, m.params)
    w = np.asarray(m.params["layers"][1]["gate_proj"], np.float32)  # 48 x 80 draws
    assert m.params["embed"].dtype == jnp.bfloat16
    assert abs(w.std() - 0.02) < 0.003 and abs(w.mean()) < 0.003
    norm = np.asarray(m.params["final_norm"], np.float32)
    assert abs(norm.mean() - 1.0) < 0.05 and 0.05 < norm.std() < 0.15
    # a different seed draws different weights; the same seed the same ones
    again = bench_latency.synthetic_model(real, 256, seed=3, dtype="bfloat16")
    other = bench_latency.synthetic_model(real, 256, seed=4, dtype="bfloat16")
    assert np.array_equal(np.asarray(again.params["embed"], np.float32), np.asarray(m.params["embed"], np.float32))
    assert not np.array_equal(np.asarray(other.params["embed"], np.float32),
                              np.asarray(m.params["embed"], np.float32))


# ------------------------------------------------------------ bench_extend
def test_bench_extend_presets_and_table_by_hand():
    import bench_extend

    a = bench_extend.parse_args(["--preset", "cpu", "--turn-tokens", "8"])
    assert a.lengths == [2048] and a.turn_tokens == [8] and a.preset == "cpu"
    assert bench_extend.parse_args([]).lengths == bench_extend.PRESETS["full"]["lengths"]
    with pytest.raises(SystemExit):
        bench_extend.parse_args(["--budget", "0"])
    rows = [{"context_tokens": 2048, "name": "full", "turn_tokens": 256, "prefill_s_per_token": 0.002,
             "chunked_s_per_token": 0.004, "per_token_s_per_token": 0.03},
            {"context_tokens": 2048, "name": "heterocache", "turn_tokens": 1024, "prefill_s_per_token": 0.002,
             "chunked_s_per_token": 0.003, "per_token_s_per_token": None}]
    table = bench_extend.results_table(rows).splitlines()
    # ms per token, chunked / prefill = 2.00 and per-token / chunked = 7.5; no per-token run -> dashes
    assert table[2].split("|")[1:-1] == [" 2,048 ", " full ", " 256 ", " 2.00 ", " 4.00 ", " 30.00 ", " 2.00 ", " 7.5 "]
    assert table[3].split("|")[1:-1] == [" 2,048 ", " heterocache ", " 1,024 ", " 2.00 ", " 3.00 ", " — ", " 1.50 ", " — "]


def test_make_policies_keeps_each_specs_options():
    """A grid entry's options reach the policy (``heterocache:copy_window=16`` once timed the default
    HeteroCache under the variant's label), and the synthetic profile replaces only HeteroCache's."""
    prof = bench_latency.synthetic_profile()
    combos = [("full", 1.0), ("heterocache", 0.3), ("heterocache:copy_window=16", 0.3), ("quest:offload=true", 0.2)]
    full, hc, hc_copy, quest = bench_latency.make_policies(combos, prof)
    assert type(full).__name__ == "FullKV"
    assert (hc.budget, hc.copy_window, hc_copy.budget, hc_copy.copy_window) == (0.3, 0, 0.3, 16)
    assert hc.profile is prof and hc_copy.profile is prof
    assert (type(quest).__name__, quest.offload, quest.budget) == ("Quest", True, 0.2)
    assert bench_latency.make_policies(combos[2:3])[0].copy_window == 16  # real weights: the shipped profile
