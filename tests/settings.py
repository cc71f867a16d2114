"""Configs for tests, written as {"section.name": value} overrides of the defaults."""

from __future__ import annotations

from moe_jax.config import Config, load, to_config_dict


def make_config(overrides: dict | None = None) -> Config:
    """The default config with "section.name" overrides, validated by config.load."""
    raw = to_config_dict(Config()).to_dict()
    for key, value in (overrides or {}).items():
        section, name = key.split(".")
        raw[section][name] = value
    return load(raw)
