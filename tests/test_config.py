"""Config validation: every bad setting fails early, on one line, naming the setting."""

import dataclasses
import math
import os
import pathlib
import re
import subprocess
import sys
import time

import pytest

from moe_jax import config as config_lib
from moe_jax.config import Config, load, to_config_dict, validate
from moe_jax.kernels import requirements, tokamax_gmm
from moe_jax.parallel import registry

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]

# (case id, overrides applied to the default config dict, setting the error must name).
# Override keys are "section.name"; the section is created if missing.
BAD_CONFIGS = [
    ("top_k_over_experts", {"moe.top_k": 9}, "moe.top_k"),
    ("top_k_zero", {"moe.top_k": 0}, "moe.top_k"),
    ("num_experts_zero", {"moe.num_experts": 0}, "moe.num_experts"),
    (
        "heads_not_multiple_of_kv",
        {"model.num_heads": 4, "model.num_kv_heads": 3},
        "model.num_heads",
    ),
    ("kv_heads_zero", {"model.num_kv_heads": 0}, "model.num_kv_heads"),
    ("negative_capacity", {"moe.capacity_factor": -1.0}, "moe.capacity_factor"),
    ("unknown_score_fn", {"moe.score_fn": "relu"}, "moe.score_fn"),
    ("unknown_impl", {"moe.impl": "megablocks"}, "moe.impl"),
    ("capacity_impl_dropless", {"moe.impl": "capacity", "moe.capacity_factor": 0.0}, "moe.impl"),
    ("n_groups_not_dividing", {"moe.n_groups": 3}, "moe.n_groups"),
    ("n_groups_zero", {"moe.n_groups": 0}, "moe.n_groups"),
    ("topk_groups_over_groups", {"moe.n_groups": 2, "moe.topk_groups": 3}, "moe.topk_groups"),
    (
        "top_k_unreachable_in_groups",
        {"moe.n_groups": 4, "moe.topk_groups": 1, "moe.top_k": 3},
        "moe.top_k",
    ),
    ("odd_head_dim", {"model.head_dim": 15}, "model.head_dim"),
    ("unknown_dtype", {"model.dtype": "float16"}, "model.dtype"),
    ("unknown_remat", {"model.remat": "partial"}, "model.remat"),
    ("unknown_qk_norm", {"model.qk_norm": "layer"}, "model.qk_norm"),
    ("gate_without_shared_experts", {"moe.shared_expert_gate": True}, "moe.shared_expert_gate"),
    ("first_k_dense_over_layers", {"model.first_k_dense": 3}, "model.first_k_dense"),
    ("negative_first_k_dense", {"model.first_k_dense": -1}, "model.first_k_dense"),
    (
        "moe_every_not_dividing",
        {"model.num_layers": 5, "model.first_k_dense": 1, "model.moe_every": 3},
        "model.moe_every",
    ),
    ("vocab_zero", {"model.vocab_size": 0}, "model.vocab_size"),
    ("vocab_negative", {"model.vocab_size": -5}, "model.vocab_size"),
    ("tile_size_negative", {"moe.tile_size": -1}, "moe.tile_size"),
    ("negative_aux_loss", {"moe.aux_loss_coef": -0.01}, "moe.aux_loss_coef"),
    ("negative_seq_aux_loss", {"moe.seq_aux_loss_coef": -0.01}, "moe.seq_aux_loss_coef"),
    ("negative_z_loss", {"moe.z_loss_coef": -1e-3}, "moe.z_loss_coef"),
    ("negative_bias_rate", {"moe.bias_update_rate": -1e-3}, "moe.bias_update_rate"),
    ("negative_shared_experts", {"moe.num_shared_experts": -1}, "moe.num_shared_experts"),
    ("batch_size_zero", {"train.batch_size": 0}, "train.batch_size"),
    ("seq_len_zero", {"train.seq_len": 0}, "train.seq_len"),
    ("b2_one", {"train.b2": 1.0}, "train.b2"),
    ("b1_negative", {"train.b1": -0.1}, "train.b1"),
    ("negative_warmup", {"train.warmup_steps": -1}, "train.warmup_steps"),
    ("vocab_one", {"model.vocab_size": 1}, "model.vocab_size"),
    ("data_path_without_tokens", {"data.path": "data/mine"}, "data.path"),
    ("data_path_with_synthetic", {"data.source": "synthetic", "data.path": "d"}, "data.path"),
    ("profile_window_beyond_run", {"train.steps": 10, "profile.steps": "5,12"}, "profile.steps"),
    ("microbatches_without_pipeline", {"parallel.microbatches": 4}, "parallel.microbatches"),
    ("seed_negative", {"train.seed": -1}, "train.seed"),
    ("seed_beyond_32_bits", {"train.seed": 2**32}, "train.seed"),
    ("rope_theta_one", {"model.rope_theta": 1.0}, "model.rope_theta"),
    ("unknown_rope_scaling", {"model.rope_scaling": "dynamic"}, "model.rope_scaling"),
    (
        "rope_factor_below_one",
        {"model.rope_scaling": "linear", "model.rope_factor": 0.5},
        "model.rope_factor",
    ),
    ("rope_factor_nan", {"model.rope_factor": math.nan}, "model.rope_factor"),
    (
        "yarn_without_original_length",
        {"model.rope_scaling": "yarn", "model.rope_factor": 4.0},
        "model.rope_original_max_position",
    ),
    (
        "yarn_beta_fast_below_slow",
        {
            "model.rope_scaling": "yarn",
            "model.rope_original_max_position": 4096,
            "model.rope_beta_fast": 0.5,
        },
        "model.rope_beta_fast",
    ),
    (
        "yarn_negative_mscale",
        {
            "model.rope_scaling": "yarn",
            "model.rope_original_max_position": 4096,
            "model.rope_mscale_all_dim": -1.0,
        },
        "model.rope_mscale_all_dim",
    ),
    ("rope_factor_without_scaling", {"model.rope_factor": 2.0}, "model.rope_factor"),
    (
        "yarn_setting_under_linear",
        {"model.rope_scaling": "linear", "model.rope_factor": 2.0, "model.rope_mscale": 1.0},
        "model.rope_mscale",
    ),
    ("unknown_group_score", {"moe.group_score": "mean"}, "moe.group_score"),
    ("group_score_without_groups", {"moe.group_score": "max"}, "moe.group_score"),
    ("tile_size_without_tiles", {"moe.impl": "ragged_dot", "moe.tile_size": 32}, "moe.tile_size"),
    (
        "wandb_without_project",
        {"train.wandb": "offline", "train.wandb_project": ""},
        "train.wandb_project",
    ),
    ("unknown_setting", {"moe.topk": 2}, "moe.topk"),
    ("unknown_model_setting", {"model.hidden_dim": 64}, "model.hidden_dim"),
    ("unknown_section", {"optimizer.lr": 1e-3}, "optimizer"),
]


