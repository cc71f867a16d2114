"""The layout registry: the one place that knows a layout by its name.

* `moe_jax.parallel` imports nothing from `moe_jax.plan` (checked in a process where
  importing `moe_jax.plan` fails);
* no module of the planner, the tools or the config compares layout names;
* a new layout is one new spec: registered under a new name (and listed in the
  config's jax-free `moe_jax.names`), a copy of an existing spec is accepted by the
  config, checked, planned, modelled and run like the original.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax import names
from moe_jax.config import load, to_config_dict
from moe_jax.moe.block import moe_forward
from moe_jax.parallel import mesh as mesh_lib
from moe_jax.parallel import registry
from moe_jax.plan import comm_volume, memory, param_traffic, planner
from moe_jax.plan.resolve import check_plan
from tests.layouts import BASE, with_plan
from tests.test_capacity_layouts import _params

ROOT = Path(__file__).resolve().parents[1]


def test_parallel_imports_nothing_from_plan():
    script = textwrap.dedent(
        """
        import importlib, pkgutil, sys

        class BlockPlan:
            def find_spec(self, name, path=None, target=None):
                if name == "moe_jax.plan" or name.startswith("moe_jax.plan."):
                    raise ImportError(f"{name} imported")
                return None

        sys.meta_path.insert(0, BlockPlan())
        import moe_jax.parallel
        for module in pkgutil.walk_packages(moe_jax.parallel.__path__, "moe_jax.parallel."):
            importlib.import_module(module.name)
        import jax
        from moe_jax.config import Config, ParallelConfig
        from moe_jax.parallel import mesh
        n = jax.device_count()
        config = Config(parallel=ParallelConfig(attention="sp", experts="ep_a2a", intra=n, data=1))
        mesh.make_layout(config, mesh.make_mesh(config))
        assert not any(m.startswith("moe_jax.plan") for m in sys.modules)
        print("ok")
        """
    )
    run = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]


def test_no_layout_name_comparisons_outside_the_registry():
    layouts = "|".join(map(re.escape, [*registry.ATTENTION, *registry.EXPERTS]))
    patterns = [
        rf'[=!]=\s*"({layouts})"',  # == "sp"
        rf'"({layouts})"\s*[=!]=',
        rf'\bin\s*[(\[{{]\s*"({layouts})"\s*,',  # in ("tp", ...)
        rf'[{{,]\s*"({layouts})"\s*:',  # {"tp": ...}
    ]
    files = [*sorted((ROOT / "moe_jax/plan").glob("*.py"))]
    files += [*sorted((ROOT / "moe_jax/tools").glob("*.py")), ROOT / "moe_jax/config.py"]
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in files
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if any(re.search(p, line) for p in patterns)
    ]
    assert not found, found


@pytest.fixture
def copied_layout(monkeypatch):
    """`ep_a2a` registered once more, as `my_a2a`: one new spec and its name in the
    config's jax-free table (`moe_jax.names`, kept equal to the registry by a test),
    nothing else."""
    spec = dataclasses.replace(registry.EXPERTS["ep_a2a"], name="my_a2a")
    monkeypatch.setitem(registry.EXPERTS, "my_a2a", spec)
    monkeypatch.setattr(names, "EXPERT_LAYOUTS", (*names.EXPERT_LAYOUTS, "my_a2a"))
    return spec


def test_a_new_spec_is_all_a_layout_needs(copied_layout):
    raw = to_config_dict(with_plan("sp", 2, 4, "ep_a2a")).to_dict()
    original = check_plan(load(raw), 8)
    raw["parallel"]["experts"] = "my_a2a"
    copy = check_plan(load(raw), 8)  # validated by the config, checked by its spec
    assert comm_volume.activation_bytes(copy) == comm_volume.activation_bytes(original)
    assert memory.memory_per_device(copy) == memory.memory_per_device(original)
    assert param_traffic.gradient_bytes_per_step(copy) == param_traffic.gradient_bytes_per_step(
        original
    )
    ranked = planner.rank(BASE, 8, "h800", experts=("my_a2a", "ep_a2a"), intra=(4,), pp=1)
    steps = {
        c.plan.parallel.experts: c.cost.step_s
        for c in ranked.candidates
        if c.plan.parallel.attention == "sp"
    }
    assert steps["my_a2a"] == steps["ep_a2a"]
    layouts = [mesh_lib.make_layout(c, mesh_lib.make_mesh(c)) for c in (original, copy)]
    x = jax.random.normal(jax.random.key(0), (8, 16, 32))
    y = [jax.jit(lambda x, p, lay=lay: lay.moe(moe_forward, x, p, BASE.moe)[0]) for lay in layouts]
    params = _params()
    np.testing.assert_array_equal(y[0](x, params), y[1](x, params))
    assert jnp.abs(y[0](x, params)).max() > 0
