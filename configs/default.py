"""Tiny MoE model that trains in minutes on 2 CPU cores."""

from moe_jax.config import Config, to_config_dict


def get_config():
    return to_config_dict(Config())
