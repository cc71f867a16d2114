"""The versions that decide a GPU run's outcome, printed and reported first.

On a GPU, XLA rewrites `lax.ragged_dot` to a zero-padded dense product unless cuDNN's
ragged-dot fusion applies (cuDNN 9.22 or newer, forward and input gradient only; the
weight gradient stays dense), cuDNN's flash attention depends on the cuDNN and driver
versions, and the Pallas kernels on jax's Triton lowering: numbers from an unknown
stack cannot be compared. Every lookup here is guarded: a version that cannot be read
is reported as why, never stops the run.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import platform
import subprocess
import sys

# distribution -> the module it installs
PACKAGES = {
    "jax": "jax",
    "jaxlib": "jaxlib",
    "flax": "flax",
    "optax": "optax",
    "orbax-checkpoint": "orbax.checkpoint",
    "numpy": "numpy",
    "ml-collections": "ml_collections",
}
RAGGED_FUSION_CUDNN = (9, 22)  # cuDNN's ragged-dot fusion, used by XLA from this version


def package(name: str) -> str:
    """The installed version, or "not installed" when its module cannot be found (found,
    not imported: an import may be slow)."""
    try:
        if importlib.util.find_spec(PACKAGES.get(name, name)) is None:
            return "not installed"
        return importlib.metadata.version(name)
    except (ImportError, ValueError, importlib.metadata.PackageNotFoundError):
        return "not installed"


def cuda_plugins() -> str:
    """jax's CUDA plugin and PJRT packages (jax-cuda12-plugin, jax-cuda13-pjrt, ...)."""
    found = {
        dist.metadata["Name"]: dist.version
        for dist in importlib.metadata.distributions()
        if (dist.metadata["Name"] or "").lower().replace("_", "-").startswith("jax-cuda")
    }
    return ", ".join(f"{name} {version}" for name, version in sorted(found.items())) or "none"


def nvidia_smi() -> dict[str, str]:
    """GPU name, memory and driver as nvidia-smi reports them (empty without it)."""
    query = "name,memory.total,driver_version"
    try:
        done = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.SubprocessError) as error:
        return {"nvidia_smi": f"not run: {type(error).__name__}"}
    first = (done.stdout.strip().splitlines() or [""])[0]
    fields = [part.strip() for part in first.split(",")]
    if done.returncode != 0 or len(fields) != 3:
        return {"nvidia_smi": f"failed: {(done.stderr or done.stdout).strip()[:200]}"}
    return dict(zip(("gpu", "gpu_memory", "driver"), fields, strict=True))


def _cuda_version(value: int) -> str:
    """CUDA's encoding, 1000 * major + 10 * minor: 12080 -> 12.8."""
    return f"{value // 1000}.{value % 1000 // 10}"


def cudnn_version(value: int) -> tuple[int, int, int]:
    """cuDNN's encoding: 10000 * major + 100 * minor + patch from 9 on, 1000 * major +
    100 * minor + patch before."""
    if value >= 90000:
        return value // 10000, value % 10000 // 100, value % 100
    return value // 1000, value % 1000 // 100, value % 100


def cuda_libraries() -> dict[str, str]:
    """CUDA runtime, driver API and cuDNN versions as the jax CUDA plugin loads them."""
    try:
        from jax._src.lib import cuda_versions  # the plugin's _versions module, or None
    except ImportError as error:
        return {"cuda": f"unknown: {error}"}
    if cuda_versions is None:
        return {"cuda": "no CUDA plugin"}
    out = {}
    lookups = {
        "cuda_runtime": ("cuda_runtime_get_version", _cuda_version),
        "cuda_driver_api": ("cuda_driver_get_version", _cuda_version),
        "cudnn": ("cudnn_get_version", lambda v: ".".join(map(str, cudnn_version(v)))),
        "cudnn_built_with": ("cudnn_build_version", lambda v: ".".join(map(str, cudnn_version(v)))),
    }
    for key, (name, decode) in lookups.items():
        try:
            out[key] = decode(int(getattr(cuda_versions, name)()))
        except Exception as error:  # a missing library or function: say which
            out[key] = f"unknown: {type(error).__name__}: {str(error)[:100]}"
    return out


def ragged_dot_lowering(cudnn: str) -> str:
    """What XLA is expected to make of `lax.ragged_dot` with this cuDNN."""
    try:
        found = tuple(int(part) for part in cudnn.split(".")[:2])
    except ValueError:
        return "unknown (cuDNN version unknown)"
    if found >= RAGGED_FUSION_CUDNN:
        return "cuDNN fusion possible for forward and input gradient; weight gradient dense"
    return "zero-padded dense product (cuDNN < 9.22): large temporaries"


def collect() -> dict[str, str]:
    """Versions in the order they are printed: the device, the driver and CUDA stack,
    the Python packages, then the interpreter and the machine."""
    import jax

    device = jax.devices()[0]
    out = {"gpu": device.device_kind, "backend": jax.default_backend()}
    out["devices"] = str(jax.device_count())
    try:
        stats = device.memory_stats() or {}
    except Exception:  # CPU devices may not report memory
        stats = {}
    if "bytes_limit" in stats:
        out["gpu_memory_for_jax_gib"] = f"{stats['bytes_limit'] / 2**30:.1f}"
    out["compute_capability"] = str(getattr(device, "compute_capability", "n/a"))
    if out["backend"] == "gpu":
        out.update(nvidia_smi())
    out["jax"], out["jaxlib"] = package("jax"), package("jaxlib")
    out["cuda_plugin"] = cuda_plugins()
    if out["backend"] == "gpu":
        out.update(cuda_libraries())
        out["ragged_dot_on_gpu"] = ragged_dot_lowering(out.get("cudnn", ""))
    for name in list(PACKAGES)[2:]:
        out[name] = package(name)
    out["python"] = sys.version.split()[0]
    out["platform"] = platform.platform()
    return out


def section(ctx) -> None:
    """Section `versions` of gpu_check.py: every version, one line each."""
    for key, value in collect().items():
        ctx.record(key, value)
