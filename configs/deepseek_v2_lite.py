"""DeepSeek-V2-Lite (DeepSeek-AI, arXiv:2405.04434; HF config
deepseek-ai/DeepSeek-V2-Lite): 15.7B parameters in total, 2.4B active per token;
multi-head latent attention without a query latent (q_lora_rank 0), one dense layer
then 26 MoE layers of 64 routed experts (top-6, softmax, greedy, not renormalised) and
two shared experts, YaRN rotary.

For scale and layout work (FLOPs, memory, sharding, the planner); the data source is
synthetic so the config validates anywhere. Real runs set
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
                num_layers=27,
                embed_dim=2048,
                num_heads=16,
                num_kv_heads=16,  # mla: every head its own key and value
                mlp_dim=10944,  # the one dense layer
                first_k_dense=1,  # first_k_dense_replace
                tie_embeddings=False,
                attention="mla",
                q_lora_rank=0,  # one query projection
                kv_lora_rank=512,
                qk_nope_head_dim=128,
                qk_rope_head_dim=64,
                v_head_dim=128,
                rope_theta=10000.0,
                rope_scaling="yarn",
                rope_factor=40.0,
                rope_original_max_position=4096,
                rope_beta_fast=32.0,
                rope_beta_slow=1.0,
                rope_mscale=0.707,
                rope_mscale_all_dim=0.707,
                norm_eps=1e-6,
                dtype="bfloat16",
                remat="full",
            ),
            moe=MoEConfig(
                num_experts=64,  # n_routed_experts
                top_k=6,  # num_experts_per_tok
                expert_mlp_dim=1408,  # moe_intermediate_size
                num_shared_experts=2,
                shared_mlp_dim=1408,
                score_fn="softmax",
                renormalize=False,  # topk_method greedy, never renormalised
                routed_scaling=1.0,  # routed_scaling_factor
                aux_loss_coef=0.001,  # the expert-level balance factor
                z_loss_coef=0.0,
            ),
            train=TrainConfig(
                # Paper: 5.7T tokens, 4608 sequences of 4K per batch, peak lr 4.2e-4,
                # 2K warmup steps.
                steps=300_000,
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
