"""The train step of a real-size config compiled from abstract inputs (nothing
allocated), for the tests that hold XLA's memory per device against the memory model."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from moe_jax.data.documents import batch_keys
from moe_jax.parallel import mesh as mesh_lib
from moe_jax.train_step import RATE, train_step, with_shardings


def compile_step(config, layout, graphdef, abstract, shardings):
    """The trainer's step, compiled from abstract inputs: the state placed by
    `shardings`, the batch the loader gives (its document fields where masked)."""
    tokens = jax.ShapeDtypeStruct(
        (config.train.batch_size, config.train.seq_len),
        jnp.int32,
        sharding=mesh_lib.batch_sharding(layout),
    )
    step = jax.jit(
        partial(train_step, graphdef, config), donate_argnums=0, out_shardings=(shardings, None)
    )
    batch = dict.fromkeys(batch_keys(config.data), tokens)
    return step.lower(with_shardings(abstract, shardings), batch, RATE).compile()


def held_bytes(compiled) -> int:
    """XLA's arguments, temporaries and outputs per device, less what donation aliases."""
    m = compiled.memory_analysis()
    return (
        m.argument_size_in_bytes
        + m.temp_size_in_bytes
        + m.output_size_in_bytes
        - m.alias_size_in_bytes
    )


def step_bytes(config, layout, graphdef, abstract, shardings) -> int:
    """`held_bytes` of `compile_step`."""
    return held_bytes(compile_step(config, layout, graphdef, abstract, shardings))
