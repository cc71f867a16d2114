"""GPU presets for the planner: datasheet peaks only, no achievable fractions.

Why a table of its own: the cost model derates these peaks by named efficiency
factors (`moe_jax.plan.op_costs.Efficiency`); keeping the datasheet numbers
apart makes every prediction traceable to a published figure.

Sources: the MegaScale-MoE paper's Table 4 (H800, A100, H20: dense BF16 TFLOP/s,
memory, HBM bandwidth, NVLink bandwidth) and NVIDIA's datasheets for H100 SXM
and H200 SXM. NVLink figures are the bidirectional totals datasheets quote
(H800: 8 NVLink-4 links, 400 GB/s, i.e. 200 GB/s each way). The network is
one 400 Gb/s NIC per GPU (50 GB/s each way; ConnectX-7 NDR InfiniBand or
RoCE, NVIDIA's DGX H100 reference design and DeepSeek's H800 cluster as
described in the DeepEP README) for Hopper parts, and one 200 Gb/s HDR NIC per
GPU (25 GB/s) for A100 (DGX A100 reference design).
"""

from __future__ import annotations

import dataclasses

from moe_jax.flops import PEAK_TFLOPS

GB = 1e9


@dataclasses.dataclass(frozen=True)
class GPU:
    """One accelerator and its node, as datasheets describe them."""

    name: str
    peak_flops: float  # dense BF16 FLOP/s
    memory_bytes: float
    hbm_bandwidth: float  # bytes/s
    nvlink_bandwidth: float  # bytes/s per GPU, both directions together (datasheet form)
    network_bandwidth: float  # bytes/s per GPU, each way
    gpus_per_node: int = 8

    @property
    def nvlink_one_way(self) -> float:
        """What one GPU can send while it receives as much (collectives do both)."""
        return self.nvlink_bandwidth / 2


def _gpu(name: str, memory_gb: float, hbm_tb_s: float, nvlink_gb_s: float, nic_gb_s: float):
    return GPU(
        name=name,
        peak_flops=PEAK_TFLOPS[name] * 1e12,
        memory_bytes=memory_gb * GB,
        hbm_bandwidth=hbm_tb_s * 1e12,
        nvlink_bandwidth=nvlink_gb_s * GB,
        network_bandwidth=nic_gb_s * GB,
    )


GPUS = {
    "h800": _gpu("H800", 80, 3.4, 400, 50),
    "h100": _gpu("H100", 80, 3.35, 900, 50),
    "h200": _gpu("H200", 141, 4.8, 900, 50),
    "a100": _gpu("A100", 80, 2.0, 600, 25),
    "h20": _gpu("H20", 96, 4.0, 900, 50),
}


def get(name: str) -> GPU:
    """The preset called `name` (any case); a one-line ValueError names the valid ones."""
    key = name.lower()
    if key not in GPUS:
        raise ValueError(f"--gpu={name!r} is unknown; valid: {sorted(GPUS)}")
    return GPUS[key]
