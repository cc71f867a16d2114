"""CPU benchmark size: a 4-layer MoE (16 experts, top-2, one shared expert) that
still trains at a useful speed on a 2-core CPU but is clearly bigger than default."""

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
                vocab_size=259,  # byte tokenizer
                num_layers=4,
                first_k_dense=1,
                embed_dim=256,
                num_heads=8,
                num_kv_heads=2,
                head_dim=32,
                mlp_dim=768,
            ),
            moe=MoEConfig(
                num_experts=16,
                top_k=2,
                expert_mlp_dim=256,
                num_shared_experts=1,
                shared_mlp_dim=256,
            ),
            train=TrainConfig(
                steps=500,
                batch_size=16,
                seq_len=256,
                learning_rate=2e-3,
                warmup_steps=20,
                eval_every=100,
                checkpoint_every=250,
            ),
            data=DataConfig(source="stdlib"),
        )
    )
