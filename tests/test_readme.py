"""README.md's configuration reference lists exactly the settings of moe_jax.config.Config,
each with its real default.

Rule for the default column: the cell is one Python literal in backticks (`8`, `0.003`,
`1e-6`, `True`, `'softmax'`, `''`). It is read with `ast.literal_eval` and must equal the
dataclass default and have the same type, so `0.003` and `3e-3` are both accepted, while
`0` for a float default, `'1'` for an int or an unquoted string is not.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import re

from moe_jax.config import SECTIONS, Config

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
SECTION = "## Configuration reference"
ROW = re.compile(r"^\|\s*`(?P<name>[a-z_]+\.[a-z_0-9]+)`\s*\|\s*`(?P<default>[^`]*)`\s*\|(.+)\|$")


def _reference_rows() -> list[str]:
    """The table lines of the README section, header and separator removed."""
    text = README.read_text()
    assert SECTION in text, f"README.md has no {SECTION!r} section"
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
        f"README {SECTION!r} is out of date with moe_jax/config.py:\n"
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
            wrong.append(f"{name}: README says `{cell}`, config.py has `{expected!r}`")
    assert not wrong, "wrong defaults in README's configuration reference:\n  " + "\n  ".join(wrong)


def test_sections_match_config():
    # The README rows are built from SECTIONS; make sure it covers Config exactly.
    assert [f.name for f in dataclasses.fields(Config)] == list(SECTIONS)
    for field in dataclasses.fields(Config):
        assert isinstance(field.default, SECTIONS[field.name])


def test_reference_table_is_the_generated_one():
    """The README's table is `python -m moe_jax.config_help --markdown`, the one source
    of `--config_help` too."""
    from moe_jax.config_help import markdown

    assert markdown() in README.read_text(), (
        "regenerate the README's configuration table: python -m moe_jax.config_help --markdown"
    )
