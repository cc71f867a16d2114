"""`python -m moe_jax.tools.comm_report [--config=FILE] [--config.<a>.<b>=<v>] [--json]`

Compiles one training step of the plan on the current devices (nothing is
run, inputs are abstract) and lists the collectives XLA emitted, then checks
the activation traffic per MoE layer against the analytic prediction of
`moe_jax.plan.comm_volume`. Why: a layout's communication volume is its
reason to exist; this shows what the compiled program really moves.

On a machine without 8 accelerators, force CPU devices:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
        python -m moe_jax.tools.comm_report --config=configs/mixtral_tiny.py

Adding `--xla_backend_optimization_level=0` to XLA_FLAGS halves the CPU compile
time; it lowers LLVM's effort only, and the HLO collectives stay the same.
XLA:CPU has no bf16 or f8 collectives: it compiles bf16 exchanges as f32 and f8 ones
as f16. The report reads each collective's dtype from the program before XLA optimises
it (`moe_jax.tools.lowered_dtypes`) and counts bytes as a GPU sends them, saying which
collectives the compiled program widened.

Bytes are what ONE device SENDS per execution of a collective over g devices,
S = its per-device buffer: all-gather (S = result), reduce-scatter (S =
operand), all-to-all (S = operand) send S·(g-1)/g; all-reduce 2·S·(g-1)/g;
collective-permute S. The paper's Eq. 2 counts the Ulysses all-to-alls at
twice this; the paper's values are printed for reference only.

Measured activation bytes per layer: forward collectives tagged
`token_exchange` or `router_stats`, times their counts, divided by
model.num_layers and train.grad_accum (the prediction is per micro-batch).
With `--json` the last line of stdout is one JSON object.

`--compare=tp+etp,sp+ep_a2a,sp+ep_ag` compiles each `attention+experts` plan
of the same config instead and prints one table of their activation bytes,
each also as a fraction of the first plan's (with `--json`, the last line is
{"compare": [one report per plan]}).
"""

from __future__ import annotations

import dataclasses
import json
import time
from functools import partial

import jax
import jax.numpy as jnp
from absl import app, flags

from moe_jax import cli
from moe_jax import config as config_lib
from moe_jax.data.documents import batch_keys
from moe_jax.parallel import mesh as mesh_lib
from moe_jax.parallel import registry, scopes
from moe_jax.plan import comm_volume, muon_cost, param_traffic
from moe_jax.plan.describe import plan_line
from moe_jax.plan.resolve import check_plan
from moe_jax.signals import interruptible
from moe_jax.tools import hlo_collectives, lowered_dtypes
from moe_jax.train_state import init_state
from moe_jax.train_step import RATE, step_shardings, train_step

CONVENTION = (
    "bytes = sent by one device per execution; S = its buffer: all-gather, reduce-scatter, "
    "all-to-all S·(g-1)/g; all-reduce 2·S·(g-1)/g; collective-permute S"
)


def validated(config: config_lib.Config, num_devices: int) -> config_lib.Config:
    """The resolved plan, or a one-line ValueError before anything is compiled."""
    return check_plan(config, num_devices)


def compile_step(
    config: config_lib.Config, compiler_options: dict | None = None
) -> tuple[str, str]:
    """(compiled HLO, lowered StableHLO) text of one training step, laid out and sharded
    as the trainer does."""
    mesh = mesh_lib.make_mesh(config)
    layout = mesh_lib.make_layout(config, mesh)
    graphdef, state = jax.eval_shape(lambda: init_state(config, layout))
    state_sharding = mesh_lib.train_state_shardings(state, layout, config.parallel.zero)
    sharding = mesh_lib.batch_sharding(layout)
    abstract = lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh)
    state = jax.tree.map(abstract, state, state_sharding)
    tokens = (config.train.batch_size, config.train.seq_len)
    keys = batch_keys(config.data)  # the loader's batch: with its document fields if masked
    batch = {key: jax.ShapeDtypeStruct(tokens, jnp.int32, sharding=sharding) for key in keys}
    step_fn = jax.jit(
        partial(train_step, graphdef, config),
        in_shardings=step_shardings(state_sharding, sharding),
        out_shardings=(state_sharding, None),
    )
    lowered = step_fn.lower(state, batch, RATE)
    compiled = lowered.compile(compiler_options=compiler_options)
    return compiled.as_text(), lowered.as_text(debug_info=True)


