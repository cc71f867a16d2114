"""Internal-352B from the MegaScale-MoE paper (ByteDance Seed, 2025): 60 layers,
hidden 4096, GQA 32/8 heads of 128, 32 experts of width 14336, top-3. With no biases
this counts 341.3B parameters (34.8B active per token), 3% under the name's 352B.

For scale and layout work (FLOPs, memory, sharding); the data source is synthetic
so the config validates anywhere. Real runs set
--config.data.source=tokens --config.data.path=<directory from moe_jax.data.prepare>.

`CONFIG` is the typed form: `bench/gpu_kernels.py` reads its shapes from there on a GPU
machine that may lack ml_collections.
"""

from moe_jax.config import (
    Config,
    DataConfig,
    ModelConfig,
    MoEConfig,
    TrainConfig,
    to_config_dict,
)

CONFIG = Config(
    model=ModelConfig(
        vocab_size=65536,
        num_layers=60,
        embed_dim=4096,
        num_heads=32,
        num_kv_heads=8,  # GQA ratio 4
        head_dim=128,
        mlp_dim=14336,  # unused: every layer is MoE
        first_k_dense=0,
        tie_embeddings=False,
        rope_theta=10000.0,
        norm_eps=1e-6,
        dtype="bfloat16",
        remat="full",
    ),
    moe=MoEConfig(
        num_experts=32,
        top_k=3,
        expert_mlp_dim=14336,  # h_ffn
        num_shared_experts=0,
        score_fn="softmax",
        renormalize=True,
    ),
    train=TrainConfig(
        steps=100_000,
        batch_size=720,  # global batch in the paper: 720 sequences of 8192 tokens
        seq_len=8192,
        learning_rate=3e-4,
        warmup_steps=2000,
        min_lr_ratio=0.1,
        weight_decay=0.1,
        grad_clip=1.0,
        log_every=10,
        eval_every=1000,
        checkpoint_every=1000,
    ),
    # Real runs: --config.data.source=tokens --config.data.path=...
    data=DataConfig(source="synthetic"),
)


def get_config():
    return to_config_dict(CONFIG)
