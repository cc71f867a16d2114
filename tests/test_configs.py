"""Every file in configs/ loads and validates; the published-model configs build
abstractly (no arrays allocated) with the published parameter counts and trace a
forward pass to logits of the right shape."""

from __future__ import annotations

import importlib.util
import math
import pathlib

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from moe_jax.config import Config, load
from moe_jax.model.transformer import Transformer

CONFIG_DIR = pathlib.Path(__file__).resolve().parents[1] / "configs"
CONFIG_FILES = sorted(CONFIG_DIR.glob("*.py"))

# (config file stem, published total parameters, published active parameters per token,
#  relative tolerance). None: no published figure to compare against.
# Sources:
#  * Mixtral-8x7B: Mistral AI's release post "Mixtral of experts" (Dec 2023): 46.7B total,
#    12.9B used per token (the paper, arXiv:2401.04088, rounds to 47B / 13B). We count
#    46,702,792,704 / 12,879,925,248 (exact match to the HF checkpoint's 46,702,792,704).
#  * DeepSeekMoE-16B: Dai et al., "DeepSeekMoE" (arXiv:2401.06066) and the
#    deepseek-ai/deepseek-moe-16b-base model card: 16.4B total, 2.8B activated. We count
#    16,375,728,128 / 2,828,650,496.
#  * MegaScale-MoE Internal-352B: only the model's name gives its size. With the listed
#    architecture (no biases) we count 341,290,487,808, 3.0% under 352B; the gap,
#    ~10.6B = 60 layers x 176M, is one more 3 x 4096 x 14336 expert per layer (e.g. an
#    unlisted shared expert would give 351.86B), hence the 5% tolerance.
#  * DeepSeek-V3: arXiv:2412.19437: 671B total, 37B activated, the MTP module apart
#    (HF's 685B holds it: 14B with its own copies of embedding and head). We count
#    671,026,404,352 / 37,551,755,264 without it, and 11,610,067,968 in the module.
#  * DeepSeek-V2-Lite: arXiv:2405.04434 and the model card: 15.7B total, 2.4B activated.
#    We count 15,706,484,224 / 2,661,150,208; DeepSeek's 2.4B leaves out the embedding
#    table (2,661,150,208 - 102400 x 2048 = 2.45B), hence no active figure here.
PUBLISHED = [
    pytest.param("mixtral_8x7b", 46.7e9, 12.9e9, 0.02, id="mixtral_8x7b"),
    pytest.param("deepseek_v3_671b", 671e9, 37e9, 0.02, id="deepseek_v3_671b"),
    pytest.param("deepseek_v2_lite", 15.7e9, None, 0.02, id="deepseek_v2_lite"),
    pytest.param("deepseek_moe_16b", 16.4e9, 2.8e9, 0.02, id="deepseek_moe_16b"),
    pytest.param("megascale_352b", 352e9, None, 0.05, id="megascale_352b"),
]


def _load_file(path: pathlib.Path) -> Config:
    spec = importlib.util.spec_from_file_location(f"configs_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return load(module.get_config())


def test_config_dir_is_not_empty():
    assert CONFIG_FILES, CONFIG_DIR
    stems = {p.stem for p in CONFIG_FILES}
    assert {"default", "small"} | {p.values[0] for p in PUBLISHED} <= stems


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.stem)
def test_config_file_loads(path: pathlib.Path):
    cfg = _load_file(path)
    assert isinstance(cfg, Config)


def _abstract_model(cfg: Config) -> Transformer:
    return nnx.eval_shape(lambda: Transformer(cfg.model, cfg.moe, rngs=nnx.Rngs(0)))


def count_params(cfg: Config, model: Transformer) -> tuple[int, int]:
    """(total, active per token): all Param sizes but the MTP modules' (which published
    counts leave out); active drops the unchosen experts' share (E - top_k) / E of the
    routed expert weights."""
    params = nnx.state(model, nnx.Param)
    leaves = jax.tree_util.tree_leaves_with_path(params)
    leaves = [(p, x) for p, x in leaves if "mtp" not in jax.tree_util.keystr(p)]
    total = sum(math.prod(x.shape) for _, x in leaves)
    routed = 0
    for path, leaf in leaves:
        keys = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
        # Routed expert weights sit directly under an MoE ffn (not under its shared MLP)
        # and carry an experts axis, [layers, E, ., .]; dense MLP weights are 3-D.
        if keys[-2:-1] == ["ffn"] and keys[-1] in ("gate", "up", "down") and leaf.ndim == 4:
            assert leaf.shape[1] == cfg.moe.num_experts, (keys, leaf.shape)
            routed += math.prod(leaf.shape)
    e, k = cfg.moe.num_experts, cfg.moe.top_k
    active = total - routed * (e - k) // e
    return total, active


def _expected_routed(cfg: Config) -> int:
    return (
        cfg.model.num_moe_layers
        * cfg.moe.num_experts
        * 3
        * cfg.model.embed_dim
        * (cfg.moe.expert_mlp_dim)
    )


@pytest.mark.parametrize("name,total_ref,active_ref,rtol", PUBLISHED)
def test_published_config_builds_abstractly(name, total_ref, active_ref, rtol):
    cfg = _load_file(CONFIG_DIR / f"{name}.py")
    model = _abstract_model(cfg)
    # Nothing was allocated: every parameter is a ShapeDtypeStruct.
    leaves = jax.tree.leaves(nnx.state(model))
    assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)

    total, active = count_params(cfg, model)
    # The routed-expert weights found by path match the closed form.
    routed = _expected_routed(cfg)
    e, k = cfg.moe.num_experts, cfg.moe.top_k
    assert total - active == routed * (e - k) // e
    print(f"{name}: total={total:,} active={active:,}")
    assert total == pytest.approx(total_ref, rel=rtol), (name, total)
    if active_ref is not None:
        assert active == pytest.approx(active_ref, rel=rtol), (name, active)

    # Forward traced abstractly on a short sequence: logits [1, 128, vocab] float32.
    graphdef, state = nnx.split(model)
    tokens = jax.ShapeDtypeStruct((1, 128), jnp.int32)
    logits, stats = jax.eval_shape(lambda s, t: nnx.merge(graphdef, s)(t), state, tokens)
    assert logits.shape == (1, 128, cfg.model.vocab_size)
    assert logits.dtype == jnp.float32
    assert stats.load.shape == (cfg.model.num_moe_layers, cfg.moe.num_experts)
