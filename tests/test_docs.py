"""The documentation cannot go stale silently.

* docs/configuration.md's table lists exactly the settings of moe_jax.config.Config,
  each with its real default, and is the generated one
  (`python -m moe_jax.config_help --markdown`).
* Every fenced code block in README.md and docs/*.md says what it is on its opening line
  (docs/development.md, "Code blocks in the documentation"): `example` (not run),
  `test` (run here: a `bash` block from the repository root, a `python` block in a fresh
  interpreter; it must exit 0) or `output` (the exact stdout of the `bash test` block
  before it). The test blocks are cheap: no training, nothing big compiled.
* Every relative link in those files points at a file that exists.
* README.md's count of bad-input cases is the number that `tests/test_bad_inputs*.py`
  run, and every command has at least five.

Rule for the default column: the cell is one Python literal in backticks (`8`, `0.003`,
`1e-6`, `True`, `'softmax'`, `''`). It is read with `ast.literal_eval` and must equal the
dataclass default and have the same type, so `0.003` and `3e-3` are both accepted, while
`0` for a float default, `'1'` for an int or an unquoted string is not.
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import importlib
import os
import pathlib
import re
import subprocess
import sys

import pytest

from moe_jax.config import SECTIONS, Config

ROOT = pathlib.Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "docs" / "configuration.md"
SECTION = "## Every setting"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKERS = ("example", "test", "output")
ROW = re.compile(r"^\|\s*`(?P<name>[a-z_]+\.[a-z_0-9]+)`\s*\|\s*`(?P<default>[^`]*)`\s*\|(.+)\|$")


def _reference_rows() -> list[str]:
    """The table lines of the reference section, header and separator removed."""
    text = REFERENCE.read_text()
    assert SECTION in text, f"docs/configuration.md has no {SECTION!r} section"
    body = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    tables = re.findall(r"(?:^\|.*\|$\n?)+", body, flags=re.MULTILINE)
    assert len(tables) == 1, f"expected one table under {SECTION!r}, found {len(tables)}"
    lines = tables[0].strip().splitlines()
    assert re.fullmatch(r"\|(\s*-+\s*\|){3}", lines[1].replace(":", "")), lines[:2]
    return lines[2:]


def _documented() -> dict[str, str]:
    """setting -> its default cell, checking each row's shape and that no row repeats."""
    documented: dict[str, str] = {}
    for line in _reference_rows():
        match = ROW.match(line)
        assert match, f"row is not | `section.key` | `default` | meaning |: {line!r}"
        name = match["name"]
        assert name not in documented, f"{name} is listed twice"
        assert match.group(3).strip(), f"{name} has no meaning"
        documented[name] = match["default"]
    return documented


def _defaults() -> dict[str, object]:
    """section.key -> default, for every field of every Config section."""
    defaults = {}
    for section in dataclasses.fields(Config):
        instance = SECTIONS[section.name]()  # also covers fields with a default_factory
        for field in dataclasses.fields(instance):
            defaults[f"{section.name}.{field.name}"] = getattr(instance, field.name)
    return defaults


def test_reference_lists_exactly_the_config_fields():
    documented, fields = set(_documented()), set(_defaults())
    missing, extra = sorted(fields - documented), sorted(documented - fields)
    assert not missing and not extra, (
        f"docs/configuration.md {SECTION!r} is out of date with moe_jax/config.py:\n"
        f"  settings missing from the table: {missing}\n"
        f"  table rows that are not settings: {extra}"
    )


def test_reference_defaults_match_the_dataclasses():
    defaults = _defaults()
    wrong = []
    for name, cell in _documented().items():
        if name not in defaults:
            continue  # reported by the test above
        try:
            value = ast.literal_eval(cell)
        except (ValueError, SyntaxError):
            wrong.append(f"{name}: `{cell}` is not a Python literal (want `{defaults[name]!r}`)")
            continue
        expected = defaults[name]
        if type(value) is not type(expected) or value != expected:
            wrong.append(f"{name}: the page says `{cell}`, config.py has `{expected!r}`")
    assert not wrong, "wrong defaults in docs/configuration.md:\n  " + "\n  ".join(wrong)


def test_sections_match_config():
    # The reference rows are built from SECTIONS; make sure it covers Config exactly.
    assert [f.name for f in dataclasses.fields(Config)] == list(SECTIONS)
    for field in dataclasses.fields(Config):
        assert isinstance(field.default, SECTIONS[field.name])


def test_reference_table_is_the_generated_one():
    """The page's table is `python -m moe_jax.config_help --markdown`, the one source
    of `--config_help` too."""
    from moe_jax.config_help import markdown

    assert markdown() in REFERENCE.read_text(), (
        "regenerate the table of docs/configuration.md: python -m moe_jax.config_help --markdown"
    )


@dataclasses.dataclass(frozen=True)
class Block:
    page: pathlib.Path
    line: int  # of the opening fence, 1-based
    language: str
    marker: str  # the word after the language, "" when there is none
    text: str

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,})(?P<info>.*)$")


