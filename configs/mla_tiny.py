"""A tiny model with multi-head latent attention (MLA, DeepSeek-V2/V3's attention) that
trains in a minute on 2 CPU cores: a query latent, a key/value latent with one shared
rotary key, values narrower than queries and keys, a dense first layer and a shared
expert, as the DeepSeek models have. `sample` decodes from its runs with the latent
cached (`moe_jax.model.decode`)."""

from moe_jax.config import Config, ModelConfig, MoEConfig, TrainConfig, to_config_dict


def get_config():
    return to_config_dict(
        Config(
            model=ModelConfig(
                num_layers=3,
                first_k_dense=1,
                embed_dim=96,
                num_heads=6,
                num_kv_heads=6,  # mla: every head its own key and value
                mlp_dim=192,
                attention="mla",
                q_lora_rank=48,
                kv_lora_rank=40,
                qk_nope_head_dim=12,
                qk_rope_head_dim=8,
                v_head_dim=14,
            ),
            moe=MoEConfig(
                num_experts=8, top_k=2, expert_mlp_dim=64, num_shared_experts=1, shared_mlp_dim=64
            ),
            train=TrainConfig(
                steps=60, batch_size=8, seq_len=64, eval_every=0, log_every=10, checkpoint_every=0
            ),
        )
    )
