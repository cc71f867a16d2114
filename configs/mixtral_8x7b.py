"""Mixtral-8x7B (Mistral AI, arXiv:2401.04088; HF config mistralai/Mixtral-8x7B-v0.1):
46.7B parameters in total, 12.9B active per token.

For scale and layout work (FLOPs, memory, sharding); the data source is synthetic
so the config validates anywhere. Real runs set
--config.data.source=tokens --config.data.path=<directory from moe_jax.data.prepare>.
"""

from moe_jax.config import (
    Config,
    DataConfig,
    ModelConfig,
    MoEConfig,
    TrainConfig,
    to_config_dict,
)


def get_config():
    return to_config_dict(
        Config(
            model=ModelConfig(
                vocab_size=32000,
                num_layers=32,
                embed_dim=4096,
                num_heads=32,
                num_kv_heads=8,
                head_dim=128,
                mlp_dim=14336,  # unused: every layer is MoE
                first_k_dense=0,
                tie_embeddings=False,
                rope_theta=1e6,
                norm_eps=1e-5,
                dtype="bfloat16",
                remat="full",
            ),
            moe=MoEConfig(
                num_experts=8,
                top_k=2,
                expert_mlp_dim=14336,
                num_shared_experts=0,
                score_fn="softmax",
                renormalize=True,  # softmax over all 8, renormalised over the top-2
                aux_loss_coef=0.02,  # HF router_aux_loss_coef
                z_loss_coef=0.0,
            ),
            train=TrainConfig(
                steps=250_000,
                batch_size=256,  # 256 x 4096 = 1M tokens per step
                seq_len=4096,
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
    )
