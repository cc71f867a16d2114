"""Kernel-level checks of the grouped GEMMs (sections `kernel_correctness`,
`gemm_timing` and `permutation_timing` of `gpu_check.py`).

Each implementation's grouped matmul [M, d] x [E, d, f] -> [M, f] (rows sorted by
expert, unpadded, `group_sizes` per expert) is run as one `jax.vjp`: the forward, the
input gradient and the weight gradient, three GEMMs of 2·M·d·f FLOPs each.

* Correctness: the three products on fresh random inputs against a float64 NumPy
  loop over groups, for group sizes 0, 1, block-1, block, block+1, one group holding
  every row and a skewed split (block: the Pallas kernels' rows per block); and the
  fused-permutation ops (`kernels/routed_gmm.py`) against float64 dispatch -> GEMM ->
  combine, gradients included.
* Speed: TFLOP/s of the three GEMMs per implementation at Mixtral-8x7B, DeepSeek-MoE
  and the paper's 352B shapes, M = tokens·top_k ≈ 32k rows, balanced and skewed (Zipf)
  group sizes, bfloat16, against a dense bfloat16 matmul of the same FLOPs timed in
  the same run. `tiled` includes the copy into and out of its tile-padded layout.
* Permutation: dispatch (gather into the sorted layout) and combine (weighted
  gather back), in bytes moved per second against the device's copy bandwidth
  (an elementwise x*2 of a large array, bytes read + written per second); and the
  cost of fusing them into the Pallas kernels: gather_gmm / gmm_scatter against the
  same Pallas GEMMs on rows already permuted (no maps), as an overhead fraction.

On CPU (`--small`) the Pallas kernels run interpreted and the timings use one tiny
shape with DeepSeek-MoE's routing: a dry run of the code, not a measurement.
"""

from __future__ import annotations

import runpy
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import repo_root  # before moe_jax: this checkout on the path
from gpu_session import Section, raised
from timing import DoesNotFit, median_seconds

from moe_jax.config import MoEConfig
from moe_jax.kernels import pallas_gmm, requirements, tokamax_gmm
from moe_jax.kernels.grouped_matmul import ragged_gmm, tiled_gmm
from moe_jax.kernels.routed_gmm import gather_gmm, gmm_scatter
from moe_jax.moe import dispatch as dsp
from moe_jax.moe.routing import Routing

GPU = jax.default_backend() == "gpu"
ROWS = 32768  # M = tokens * top_k per GEMM on GPU; tokens = ROWS // top_k
SMALL_ROWS, SMALL_DIMS = 384, (64, 48)  # --small: M, and (hidden, width) for every shape
# Worst |error| / max |reference| per product. Triton's float32 dot may use TF32.
TOLERANCE = {"float32": 1e-4, "bfloat16": 1e-2}
PALLAS_F32_TOLERANCE = 2e-3
OPTIONAL = ("tokamax_mosaic",)  # an exception here is a note, not a failure
# Seconds one timing needs (compile, warm-up, repeats): checked against the budget.
GEMM_SECONDS = {"small": 1.0, "full": 10.0}
PERMUTATION_SECONDS = {"small": 3.0, "full": 20.0}


def model_shapes(small: bool = False) -> dict[str, tuple[int, int, int, int]]:
    """(hidden, expert width, experts, top_k) per model; the 352B from its config file's
    typed CONFIG (no ml_collections needed). `small`: DeepSeek-MoE's routing (64
    experts, top-6) at SMALL_DIMS."""
    if small:
        return {"deepseek_moe_16b": (*SMALL_DIMS, 64, 6)}
    paper = runpy.run_path(str(repo_root.ROOT / "configs" / "megascale_352b.py"))["CONFIG"]
    return {
        "mixtral_8x7b": (4096, 14336, 8, 2),
        "deepseek_moe_16b": (2048, 1408, 64, 6),
        "megascale_352b": (
            paper.model.embed_dim,
            paper.moe.expert_mlp_dim,
            paper.moe.num_experts,
            paper.moe.top_k,
        ),
    }


@jax.custom_vjp
def pallas_plain(x, w, group_sizes):
    """The Pallas grouped GEMM without row maps, differentiable (rows pre-permuted)."""
    return pallas_gmm.grouped_matmul(x, w, group_sizes)


def _plain_fwd(x, w, group_sizes):
    return pallas_plain(x, w, group_sizes), (x, w, group_sizes)


def _plain_bwd(residuals, dy):
    x, w, sizes = residuals
    dx = pallas_gmm.grouped_matmul(dy, w, sizes, transpose_rhs=True)
    dw = pallas_gmm.transposed_grouped_matmul(x, dy, sizes, rows=x.shape[0])
    return dx.astype(x.dtype), dw.astype(w.dtype), None


