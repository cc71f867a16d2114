"""`bench/gpu_check.py --small`, the GPU session script's CPU dry run (Pallas kernels
interpreted), runs every section end to end and reports every check passed."""

from __future__ import annotations

import pytest

from tests.bench_runner import run_bench


@pytest.mark.slow
def test_gpu_check_dry_run():
    report = run_bench("gpu_check.py", "--small")
    assert report["ok"] and report["failures"] == [], report["failures"]
    assert set(report["seconds"]) == {"block", "kernels", "ragged_exchange", "attention"}
    for impl in ("ragged_dot", "tiled", "pallas"):
        assert f"softmax_top2/{impl}" in report["max_rel_error"]
        for dtype in ("float32", "bfloat16"):
            assert f"{impl}/{dtype}" in report["kernels"]["correctness"]
        assert any(key.endswith(f"/{impl}_tflops") for key in report["kernels"]["tflops"])
    assert set(report["kernels"]["fused_correctness"]) == {
        f"{op}/{dtype}" for op in ("gather_gmm", "gmm_scatter") for dtype in ("float32", "bfloat16")
    }
    assert any(key.endswith("pallas_fused_overhead") for key in report["kernels"]["permutation"])
