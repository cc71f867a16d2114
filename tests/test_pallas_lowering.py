"""Every Pallas kernel entry point lowered for an H100 on this CPU-only machine, through
the Triton path (not interpret mode), so an error that only the GPU compile would hit
is caught here: a block shape Triton cannot build, a kernel that picked interpret mode
from the default backend, a Triton module its verifier rejects, a dot under Triton's
16-wide minimum.

No GPU is needed: jax lowers for an abstract device (`jax.sharding.AbstractDevice`,
whose kind gives the Triton lowering its compute capability) with
`lowering_platforms=("cuda",)`. Nothing is compiled or run.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir
from jax._src.lib.triton import dialect as tt_dialect

from moe_jax.kernels import pallas_gmm
from moe_jax.kernels.routed_gmm import gather_gmm, gmm_scatter

TRITON_CALL = "__gpu$xla.gpu.triton"
H100 = jax.sharding.AbstractDevice(
    device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu"
)
TOKENS, D, F, E = 150, 136, 200, 6  # d, f not multiples of the blocks: edges are masked
ROWS = 2 * TOKENS  # top-2
# jax 0.12 deprecates Pallas's Triton backend (docs/kernels-and-benchmarks.md says why
# the kernels stay on it); the warning is known, and noise here.
pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend:DeprecationWarning")
DOT = re.compile(r"tt\.dot .*: tensor<(\d+)x(\d+)x\w+> \* tensor<(\d+)x(\d+)x\w+>")


def _spec(shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype)


def _vjp(f, n_args: int):
    """(args..., cotangent) -> (value, gradients of the first `n_args` args)."""

    def fn(*args):
        out, pull = jax.vjp(lambda *a: f(*a, *args[n_args:-1]), *args[:n_args])
        return out, *pull(args[-1])

    return fn


def entry_points(dtype, blocks: pallas_gmm.Blocks | None = None) -> dict:
    """name -> (function, abstract arguments, Pallas calls it makes): the three grouped
    GEMMs and both fused ops, forward and backward."""
    sizes, token, weight = _spec((E,), jnp.int32), _spec((ROWS,), jnp.int32), _spec((ROWS,))
    x, rows = _spec((TOKENS, D), dtype), _spec((ROWS, D), dtype)
    w_up, w_down = _spec((E, D, F), dtype), _spec((E, F, D), dtype)
    h, dy = _spec((ROWS, F), dtype), _spec((ROWS, F), dtype)
    gmm, wgrad = pallas_gmm.grouped_matmul, pallas_gmm.transposed_grouped_matmul
    return {
        "forward": (lambda x, w, s: gmm(x, w, s, blocks=blocks), (rows, w_up, sizes), 1),
        "input_gradient": (
            lambda dy, w, s: gmm(dy, w, s, transpose_rhs=True, blocks=blocks),
            (dy, w_up, sizes),
            1,
        ),
        "weight_gradient": (
            lambda x, dy, s: wgrad(x, dy, s, rows=ROWS, blocks=blocks),
            (rows, dy, sizes),
            1,
        ),
        "gather_gmm": (_vjp(gather_gmm, 2), (x, w_up, token, sizes, dy), 3),
        "gmm_scatter": (
            _vjp(lambda h, w, c, t, s: gmm_scatter(h, w, t, c, s, TOKENS), 3),
            (h, w_down, weight, token, sizes, _spec((TOKENS, D), dtype)),
            3,
        ),
    }


def lower_for_h100(fn, args) -> ir.Module:
    """StableHLO of `fn` on `args` as it would be built for one H100."""
    mesh = jax.sharding.AbstractMesh((), (), abstract_device=H100)
    with jax.sharding.use_abstract_mesh(mesh):
        lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    return lowered.compiler_ir("stablehlo")


def custom_calls(op: ir.Operation) -> list[ir.Operation]:
    found = []
    for region in op.regions:
        for block in region:
            for inner in block.operations:
                if inner.name == "stablehlo.custom_call":
                    found.append(inner)
                found += custom_calls(inner)
    return found


def triton_kernels(module: ir.Module) -> list[str]:
    """The Triton modules of the program's Triton calls, each checked by the Triton
    dialect's verifier (what XLA would hand to Triton on the GPU)."""
    texts = []
    for call in custom_calls(module.operation):
        if ir.StringAttr(call.attributes["call_target_name"]).value != TRITON_CALL:
            continue
        config = call.attributes["mhlo.backend_config"]
        context = mlir.make_ir_context()
        tt_dialect.register_dialect(context)
        with context:
            kernel = ir.Module.parse(ir.StringAttr(config["ir"]).value_bytes)
            assert kernel.operation.verify()
            texts.append(str(kernel))
    return texts


def small_dots(kernel: str) -> list[str]:
    """Dots with a dimension under 16, which Triton cannot compile."""
    return [m.group(0) for m in DOT.finditer(kernel) if min(map(int, m.groups())) < 16]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", list(entry_points(jnp.float32)))
def test_every_kernel_lowers_for_triton_on_an_h100(name, dtype):
    fn, args, calls = entry_points(dtype)[name]
    module = lower_for_h100(fn, args)
    kernels = triton_kernels(module)
    assert len(kernels) == calls, f"{name}: {len(kernels)} Triton calls, expected {calls}"
    assert "tt.dot" in "".join(kernels)
    assert [dot for kernel in kernels for dot in small_dots(kernel)] == []
    # Lowered for CPU, the same function has no Triton call (the kernels run interpreted).
    cpu = jax.jit(fn).trace(*args).lower(lowering_platforms=("cpu",)).as_text()
    assert TRITON_CALL not in cpu


def test_the_gpu_tiles_are_the_ones_lowered():
    """The kernels take the GPU tiles for a GPU target, whatever this process runs on."""
    fn, args, _ = entry_points(jnp.bfloat16)["forward"]
    (kernel,) = triton_kernels(lower_for_h100(fn, args))
    m, k = pallas_gmm.GPU_BLOCKS.m, pallas_gmm.GPU_BLOCKS.k
    assert f"tensor<{m}x{k}xbf16>" in kernel
    assert pallas_gmm.default_blocks("cuda") == pallas_gmm.GPU_BLOCKS


def test_a_broken_block_shape_fails_the_check():
    """The checks above can fail: rows per block that Triton cannot build (not a power
    of two) stop the lowering, and 8-row blocks make a dot Triton cannot compile."""
    fn, args, _ = entry_points(jnp.bfloat16, pallas_gmm.Blocks(m=48))["forward"]
    with pytest.raises(ValueError, match="power of 2"):
        lower_for_h100(fn, args)
    fn, args, _ = entry_points(jnp.bfloat16, pallas_gmm.Blocks(m=8))["forward"]
    (kernel,) = triton_kernels(lower_for_h100(fn, args))
    assert small_dots(kernel)


def test_the_lowered_functions_run_interpreted_on_cpu():
    """The same entry points, run here, give numbers (the CPU branch is the one run)."""
    fn, args, _ = entry_points(jnp.float32)["forward"]
    x, w, _ = (jnp.ones(a.shape, a.dtype) for a in args)
    sizes = jnp.asarray([ROWS - 5, 0, 1, 2, 2, 0], jnp.int32)
    out = jax.jit(fn)(x, w, sizes)
    np.testing.assert_allclose(np.asarray(out), D, rtol=1e-5)