def summarize(config: config_lib.Config, collectives: list) -> dict:
    """The report of a resolved config from the collectives of its compiled step."""
    m, p = config.model, config.parallel
    per_layer = m.num_layers * config.train.grad_accum
    forward = [c for c in collectives if c.role == "activation" and c.pass_ == "forward"]
    measured = {tag: sum(c.total for c in forward if c.tag == tag) for tag in scopes.TAGS}
    widened = sorted({f"{c.dtype} as {c.compiled_dtype}" for c in forward if c.compiled_dtype})
    predicted = _model(comm_volume.activation_bytes, config)
    paper = _model(comm_volume.paper_bytes, config)
    expected = dict.fromkeys(("predicted", "predicted_attention", "predicted_experts"))
    if predicted is not None:
        expected = {
            "predicted": int(predicted.total),
            "predicted_attention": int(predicted.attention),
            "predicted_experts": int(predicted.experts),
        }
    total = (measured["token_exchange"] + measured["router_stats"]) / per_layer  # the layers
    rows = hlo_collectives.aggregate(collectives)
    return {
        "plan": plan_line(p),
        "attention": p.attention,
        "experts": p.experts,
        "n": p.intra,
        "data": p.data,
        "activation_bytes_per_layer": {
            "measured": total,
            **expected,
            "ratio": total / expected["predicted"] if expected["predicted"] else None,
            "measured_token_exchange": measured["token_exchange"] / per_layer,
            "measured_router_stats": measured["router_stats"] / per_layer,
            "compiled_wider": widened,
            "paper": None if paper is None else dataclasses.asdict(paper),
        },
        "zero": p.zero,
        "expert_fsdp": p.expert_fsdp,
        "param_grad_bytes_per_step": sum(c.total for c in collectives if c.role == "param_grad"),
        "predicted_param_grad_bytes_per_step": param_traffic.gradient_bytes_per_step(config),
        "activation_bytes_per_step": sum(c.total for c in collectives if c.role == "activation"),
        "document_positions_bytes_per_step": {
            "measured": sum(c.total for c in collectives if c.tag == scopes.DOCUMENT_POSITIONS),
            "predicted": comm_volume.document_positions_bytes(config),
        },
        "muon_exchange_bytes_per_step": {
            "measured": sum(c.total for c in collectives if scopes.MUON_EXCHANGE in c.op_name),
            "predicted": muon_cost.exchange_bytes_per_step(config),
        },
        "dense_layers": m.num_layers - m.num_moe_layers,
        "num_layers": m.num_layers,
        "grad_accum": config.train.grad_accum,
        "counts_known": all(c.count_known for c in collectives),
        "collectives": [c.as_dict() for c in rows],
        "paper_equations": list(comm_volume.paper_equations(config)),
    }


def _model(formula, config: config_lib.Config) -> comm_volume.LayerBytes | None:
    """The analytic volume, or None for a layout comm_volume has no model of."""
    try:
        return formula(config)
    except ValueError:
        return None


def report(config: config_lib.Config, compiler_options: dict | None = None) -> dict:
    """Compiles one step of `config` (a loaded, possibly unresolved config) on the current
    devices and reports its collectives; a plan that cannot run raises ValueError."""
    config = validated(config, jax.device_count())
    start = time.perf_counter()
    hlo, lowered = compile_step(config, compiler_options)
    result = summarize(config, lowered_dtypes.as_sent(hlo_collectives.parse(hlo), lowered))
    result["compile_seconds"] = round(time.perf_counter() - start, 1)
    return result


