"""A run trained on prepared BPE data is used from another working directory, and after
the run and its data are moved together (the path rule: `moe_jax.paths`): sampled,
evaluated, resumed and exported; the tokenizer travels with the corpus and the export,
and the export is readable by other users under umask 022."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import stat
from pathlib import Path

import pytest

from moe_jax import config as config_lib
from moe_jax import paths, signals
from moe_jax.convert import commands
from moe_jax.data import prepare
from moe_jax.data.tokenizer import HFTokenizer
from tests.commands import TINY, run_command
from tests.test_data import train_bpe

TEXT = "".join(f"document {i}: the quick brown fox jumps over the dog.\n\n" for i in range(300))


def _train(cwd: Path, run: str, data: str, steps: int):
    args = [
        *TINY,
        "--config.train.eval_every=0",
        "--config.train.checkpoint_every=1",
        f"--config.train.steps={steps}",
        "--config.data.source=tokens",
        f"--config.data.path={data}",
        "--config.model.vocab_size=300",
        f"--workdir={run}",
    ]
    done = run_command(cwd, "train", args, warm=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _used_from(cwd: Path, run: Path) -> tuple[str, str]:
    """(a greedy sample, evaluate's line) of `run`, both started in `cwd`."""
    sample = run_command(
        cwd, "sample", [f"--workdir={run}", "--temperature=0", "--max_new_tokens=8"], warm=True
    )
    assert sample.returncode == 0, sample.stderr[-3000:]
    scored = run_command(cwd, "evaluate", [f"--workdir={run}"], warm=True)
    assert scored.returncode == 0, scored.stderr[-3000:]
    return sample.stdout, re.sub(r" of \S+\)", ")", scored.stdout.strip())


def test_run_on_bpe_data_works_from_anywhere_and_after_moving(tmp_path: Path, monkeypatch):
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    project.mkdir()
    elsewhere.mkdir()
    tokenizer = tmp_path / "bpe.json"
    assert train_bpe(tokenizer, ["<|endoftext|>"]) == 300
    (tmp_path / "text.txt").write_text(TEXT)
    assert prepare.main(["--input", str(tmp_path / "text.txt"), "--output", str(project / "data"),
                         "--tokenizer", str(tokenizer)]) == 0  # fmt: skip
    tokenizer.unlink()  # from now on only the corpus's own copy exists
    meta = json.loads((project / "data" / "meta.json").read_text())
    assert meta["tokenizer"] == "tokenizer.json"
    assert HFTokenizer(str(project / "data" / "tokenizer.json")).vocab_size == 300

    _train(project, "run", "data", steps=2)  # paths relative to where it started
    saved = json.loads((project / "run" / "config.json").read_text())
    assert saved["data"]["path"] == "../data"  # relative to the run directory

    here = _used_from(elsewhere, project / "run")
    assert here[0] and "step 2" in here[1] and "val loss" in here[1]

    moved = tmp_path / "moved" / "project"
    moved.parent.mkdir()
    shutil.move(project, moved)
    assert _used_from(elsewhere, moved / "run") == here  # the same sample, the same loss
    # Resumed with the run's saved settings alone: its relative data.path is read
    # against the moved run directory, not against where the command starts.
    args = [f"--workdir={moved / 'run'}", "--config.train.steps=3"]
    resumed = run_command(elsewhere, "train", args, warm=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "changed: train.steps 2 -> 3" in resumed.stdout + resumed.stderr
    assert "resumed from" in resumed.stdout + resumed.stderr
    assert json.loads((moved / "run" / "config.json").read_text())["data"]["path"] == "../data"

    # SIGTERM once the shards are written (sent for real): nothing is left behind.
    real_export = commands.hf_export.export

    def signalled(*args, **kwargs):
        files = real_export(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)
        return files

    monkeypatch.setattr(commands.hf_export, "export", signalled)
    export = signals.interruptible("the conversion")(commands.export_hf)
    with pytest.raises(SystemExit) as stopped:
        export(moved / "run", tmp_path / "cut", config_lib.ParallelConfig(), None, "float32", 5.0)
    assert stopped.value.code == 130
    assert not [p.name for p in tmp_path.iterdir() if "cut" in p.name]  # nor its staging
    monkeypatch.undo()

    # The export carries the tokenizer and is readable by everyone under umask 022.
    previous = os.umask(0o022)
    try:
        _, step, files = commands.export_hf(
            moved / "run", tmp_path / "hf", config_lib.ParallelConfig(), None, "float32", 5.0
        )
    finally:
        os.umask(previous)
    assert step == 3 and "tokenizer.json" in files
    copied = (tmp_path / "hf" / "tokenizer.json").read_bytes()
    assert copied == (moved / "data" / "tokenizer.json").read_bytes()
    for path in [tmp_path / "hf", *(tmp_path / "hf").rglob("*")]:
        mode = path.stat().st_mode
        want = stat.S_IROTH | (stat.S_IXOTH if path.is_dir() else 0)
        assert mode & want == want, f"{path}: {stat.filemode(mode)}"


def test_path_settings_are_stored_relative_to_the_run_when_near(tmp_path: Path, monkeypatch):
    """Within two levels above the run directory: relative (moves with it); farther:
    absolute (stays put); a run written before the rule (relative to where it started)
    still resolves when only that place exists."""
    run = tmp_path / "project" / "runs" / "a"
    assert paths.store(str(tmp_path / "project" / "data"), run) == "../../data"
    assert paths.store(str(run / "data"), run) == "data"
    far = tmp_path / "shared" / "corpus"
    assert paths.store(str(far), run) == str(far)  # three levels up: absolute
    (tmp_path / "project").mkdir()
    monkeypatch.chdir(tmp_path / "project")  # a relative setting is relative to here
    assert paths.store("data", run) == "../../data"
    saved = {"data": {"path": "../../data"}, "train": {"init_from": ""}}
    resolved = paths.resolved(saved, run)
    assert resolved["data"]["path"] == str(tmp_path / "project" / "data")
    assert resolved["train"]["init_from"] == ""
    (tmp_path / "project" / "legacy").mkdir()
    legacy = paths.resolved({"data": {"path": "legacy"}}, run)["data"]["path"]
    assert legacy == str(tmp_path / "project" / "legacy")
    # A checkpoint written before the rule (absolute) compares equal once re-stored.
    old = {"data": {"path": str(tmp_path / "project" / "data")}}
    assert paths.stored(paths.resolved(old, run), run)["data"]["path"] == "../../data"
    # A mixture's directories follow the same rule, each entry's weight and name kept.
    mixed = {"data": {"sources": f"data/web:0.7:web,{far}:0.3:code"}}
    stored = paths.stored(mixed, run)["data"]["sources"]
    assert stored == f"../../data/web:0.7:web,{far}:0.3:code"
    back = paths.resolved({"data": {"sources": stored}}, run)["data"]["sources"]
    assert back == f"{tmp_path / 'project' / 'data' / 'web'}:0.7:web,{far}:0.3:code"
