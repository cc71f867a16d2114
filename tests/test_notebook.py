"""The notebooks are committed clean and run top to bottom: quickstart.ipynb trains and
samples; overlap.ipynb reads the chunked exchange out of compiled programs.

The execution test starts a real Jupyter kernel with nbclient. The kernel is pinned to the
interpreter running the tests (a `python3` kernelspec written into a temporary JUPYTER_PATH),
so a `python3` kernelspec of some other installation can never run the notebook.
"""

from __future__ import annotations

import json
import pathlib
import sys
import time

import nbformat
import pytest

from tests.commands import COMPILE_FLAGS, subprocess_env

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "quickstart.ipynb"
OVERLAP = ROOT / "notebooks" / "overlap.ipynb"
FINETUNE = ROOT / "notebooks" / "finetune.ipynb"
RESULT_MARKER = "NOTEBOOK_RESULT "

# Appended to the in-memory copy only: reports what the notebook computed.
_REPORT_CELL = f"""
import json as _json, sys as _sys
print({RESULT_MARKER!r} + _json.dumps({{
    "executable": _sys.executable,
    "first_train_loss": losses[0],
    "initial_val_loss": initial_val_loss,
    "final_val_loss": final_val_loss,
    "greedy": greedy,
    "samples": samples,
}}))
"""


@pytest.mark.parametrize("path", [NOTEBOOK, OVERLAP, FINETUNE], ids=lambda p: p.name)
def test_committed_notebook_has_no_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    code_cells = [c for c in nb.cells if c.cell_type == "code"]
    assert code_cells
    dirty = [
        i
        for i, cell in enumerate(nb.cells)
        if cell.cell_type == "code" and (cell.outputs or cell.execution_count is not None)
    ]
    assert not dirty, f"cells {dirty} carry outputs or execution counts; clear them before commit"


def _python3_kernelspec(tmp_path: pathlib.Path) -> pathlib.Path:
    """A JUPYTER_PATH directory whose `python3` kernel runs sys.executable."""
    from ipykernel.kernelspec import install

    prefix = tmp_path / "jupyter-prefix"
    install(kernel_name="python3", prefix=str(prefix))
    data_dir = prefix / "share" / "jupyter"
    spec = json.loads((data_dir / "kernels" / "python3" / "kernel.json").read_text())
    assert spec["argv"][0] == sys.executable, spec["argv"]
    return data_dir


def _execute(
    path: pathlib.Path,
    report_cell: str,
    tmp_path,
    monkeypatch,
    xla_flags: str = "",
    shorter: dict[str, str] | None = None,
    **env,
):
    """The notebook with `report_cell` appended, run in a real kernel as a newcomer would
    (the single real CPU device, not the 8 forced host devices of tests/conftest.py;
    `xla_flags` none by default, as a newcomer has them): the executed notebook and what
    the report cell printed. `shorter`: text of the notebook's cells replaced in the
    copy run (each must be found), to run fewer steps of the same code."""
    from jupyter_client.kernelspec import KernelSpecManager
    from nbclient import NotebookClient

    monkeypatch.setenv("JUPYTER_PATH", str(_python3_kernelspec(tmp_path)))
    resolved = KernelSpecManager().get_kernel_spec("python3")
    assert resolved.argv[0] == sys.executable, resolved.argv

    nb = nbformat.read(path, as_version=4)
    for old, new in (shorter or {}).items():
        cells = [c for c in nb.cells if c.cell_type == "code" and old in c.source]
        assert cells, f"{path.name} no longer has {old!r}"
        for cell in cells:
            cell.source = cell.source.replace(old, new)
    nb.cells.append(nbformat.v4.new_code_cell(report_cell))
    env = subprocess_env(
        JAX_PLATFORMS="cpu", IPYTHONDIR=str(tmp_path / "ipython"), XLA_FLAGS=xla_flags, **env
    )
    client = NotebookClient(
        nb,
        timeout=600,
        kernel_name="python3",
        resources={"metadata": {"path": str(ROOT)}},
    )
    start = time.perf_counter()
    client.execute(env=env)  # raises CellExecutionError on the first failing cell
    print(f"{path.name} executed in {time.perf_counter() - start:.1f} s")
    errors = [
        (i, out.get("ename"), out.get("evalue"))
        for i, cell in enumerate(nb.cells)
        if cell.cell_type == "code"
        for out in cell.outputs
        if out.output_type == "error"
    ]
    assert not errors, errors
    report = "".join(
        out.get("text", "") for out in nb.cells[-1].outputs if out.output_type == "stream"
    )
    assert RESULT_MARKER in report, report
    return nb, json.loads(report.split(RESULT_MARKER, 1)[1])