def format_report(result: dict) -> str:
    """The table of collectives and the summary, as printed."""
    header = ("kind", "pass", "role", "tag", "chunk", "ring", "group", "dtype", "bytes/device")
    lines = [
        f"collectives of one training step ({CONVENTION})",
        f"{header[0]:<19}{header[1]:<9}{header[2]:<11}{header[3]:<15}{header[4]:>5}{header[5]:>5}"
        f"{header[6]:>6} {header[7]:<6}{header[8]:>14}{'count':>7}{'total':>14}",
    ]
    silent = [c for c in result["collectives"] if c["bytes"] == 0]
    for c in result["collectives"]:
        if c["bytes"] == 0:
            continue
        unsure = "" if c["count_known"] else "  (loop trip count unknown: counted once)"
        chunk, ring = ("-" if c[key] is None else c[key] for key in ("chunk", "ring"))
        lines.append(
            f"{c['kind']:<19}{c['pass']:<9}{c['role']:<11}{c['tag'] or '-':<15}{chunk:>5}{ring:>5}"
            f"{c['group_size']:>6} {c['dtype']:<6}{c['bytes']:>14,}{c['count']:>7}"
            f"{c['bytes'] * c['count']:>14,}{unsure}"
        )
    if silent:
        lines.append(f"({len(silent)} more over groups of one device move nothing; not listed)")
    a = result["activation_bytes_per_layer"]
    per = f"/ {result['num_layers']} layers" + (
        f" / {result['grad_accum']} micro-batches" if result["grad_accum"] > 1 else ""
    )
    ratio = f"{a['ratio']:.3f}" if a["ratio"] is not None else "n/a (nothing predicted)"
    predicted = (
        f"{a['predicted']:>14,}  (attention {a['predicted_attention']:,}, "
        f"experts {a['predicted_experts']:,})"
        if a["predicted"] is not None
        else f"{'n/a':>14}  (comm_volume has no model of this layout)"
    )
    lines += [
        "",
        f"plan: {result['plan']}; compiled in {result['compile_seconds']} s",
        f"activation bytes per MoE layer per device, forward ({per}):",
        f"  measured  {a['measured']:>14,.0f}  (token_exchange "
        f"{a['measured_token_exchange']:,.0f}, router_stats {a['measured_router_stats']:,.0f})",
        f"  predicted {predicted}",
        f"  measured / predicted = {ratio}",
    ]
    if a["paper"] is not None:
        attention, experts = result["paper_equations"]
        lines.append(
            f"  paper     {a['paper']['attention'] + a['paper']['experts']:>14,.0f}  "
            f"(attention {attention}: {a['paper']['attention']:,.0f}, experts {experts}: "
            f"{a['paper']['experts']:,.0f}; the paper's counting, no capacity padding)"
        )
    if a["compiled_wider"]:
        lines.append(
            "  note: bytes are counted in the dtypes the program sends (read from the lowered "
            f"program); XLA:CPU compiled {', '.join(a['compiled_wider'])}, which a GPU does not"
        )
    if result["dense_layers"] and a["predicted"] is not None:
        layers, dense = result["num_layers"], result["dense_layers"]
        mix = a["predicted_attention"] + a["predicted_experts"] * (layers - dense) / layers
        lines.append(
            f"  note: {dense} of {layers} layers are dense (attention, no MoE block); measured "
            f"is divided by all layers, so it is not one MoE layer's volume (predicted for "
            f"this mix of layers: {mix:,.0f})"
        )
    if not result["counts_known"]:
        lines.append("  note: some loop trip counts were unknown; those collectives count once")
    lines.append(
        f"param_grad bytes per step per device: {result['param_grad_bytes_per_step']:,} "
        f"(predicted {result['predicted_param_grad_bytes_per_step']:,}, "
        "moe_jax.plan.param_traffic)"
    )
    muon = result["muon_exchange_bytes_per_step"]
    if muon["measured"] or muon["predicted"]:
        lines.append(
            f"Muon's whole-matrix exchanges per step per device: {muon['measured']:,} "
            f"(predicted {muon['predicted']:,.0f}, moe_jax.plan.muon_cost; within param_grad)"
        )
    positions = result["document_positions_bytes_per_step"]
    if positions["measured"] or positions["predicted"]:
        lines.append(
            f"document positions gathered per step per device: {positions['measured']:,} "
            f"(predicted {positions['predicted']:,}, moe_jax.plan.comm_volume)"
        )
    return "\n".join(lines)


