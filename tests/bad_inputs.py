"""The bad-input harness shared by `tests/test_bad_inputs*.py`: a case is a command line
typed as a user types it, run in a fresh directory that its setup may fill.

Every case must end with a non-zero exit status, no traceback on stderr, and a last
stderr line that is one `error:` line naming the setting or path at fault; and every
file under the directory it ran in (workdirs, data, configs) must be byte-identical
afterwards, except damaged checkpoints that the run moved to `checkpoints-damaged/`.

Cases run the command forked from a warm interpreter (`tests.warm`), which spares each
case Python's start and the imports; those a test file names `real` run as real
subprocesses, proving the command line itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

from moe_jax.data import prepare
from tests.commands import ROOT, TINY, run_command
from tests.small_disk import small_disk

TRAINED = [*TINY, "--config.train.eval_every=0", "--config.train.checkpoint_every=2"]
TRAINED_STEPS = 4  # checkpoints 2 and 4
TOKENS = ["--config.data.source=tokens", "--config.data.path={root}/data"]
WORKDIR = "--workdir={root}/run"


def snapshot(directory: Path) -> dict[str, str]:
    """Every file below `directory` with a hash of its bytes."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def train_template(run: Path) -> Path:
    """A finished TINY run in `run` with checkpoints 2 and 4, trained by the real command."""
    args = [*TRAINED, f"--config.train.steps={TRAINED_STEPS}", f"--workdir={run}"]
    done = run_command(ROOT, "train", args)
    assert done.returncode == 0, done.stderr[-3000:]
    return run


class Place:
    """The directory a case runs in, and what its setup may put there."""

    def __init__(self, root: Path, template: Path, stack: contextlib.ExitStack):
        self.root, self._template, self.stack = root, template, stack

    def file(self, name: str = "blocker", text: str = "a user's file\n") -> Path:
        (self.root / name).parent.mkdir(parents=True, exist_ok=True)
        (self.root / name).write_text(text)
        return self.root / name

    def trained(self) -> Path:
        """A finished run (checkpoints 2 and 4) of the TINY model in `run/`."""
        shutil.copytree(self._template, self.root / "run", symlinks=True)
        return self.root / "run"

    def prepared(self, name: str = "data") -> Path:
        text = self.root / "text.txt"
        text.write_text("".join(f"document {i}: the quick brown fox.\n\n" for i in range(300)))
        assert prepare.main(["--input", str(text), "--output", str(self.root / name)]) == 0
        return self.root / name

    def small_disk(self, name: str = "disk", size: str = "1m", read_only: bool = False) -> Path:
        return self.stack.enter_context(small_disk(self.root / name, size, read_only))


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    command: str
    args: tuple[str, ...]  # `{root}` is the directory the case runs in
    expect: tuple[str, ...]  # all in the last stderr line
    setup: Callable[[Place], object] | None = None
    moved: tuple[int, ...] = ()  # damaged checkpoints the run moves aside


def case(name, command, args, *expect, setup=None, moved=()) -> Case:
    return Case(name, command, tuple(args), expect, setup, moved)


def moved_aside(before: dict[str, str], steps: tuple[int, ...]) -> dict[str, str]:
    """`before` with the checkpoints of `steps` under run/checkpoints-damaged/."""
    moved = {}
    for path, digest in before.items():
        for step in steps:
            prefix = f"run/checkpoints/{step}/"
            if path.startswith(prefix):
                path = f"run/checkpoints-damaged/{step}/" + path[len(prefix) :]
        moved[path] = digest
    return moved


def check(tmp_path: Path, template: Path, case: Case, real: bool = False) -> None:
    """Run `case` in `tmp_path` and assert the rules of the module docstring."""
    with contextlib.ExitStack() as stack:
        place = Place(tmp_path, template, stack)
        if case.setup:
            case.setup(place)
        before = snapshot(tmp_path)
        args = [arg.replace("{root}", str(tmp_path)) for arg in case.args]
        done = run_command(tmp_path, case.command, args, warm=not real)
        assert done.returncode != 0, done.stdout[-2000:]
        first = done.stderr.find("Traceback")
        assert first < 0, done.stderr[:600] + " ... " + done.stderr[first : first + 1500]
        last = (done.stderr.strip().splitlines() or [""])[-1]
        assert "error: " in last, done.stderr[-2000:]
        for word in case.expect:
            assert word.replace("{root}", str(tmp_path)) in last, last
        assert snapshot(tmp_path) == moved_aside(before, case.moved)


def names(cases: Iterable[Case]) -> list[str]:
    return [c.name for c in cases]
