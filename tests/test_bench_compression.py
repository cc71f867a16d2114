"""`bench/compression_errors.py --small` runs end to end on a (briefly) trained model's tensors
and shows what the compressed exchanges are for: scaled FP8 within E4M3's error, an
unscaled FP8 cotangent lost, and one bf16 rounding (all-to-all, float32 sum) well under
a ring's rounding at every hop."""

from __future__ import annotations

from tests.bench_runner import run_bench


def test_compression_dry_run():
    report = run_bench("compression_errors.py", "--small")
    forward, backward = report["forward_payload"], report["backward_cotangent"]
    assert 0.01 < forward["fp8_1x128_scaled"] < 0.035  # E4M3: 3 mantissa bits
    assert forward["bf16"] < 0.004 and backward["bf16"] < 0.004
    assert backward["fp8_unscaled"] > 0.5  # gradients underflow E4M3 without a scale
    assert backward["fp8_1x128_scaled"] < 0.035
    assert report["a2a_over_ring"] < 0.5  # the point of the all-to-all + float32 sum
