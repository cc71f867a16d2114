"""Test setup: 8 forced CPU devices (for sharding tests) before jax is imported."""

import os
import tempfile

import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Compiled programs are cached on disk and shared by the test process and the
# training subprocesses it starts (many tests compile the same tiny model).
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="moe_jax_jit_"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


@pytest.fixture(scope="session")
def single_process_run(tmp_path_factory):
    """The uninterrupted 8-device run that the multi-process runs must reproduce."""
    from tests import multihost

    workdir = tmp_path_factory.mktemp("single_process") / "run"
    settings = {**multihost.MODEL, **multihost.SAVED_PLAN}
    multihost.train(workdir, multihost.flags(settings, multihost.STEPS + multihost.MORE_STEPS))
    return workdir
