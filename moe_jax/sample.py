"""`python -m moe_jax.sample --workdir RUN [--prompt TEXT] [--max_new_tokens N]
[--temperature T] [--top_p P] [--seed S] [--num_samples K] [--tokenizer SPEC]`.

Text from a run's newest checkpoint, generated with a KV cache
(`moe_jax.model.decode`): the prompt in one pass, then a token at a time. The
parameters are placed under `--config.parallel.*` (default: this machine's devices,
data parallel). The tokenizer is the run's (`byte` for the embedded corpus) unless
`--tokenizer` names another (a tokenizer.json, say an imported model's). Exit status
0, or 1 on bad input.
"""

from __future__ import annotations

import sys
from pathlib import Path

from absl import app, flags

from moe_jax import cli

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
    from moe_jax.data.tokenizer import load_tokenizer

    if not spec:
        spec = "byte"
        if config.data.source == "tokens":
            import json

            spec = json.loads((Path(config.data.path) / "meta.json").read_text())["tokenizer"]
    tokenizer = load_tokenizer(spec)
    if tokenizer.vocab_size > config.model.vocab_size:
        raise ValueError(
            f"tokenizer {spec!r} has {tokenizer.vocab_size} ids but the model "
            f"model.vocab_size={config.model.vocab_size}; pass the model's own --tokenizer"
        )
    return tokenizer


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

    config, _, _, _, state = saved_run.restore(workdir, ParallelConfig(**parallel))
    tokenizer = _tokenizer(config, spec)
    ids = tokenizer.encode(prompt) if prompt else np.array([tokenizer.bos_id], np.int32)
    num, new = settings["num_samples"], settings["max_new_tokens"]
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


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise SystemExit(f"error: unexpected arguments {argv[1:]}")
    if not _WORKDIR.value:
        raise SystemExit("error: sample needs --workdir=RUN (a run directory)")
    _check_flags()
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
    for i, text in enumerate(texts):
        if len(texts) > 1:
            print(f"--- sample {i + 1}")
        print(_PROMPT.value + text)


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse)
