"""The training loop: data, resume, steps, evaluation, logging, checkpoints, signals.

Order of start-up matters: everything that can reject the run (config, data,
an incompatible checkpoint in the workdir) is checked before anything is
written to the workdir or compiled.
"""

from __future__ import annotations

import dataclasses
import json
import time
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax import checkpoint, config_sources, flops, init_from, memory_check, optimizer, paths
from moe_jax import config as config_lib
from moe_jax import workdir as workdir_lib
from moe_jax.checkpoint import Checkpointer
from moe_jax.data import pipeline
from moe_jax.metrics import MetricsLogger, check_wandb, read_rows
from moe_jax.parallel import mesh as mesh_lib
from moe_jax.plan.describe import plan_line
from moe_jax.plan.resolve import check_plan
from moe_jax.plots import plot_run
from moe_jax.preemption import StopRequest
from moe_jax.train_step import (
    abstract_state,
    eval_step,
    init_placed,
    step_shardings,
    train_step,
    with_shardings,
)


@jax.jit
def _count_bad(bad: tuple[jax.Array, jax.Array], skipped: jax.Array):
    in_a_row, since_log = bad
    return jnp.where(skipped > 0, in_a_row + 1, 0), since_log + skipped


class RunError(Exception):
    """A run that cannot start or must stop, for a reason the user can fix (one line)."""


class Stopped(Exception):
    """The run saved a checkpoint and stopped early because it was asked to (a signal)."""


def say(message: str) -> None:
    """Prints on process 0 only: a 128-process job says things once."""
    if jax.process_index() == 0:
        print(message, flush=True)


def _evaluate(eval_fn, state, config: config_lib.Config, sharding, rows) -> dict[str, float]:
    """{'val_loss'}: the mean over train.eval_batches batches of the val split; for a
    mixture also 'val_loss/<name>' of each source's val split alone, with 'val_loss'
    their mean by weight (one compiled eval_fn serves every source: same shapes)."""
    size = config.train.batch_size

    def mean_loss(batches) -> float:
        return float(
            np.mean(
                [
                    float(eval_fn(state, pipeline.global_array(next(batches), sharding, size)))
                    for _ in range(config.train.eval_batches)
                ]
            )
        )

    if not config.data.sources:
        return {"val_loss": mean_loss(pipeline.make_iterator(config, "val", rows, shuffle=False))}
    alone = pipeline.source_iterators(config, rows)
    found = {f"val_loss/{name}": mean_loss(batches) for name, batches in alone.items()}
    weights = {s.name: s.weight for s in config_sources.parse(config.data.sources)}
    total = sum(weights.values())
    found["val_loss"] = sum(weights[n] / total * found[f"val_loss/{n}"] for n in alone)
    return {"val_loss": found.pop("val_loss"), **found}


def _step_row(step: int, metrics: dict[str, Any], throughput: dict, plan: dict) -> dict:
    host = jax.device_get(metrics)
    row: dict[str, Any] = {"step": step, **plan}
    scalars = (
        "loss",
        "lm_loss",
        "mtp_loss",
        "aux_loss",
        "seq_aux_loss",
        "z_loss",
        "grad_norm",
        "max_attn_logit",  # train.qk_clip: the step's peak logit, before its clip
    )
    for key in (*scalars, "lr"):
        if key in host:
            row[key] = float(host[key])
    row.update(throughput)
    if "load" in host:
        load = np.asarray(host["load"], np.float64)  # [moe layers, experts]
        per_layer = load.max(-1) / np.maximum(load.mean(-1), 1e-9)
        row["expert_load_max_over_mean"] = float(per_layer.mean())
        row["expert_load_max_over_mean_per_layer"] = [float(x) for x in per_layer]
        row["expert_load"] = (load / load.sum(-1, keepdims=True)).round(5).tolist()
        row["dropped_fraction"] = float(host["dropped_fraction"])
    if "mtp_load" in host:  # [MTP depths, experts]; zero rows for dense depths
        row["mtp_expert_load"] = np.asarray(host["mtp_load"], np.float64).tolist()
    return row


