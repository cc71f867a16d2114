"""Test setup: 8 forced CPU devices (for sharding tests) before jax is imported."""

import os
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Compiled programs are cached on disk and shared by the test process and the
# training subprocesses it starts (many tests compile the same tiny model).
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="moe_jax_jit_"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