def _default_dict() -> dict:
    return to_config_dict(Config()).to_dict()


def _apply(raw: dict, overrides: dict) -> dict:
    for key, value in overrides.items():
        section, name = key.split(".")
        raw.setdefault(section, {})[name] = value
    return raw


def _names_setting(message: str, setting: str) -> bool:
    """The setting appears as a whole name, and is the first dotted setting mentioned."""
    pattern = rf"(?<![\w.]){re.escape(setting)}(?![\w])"
    if not re.search(pattern, message):
        return False
    if "." not in setting:
        return True
    first = re.search(rf"\b({'|'.join(config_lib.SECTIONS)})\.\w+", message)
    return first is not None and first.group(0) == setting


@pytest.mark.parametrize(
    ("overrides", "setting"),
    [pytest.param(o, s, id=i) for i, o, s in BAD_CONFIGS],
)
def test_bad_config_is_one_line_error_naming_setting(overrides, setting):
    """Each malformed config raises a one-line ValueError that names the bad setting."""
    raw = _apply(_default_dict(), overrides)
    with pytest.raises(ValueError) as info:
        load(raw)
    message = str(info.value)
    assert "\n" not in message, message
    assert _names_setting(message, setting), f"{setting!r} not named in: {message}"


@pytest.mark.parametrize(
    ("overrides", "setting"),
    [pytest.param(o, s, id=i) for i, o, s in BAD_CONFIGS if "unknown" not in i],
)
def test_validate_on_dataclasses_matches_load(overrides, setting):
    """`validate` on a typed config built with dataclasses.replace rejects the same inputs."""
    config = Config()
    for key, value in overrides.items():
        section, name = key.split(".")
        config = dataclasses.replace(
            config, **{section: dataclasses.replace(getattr(config, section), **{name: value})}
        )
    with pytest.raises(ValueError) as info:
        validate(config)
    message = str(info.value)
    assert "\n" not in message
    assert _names_setting(message, setting), f"{setting!r} not named in: {message}"