# Settings a resume cannot change: the data iterator's saved position depends on them.
FIXED_ON_RESUME = (
    "train.batch_size",
    "train.seq_len",
    "train.seed",
    "data.source",
    "data.path",
    "data.sources",
    "data.val_fraction",
)


def _optimizer_changes(ours: dict, saved: dict) -> list[tuple[str, Any, Any]]:
    """(setting, here, there) of the settings that shape the optimizer's saved state:
    `train.optimizer`, and whether `train.grad_clip` clips (its transformation is part of
    the state's tree). A setting missing from an older checkpoint held its default; a
    threshold that is not a number (a hand-edited checkpoint) is a change, never a crash."""
    default = config_lib.TrainConfig()
    clips = lambda v: v > 0 if isinstance(v, int | float) else v
    shapes = {"optimizer": lambda v: v, "grad_clip": clips}
    found = []
    for key, shape in shapes.items():
        here, there = ours["train"][key], saved.get("train", {}).get(key, getattr(default, key))
        if shape(here) != shape(there):
            found.append((f"train.{key}", here, there))
    return found


def _resume_changes(ours: dict, saved: dict, step: int, directory: Path) -> list[str]:
    """Lines naming the settings that differ from the checkpoint's; one ValueError naming
    every setting that cannot change (the model's, and from step 1 on those the data
    position depends on), all at once, so one retry is enough."""
    flat = lambda c: {f"{s}.{k}": v for s, section in c.items() for k, v in section.items()}
    ours_flat, saved_flat = flat(ours), flat(saved)
    changed = [k for k in sorted(ours_flat) if k in saved_flat and ours_flat[k] != saved_flat[k]]
    # A setting added since the checkpoint was saved holds its default there.
    model = checkpoint.architecture(ours)
    defaults = checkpoint.architecture(config_lib.to_config_dict(config_lib.Config()))
    model_saved = {**defaults, **checkpoint.architecture(saved)}
    refused = {
        "another model": [
            (k, model.get(k), model_saved.get(k))
            for k in sorted(set(model) | set(model_saved))
            if model.get(k) != model_saved.get(k)
        ],
        "the data position cannot carry over": [
            (k, ours_flat[k], saved_flat[k]) for k in changed if step and k in FIXED_ON_RESUME
        ],
        "the optimizer's state cannot carry over": _optimizer_changes(ours, saved),
    }
    groups = [
        ", ".join(f"{k}={here!r} here but {there!r} there" for k, here, there in found)
        + f" ({why})"
        for why, found in refused.items()
        if found
    ]
    if groups:
        raise ValueError(
            f"{directory} holds a checkpoint (step {step}) that these settings cannot resume: "
            f"{'; '.join(groups)}; use the checkpoint's values (without --config, the run's "
            "saved settings are the defaults) or a new --workdir"
        )
    if not changed or not step:
        return []
    listed = ", ".join(f"{k}={ours_flat[k]!r} (was {saved_flat[k]!r})" for k in changed)
    return [f"resuming step {step} with changed settings: {listed}"]


def _check_own_config_json(workdir: Path) -> None:
    """A config.json in the workdir that no run wrote is the user's: never overwrite it."""
    path = workdir / "config.json"
    if not path.exists():
        return
    try:
        ours = set(json.loads(path.read_text())) == set(config_lib.SECTIONS)
    except (ValueError, TypeError):
        ours = False
    if not ours:
        raise ValueError(
            f"{path} was not written by a run (it is not a resolved config); move it aside "
            "or use another --workdir"
        )


def _os_error(error: OSError, workdir: Path) -> RunError:
    """A failed write during the run as one line (what failed, where, and that the newest
    complete checkpoint is intact)."""
    where = error.filename or workdir
    return RunError(
        f"stopping: {error.strerror or error} ({where}); the newest complete checkpoint is "
        "intact: fix this (free space) and run again to resume from it"
    )


