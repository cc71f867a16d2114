"""`python -m moe_jax.sample --workdir RUN [--prompt TEXT] [--max_new_tokens N]
[--temperature T] [--top_p P] [--seed S] [--num_samples K] [--tokenizer SPEC]`.

Text from a run's newest checkpoint, generated with a KV cache
(`moe_jax.model.decode`): the prompt in one pass, then a token at a time. The
parameters are placed under `--config.parallel.*` (default: this machine's devices,
data parallel). The tokenizer is the run's (`byte` for the embedded corpus) unless
`--tokenizer` names another (a tokenizer.json, say an imported model's). A length
that cannot fit in memory is refused before anything compiles. Exit status 0, 1 on
bad input, 130 on SIGINT or SIGTERM.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

from absl import app, flags

from moe_jax import cli, paths, signals

_CONFIG = cli.define_config_flag()
_WORKDIR = flags.DEFINE_string("workdir", None, "The run directory to sample from.")
_PROMPT = flags.DEFINE_string("prompt", "", "Text the samples continue (default: none).")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 200, "Tokens generated per sample.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.8, "Softmax temperature; 0 is greedy.")
_TOP_P = flags.DEFINE_float("top_p", 0.95, "Nucleus sampling: the probability mass kept.")
_SEED = flags.DEFINE_integer("seed", 0, "Random seed of the sampling.")
_NUM = flags.DEFINE_integer("num_samples", 1, "Samples, generated side by side.")
_TOKENIZER = flags.DEFINE_string("tokenizer", "", "byte or a tokenizer.json (default: the run's).")


def _check_flags() -> None:
    problems = [
        (_MAX_NEW.value >= 1, f"--max_new_tokens={_MAX_NEW.value} must be >= 1"),
        (_TEMPERATURE.value >= 0, f"--temperature={_TEMPERATURE.value} must be >= 0"),
        (0 < _TOP_P.value <= 1, f"--top_p={_TOP_P.value} must be in (0, 1]"),
        (_NUM.value >= 1, f"--num_samples={_NUM.value} must be >= 1"),
    ]
    for ok, message in problems:
        if not ok:
            raise SystemExit(f"error: {message}")


def _tokenizer(config, spec: str):
    """The tokenizer `spec` names, else the run's (its corpus's copy); one line for a
    missing or unreadable one."""
    from moe_jax.config_sources import tokenizer_directory
    from moe_jax.data.token_files import read_meta, tokenizer_spec
    from moe_jax.data.tokenizer import load_tokenizer

    flag = "--tokenizer"
    if spec and spec != "byte":
        paths.check_input(spec, flag, "file")
    if not spec:
        spec, flag = "byte", "the run's tokenizer"
        if config.data.source == "tokens":
            data = tokenizer_directory(config.data)  # data.path, or a mixture's first source
            spec = tokenizer_spec(data, read_meta(data))
            if spec != "byte":
                where = (
                    f"data.path={data}" if data == config.data.path else f"data.sources ({data})"
                )
                paths.check_input(spec, f"the tokenizer of {where}", "file")
    tokenizer = load_tokenizer(spec)
    if tokenizer.vocab_size > config.model.vocab_size:
        raise ValueError(
            f"tokenizer {spec!r} has {tokenizer.vocab_size} ids but the model "
            f"model.vocab_size={config.model.vocab_size}; pass the model's own --tokenizer"
        )
    return tokenizer


def check_memory(config, num: int, prompt: int, new: int) -> None:
    """A one-line ValueError, before anything compiles, when `num` sequences of a
    `prompt` and `new` tokens cannot fit: the KV cache and the prompt pass's logits and
    attention scores, counted whole on one device beside the parameters."""
    import numpy as np

    from moe_jax import memory_check

    m, length = config.model, prompt + new
    itemsize = np.dtype(m.dtype).itemsize
    from moe_jax.model.decode import cached_widths

    per_token = sum(math.prod(width) for width in cached_widths(m))  # MLA: the latent
    cache = m.num_layers * num * length * per_token * itemsize
    work = num * prompt * (m.vocab_size + m.num_heads * length) * 4
    params = memory_check.parameter_counts(config)[0] * 4
    limit, source = memory_check.device_limit(config)
    if cache + work + params > limit:
        raise ValueError(
            f"--max_new_tokens={new} with --num_samples={num}: {length} tokens per "
            f"sample need about {(cache + work + params) / 1e9:,.2f} GB (KV cache "
            f"{cache / 1e9:,.2f} GB), more than the {limit / 1e9:,.2f} GB available "
            f"({source}); lower --max_new_tokens or --num_samples"
        )


def generate(workdir: Path, parallel, prompt: str, spec: str, settings: dict) -> list[str]:
    """`settings['num_samples']` continuations of `prompt`, decoded."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from moe_jax import saved_run
    from moe_jax.config import ParallelConfig
    from moe_jax.model import decode
    from moe_jax.parallel.layout import SINGLE_DEVICE
    from moe_jax.train_step import abstract_state

    saved = saved_run.saved_config(workdir)
    tokenizer = _tokenizer(saved, spec)
    ids = tokenizer.encode(prompt) if prompt else np.array([tokenizer.bos_id], np.int32)
    num, new = settings["num_samples"], settings["max_new_tokens"]
    check_memory(saved, num, len(ids), new)
    config, _, _, _, state = saved_run.restore(workdir, ParallelConfig(**parallel))
    graphdef, _ = abstract_state(config, SINGLE_DEVICE)  # GSPMD partitions it by the params
    params, biases = state.params, state.biases
    forward = jax.jit(lambda p, b, *args: decode.forward(nnx.merge(graphdef, p, b), *args))
    step = lambda *args: forward(params, biases, *args)
    pick = jax.jit(decode.next_token, static_argnums=(2, 3))
    cache = decode.empty_cache(nnx.merge(graphdef, params, biases), num, len(ids) + new)
    tokens = jnp.asarray(np.tile(ids, (num, 1)), jnp.int32)
    logits, cache = step(tokens, cache, 0)
    key = jax.random.key(settings["seed"])
    out = []
    for i in range(new):
        key, sub = jax.random.split(key)
        token = pick(logits[:, -1], sub, settings["temperature"], settings["top_p"])
        out.append(np.asarray(token))
        if i + 1 < new:
            logits, cache = step(token[:, None].astype(jnp.int32), cache, len(ids) + i)
    generated = np.stack(out, axis=1)
    texts = []
    for row in generated:
        end = np.flatnonzero(row == tokenizer.eos_id)
        texts.append(tokenizer.decode(row[: end[0]] if end.size else row))
    return texts


@signals.interruptible("sampling")
def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise SystemExit(f"error: unexpected arguments {argv[1:]}")
    if not _WORKDIR.value:
        raise SystemExit("error: sample needs --workdir=RUN (a run directory)")
    _check_flags()
    try:
        paths.check_input(_WORKDIR.value, "--workdir", "dir")
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    given = cli.overridden(sys.argv, _CONFIG.value, ("parallel",))
    settings = dict(
        max_new_tokens=_MAX_NEW.value,
        temperature=_TEMPERATURE.value,
        top_p=_TOP_P.value,
        seed=_SEED.value,
        num_samples=_NUM.value,
    )
    try:
        texts = generate(
            Path(_WORKDIR.value), given["parallel"], _PROMPT.value, _TOKENIZER.value, settings
        )
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    except Exception as error:  # XLA's out-of-memory, past what check_memory foresaw
        if "RESOURCE_EXHAUSTED" not in str(error):
            raise
        print(
            f"error: out of device memory while sampling (--max_new_tokens="
            f"{_MAX_NEW.value}, --num_samples={_NUM.value}); lower them",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(1) from None
    for i, text in enumerate(texts):
        if len(texts) > 1:
            print(f"--- sample {i + 1}")
        print(_PROMPT.value + text)


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse)
