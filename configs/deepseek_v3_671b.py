"""DeepSeek-V3 (DeepSeek-AI, arXiv:2412.19437; HF config deepseek-ai/DeepSeek-V3): 671B
parameters in total, 37B active per token; multi-head latent attention, 3 dense layers
then 58 MoE layers of 256 routed experts (top-8, sigmoid scores with the correction
bias, 8 groups of which 4 are kept) and one shared expert, YaRN rotary and one
multi-token-prediction module (itself an MoE layer, 11.5B more parameters).

For scale and layout work (FLOPs, memory, sharding, the planner); the data source is
synthetic so the config validates anywhere. Real runs set
--config.data.source=tokens --config.data.path=<directory from moe_jax.data.prepare>.
The training settings are the paper's pre-training ones (its batch after the ramp).
"""

from moe_jax.config import (
    Config,
    DataConfig,
    ModelConfig,
    MoEConfig,
    ParallelConfig,
    TrainConfig,
    to_config_dict,
)


def get_config():
    return to_config_dict(
        Config(
            model=ModelConfig(
                vocab_size=129280,
                num_layers=61,
                embed_dim=7168,
                num_heads=128,
                num_kv_heads=128,  # mla: every head its own key and value
                mlp_dim=18432,  # the 3 dense layers
                first_k_dense=3,  # first_k_dense_replace
                tie_embeddings=False,
                attention="mla",
                q_lora_rank=1536,
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
                rope_mscale=1.0,
                rope_mscale_all_dim=1.0,
                norm_eps=1e-6,
                mtp_depth=1,  # num_nextn_predict_layers
                dtype="bfloat16",
                remat="full",
            ),
            moe=MoEConfig(
                num_experts=256,  # n_routed_experts
                top_k=8,  # num_experts_per_tok
                expert_mlp_dim=2048,  # moe_intermediate_size
                num_shared_experts=1,
                shared_mlp_dim=2048,
                score_fn="sigmoid",
                renormalize=True,  # norm_topk_prob
                routed_scaling=2.5,  # routed_scaling_factor
                n_groups=8,  # n_group
                topk_groups=4,  # topk_group
                group_score="top2_sum",
                # auxiliary-loss-free balancing (bias update speed 0.001) and the small
                # sequence-wise balance loss (alpha = 0.0001) of the paper
                bias_update_rate=0.001,
                aux_loss_coef=0.0,
                seq_aux_loss_coef=0.0001,
                z_loss_coef=0.0,
            ),
            train=TrainConfig(
                # Paper: 14.8T tokens, 15360 sequences of 4K after the batch ramp, peak
                # lr 2.2e-4 after 2K warmup steps, MTP loss weight 0.3 then 0.1.
                steps=1_000_000,
                batch_size=15360,
                seq_len=4096,
                learning_rate=2.2e-4,
                warmup_steps=2000,
                min_lr_ratio=0.1,
                weight_decay=0.1,
                grad_clip=1.0,
                mtp_loss_weight=0.3,
                # Paper, 3.3.2: AdamW's moments kept in BF16 "without observable
                # performance degradation"; master weights and gradient sums float32.
                # It is what fits the model on 256 H100 (docs/planner-and-memory.md).
                moment_dtype="bfloat16",
                log_every=10,
                eval_every=1000,
                checkpoint_every=1000,
            ),
            # The 129,280 x 7,168 table and head split over the intra group, as Megatron
            # always splits them: whole, each device holds them in float32 with their
            # gradients and the MTP module's own gradients of both, 30 GB
            # (docs/planner-and-memory.md, "MLA and MTP").
            parallel=ParallelConfig(vocab_parallel=True),
            # Real runs: --config.data.source=tokens --config.data.path=...
            data=DataConfig(source="synthetic"),
        )
    )