def _check_not_all_damaged(checkpoints: Checkpointer) -> None:
    """Starting over in a workdir whose checkpoints were all damaged would mix two runs
    (and drop the first one's metrics): refused, every time, until the user chooses."""
    aside = checkpoints.damaged_directory
    if aside.exists() and not checkpoints.steps():
        raise ValueError(
            f"no readable checkpoint is left in {checkpoints.directory} (the damaged ones "
            f"are in {aside}); starting over here would mix two runs: use a new --workdir"
        )


def run(config: config_lib.Config, workdir: str | Path) -> dict[str, Any]:
    """Trains (or resumes) `config` in `workdir`; returns the last logged rows."""
    workdir = Path(workdir)
    tc = config.train
    process = jax.process_index()
    checkpoints = Checkpointer(workdir / "checkpoints", tc.keep_checkpoints)
    lock = workdir_lib.Lock(workdir)
    try:
        workdir_lib.check(workdir)  # first: a path that cannot be a workdir costs nothing
        if process == 0:
            lock.check_free()
        chose = config.parallel.layout == "auto"
        config = check_plan(config, jax.device_count())
        if chose:
            say(f"planner chose {plan_line(config.parallel)}")
        if tc.warmup_steps >= tc.steps:
            say(
                f"warning: train.warmup_steps={tc.warmup_steps} >= train.steps={tc.steps}: "
                f"the learning rate never reaches its peak train.learning_rate={tc.learning_rate}"
            )
        mesh = mesh_lib.make_mesh(config)
        layout = mesh_lib.make_layout(config, mesh)
        sharding = mesh_lib.batch_sharding(layout)
        rows = pipeline.local_rows(sharding, tc.batch_size, tc.seq_len)  # this process's share
        train_batches = pipeline.make_iterator(config, "train", rows)
        pipeline.make_iterator(config, "val", rows, shuffle=False)  # fails early on a bad split
        config_dict = paths.stored(dataclasses.asdict(config), workdir)  # moe_jax.paths
        found = checkpoints.newest_readable()
        changes = []
        if found:  # a run written before paths were stored relative to it resolves too
            saved = paths.stored(paths.resolved(found[1], workdir), workdir)
            changes = _resume_changes(config_dict, saved, found[0], checkpoints.directory)
        _check_own_config_json(workdir)
        read_rows(workdir / "metrics.jsonl")  # a line damaged mid-file stops it here
        if found is None:
            _check_not_all_damaged(checkpoints)
        start = found[0] if found else 0
        if start:
            for line in changes:
                say(line)
            if tc.steps <= start:
                say(f"already complete at step {start} (train.steps={tc.steps}); nothing to do")
                return {}
        check_wandb(tc.wandb)
        if not start:
            init_from.check(config)  # a source that cannot start this run, in one line
        need, limit, lines = memory_check.summary(config)
        for line in lines:
            say(line)
        memory_check.check(config, need, limit)
        graphdef, abstract = abstract_state(config, layout)
        state_sharding = mesh_lib.train_state_shardings(abstract, layout, config.parallel.zero)
        placed = with_shardings(abstract, state_sharding)
        need = checkpoint.bytes_written(placed) + checkpoint.SPACE_MARGIN
        workdir_lib.check(workdir, need_bytes=need, purpose=" to save a checkpoint")
        took_over = lock.acquire() if process == 0 else None  # the run's first write
    except ValueError as error:
        raise RunError(str(error)) from None
    if took_over:
        say(took_over)
    try:
        return _train(config, workdir, layout, graphdef, placed, checkpoints, train_batches)
    except OSError as error:  # the disk filled, or a path vanished, while the run wrote
        raise _os_error(error, workdir) from None
    finally:
        lock.release()