# Every float setting (found from the dataclasses, so a new one is covered), with the
# settings the issue names as letting inf through: the introspection must find them.
FLOATS = [
    f"{section}.{field.name}"
    for section, cls in config_lib.SECTIONS.items()
    for field in dataclasses.fields(cls)
    if isinstance(field.default, float)
]
NAMED_IN_THE_ISSUE = {
    "train.learning_rate", "train.weight_decay", "train.eps", "model.norm_eps",
    "model.rope_theta", "moe.capacity_factor", "moe.routed_scaling", "moe.aux_loss_coef",
    "moe.seq_aux_loss_coef", "moe.z_loss_coef", "moe.bias_update_rate", "train.grad_clip",
    "train.memory_limit_gb",
}  # fmt: skip


def test_the_float_settings_are_found():
    assert set(FLOATS) >= NAMED_IN_THE_ISSUE, NAMED_IN_THE_ISSUE - set(FLOATS)


@pytest.mark.parametrize("setting", FLOATS)
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
def test_every_float_setting_must_be_finite(setting: str, value: float):
    """inf passes every `> 0` check and nan fails them with the wrong reason: each float
    setting is refused as not finite, by load and by validate alike."""
    with pytest.raises(ValueError) as info:
        load(_apply(_default_dict(), {setting: value}))
    assert str(info.value) == f"{setting}={value!r} is invalid: must be finite"
    section, name = setting.split(".")
    config = Config()
    replaced = dataclasses.replace(getattr(config, section), **{name: value})
    with pytest.raises(ValueError, match=f"^{re.escape(setting)}=.* must be finite$"):
        validate(dataclasses.replace(config, **{section: replaced}))


def test_settings_that_make_sense_together_load():
    """The controls of the new refusals: data.path with its source, a profile window
    ending with the run, micro-batches of a pipeline, the largest seed, vocabulary 2."""
    config = load(
        {
            "data": {"source": "tokens", "path": "data/mine"},
            "train": {"steps": 10, "seed": 2**32 - 1},
            "profile": {"steps": "5,11"},
            "model": {"vocab_size": 2},
        }
    )
    assert config_lib.profile_steps(config.profile) == (5, 11)
    assert config.data.path == "data/mine" and config.train.seed == 2**32 - 1
    assert load({"moe": {"impl": "tiled", "tile_size": 32}}).moe.tile(1024) == 32
    assert load({"model": {"rope_theta": 1.5}}).model.rope_theta == 1.5
    piped = load({"parallel": {"stages": 2, "microbatches": 4}})
    assert piped.micro_batches == 4
    auto = load({"parallel": {"layout": "auto", "microbatches": 4}})  # the planner's to set
    assert auto.parallel.microbatches == 4