def blocks(page: pathlib.Path) -> list[Block]:
    """The fenced code blocks of a markdown page, in order."""
    found, lines, i = [], page.read_text().splitlines(), 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        words = opening["info"].split()
        indent, fence, body = opening["indent"], opening["fence"], []
        i += 1
        while i < len(lines) and lines[i].strip() != fence:
            body.append(lines[i].removeprefix(indent))
            i += 1
        assert i < len(lines), f"{page.relative_to(ROOT)}: a code block is never closed"
        start = i - len(body)
        language, marker = [*words, "", ""][:2]
        found.append(Block(page, start, language, marker, "\n".join(body) + "\n"))
        i += 1
    return found


ALL_BLOCKS = [block for page in PAGES for block in blocks(page)]
TEST_BLOCKS = [block for block in ALL_BLOCKS if block.marker == "test"]


def test_every_code_block_is_run_or_marked_as_an_example():
    unmarked = [
        f"{block}: ```{block.language} {block.marker}".rstrip()
        for block in ALL_BLOCKS
        if block.marker not in MARKERS
    ]
    assert not unmarked, (
        "code blocks that no test runs and that do not say they are examples (write "
        "```bash example, or ```bash test for a cheap command this test should run):\n  "
        + "\n  ".join(unmarked)
    )
    wrong = [
        f"{b}: ```{b.language} test" for b in TEST_BLOCKS if b.language not in ("bash", "python")
    ]
    assert not wrong, "only bash and python blocks can be run:\n  " + "\n  ".join(wrong)


def test_every_output_block_follows_a_command_that_is_run():
    for page in PAGES:
        previous = None
        for block in blocks(page):
            if block.marker == "output":
                assert previous is not None and previous.marker == "test", (
                    f"{block}: an output block must follow a ```bash test block"
                )
                assert previous.language == "bash", f"{block}: it follows a python block"
            previous = block


def test_the_pages_have_blocks_of_each_kind():
    """The parser finds what the pages hold (a test that cannot fail is a defect)."""
    kinds = {block.marker for block in ALL_BLOCKS}
    assert set(MARKERS) <= kinds, kinds
    assert len(ALL_BLOCKS) >= 10, [str(block) for block in ALL_BLOCKS]


def _expected_output(block: Block) -> str | None:
    """The text of the `output` block right after `block` on its page, if any."""
    page_blocks = blocks(block.page)
    index = [b.line for b in page_blocks].index(block.line)
    following = page_blocks[index + 1] if index + 1 < len(page_blocks) else None
    return following.text if following is not None and following.marker == "output" else None


def _stripped(text: str) -> list[str]:
    return [line.rstrip() for line in text.strip().splitlines()]


@pytest.mark.parametrize("block", TEST_BLOCKS, ids=str)
def test_code_block_runs(block: Block, tmp_path):
    """`python` in a bash block is this test's interpreter; the block runs from the
    repository root with the repository on the path, as a user's shell would."""
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (shim / "python").chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{shim}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": str(ROOT),
    }
    if block.language == "bash":
        command = ["bash", "-euo", "pipefail", "-c", block.text]
    else:
        command = [sys.executable, "-c", block.text]
    run = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert run.returncode == 0, f"{block} failed:\n{run.stderr[-3000:]}"
    expected = _expected_output(block)
    if expected is not None:
        assert _stripped(run.stdout) == _stripped(expected), (
            f"{block}: the output shown on the page is not what the command prints now:\n"
            f"{run.stdout}"
        )


LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")


def _anchors(page: pathlib.Path) -> set[str]:
    """GitHub's anchors of the page's headings (lower case, punctuation dropped, spaces
    as hyphens), code blocks left out."""
    anchors, fence = set(), None
    for line in page.read_text().splitlines():
        opening = FENCE.match(line)
        if opening and (fence is None or line.strip() == fence):
            fence = opening["fence"] if fence is None else None
        elif fence is None and line.startswith("#"):
            heading = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", heading).replace(" ", "-"))
    return anchors


def test_relative_links_point_at_files_and_headings_that_exist():
    broken = []
    for page in PAGES:
        for match in LINK.finditer(page.read_text()):
            target, _, anchor = match["target"].partition("#")
            if "://" in target or target.startswith("mailto:"):
                continue
            path = page.parent / target if target else page
            if not path.exists() or (
                anchor and path.suffix == ".md" and anchor not in _anchors(path)
            ):
                broken.append(f"{page.relative_to(ROOT)}: {match['target']}")
    assert not broken, "links to files or headings that do not exist:\n  " + "\n  ".join(broken)


def test_readme_counts_the_bad_input_cases():
    modules = sorted((ROOT / "tests").glob("test_bad_inputs*.py"))
    cases = [c for m in modules for c in importlib.import_module(f"tests.{m.stem}").CASES]
    per_command = collections.Counter(case.command for case in cases)
    from tests.commands import COMMANDS

    assert {command: per_command[command] for command in COMMANDS if per_command[command] < 5} == {}
    said = re.search(r"(\d+) bad-input cases", (ROOT / "README.md").read_text())
    assert said, "README.md does not say how many bad-input cases the tests run"
    assert int(said[1]) == len(cases), f"README.md says {said[1]}; the tests run {len(cases)}"