def compare(config: config_lib.Config, plans: list[str], compiler_options=None) -> list[dict]:
    """One report per `attention+experts` plan, all else as in `config`; every plan is
    validated before the first compiles."""
    configs = []
    for plan in compare_entries(plans):
        attention, _, experts = plan.partition("+")
        parallel = dataclasses.replace(config.parallel, attention=attention, experts=experts)
        one = dataclasses.replace(config, parallel=parallel)
        config_lib.validate(one)
        one = validated(one, jax.device_count())
        if one.parallel.intra < 2:
            raise ValueError(
                f"--compare compares how layouts exchange tokens inside an intra group, but "
                f"parallel.intra={one.parallel.intra} on {jax.device_count()} device(s) has "
                "none; set --config.parallel.intra=N (N > 1) on N or more devices (on CPU: "
                "XLA_FLAGS=--xla_force_host_platform_device_count=N)"
            )
        configs.append(one)
    return [report(one, compiler_options) for one in configs]


def compare_entries(plans: list[str]) -> list[str]:
    """The `--compare` entries, or a one-line ValueError naming the first that is
    malformed, repeated or names no layout."""
    valid = f"attention in {sorted(registry.ATTENTION)}, experts in {sorted(registry.EXPERTS)}"
    for i, plan in enumerate(plans):
        attention, _, experts = plan.partition("+")
        if not attention or not experts or "+" in experts:
            raise ValueError(f"--compare entry {plan!r} must look like attention+experts ({valid})")
        if attention not in registry.ATTENTION or experts not in (*registry.EXPERTS, "auto"):
            raise ValueError(f"--compare entry {plan!r} names no layout; valid: {valid}")
        if plan in plans[:i]:
            raise ValueError(f"--compare entry {plan!r} is given twice; list each plan once")
    return plans


def format_comparison(results: list[dict]) -> str:
    """Activation bytes per MoE layer of several plans, the first one as the baseline."""
    first = results[0]["activation_bytes_per_layer"]["measured"]
    lines = [
        f"activation bytes per MoE layer per device, forward (n={results[0]['n']}; {CONVENTION})",
        f"{'plan':<16}{'measured':>14}{'predicted':>14}{'meas/pred':>11}{'vs first':>10}",
    ]
    for r in results:
        a = r["activation_bytes_per_layer"]
        predicted = f"{a['predicted']:>14,}" if a["predicted"] is not None else f"{'n/a':>14}"
        ratio = f"{a['ratio']:>11.3f}" if a["ratio"] is not None else f"{'n/a':>11}"
        lines.append(
            f"{r['attention'] + '+' + r['experts']:<16}{a['measured']:>14,.0f}{predicted}"
            f"{ratio}{a['measured'] / first:>10.3f}"
        )
    return "\n".join(lines)


def define_flags() -> None:
    """The CLI's flags; defined only when run as a program, so that importing `report`
    next to `moe_jax.train` (which owns a `--config` flag too) does not clash."""
    cli.define_config_flag()
    flags.DEFINE_bool("json", False, "End stdout with one line of JSON.")
    flags.DEFINE_list("compare", [], "attention+experts plans to compare, e.g. tp+etp,sp+ep_a2a.")


@interruptible("the report")
def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise SystemExit(
            f"error: unexpected arguments {argv[1:]}; settings go in --config.<a>.<b>="
        )
    try:
        config = config_lib.load(flags.FLAGS.config)
        if flags.FLAGS.compare:
            results = compare(config, flags.FLAGS.compare)
        else:
            config = validated(config, jax.device_count())
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    if flags.FLAGS.compare:
        print(format_comparison(results), flush=True)
        if flags.FLAGS.json:
            print(json.dumps({"compare": results}), flush=True)
        return
    result = report(config)
    print(format_report(result), flush=True)
    if flags.FLAGS.json:
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=cli.parse)