pallas_plain.defvjp(_plain_fwd, _plain_bwd)


def padded_tiled(x, w, group_sizes, tile: int):
    """`tiled_gmm` behind the unpadded contract: rows scattered into the tile-padded
    layout (each group rounded up to `tile` rows) and gathered back."""
    sizes = group_sizes.astype(jnp.int32)
    padded = (sizes + tile - 1) // tile * tile
    ends = jnp.cumsum(sizes)
    r = jnp.arange(x.shape[0], dtype=jnp.int32)
    g = jnp.minimum(jnp.searchsorted(ends, r, side="right"), sizes.shape[0] - 1)
    dest = (jnp.cumsum(padded) - padded)[g] + r - (ends - sizes)[g]
    num_rows = -(-(x.shape[0] + sizes.shape[0] * (tile - 1)) // tile) * tile
    rows = jnp.zeros((num_rows, x.shape[1]), x.dtype).at[dest].set(x, unique_indices=True)
    return tiled_gmm(rows, w, padded, tile)[dest]


def implementations(tile: int) -> tuple[dict, list[str]]:
    """name -> gmm(x, w, group_sizes), and notes on what is left out."""
    impls = {
        "ragged_dot": ragged_gmm,
        "tiled": partial(padded_tiled, tile=tile),
        "pallas": pallas_plain,
    }
    notes = []
    if tokamax_gmm.missing():
        notes.append(f"tokamax skipped: not installed ({requirements.TOKAMAX_INSTALL})")
    else:
        impls["tokamax"] = tokamax_gmm.tokamax_gmm  # tokamax's own choice per device
        if GPU:
            impls["tokamax_mosaic"] = partial(tokamax_gmm.tokamax_gmm, implementation="mosaic")
    return impls, notes


def three_gemms(gmm):
    """jit of (x, w, sizes, dy) -> (y, dx, dw): one vjp of the grouped matmul."""

    def fn(x, w, sizes, dy):
        y, pull = jax.vjp(lambda x, w: gmm(x, w, sizes), x, w)
        return (y, *pull(dy))

    return jax.jit(fn)


def _groups(sizes) -> list[slice]:
    ends = np.cumsum(sizes)
    return [slice(int(e - s), int(e)) for s, e in zip(sizes, ends, strict=True)]


def _rel(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def _random(rng, shape, dtype, scale=1.0):
    """Fresh normal values in `dtype`, and the same values (after rounding) in float64."""
    a = jnp.asarray(rng.normal(size=shape) * scale, dtype)
    return a, np.asarray(a, np.float64)


def size_cases(block: int, experts: int = 6) -> dict[str, list[int]]:
    """Group sizes over the same M rows (one compile per implementation and dtype)."""
    rows = 5 * block + 7
    edges = [0, 1, block - 1, block + 1, block]
    return {
        "edges_0_1_block-1_block+1_block": [*edges, rows - sum(edges)],
        "one_group_holds_all": [0, 0, rows, 0, 0, 0][:experts],
        "skewed": [rows - 13, 1, 2, 0, 7, 3],
    }


def check_products(ctx: Section) -> None:
    """Worst relative error per implementation and dtype over the size cases."""
    block = pallas_gmm.default_blocks().m
    d, f = (40, 24) if ctx.small else (136, 200)  # not multiples of the blocks: edges masked
    impls, notes = implementations(tile=16)
    for line in notes:
        ctx.note(line)
    for dtype in (jnp.float32, jnp.bfloat16):
        name = jnp.dtype(dtype).name
        for impl, gmm in impls.items():
            fn, worst = three_gemms(gmm), 0.0
            try:
                for seed, (case, sizes) in enumerate(size_cases(block).items()):
                    rng = np.random.default_rng(seed)
                    rows = sum(sizes)
                    x, x64 = _random(rng, (rows, d), dtype)
                    w, w64 = _random(rng, (len(sizes), d, f), dtype, d**-0.5)
                    dy, dy64 = _random(rng, (rows, f), dtype)
                    got = fn(x, w, jnp.asarray(sizes, jnp.int32), dy)
                    want = [np.zeros((rows, f)), np.zeros((rows, d)), np.zeros(w64.shape)]
                    for g, part in enumerate(_groups(sizes)):
                        want[0][part] = x64[part] @ w64[g]
                        want[1][part] = dy64[part] @ w64[g].T
                        want[2][g] = x64[part].T @ dy64[part]
                    err = max(_rel(a, b) for a, b in zip(got, want, strict=True))
                    tol = TOLERANCE[name]
                    tol = PALLAS_F32_TOLERANCE if impl == "pallas" and name == "float32" else tol
                    if not err <= tol:
                        ctx.fail(f"{impl}/{name}/{case}: {err:.2e} > {tol:.0e}")
                    worst = max(worst, err)
            except Exception as error:  # the other implementations still run
                if impl in OPTIONAL:
                    ctx.note(f"{impl}/{name} not run: {raised(error)}")
                else:
                    ctx.fail(f"{impl}/{name} {raised(error)}")
                continue
            ctx.record(f"{impl}/{name}", worst, "products")


def random_routing(rng, tokens: int, experts: int, top_k: int, skew: float = 0.0) -> Routing:
    """k distinct experts per token, drawn ∝ 1/(rank+1)^skew (0: uniform), and random
    positive combine weights."""
    logp = -skew * np.log(np.arange(1, experts + 1))
    keys = logp + rng.gumbel(size=(tokens, experts))  # Gumbel top-k: without replacement
    index = np.argsort(-keys, axis=1)[:, :top_k].astype(np.int32)
    weights = rng.uniform(0.1, 1.0, size=(tokens, top_k)).astype(np.float32)
    zeros = jnp.zeros((tokens, experts), jnp.float32)
    return Routing(
        expert_index=jnp.asarray(index),
        weights=jnp.asarray(weights),
        keep=jnp.ones((tokens, top_k), bool),
        logits=zeros,
        probs=zeros,
    )


def _fused_reference(x, w_up, h, w_down, c, dy, dout, token, sizes):
    """float64 dispatch -> per-group GEMM -> combine, and the gradients of each op."""
    tokens = x.shape[0]
    real = token < tokens
    src = np.where(real, token, 0)
    xs = np.where(real[:, None], x[src], 0.0)  # dispatch
    y, dxs, dw_up = np.zeros(dy.shape), np.zeros(xs.shape), np.zeros(w_up.shape)
    z, dh, dw_down = (
        np.zeros((h.shape[0], w_down.shape[2])),
        np.zeros(h.shape),
        np.zeros(w_down.shape),
    )
    g = np.where(real[:, None], dout[src], 0.0)  # the combine's cotangent, per row
    for e, part in enumerate(_groups(sizes)):
        y[part] = xs[part] @ w_up[e]
        dxs[part] = dy[part] @ w_up[e].T
        dw_up[e] = xs[part].T @ dy[part]
        z[part] = h[part] @ w_down[e]
        dh[part] = (c[part, None] * g[part]) @ w_down[e].T
        dw_down[e] = h[part].T @ (c[part, None] * g[part])
    dx, out = np.zeros(x.shape), np.zeros((tokens, w_down.shape[2]))
    np.add.at(dx, src[real], dxs[real])  # the dispatch's transpose
    np.add.at(out, src[real], (c[:, None] * z)[real])  # combine
    dc = np.sum(g * z, axis=-1)
    return (y, dx, dw_up), (out, dh, dw_down, dc)


def _fused_case(rng, dtype, tokens: int, d: int, f: int):
    """Both fused ops' (value, gradients) and their float64 references, top-2 of 6."""
    routing = random_routing(rng, tokens, 6, 2, skew=1.0)
    rows = dsp.sorted_layout(routing, 6)
    token, sizes = rows.source, rows.group_sizes
    m = token.shape[0]
    x, x64 = _random(rng, (tokens, d), dtype)
    w_up, w_up64 = _random(rng, (6, d, f), dtype, d**-0.5)
    h, h64 = _random(rng, (m, f), dtype)
    w_down, w_down64 = _random(rng, (6, f, d), dtype, f**-0.5)
    dy, dy64 = _random(rng, (m, f), dtype)
    dout, dout64 = _random(rng, (tokens, d), dtype)
    c = dsp.row_weights(rows, routing).astype(dtype)
    up = jax.vjp(lambda x, w: gather_gmm(x, w, token, sizes), x, w_up)
    down = jax.vjp(lambda h, w, c: gmm_scatter(h, w, token, c, sizes, tokens), h, w_down, c)
    got_up, got_down = (up[0], *up[1](dy)), (down[0], *down[1](dout))
    want_up, want_down = _fused_reference(
        x64, w_up64, h64, w_down64, np.asarray(c, np.float64), dy64, dout64,
        np.asarray(token), np.asarray(sizes),
    )  # fmt: skip
    return {"gather_gmm": (got_up, want_up), "gmm_scatter": (got_down, want_down)}


def check_fused(ctx: Section) -> None:
    """gather_gmm and gmm_scatter, values and gradients, against float64 dispatch ->
    GEMM -> combine."""
    tokens, d, f = (40, 40, 24) if ctx.small else (300, 136, 200)
    for seed, dtype in enumerate((jnp.float32, jnp.bfloat16)):
        name = jnp.dtype(dtype).name
        try:
            cases = _fused_case(np.random.default_rng(100 + seed), dtype, tokens, d, f)
        except Exception as error:  # the other dtype still runs
            ctx.fail(f"fused/{name} {raised(error)}")
            continue
        for op, (got, want) in cases.items():
            err = max(_rel(a, b) for a, b in zip(got, want, strict=True))
            tol = PALLAS_F32_TOLERANCE if name == "float32" else TOLERANCE[name]
            ctx.record(f"{op}/{name}", err, "fused")
            if not err <= tol:
                ctx.fail(f"{op}/{name}: {err:.2e} > {tol:.0e}")


def correctness(ctx: Section) -> None:
    """Section `kernel_correctness`: every grouped GEMM's three products, then the
    fused ops, with XLA's float32 dots in float32."""
    with jax.default_matmul_precision("highest"):
        check_products(ctx)
        check_fused(ctx)


def zipf_sizes(rows: int, experts: int, top_k: int, skew: float = 1.0) -> np.ndarray:
    """Group sizes ∝ 1/(i+1)^skew summing to `rows`, none above the tokens (rows/k): a
    token sends at most one row to an expert."""
    cap, share = rows // top_k, 1.0 / np.arange(1, experts + 1) ** skew
    sizes = np.zeros(experts, np.int64)
    free = np.ones(experts, bool)
    while rows - sizes.sum() > 0 and free.any():
        left = rows - sizes.sum()
        add = np.floor(left * share * free / (share * free).sum()).astype(np.int64)
        add[np.argmax(free)] += left - add.sum()  # rounding to the largest free group
        sizes = np.minimum(sizes + add, cap)
        free = sizes < cap
    return sizes


def balanced_sizes(rows: int, experts: int) -> np.ndarray:
    return rows // experts + (np.arange(experts) < rows % experts)


def time_gemms(ctx: Section) -> None:
    """Section `gemm_timing`: TFLOP/s of the three GEMMs per implementation (pallas and
    ragged_dot first), shape (Mixtral first) and routing, bfloat16, against a dense
    matmul; a program too large for the device is a note, one that raised a failure."""
    rows, repeats = (SMALL_ROWS, 1) if ctx.small else (ROWS, 10)
    item = GEMM_SECONDS["small" if ctx.small else "full"]
    for seed, (shape, (hidden, width, experts, top_k)) in enumerate(
        model_shapes(ctx.small).items()
    ):
        if not ctx.time_for(3 * item, shape):
            continue
        tokens = rows // top_k
        m = tokens * top_k
        keys = jax.random.split(jax.random.key(seed), 3)
        x = jax.random.normal(keys[0], (m, hidden), jnp.bfloat16)
        w = jax.random.normal(keys[1], (experts, hidden, width), jnp.bfloat16) * hidden**-0.5
        dy = jax.random.normal(keys[2], (m, width), jnp.bfloat16)
        flops = 6 * m * hidden * width
        dense = three_gemms(lambda x, w, _: x @ w)
        base = median_seconds(dense, (x, w[0], jnp.zeros(1, jnp.int32), dy), repeats)
        prefix = f"{shape}(M={m},h={hidden},f={width},E={experts},k={top_k})"
        ctx.record(f"{prefix}/dense_tflops", _sig(flops / base / 1e12), "tflops")
        impls, _ = implementations(MoEConfig(num_experts=experts, top_k=top_k).tile(tokens))
        for impl in sorted(impls, key=lambda name: (name != "pallas", name != "ragged_dot")):
            fn = three_gemms(impls[impl])
            for routing in ("balanced", "zipf1"):
                key = f"{prefix}/{routing}/{impl}"
                if not ctx.time_for(item, key):
                    continue
                sizes = balanced_sizes(m, experts) if routing == "balanced" else None
                sizes = zipf_sizes(m, experts, top_k) if sizes is None else sizes
                args = (x, w, jnp.asarray(sizes, jnp.int32), dy)
                try:
                    seconds = median_seconds(fn, args, repeats)
                except DoesNotFit as why:
                    ctx.note(f"{impl} at {shape} not timed: {why}")
                    break
                except Exception as error:
                    line = f"{impl} at {shape} not timed: {raised(error)}"
                    (ctx.note if impl in OPTIONAL else ctx.fail)(line)
                    break
                ctx.record(f"{key}_tflops", _sig(flops / seconds / 1e12), "tflops")
                ctx.record(f"{key}_vs_dense", round(base / seconds, 3), "tflops")
        del x, w, dy


def _sig(value: float) -> float:
    """Four significant digits (tiny shapes on CPU give tiny rates)."""
    return float(f"{value:.4g}")


def _bytes_per_s(fn, args, nbytes: int, repeats: int) -> float:
    return nbytes / median_seconds(jax.jit(fn), args, repeats)


def time_permutation(ctx: Section) -> None:
    """Section `permutation_timing`: dispatch and combine bandwidth against a copy's,
    and the fused maps' overhead, per shape."""
    repeats = 1 if ctx.small else 10
    big = jax.random.normal(jax.random.key(5), (2**14 if ctx.small else 2**24, 64), jnp.bfloat16)
    copy = _bytes_per_s(lambda a: a * 2, (big,), 2 * big.nbytes, repeats)
    ctx.record("copy_GBps", _sig(copy / 1e9))
    del big
    rows = SMALL_ROWS if ctx.small else ROWS
    for shape, (hidden, width, experts, top_k) in model_shapes(ctx.small).items():
        if not ctx.time_for(PERMUTATION_SECONDS["small" if ctx.small else "full"], shape):
            continue
        tokens = rows // top_k
        rng = np.random.default_rng(7)
        routing = random_routing(rng, tokens, experts, top_k)
        layout = dsp.sorted_layout(routing, experts)
        m, item = layout.source.shape[0], 2  # bfloat16
        keys = jax.random.split(jax.random.key(6), 6)
        x = jax.random.normal(keys[0], (tokens, hidden), jnp.bfloat16)
        y = jax.random.normal(keys[1], (m, hidden), jnp.bfloat16)
        moved = {
            "dispatch": (dsp.dispatch, (x, layout), 2 * m * hidden * item),
            "combine": (dsp.combine, (y, layout, routing), (m + tokens) * hidden * item),
        }
        try:
            for op, (fn, args, nbytes) in moved.items():
                speed = _bytes_per_s(fn, args, nbytes, repeats)
                ctx.record(f"{shape}/{op}_GBps", _sig(speed / 1e9))
                ctx.record(f"{shape}/{op}_vs_copy", round(speed / copy, 3))
            _fused_overhead(ctx, shape, keys, x, y, routing, layout, width, repeats)
        except DoesNotFit as why:
            ctx.note(f"{shape} not timed: {why}")
        except Exception as error:  # the other shapes still run
            ctx.fail(f"{shape} {raised(error)}")


def _fused_overhead(ctx, shape, keys, x, y, routing, layout, width, repeats) -> None:
    """Pallas forward+backward of both projections with the maps fused (gather_gmm,
    gmm_scatter) against the same GEMMs on pre-permuted rows."""
    tokens, hidden = x.shape
    experts = layout.group_sizes.shape[0]
    token, sizes, m = layout.source, layout.group_sizes, layout.source.shape[0]
    w_up = jax.random.normal(keys[2], (experts, hidden, width), jnp.bfloat16) * hidden**-0.5
    w_down = jax.random.normal(keys[3], (experts, width, hidden), jnp.bfloat16) * width**-0.5
    h = jax.random.normal(keys[4], (m, width), jnp.bfloat16)
    c = dsp.row_weights(layout, routing).astype(jnp.bfloat16)
    xs = dsp.dispatch(x, layout)

    def vjp(f, dy):
        def fn(*args):
            out, pull = jax.vjp(f, *args)
            return out, *pull(dy)

        return fn

    up_dy = jax.random.normal(keys[5], (m, width), jnp.bfloat16)
    runs = {
        "up_fused": (vjp(lambda x, w: gather_gmm(x, w, token, sizes), up_dy), (x, w_up)),
        "up_plain": (vjp(lambda x, w: pallas_plain(x, w, sizes), up_dy), (xs, w_up)),
        "down_fused": (
            vjp(lambda h, w, c: gmm_scatter(h, w, token, c, sizes, tokens), x),
            (h, w_down, c),
        ),
        "down_plain": (vjp(lambda h, w: pallas_plain(h, w, sizes), y), (h, w_down)),
    }
    ms = {}
    for name, (f, args) in runs.items():
        ms[name] = median_seconds(jax.jit(f), args, repeats) * 1e3
        ctx.record(f"{shape}/pallas_{name}_ms", round(ms[name], 3))
    fused, plain = ms["up_fused"] + ms["down_fused"], ms["up_plain"] + ms["down_plain"]
    ctx.record(f"{shape}/pallas_fused_overhead", round(fused / plain - 1, 3))
