"""benchmarks/profile_step.py: kernels summed per step by name and kind (hand-made trace events)."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import profile_step as PS  # noqa: E402


@pytest.mark.parametrize("name,kind", [
    ("pool_attention", "attention (Pallas/Triton)"), ("gemm_fusion_dot_34", "matmul"),
    ("MemcpyH2D", "copy"), ("input_reduce_fusion_97", "reduction/sort"), ("loop_add_fusion_62", "fusion"),
    ("void cub::detail::radix_sort::DeviceRadixSortOnesweepKernel", "reduction/sort"), ("nccl_kernel", "other"),
])
def test_kernel_kinds(name, kind):
    assert PS.kind_of(name) == kind


def test_summarise_sums_per_step_over_lines():
    lines = {"Stream #14": [("gemm_fusion_dot_1", 30_000), ("loop_add_fusion", 2_000), ("gemm_fusion_dot_1", 30_000)],
             "Stream #15(MemcpyH2D)": [("MemcpyH2D", 8_000)]}
    got = PS.summarise(lines, n_steps=2, top=2)
    assert got["busy_ms_per_step"] == pytest.approx((60_000 + 2_000 + 8_000) / 1e6 / 2)
    assert got["events_per_step"] == 2.0
    assert got["by_kind"]["matmul"] == {"kernels_per_step": 1.0, "ms_per_step": pytest.approx(0.03)}
    assert got["by_kind"]["copy"]["ms_per_step"] == pytest.approx(0.004)
    assert [t["name"] for t in got["top"]] == ["gemm_fusion_dot_1", "MemcpyH2D"]
    assert got["top"][0]["us_per_call"] == pytest.approx(30.0)
    assert got["lines"] == {"Stream #14": 3, "Stream #15(MemcpyH2D)": 1}
