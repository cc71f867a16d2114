"""notebooks/quickstart.ipynb is committed clean and runs top to bottom.

The execution test starts a real Jupyter kernel with nbclient. The kernel is pinned to the
interpreter running the tests (a `python3` kernelspec written into a temporary JUPYTER_PATH),
so a `python3` kernelspec of some other installation can never run the notebook.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time

import nbformat
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "quickstart.ipynb"
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


def test_committed_notebook_has_no_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
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


@pytest.mark.slow
def test_quickstart_notebook_executes(tmp_path, monkeypatch):
    from jupyter_client.kernelspec import KernelSpecManager
    from nbclient import NotebookClient

    monkeypatch.setenv("JUPYTER_PATH", str(_python3_kernelspec(tmp_path)))
    resolved = KernelSpecManager().get_kernel_spec("python3")
    assert resolved.argv[0] == sys.executable, resolved.argv

    nb = nbformat.read(NOTEBOOK, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(_REPORT_CELL))
    # The kernel runs as a newcomer's would: the single real CPU device, not the 8 forced
    # host devices of tests/conftest.py; IPython's profile goes to the temporary directory.
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", IPYTHONDIR=str(tmp_path / "ipython"))
    client = NotebookClient(
        nb,
        timeout=600,
        kernel_name="python3",
        resources={"metadata": {"path": str(ROOT)}},
    )
    start = time.perf_counter()
    client.execute(env=env)  # raises CellExecutionError on the first failing cell
    print(f"quickstart notebook executed in {time.perf_counter() - start:.1f} s")

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
    result = json.loads(report.split(RESULT_MARKER, 1)[1])
    print(json.dumps(result, indent=1))

    assert result["executable"] == sys.executable
    assert result["final_val_loss"] < result["initial_val_loss"], result
    assert result["final_val_loss"] < result["first_train_loss"], result
    texts = [result["greedy"], *result["samples"]]
    assert all(isinstance(text, str) and text for text in texts), texts
    # Each text is the prompt plus its continuation (cut short only at end-of-text).
    assert all(text.startswith("def ") for text in texts), texts
    assert any(len(text) > len("def ") for text in texts), texts

    # The plots rendered inline as images.
    images = sum(
        "image/png" in out.get("data", {})
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.outputs
    )
    assert images >= 2, images
