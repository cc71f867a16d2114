"""`bench/data.py --small --json` runs end to end: prepare's MB/s for bytes and a BPE at 1
and 2 workers beside `tokenizers`' own speed, and the loader's tokens/s."""

from __future__ import annotations

from tests.bench_runner import run_bench


def test_data_bench_small():
    report = run_bench("data.py", "--small", "--json")
    rates = report["prepare_mb_per_s"]
    assert set(rates) == {f"{t}_workers{w}" for t in ("byte", "bpe") for w in (1, 2)}
    assert all(rate > 0 for rate in rates.values()) and report["text_mb"] > 0.9
    assert report["tokenizers_encode_batch_mb_per_s"] > 0
    # 20 batches of 16 x 128 served well under a second each, whatever the machine
    assert report["loader_tokens_per_s"] > 2048
    assert report["default_run_tokens_per_s"] is None and report["loader_over_run"] is None
