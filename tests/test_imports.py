"""The package's import structure: no circle, and validation that imports no jax.

`moe_jax.config` checks layout, GPU and kernel names against jax-free tables
(`moe_jax.names`, `moe_jax.kernels.requirements`); the tests here keep those tables
equal to what they stand for, and prove that loading and validating a config, and
refusing a bad one on the command line, import neither jax nor flax.
"""

from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys
import textwrap

import pytest

from moe_jax import names
from moe_jax.kernels import attention, requirements
from moe_jax.parallel import registry
from moe_jax.plan import hardware

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = REPO_ROOT / "moe_jax"
HEAVY = ("jax", "flax", "moe_jax.parallel.registry")


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _packages_above(name: str) -> set[str]:
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def import_graph() -> dict[str, set[str]]:
    """moe_jax module -> the moe_jax modules it imports, at module or function level.

    Importing `a.b.c` runs `a/__init__.py` and `a/b/__init__.py` too, so those count as
    imported; a module's own enclosing packages do not (they are set up before it)."""
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                found = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in paths else base
                    for alias in node.names
                ]
            else:
                continue
            for target in found:
                while target and target not in paths:  # `moe_jax.x.name` -> `moe_jax.x`
                    target = target.rpartition(".")[0]
                if target:
                    targets |= {target} | _packages_above(target)
        graph[name] = targets - {name} - _packages_above(name)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as [a, b, ..., a], or None when the graph is acyclic."""
    done: set[str] = set()
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        path.append(node)
        for nxt in sorted(graph[node]):
            if nxt in path:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in done:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        done.add(node)
        return None

    for start in sorted(graph):
        if start not in done:
            cycle = visit(start)
            if cycle:
                return cycle
    return None


def test_find_cycle_finds_a_planted_circle():
    """The walk would see a circle (hand-made graphs), so the real test can fail."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_import_graph_sees_function_level_and_package_imports():
    """The walk reads imports inside functions (train.py's slow ones) and counts the
    packages a submodule import runs."""
    graph = import_graph()
    assert "moe_jax.trainer" in graph["moe_jax.train"]  # imported inside _main
    assert {"moe_jax.parallel", "moe_jax.parallel.registry"} <= graph["moe_jax.plan.resolve"]


def test_no_import_circle_in_the_package():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


PIPELINE_FIELDS = {"pipeline_run", "pipelined", "stages", "microbatches", "repeats", "per_device"}


def _attributes_read(path: pathlib.Path) -> set[str]:
    return {n.attr for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Attribute)}


def test_model_code_reads_no_pipeline_setting():
    """The pipeline is applied to a finished model (`parallel.pipeline.hold`) and the
    step's per-device form set on it from outside (`parallel.per_device_step`): no
    module of `moe_jax/model/` or `moe_jax/moe/` reads a pipeline field or imports the
    pipeline. The check itself sees such a read (`parallel/pipeline.py` has some)."""
    assert PIPELINE_FIELDS & _attributes_read(PACKAGE / "parallel" / "pipeline.py")
    graph = import_graph()
    for folder in ("model", "moe"):
        for path in sorted((PACKAGE / folder).glob("*.py")):
            read = PIPELINE_FIELDS & _attributes_read(path)
            assert not read, f"{path.relative_to(REPO_ROOT)} reads {sorted(read)}"
            assert "moe_jax.parallel.pipeline" not in graph[_module_name(path)], path


def test_no_module_over_500_lines():
    """Small modules with one job: none of the package's over 500 lines."""
    long = {
        str(p.relative_to(REPO_ROOT)): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 500
    }
    assert not long, long


def test_name_tables_equal_their_owners():
    """The jax-free tables the config checks against list exactly the registry's
    layouts, the planner's GPU presets and the attention functions, in their order."""
    assert tuple(registry.ATTENTION) == names.ATTENTION_LAYOUTS
    assert tuple(registry.EXPERTS) == names.EXPERT_LAYOUTS
    assert tuple(hardware.GPUS) == names.GPU_PRESETS
    assert ("auto", *attention.FUNCTIONS) == requirements.ATTENTION_IMPLS


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO_ROOT,
        env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_config_loads_and_validates_without_jax():
    """configs/default.py with overrides (a layout, a GPU preset, an attention kernel)
    loads and validates, and a bad setting is refused, with no jax, flax or layout
    registry imported; the scope table and the collectives reader are jax-free too."""
    result = _run(
        f"""
        import json, runpy, sys
        import moe_jax.config as c
        raw = runpy.run_path("configs/default.py")["get_config"]()
        raw.parallel.attention, raw.parallel.experts, raw.parallel.gpu = "tp", "ep_ag", "H100"
        raw.model.attention_impl, raw.moe.impl = "blockwise", "ragged_dot"
        config = c.load(raw)
        try:
            c.load({{"parallel": {{"experts": "ep_nope"}}}})
            refused = None
        except ValueError as error:
            refused = str(error)
        import moe_jax.parallel.scopes, moe_jax.tools.hlo_collectives
        print(json.dumps({{
            "experts": config.parallel.experts,
            "refused": refused,
            "loaded": [m for m in {HEAVY!r} if m in sys.modules],
        }}))
        """
    )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["experts"] == "ep_ag"
    assert out["refused"].startswith("parallel.experts='ep_nope' is invalid: valid: ("), out
    assert out["loaded"] == [], out


@pytest.mark.parametrize(
    "command, argv, refusal",
    [
        ("moe_jax.train", ["--config.moe.top_k=99"], "error: moe.top_k=99 is invalid"),
        (
            "moe_jax.train",
            ["--config.train.learning_rate=inf"],
            "error: train.learning_rate=inf is invalid: must be finite",
        ),
        (
            "moe_jax.convert.__main__",
            ["export", "--hf=x", "--workdir=y", "--config.moe.top_k=99"],
            "error: moe.top_k=99 is invalid",
        ),
    ],
)
def test_command_line_refuses_a_bad_setting_before_importing_jax(command, argv, refusal):
    """A command given a bad setting stops with one `error:` line before jax or flax is
    imported (its `main`, run as `python -m` runs it, in a process that then reports
    what it imported)."""
    result = _run(
        f"""
        import importlib, json, sys
        sys.argv = ["{command}", *{argv!r}]
        from absl import app
        from moe_jax import cli
        module = importlib.import_module("{command}")
        try:
            app.run(module.main, flags_parser=cli.parse)
        except SystemExit as stop:
            message = str(stop.code)
        print(json.dumps([message, [m for m in {HEAVY!r} if m in sys.modules]]))
        """
    )
    assert result.returncode == 0, result.stderr
    message, loaded = json.loads(result.stdout)
    assert message.startswith(refusal), message
    assert loaded == [], loaded
