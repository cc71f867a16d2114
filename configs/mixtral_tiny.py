"""Mixtral-8x7B's layer shape with the hidden size scaled down 8x: the acceptance shape
for communication volume (`python -m moe_jax.tools.comm_report`).

Why this shape: the paper's comm-volume analysis is for Mixtral-8x7B on one
8-device node (n=8, GQA ratio m=4, top-2 of 8 experts). Keeping heads, kv heads,
experts, top-k and the expert/hidden ratio while shrinking h (4096 -> 512) and
the depth (2 layers) keeps every ratio in Eq. 1-4 and compiles on CPU. The
capacity factor 1.25 makes the all-to-all buffers capacity-padded, as in
production. Data are synthetic: the config is for layouts, not for training.
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
                vocab_size=259,  # byte tokenizer
                num_layers=2,
                embed_dim=512,  # Mixtral: 4096
                num_heads=32,
                num_kv_heads=8,  # GQA ratio m = 4
                head_dim=16,  # Mixtral: 128; num_heads * head_dim = embed_dim as there
                mlp_dim=1792,  # unused: every layer is MoE
                first_k_dense=0,
                moe_every=1,
                dtype="float32",  # XLA:CPU widens bf16 collectives to f32; fp32 measures as written
            ),
            moe=MoEConfig(
                num_experts=8,
                top_k=2,
                expert_mlp_dim=1792,  # Mixtral: 14336 (3.5 x hidden)
                capacity_factor=1.25,
            ),
            train=TrainConfig(batch_size=8, seq_len=1024),
            data=DataConfig(source="synthetic"),
            parallel=ParallelConfig(attention="sp", experts="ep_a2a", intra=8, data=1),
        )
    )
