"""Plan resolution: the settings the user left to the project, made concrete.

`parallel.layout='auto'` becomes the planner's choice for the devices at hand (for
`parallel.gpu`, or the preset this device's kind names), `parallel.experts='auto'`
the paper's rule, and `parallel.data=0` the devices left over by the intra group.
The trainer, `comm_report` and the tests resolve through here, then check the
resolved plan against the layout specs (`moe_jax.parallel.registry.check`).
"""

from __future__ import annotations

import dataclasses

from moe_jax.config import Config
from moe_jax.parallel import registry
from moe_jax.plan import hardware


def auto_experts(config: Config) -> str:
    """The paper's rule for `parallel.experts='auto'`: the all-gather form once top-k is
    large relative to the group (ring collectives talk to neighbours only; the
    all-to-all's volume grows with k), the all-to-all form otherwise."""
    p = config.parallel
    return "ep_ag" if config.moe.top_k / p.intra > p.ag_threshold else "ep_a2a"


def planner_gpu(config: Config) -> str:
    """`parallel.gpu`, else the preset named in this device's kind, else H800."""
    import jax

    if config.parallel.gpu:
        return config.parallel.gpu
    kind = jax.devices()[0].device_kind.lower()
    # Longest names first: an "H200" must not read as "h20".
    for name in sorted(hardware.GPUS, key=len, reverse=True):
        if name in kind:
            return name
    return "h800"


def resolve(config: Config, num_devices: int, platform: str | None = None) -> Config:
    """The plan made concrete for `num_devices` devices of `platform` (default: this
    process's backend; see the module docstring)."""
    if config.parallel.layout == "auto":
        from moe_jax.plan.planner import choose_plan

        manual = dataclasses.replace(config.parallel, layout="manual")
        config = dataclasses.replace(config, parallel=manual)
        config = dataclasses.replace(
            config, parallel=choose_plan(config, num_devices, planner_gpu(config), platform)
        )
    p = config.parallel
    if p.experts == "auto":
        p = dataclasses.replace(p, experts=auto_experts(config))
    if not p.data:
        if num_devices % (p.intra * p.stages):
            taken = f"parallel.intra={p.intra}"
            taken += f" x parallel.stages={p.stages}" if p.stages > 1 else ""
            raise ValueError(
                f"{taken} must divide the {num_devices} devices (or set parallel.data explicitly)"
            )
        p = dataclasses.replace(p, data=num_devices // (p.intra * p.stages))
    return dataclasses.replace(config, parallel=p)


def check_plan(config: Config, num_devices: int, platform: str | None = None) -> Config:
    """The resolved plan, or a one-line ValueError for the first reason it cannot run on
    `num_devices` devices of `platform` (default: this process's backend)."""
    if platform is None:
        import jax

        platform = jax.default_backend()
    config = resolve(config, num_devices, platform)
    registry.check(config, num_devices, platform)
    return config
