"""`strata_jax.pallas.gpu_flags`: the command-buffer / autotuning flags, merged without overriding a user's."""

import jax
import pytest

from strata_jax.errors import StrataError
from strata_jax.pallas import gpu_flags


def test_flags_and_merge():
    on = gpu_flags.xla_flags(True, "off")
    assert f"--xla_gpu_enable_command_buffer={gpu_flags.COMMAND_BUFFER_TYPES}" in on
    assert "--xla_gpu_autotune_level=0" in on
    assert gpu_flags.xla_flags(False, "default") == ["--xla_gpu_enable_command_buffer="]
    assert gpu_flags.xla_flags(False, "cache:/tmp/at")[-1] == "--xla_gpu_per_fusion_autotune_cache_dir=/tmp/at"
    with pytest.raises(StrataError):
        gpu_flags.xla_flags(True, "fast")
    user = "--xla_gpu_autotune_level=4 --xla_force_host_platform_device_count=4"
    got = gpu_flags.merged(user, on).split()
    assert "--xla_gpu_autotune_level=4" in got and "--xla_gpu_autotune_level=0" not in got
    assert got[:2] == user.split() and len(got) == 4


def test_apply_after_backend_start_refuses():
    jax.devices()  # the backend is up
    with pytest.raises(StrataError):
        gpu_flags.apply(gpu_flags.xla_flags())