def _images(nb) -> int:
    return sum(
        "image/png" in out.get("data", {})
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.outputs
    )


# The quickstart's code with a third of its steps and sampled bytes (the default config's
# full run is conftest's `default_run`): what the test checks holds at 50 steps already.
QUICKSTART_SHORTER = {
    "config_dict.train.steps = 150": "config_dict.train.steps = 50",
    'state, "def ", steps=150, temperature=0)': 'state, "def ", steps=50, temperature=0)',
    'state, "def ", steps=200, temperature=1.0': 'state, "def ", steps=60, temperature=1.0',
}


@pytest.mark.slow
def test_quickstart_notebook_executes(tmp_path, monkeypatch):
    nb, result = _execute(NOTEBOOK, _REPORT_CELL, tmp_path, monkeypatch, shorter=QUICKSTART_SHORTER)
    print(json.dumps(result, indent=1))

    assert result["executable"] == sys.executable
    assert result["final_val_loss"] < result["initial_val_loss"], result
    assert result["final_val_loss"] < result["first_train_loss"], result
    texts = [result["greedy"], *result["samples"]]
    assert all(isinstance(text, str) and text for text in texts), texts
    # Each text is the prompt plus its continuation (cut short only at end-of-text).
    assert all(text.startswith("def ") for text in texts), texts
    assert any(len(text) > len("def ") for text in texts), texts

    assert _images(nb) >= 2  # the plots rendered inline as images


_OVERLAP_REPORT = f"""
import json as _json
print({RESULT_MARKER!r} + _json.dumps({{
    "bytes": forward_bytes, "steps": steps_seen, "step_s": step_s, "ring_kinds": sorted(ring_kinds),
}}))
"""


def test_overlap_notebook_executes(tmp_path, monkeypatch):
    """At the tests' compile level (`COMPILE_FLAGS`): the notebook reads programs, never
    speed, and the level changes no HLO pass; the quickstart trains at XLA's own."""
    nb, result = _execute(OVERLAP, _OVERLAP_REPORT, tmp_path, monkeypatch, xla_flags=COMPILE_FLAGS)
    moved, steps = result["bytes"], result["steps"]
    for experts in ("ep_ag", "ep_a2a"):
        assert moved[f"dp+{experts} C=4"] == moved[f"dp+{experts} C=1"]
        assert steps[f"dp+{experts} C=4"] == ["c0", "c1", "c2", "c3"]
    assert moved["tp+ep_ag C=1 +cm"] == moved["tp+ep_ag C=1"]  # the rings move the same bytes
    assert steps["tp+ep_ag C=1 +cm"] == [f"r{i}" for i in range(8)]
    assert result["ring_kinds"] == ["collective-permute"]
    best, megatron = result["step_s"].values()
    assert best["none"] > best["chunked C=2"] > best["chunked C=4"]
    assert megatron["none"] > megatron["collective_matmul"]  # only rings hide tp's exchanges
    assert megatron["chunked C=4"] > megatron["both C=4"]
    assert _images(nb) == 3


_FINETUNE_REPORT = f"""
import json as _json
print({RESULT_MARKER!r} + _json.dumps({{
    "import_diff": import_diff, "export_diff": export_diff, "losses": losses,
    "samples": samples, "step": step,
}}))
"""


@pytest.mark.skipif(not (ROOT / ".venv-hf").exists(), reason="needs .venv-hf (make test)")
def test_finetune_notebook_executes(tmp_path, monkeypatch):
    """Build with transformers, import, same logits, fine-tune, sample, export, and
    transformers gives the fine-tuned model's logits."""
    hf_python = str(ROOT / ".venv-hf" / "bin" / "python")
    _, result = _execute(  # 8 steps: compile-bound, so at the tests' level
        FINETUNE,
        _FINETUNE_REPORT,
        tmp_path,
        monkeypatch,
        MOE_JAX_HF_PYTHON=hf_python,
        xla_flags=COMPILE_FLAGS,
    )
    assert result["import_diff"] < 1e-4 and result["export_diff"] < 1e-4, result
    losses = result["losses"]
    assert len(losses) == 8 and losses[-1] < losses[0], losses
    assert result["step"] == 8
    assert all(text.startswith("def ") for text in result["samples"]), result["samples"]
