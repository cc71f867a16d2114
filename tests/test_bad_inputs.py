"""Bad input on the eight command lines (the rules: `tests/bad_inputs.py`): flag and
config errors, the workdir, resuming, data, settings, `plan`, `comm_report`, `prepare`,
`launch/local.py`, `sample`, `evaluate` and `convert`."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from moe_jax import workdir as workdir_lib
from moe_jax.data.token_files import write_meta, write_split
from tests.bad_inputs import (
    TOKENS,
    TRAINED,
    WORKDIR,
    Case,
    Place,
    check,
    names,
)
from tests.bad_inputs import case as _c
from tests.commands import COMMANDS, ROOT, TINY


def _truncate_newest_data_file(step_dir: Path) -> None:
    data = max((p for p in step_dir.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])


def _all_checkpoints_damaged(place: Place) -> None:
    run = place.trained()
    for step in (2, 4):
        _truncate_newest_data_file(run / "checkpoints" / str(step) / "state")


def _held_by_a_live_run(place: Place) -> None:
    lock = workdir_lib.Lock(place.trained())
    lock.acquire()  # this test process stands for the live run
    place.stack.callback(lock.release)


def _out_of_vocabulary(place: Place) -> None:
    data = place.prepared()
    tokens = np.random.default_rng(1).integers(0, 256, 5000).astype(np.uint16)
    tokens[1234] = 300  # vocab_size is 259: meta.json understates it
    write_split(data, "train", tokens)
    meta = json.loads((data / "meta.json").read_text())
    meta["splits"]["train"] = {"num_tokens": 5000, "max_id": 300}  # train.bin, no shards
    write_meta(data, meta)


def _garble(path: Path, text: str = "{not json") -> None:
    path.write_text(text)


def _torn_middle_of_metrics(place: Place) -> None:
    metrics = place.trained() / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    lines[1] = lines[1][:10]
    metrics.write_text("\n".join(lines) + "\n")


def _user_config_json(place: Place) -> None:
    (place.root / "run").mkdir()
    place.file("run/config.json", '{"my": "notes"}\n')


def _truncated_split(place: Place) -> None:
    split = place.prepared() / "train-00000.bin"
    split.write_bytes(split.read_bytes()[:-3])


SHARED_FLAGS = [  # every absl command: a mistyped or unknown setting, a missing config
    ("trian_section", ["--config.trian.steps=1"], "unknown setting trian.steps", "train.steps?"),
    ("stepz_key", ["--config.train.stepz=1"], "unknown setting train.stepz", "train.steps?"),
    ("foo_key", ["--config.model.foo=1"], "unknown setting model.foo", "settings of model: ["),
    ("missing_config", ["--config=nope.py"], "--config=nope.py: no such file"),
    ("not_a_number", ["--config.train.steps=abc"], "--config.train.steps=abc"),
    ("unknown_flag", ["--no_such_flag=1"], "no_such_flag"),
    ("broken_config", ["--config={root}/mine.py"], "--config=", "mine.py: SyntaxError at line 1"),
]

CASES = [
    *(
        _c(f"{command}-{name}", command, args, *expect, setup=lambda p: p.file("mine.py", "def("))
        for command in ("train", "plan", "comm_report")
        for name, args, *expect in SHARED_FLAGS
    ),
    # train: the workdir
    _c(
        "workdir_is_a_file",
        "train",
        ["--workdir={root}/blocker"],
        "blocker is a file",
        setup=Place.file,
    ),
    _c(
        "workdir_under_a_file",
        "train",
        ["--workdir={root}/blocker/run"],
        "lies under",
        setup=Place.file,
    ),
    _c(
        "workdir_read_only_fs",
        "train",
        ["--workdir={root}/ro/run"],
        "ro is on a read-only",
        setup=lambda p: p.small_disk("ro", read_only=True),
    ),
    _c(
        "workdir_disk_full",
        "train",
        [*TINY, "--workdir={root}/disk/run"],
        "MB needed to save a checkpoint",
        "MB free on",
        setup=lambda p: p.small_disk(),
    ),
    _c(
        "workdir_in_use",
        "train",
        [*TRAINED, WORKDIR, "--config.train.steps=6"],
        "run is in use by process",
        f"{os.getpid()}",
        setup=_held_by_a_live_run,
    ),
    _c(
        "users_own_config_json",
        "train",
        [*TINY, WORKDIR],
        "config.json was not written by a run",
        setup=_user_config_json,
    ),
    # train: resuming
    _c(
        "resume_changed_batch_size",
        "train",
        [*TRAINED, WORKDIR, "--config.train.batch_size=8"],
        "holds a checkpoint (step 4)",
        "train.batch_size=8 here but 4 there",
        setup=Place.trained,
    ),
    _c(
        "resume_changed_seq_len",
        "train",
        [*TRAINED, WORKDIR, "--config.train.seq_len=16"],
        "train.seq_len=16 here but 32",
        setup=Place.trained,
    ),
    _c(
        "resume_changed_seed",
        "train",
        [*TRAINED, WORKDIR, "--config.train.seed=7"],
        "train.seed=7 here",
        setup=Place.trained,
    ),
    _c(
        "resume_another_model",
        "train",
        [*TRAINED, WORKDIR, "--config.model.num_layers=3"],
        "holds a checkpoint (step 4)",
        "model.num_layers=3 here but 2 there (another model)",
        setup=Place.trained,
    ),
    _c(
        "resume_every_checkpoint_damaged",
        "train",
        [*TRAINED, WORKDIR, "--config.train.steps=6"],
        "no readable checkpoint is left in",
        "checkpoints-damaged",
        setup=_all_checkpoints_damaged,
        moved=(4, 2),
    ),
    _c(
        "resume_metrics_damaged_mid_file",
        "train",
        [*TRAINED, WORKDIR, "--config.train.steps=6"],
        "metrics.jsonl line 2 is not JSON",
        setup=_torn_middle_of_metrics,
    ),
    # train: data
    _c(
        "tokens_beyond_vocabulary",
        "train",
        [*TINY, *TOKENS, WORKDIR],
        "train.bin",
        "token id 300",
        "model.vocab_size=259",
        setup=_out_of_vocabulary,
    ),
    _c("data_path_missing", "train", [*TINY, *TOKENS, WORKDIR], "data.path=", "/data"),
    _c(
        "data_meta_garbled",
        "train",
        [*TINY, *TOKENS, WORKDIR],
        "meta.json",
        setup=lambda p: _garble(p.prepared() / "meta.json"),
    ),
    _c(
        "data_split_truncated",
        "train",
        [*TINY, *TOKENS, WORKDIR],
        "train-00000.bin",
        setup=_truncated_split,
    ),
    # train: settings
    _c(
        "intra_does_not_divide",
        "train",
        [*TINY, WORKDIR, "--config.parallel.intra=3"],
        "parallel.intra=3 must divide the 1 devices",
    ),
    _c(
        "attention_impl",
        "train",
        [*TINY, WORKDIR, "--config.model.attention_impl=magic"],
        "model.attention_impl='magic' is invalid",
        "'blockwise'",
    ),
    _c(
        "remat",
        "train",
        [*TINY, WORKDIR, "--config.model.remat=sometimes"],
        "model.remat='sometimes' is invalid",
        "'selective'",
    ),
    _c(
        "overlap_chunks_do_not_divide",
        "train",
        [*TINY, WORKDIR, "--config.parallel.overlap_chunks=3"],
        "parallel.overlap_chunks=3 must divide the 32 positions",
    ),
    _c(
        "collective_matmul_without_a_ring_form",
        "train",
        [
            *TINY,
            WORKDIR,
            "--config.parallel.collective_matmul=True",
            "--config.parallel.experts=ep_a2a",
        ],
        "parallel.collective_matmul=True has no exchange to rewrite",
        "tp, sp, ep_ag, etp, ep_etp",
    ),
    _c(
        "grad_exchange",
        "train",
        [*TINY, WORKDIR, "--config.parallel.grad_exchange=bf16"],
        "parallel.grad_exchange='bf16' is invalid",
        "fp32 or bf16_a2a",
    ),
    _c(
        "stages_beyond_the_devices",
        "train",
        [*TINY, WORKDIR, "--config.parallel.stages=2"],
        "parallel.intra=1 x parallel.stages=2 must divide the 1 devices",
    ),
    _c(
        "repeats_without_a_pipeline",
        "train",
        [*TINY, WORKDIR, "--config.parallel.repeats=2"],
        "parallel.repeats=2 needs a pipeline (parallel.stages > 1)",
    ),
    _c(
        "microbatches_zero",
        "train",
        [*TINY, WORKDIR, "--config.parallel.microbatches=0"],
        "parallel.microbatches=0 is invalid",
    ),
    _c(
        "overlap_chunks_zero",
        "train",
        [*TINY, WORKDIR, "--config.parallel.overlap_chunks=0"],
        "parallel.overlap_chunks=0 is invalid",
    ),
    _c(
        "batch_size_zero",
        "train",
        [*TINY, WORKDIR, "--config.train.batch_size=0"],
        "train.batch_size=0 is invalid",
    ),
    _c(
        "config_without_get_config",
        "train",
        ["--config={root}/mine.py", WORKDIR],
        "mine.py: it defines no get_config()",
        setup=lambda p: p.file("mine.py", "x = 1\n"),
    ),
    _c(
        "config_that_raises",
        "train",
        ["--config={root}/mine.py", WORKDIR],
        "get_config() raised ZeroDivisionError",
        setup=lambda p: p.file("mine.py", "def get_config():\n    return 1 / 0\n"),
    ),
    _c("positional_argument", "train", [WORKDIR, "extra"], "unexpected arguments ['extra']"),
    _c(
        "coordinator_alone",
        "train",
        [*TINY, WORKDIR, "--coordinator=localhost:1"],
        "--coordinator='localhost:1' --num_processes=0",
    ),
    _c(
        "model_too_big",
        "train",
        [f"--config={ROOT}/configs/mixtral_8x7b.py", WORKDIR],
        "the plan needs",
        "GB are available",
    ),
    # plan
    _c("plan_gpus_zero", "plan", ["--gpus=0"], "--gpus=0: 0 is not a positive integer"),
    _c("plan_gpus_not_a_number", "plan", ["--gpus=abc"], "--gpus=abc"),
    _c("plan_unknown_gpu", "plan", ["--gpu=tpu9"], "--gpu=tpu9", "h800"),
    _c("plan_no_layout", "plan", ["--gpus=7"], "no layout splits 7 GPUs"),
    _c("plan_top_zero", "plan", ["--top=0"], "--top=0"),
    # comm_report
    _c(
        "compare_on_one_device",
        "comm_report",
        ["--compare=tp+etp,sp+ep_a2a"],
        "parallel.intra=1",
        "xla_force_host_platform_device_count",
    ),
    _c("compare_malformed", "comm_report", ["--compare=bogus"], "--compare entry 'bogus'"),
    # prepare
    _c(
        "prepare_input_missing",
        "prepare",
        ["--input={root}/nothing", "--output={root}/out"],
        "--input",
        "nothing does not exist",
    ),
    _c(
        "prepare_output_is_a_file",
        "prepare",
        ["--input={root}/blocker", "--output={root}/blocker"],
        "blocker is a file",
        setup=Place.file,
    ),
    _c(
        "prepare_output_under_a_file",
        "prepare",
        ["--input={root}/blocker", "--output={root}/blocker/out"],
        "lies under",
        setup=Place.file,
    ),
    _c(
        "prepare_output_already_prepared",
        "prepare",
        ["--input={root}/text.txt", "--output={root}/data"],
        "already holds a prepared corpus",
        setup=Place.prepared,
    ),
    _c(
        "prepare_disk_full",
        "prepare",
        ["--input={root}/big.txt", "--output={root}/disk/out"],
        "MB needed",
        "disk",
        setup=lambda p: (p.file("big.txt", "words " * 400_000), p.small_disk()),
    ),
    _c(
        "prepare_read_only_fs",
        "prepare",
        ["--input={root}/blocker", "--output={root}/ro/out"],
        "read-only",
        setup=lambda p: (p.file(), p.small_disk("ro", read_only=True)),
    ),
    _c(
        "prepare_val_fraction",
        "prepare",
        ["--input={root}/blocker", "--output={root}/out", "--val_fraction=1.5"],
        "--val_fraction=1.5 is invalid",
        setup=Place.file,
    ),
    _c(
        "prepare_tokenizer_missing",
        "prepare",
        ["--input={root}/blocker", "--output={root}/out", "--tokenizer={root}/tok.json"],
        "tok.json",
        setup=Place.file,
    ),
    _c("prepare_no_input_flag", "prepare", ["--output={root}/out"], "--input"),
    # launch/local.py
    _c(
        "launch_bad_setting",
        "launch",
        ["-n", "2", "--", WORKDIR, "--config.trian.steps=1"],
        "unknown setting trian.steps",
    ),
    _c(
        "launch_invalid_setting_leaves_no_logs",
        "launch",
        ["-n", "2", "--devices", "1", "--", *TINY, WORKDIR, "--config.train.batch_size=0"],
        "train.batch_size=0 is invalid",
    ),
    _c(
        "launch_workdir_flag_apart",
        "launch",
        ["-n", "1", "--devices", "1", "--", *TINY, "--workdir", "{root}/blocker"],
        "blocker is a file",
        setup=Place.file,
    ),
    _c("launch_no_processes", "launch", ["-n", "0"], "-n=0"),
    _c("launch_processes_not_a_number", "launch", ["-n", "abc"], "-n: invalid int value: 'abc'"),
    # train: where a fresh run's weights come from
    _c(
        "init_from_another_model",
        "train",
        [
            *TINY,
            "--workdir={root}/new",
            "--config.train.init_from={root}/run",
            "--config.model.num_layers=3",
        ],
        "train.init_from='",
        "is another model: model.num_layers=2 there, 3 here",
        setup=Place.trained,
    ),
    _c(
        "init_from_nothing",
        "train",
        [*TINY, WORKDIR, "--config.train.init_from={root}/nowhere"],
        "nowhere' is neither a moe_jax run directory",
    ),
    _c(
        "upcycle_without_source",
        "train",
        [*TINY, WORKDIR, "--config.train.upcycle=copy"],
        "train.upcycle='copy' is invalid: upcycles the model of train.init_from",
    ),
    # sample and evaluate: a run's checkpoint
    _c("sample_no_workdir", "sample", ["--prompt=x"], "sample needs --workdir=RUN"),
    _c("sample_top_p_zero", "sample", [WORKDIR, "--top_p=0"], "--top_p=0.0 must be in (0, 1]"),
    _c("sample_not_a_run", "sample", ["--workdir={root}"], "no config.json (not a moe_jax run"),
    _c(
        "evaluate_changes_the_model",
        "evaluate",
        [WORKDIR, "--config.model.num_layers=3"],
        "--config.model.num_layers: this command keeps the run's model settings",
    ),
    _c("evaluate_negative_batches", "evaluate", [WORKDIR, "--batches=-1"], "--batches=-1"),
    # convert: the command and its directories (the checkpoint's own damage: test_hf_convert)
    _c("convert_no_command", "convert", ["--hf={root}/hf", WORKDIR], "give one command"),
    _c("convert_import_no_hf", "convert", ["import", WORKDIR], "import needs --hf=DIR"),
    _c(
        "convert_import_no_config_json",
        "convert",
        ["import", "--hf={root}/hf", WORKDIR],
        "hf: no config.json",
        setup=lambda p: (p.root / "hf").mkdir(),
    ),
    _c(
        "convert_export_not_a_run",
        "convert",
        ["export", "--workdir={root}", "--hf={root}/out"],
        "no config.json (not a moe_jax run directory)",
    ),
    _c(
        "launch_missing_config",
        "launch",
        ["-n", "1", "--", "--config={root}/nope.py"],
        "nope.py: no such file",
    ),
]


# Real subprocesses: for every command a flag error and an error of its own.
REAL = {
    "train-trian_section",
    "workdir_is_a_file",
    "resume_changed_batch_size",
    "plan-trian_section",
    "plan_no_layout",
    "comm_report-trian_section",
    "compare_on_one_device",
    "prepare_input_missing",
    "prepare_disk_full",
    "launch_no_processes",
    "launch_bad_setting",
    "sample_not_a_run",
    "evaluate_changes_the_model",
    "convert_import_no_config_json",
}


def test_there_are_enough_cases():
    assert len(CASES) >= 40
    assert {case.command for case in CASES} == set(COMMANDS)
    real = [case for case in CASES if case.name in REAL]
    assert len(real) == len(REAL)  # each name is a case's
    assert {case.command for case in real} == set(COMMANDS)


@pytest.mark.parametrize("case", CASES, ids=names(CASES))
def test_bad_input_is_one_line_and_changes_nothing(tmp_path: Path, bad_input_run: Path, case: Case):
    check(tmp_path, bad_input_run, case, real=case.name in REAL)