def _train(config, workdir: Path, layout, graphdef, placed, checkpoints, train_batches):
    """The run itself, once everything that can reject it has been checked. `placed` is
    the abstract state in the plan's shardings, placed as the step's outputs will be:
    the state is built (or read) straight into it, so nothing exists whole on one
    device and step 1 does not compile twice."""
    tc, process = config.train, jax.process_index()
    sharding = mesh_lib.batch_sharding(layout)
    rows = pipeline.local_rows(sharding, tc.batch_size, tc.seq_len)
    config_dict = paths.stored(dataclasses.asdict(config), workdir)  # moe_jax.paths
    state_sharding = jax.tree.map(lambda x: x.sharding, placed)
    restored = checkpoints.restore_newest(placed, say)
    if restored is not None:
        start, state, data_state = restored
        if data_state:  # an imported checkpoint (step 0) has read no data yet
            train_batches.set_state(data_state)
        say(f"resumed from {checkpoints.directory / str(start)}")
    else:
        try:
            _check_not_all_damaged(checkpoints)  # every one failed to restore
        except ValueError as error:
            raise RunError(str(error)) from None
        start, state = 0, init_placed(config, layout, state_sharding)
        if tc.init_from:
            try:
                params = init_from.initial_params(config, layout, state.params, say)
            except ValueError as error:
                raise RunError(str(error)) from None
            state = dataclasses.replace(state, params=params)
            how = f" (upcycled: {tc.upcycle})" if tc.upcycle != "none" else ""
            say(f"initialised from {tc.init_from}{how}, at step 0 with a fresh optimizer")
    workdir.mkdir(parents=True, exist_ok=True)
    if process == 0:  # one writer for the run's files in a multi-process job
        (workdir / "config.json").write_text(json.dumps(config_dict, indent=2) + "\n")

    # The learning rate is an argument (`train_step`): one value per step, replicated.
    rates = optimizer.rates(tc, start)
    step_fn = jax.jit(
        partial(train_step, graphdef, config),
        in_shardings=step_shardings(state_sharding, sharding),
        out_shardings=(state_sharding, None),
        donate_argnums=0,  # the new state reuses the old one's buffers
    )
    eval_fn = jax.jit(partial(eval_step, graphdef, config))
    try:
        wandb = (tc.wandb, tc.wandb_project, config_dict)
        logger = MetricsLogger(workdir, tc.steps, start, enabled=process == 0, wandb=wandb)
    except ValueError as error:  # a damaged metrics.jsonl, or W&B that did not start
        raise RunError(str(error)) from None
    tokens_per_step = tc.batch_size * tc.seq_len
    flops_per_step = flops.flops_per_token(config.model, config.moe, tc.seq_len) * tokens_per_step
    peak = flops.peak_flops(jax.devices()[0])
    peak = peak * jax.device_count() if peak else None
    profile = config_lib.profile_steps(config.profile)
    plan = {f"plan_{k}": v for k, v in dataclasses.asdict(config.parallel).items()}
    last: dict[str, Any] = {}
    # (non-finite steps in a row, non-finite steps since the last log), kept on the
    # device and read every train.log_every steps, so the loop never waits for a step.
    bad = (jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32))
    logged = start  # the last step whose metrics were read

    def save(step: int, wait: bool = False) -> None:
        try:
            checkpoints.save(step, state, train_batches.get_state(), config_dict)
            if wait:
                checkpoints.wait()
        except ValueError as error:  # the disk cannot hold it: nothing half-written is kept
            raise RunError(str(error)) from None

    try:
        with StopRequest() as stop:
            clock, clock_step = time.perf_counter(), start
            for step in range(start + 1, tc.steps + 1):
                if profile and step == profile[0]:
                    jax.profiler.start_trace(str(workdir / "profile"))
                # Steps are dispatched asynchronously: this batch goes to the devices
                # while the previous step still runs there.
                try:  # the loader checks each batch's ids: a bad one stops here, in one line
                    local = next(train_batches)
                except ValueError as error:
                    raise RunError(str(error)) from None
                batch = pipeline.global_array(local, sharding, tc.batch_size)
                if step == start + 1:
                    say("compiling the train step...")
                state, metrics = step_fn(state, batch, rates[step - start - 1])
                if step == start + 1:  # compiled and run once: kept out of the throughput
                    jax.block_until_ready(metrics)
                    say(f"first step (compiling included) took {time.perf_counter() - clock:.1f} s")
                    clock = time.perf_counter()
                    clock_step = step
                if profile and step == profile[1] - 1:
                    jax.block_until_ready(state)
                    jax.profiler.stop_trace()
                logger.advance()
                bad = _count_bad(bad, metrics["skipped"])  # on the device: no wait here
                if step % tc.log_every == 0 or step == tc.steps:
                    jax.block_until_ready(metrics)
                    bad_in_a_row, skipped = (int(x) for x in jax.device_get(bad))
                    if skipped:
                        say(
                            f"steps {logged + 1}-{step}: {skipped} skipped (a non-finite loss, "
                            "gradient or update)"
                        )
                    if bad_in_a_row >= tc.max_bad_steps:
                        last_good = checkpoints.latest_step()
                        where = (
                            f"the last good checkpoint is {checkpoints.directory / str(last_good)}"
                            if last_good
                            else "no checkpoint was saved before it"
                        )
                        raise RunError(
                            f"stopping: {bad_in_a_row} steps in a row had a non-finite loss, "
                            f"gradient or update (train.max_bad_steps={tc.max_bad_steps}); {where}"
                        )
                    bad, logged = (bad[0], jnp.zeros((), jnp.int32)), step
                    now = time.perf_counter()
                    steps_timed = step - clock_step
                    # None until a step ran without compiling (log_every=1, step 1).
                    step_s = (now - clock) / steps_timed if steps_timed else None
                    rate = tokens_per_step / step_s if step_s else None
                    throughput = {
                        "time": round(time.time(), 3),
                        "step_time_s": step_s,
                        "tokens_per_sec": rate,
                        "eta_s": round(step_s * (tc.steps - step), 1) if step_s else None,
                        "skipped_steps_in_a_row": bad_in_a_row,
                    }
                    throughput["mfu"] = (
                        flops_per_step / tokens_per_step * rate / peak if peak and rate else None
                    )
                    # The plan goes in the run's first row only (and config.json).
                    last = _step_row(step, metrics, throughput, plan)
                    if hasattr(train_batches, "epochs"):  # a mixture: each source's epochs
                        last.update(train_batches.epochs())
                    plan = {}
                    logger.write(last)
                    if config.moe.dropless and last.get("dropped_fraction", 0) > 0:
                        say(
                            f"step {step}: {last['dropped_fraction']:.2%} of assignments did "
                            "not fit the all-to-all buffers and were dropped (raise "
                            "parallel.a2a_buffer_factor; 0 is exactly dropless)"
                        )
                    clock, clock_step = time.perf_counter(), step
                if (tc.eval_every and step % tc.eval_every == 0) or step == tc.steps:
                    val = {"step": step, **_evaluate(eval_fn, state, config, sharding, rows)}
                    logger.write(val)
                    last = {**last, **val}
                    clock, clock_step = time.perf_counter(), step
                if stop.reached(step):
                    save(step, wait=True)
                    say(f"{stop.name}: saved step {step} in {checkpoints.directory}")
                    raise Stopped(f"{stop.name}: stopped after step {step}; run again to resume")
                if tc.checkpoint_every and step % tc.checkpoint_every == 0:
                    save(step)
            if tc.steps > start:
                save(tc.steps)
    finally:
        problems = []
        for close in (checkpoints.close, logger.close):  # the first waits for the last save
            try:
                close()
            except ValueError as error:
                problems.append(RunError(str(error)))
            except OSError as error:  # a full disk while the metrics are flushed
                problems.append(_os_error(error, workdir))
        if problems:
            raise problems[0] from None
    if process == 0:
        pictures = plot_run(workdir)
        print(f"outputs in {workdir}: metrics.jsonl, tb/, checkpoints/, config.json, ", end="")
        print(", ".join(p.name for p in pictures), flush=True)
    return last
