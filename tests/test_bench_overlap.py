"""`bench/gpu_overlap.py --small`, the GPU schedule check's CPU dry run, runs end to end
and finds every chunk's exchanges and every ring step's in the compiled program."""

from __future__ import annotations

from tests.bench_runner import run_bench


def test_gpu_overlap_dry_run():
    report = run_bench("gpu_overlap.py", "--small")
    assert report["ok"] and report["runs_on"] == "cpu"
    for experts in ("ep_ag", "ep_a2a"):
        one = report["schedule"][f"dp+{experts}/C1"]["exchanges"]
        for chunks in (2, 4):
            counts = report["schedule"][f"dp+{experts}/C{chunks}"]["exchanges"]
            assert counts == {f"moe/c{c}": one["moe/-"] for c in range(chunks)}
    plain = report["schedule"]["tp+ep_ag/C1"]["exchanges"]
    ring = report["schedule"]["tp+ep_ag/C1+cm"]["exchanges"]
    assert set(plain) == {"attention/-", "moe/-"}  # all-gathers and reduce-scatters
    assert {w.split("/")[0] for w in ring} == {"attention", "moe"}
    assert {w.split("/")[1] for w in ring} == {f"r{i}" for i in range(8)}  # ring steps only
    assert set(report["pieces"]) == {"C2", "C4", "ring8"}