def test_data_path_refusal_says_what_to_add():
    with pytest.raises(ValueError) as info:
        load({"data": {"path": "data/mine"}})
    assert "--config.data.source=tokens" in str(info.value)
    assert "data.source='stdlib' here" in str(info.value)


def test_cases_cover_many_distinct_settings():
    """Guard against the table shrinking: many distinct cases and settings."""
    assert len(BAD_CONFIGS) >= 18
    assert len({setting for _, _, setting in BAD_CONFIGS}) >= 18


def test_default_config_loads_and_round_trips():
    """The default config is valid and load/to_config_dict are inverse."""
    d = to_config_dict(Config())
    config = load(d)
    assert config == Config()
    assert to_config_dict(config) == d
    # A plain dict works too, and a partial dict fills in defaults.
    assert load(d.to_dict()) == config
    assert load({"moe": {"top_k": 1}}) == dataclasses.replace(
        Config(), moe=dataclasses.replace(Config().moe, top_k=1)
    )


def test_valid_non_default_config_round_trips():
    """A legal non-default config (groups, capacity, dense prefix) also round-trips."""
    raw = _apply(
        _default_dict(),
        {
            "moe.n_groups": 4,
            "moe.topk_groups": 2,
            "moe.top_k": 4,
            "moe.capacity_factor": 1.25,
            "moe.impl": "capacity",
            "moe.score_fn": "sigmoid",
            "model.num_layers": 5,
            "model.first_k_dense": 1,
            "model.moe_every": 2,
            "model.dtype": "bfloat16",
            "model.remat": "full",
        },
    )
    config = load(raw)
    assert config.model.num_moe_layers == 2
    assert to_config_dict(config).to_dict() == raw


def test_train_entry_point_rejects_bad_flag_before_compiling():
    """`python -m moe_jax.train` fails fast on a bad override, naming the setting last."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "moe_jax.train", "--config.moe.top_k=99"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    elapsed = time.perf_counter() - start
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines, "no error output"
    assert "moe.top_k" in lines[-1], result.stderr
    assert elapsed < 60, f"took {elapsed:.1f}s"
    # Nothing was trained: the banner printed after validation never appears.
    assert "minimal training loop" not in result.stdout


def test_config_module_lists_match_validation():
    """Every listed choice is accepted (the lists and the checks agree)."""
    for score_fn in config_lib.SCORE_FNS:
        load({"moe": {"score_fn": score_fn}})
    for impl in config_lib.MOE_IMPLS:
        if impl == "tokamax" and not requirements.tokamax_installed():
            continue  # optional package; its absence is tested below
        extra = {"capacity_factor": 1.0} if impl == "capacity" else {}
        load({"moe": {"impl": impl, **extra}})
    for dtype in config_lib.DTYPES:
        load({"model": {"dtype": dtype}})
    for remat in config_lib.REMAT:
        load({"model": {"remat": remat}})


def test_tokamax_without_the_package_is_one_line_error(monkeypatch):
    """`moe.impl=tokamax` where tokamax is not installed is refused at load, in one line
    naming the setting and the install command."""
    monkeypatch.setattr(requirements, "tokamax_installed", lambda: False)
    with pytest.raises(ValueError) as info:
        load({"moe": {"impl": "tokamax"}})
    message = str(info.value)
    assert "\n" not in message and _names_setting(message, "moe.impl"), message
    assert "pip install tokamax" in message, message


def test_tokamax_installed_but_broken_is_refused_with_the_plan(monkeypatch):
    """An installed tokamax that does not import passes the load (which only finds the
    package) and is refused by the plan check, before anything compiles, with the same
    line."""
    monkeypatch.setattr(requirements, "tokamax_installed", lambda: True)
    monkeypatch.setattr(tokamax_gmm, "_module", lambda: None)
    config = load({"moe": {"impl": "tokamax"}, "parallel": {"experts": "ep_a2a", "data": 1}})
    found = registry.problems(config, num_devices=1, platform="cpu")
    assert found == [requirements.TOKAMAX_MISSING], found
