"""Bad FP8 block-scaled checkpoints given to `convert import` (the rules:
`tests/bad_inputs.py`): a tiny Mixtral quantised as DeepSeek-V3 ships its weights
(`tests.fp8_checkpoint`: float8_e4m3fn, 128x128 float32 scales in a shard of their own;
lm_head [200, 40] has 2 scale rows), then damaged one way per case; each is refused in
one line naming the tensor or setting, before any tensor is read, writing nothing."""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.flax import save_file
from safetensors.numpy import load_file

from tests.bad_inputs import WORKDIR, Case, Place, check, names
from tests.bad_inputs import case as _c
from tests.fp8_checkpoint import write_quantised

D, VOCAB, FFN, EXPERTS = 40, 200, 24, 4
CONFIG = {
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "vocab_size": VOCAB,
    "hidden_size": D,
    "intermediate_size": FFN,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_local_experts": EXPERTS,
    "num_experts_per_tok": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}
IMPORT = ["import", "--hf={root}/hf", WORKDIR]
SCALES = "model-00002-of-00002.safetensors"


def _tensors() -> dict[str, np.ndarray]:
    p = "model.layers.0."
    shapes = {
        "model.embed_tokens.weight": (VOCAB, D),
        "model.norm.weight": (D,),
        "lm_head.weight": (VOCAB, D),
        p + "input_layernorm.weight": (D,),
        p + "post_attention_layernorm.weight": (D,),
        p + "self_attn.q_proj.weight": (D, D),
        p + "self_attn.k_proj.weight": (D // 2, D),
        p + "self_attn.v_proj.weight": (D // 2, D),
        p + "self_attn.o_proj.weight": (D, D),
        p + "block_sparse_moe.gate.weight": (EXPERTS, D),
    }
    for e in range(EXPERTS):
        q = f"{p}block_sparse_moe.experts.{e}."
        shapes.update(
            {q + "w1.weight": (FFN, D), q + "w2.weight": (D, FFN), q + "w3.weight": (FFN, D)}
        )
    rng = np.random.default_rng(0)
    return {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}


def _quantised(name: str) -> str | None:
    plain = name.endswith(("norm.weight", "gate.weight")) or "embed" in name
    return None if plain else "f32"


def _fp8(place: Place, damage: str) -> None:
    hf = place.root / "hf"
    write_quantised(_tensors(), CONFIG, hf, _quantised)
    config = json.loads((hf / "config.json").read_text())
    quantization = config["quantization_config"]
    if damage == "no scales":
        (hf / SCALES).unlink()
        index = json.loads((hf / "model.safetensors.index.json").read_text())
        index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != SCALES}
        (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    elif damage == "scale shape":
        scales = load_file(str(hf / SCALES))
        scales["lm_head.weight_scale_inv"] = scales["lm_head.weight_scale_inv"][:1]
        save_file({k: jnp.asarray(v) for k, v in scales.items()}, str(hf / SCALES))
    elif damage == "no quantization_config":
        del config["quantization_config"]
    else:
        key, value = damage.split("=")
        quantization[key] = json.loads(value)
    (hf / "config.json").write_text(json.dumps(config))


def _fp8_case(name: str, damage: str, *expect: str) -> Case:
    return _c(name, "convert", IMPORT, *expect, setup=lambda place: _fp8(place, damage))


CASES = [
    _fp8_case(
        "fp8_without_scales",
        "no scales",
        "tensor lm_head.weight is F8_E4M3",
        "has no block scales lm_head.weight_scale_inv",
    ),
    _fp8_case(
        "fp8_scale_of_wrong_shape",
        "scale shape",
        "tensor lm_head.weight_scale_inv has shape [1, 1], expected [2, 1]",
    ),
    _fp8_case(
        "fp8_without_quantization_config",
        "no quantization_config",
        "has no quantization_config",
    ),
    _fp8_case(
        "fp8_unsupported_method",
        'quant_method="awq"',
        "quantization_config.quant_method='awq' is not supported; supported: 'fp8'",
    ),
    _fp8_case(
        "fp8_unsupported_block_size",
        "weight_block_size=[128]",
        "quantization_config.weight_block_size=[128] is not supported",
    ),
    _fp8_case(
        "fp8_unsupported_format",
        'fmt="e5m2"',
        "quantization_config.fmt='e5m2' is not supported; supported: 'e4m3'",
    ),
]


@pytest.mark.parametrize("case", CASES, ids=names(CASES))
def test_bad_fp8_checkpoint_is_one_line_and_writes_nothing(tmp_path: Path, case: Case):
    check(tmp_path, tmp_path / "no-trained-run", case)  # no case copies a trained run
