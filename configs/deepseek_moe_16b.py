"""DeepSeekMoE-16B (DeepSeek-AI, arXiv:2401.06066; HF config deepseek-ai/deepseek-moe-16b-base):
16.4B parameters in total, 2.8B active per token; fine-grained experts plus shared experts.

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
                vocab_size=102400,
                num_layers=28,
                embed_dim=2048,
                num_heads=16,
                num_kv_heads=16,  # multi-head attention
                head_dim=128,
                mlp_dim=10944,  # the one dense layer
                first_k_dense=1,
                tie_embeddings=False,
                rope_theta=10000.0,
                norm_eps=1e-6,
                dtype="bfloat16",
                remat="full",
            ),
            moe=MoEConfig(
                num_experts=64,
                top_k=6,
                expert_mlp_dim=1408,
                num_shared_experts=2,
                shared_mlp_dim=1408,
                score_fn="softmax",
                renormalize=False,  # norm_topk_prob=False
                aux_loss_coef=0.001,  # expert-level balance factor of the 16B run
                z_loss_coef=0.0,
            ),
            train=TrainConfig(
                # Paper: 2T tokens, 4.5K sequences of 4K tokens per batch, peak lr 4.2e-4,
                # 2K warmup steps.
                steps=106_000,
                batch_size=4608,
                seq_len=4096,
                learning_rate=4.2e-4,
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
