"""`data.sources`: a mixture of prepared directories, each with a weight and a name.

Written `DIR:WEIGHT:NAME,DIR:WEIGHT:NAME` (one string, so that the command line and a
run's config.json hold it as they hold every other setting); a config file may give a
list of (DIR, WEIGHT, NAME) instead, which `as_text` turns into that string. Like
`moe_jax.config`, this module imports no jax: what needs the files (are they prepared,
with one tokenizer, within the vocabulary) is checked when the data opens
(`moe_jax.data.mixture`), still before anything compiles.
"""

from __future__ import annotations

import math
import re
from typing import Any, NamedTuple

from moe_jax import config_rules

FORM = "DIR:WEIGHT:NAME,DIR:WEIGHT:NAME (e.g. data/web:0.7:web,data/code:0.3:code)"
_NAME = re.compile(r"[A-Za-z0-9_.-]+")  # a name is a metric key: val_loss/<name>


class Source(NamedTuple):
    path: str
    weight: float
    name: str


def as_text(value: Any) -> Any:
    """A config file's list of (DIR, WEIGHT, NAME) as the string form; anything else as is
    (the type check then names what was given)."""
    if isinstance(value, list | tuple) and all(isinstance(v, list | tuple) for v in value):
        return ",".join(":".join(str(part) for part in entry) for entry in value)
    return value


def parse(text: str) -> tuple[Source, ...]:
    """The sources `text` names (none for ""), or a one-line ValueError."""
    if not text:
        return ()
    found = []
    for entry in text.split(","):
        parts = entry.rsplit(":", 2)  # a directory may hold ':'; a weight or name may not
        config_rules.check(len(parts) == 3 and all(parts), "data.sources", text, f"write {FORM}")
        path, weight, name = parts
        try:
            value = float(weight)
        except ValueError:
            value = math.nan
        config_rules.check(
            math.isfinite(value) and value >= 0,
            "data.sources",
            text,
            f"the weight {weight!r} of {name!r} must be a finite number >= 0",
        )
        config_rules.check(
            bool(_NAME.fullmatch(name)),
            "data.sources",
            text,
            f"the name {name!r} must be letters, digits, '_', '-' or '.' (it names a metric)",
        )
        found.append(Source(path, value, name))
    return tuple(found)


def tokenizer_directory(d: Any) -> str:
    """The prepared directory whose tokenizer the run's ids are in: data.path, or a
    mixture's first source (every source has the same tokenizer: checked at start)."""
    sources = parse(d.sources) if d.sources else ()
    return sources[0].path if sources else d.path


def validate(d: Any) -> None:
    """The data section's sources, and how they sit with data.source and data.path."""
    sources = parse(d.sources)
    config_rules.check(
        d.source != "tokens" or bool(d.path) or bool(sources),
        "data.path",
        d.path,
        "data.source='tokens' needs the directory written by moe_jax.data.prepare",
    )
    if not sources:
        return
    names = [s.name for s in sources]
    twice = sorted({n for n in names if names.count(n) > 1})
    config_rules.check(
        not twice,
        "data.sources",
        d.sources,
        f"the name {twice[0]!r} is given twice" if twice else "",
    )
    config_rules.check(
        sum(s.weight for s in sources) > 0,
        "data.sources",
        d.sources,
        "every weight is 0: at least one must be > 0",
    )
    config_rules.check(
        not d.path,
        "data.path",
        d.path,
        "is ambiguous beside data.sources: give one directory in data.path or a mixture "
        "in data.sources (clear the other)",
    )
    config_rules.check(
        d.source == "tokens",
        "data.source",
        d.source,
        "data.sources mixes prepared directories: add --config.data.source=tokens",
    )
