"""`strata_jax.pallas.gpu_flags`: the command-buffer / autotuning flags, merged without overriding a user's."""

import jax
import pytest

from strata_jax.errors import StrataError
from strata_jax.pallas import gpu_flags


def test_flags_and_merge():
    on = gpu_flags.xla_flags(True, "off")
    assert f"--xla_gpu_enable_command_buffer={gpu_flags.COMMAND_BUFFER_TYPES}" in on
    assert "--xla_gpu_autotune_level=0" in on
    assert "--xla_gpu_command_buffer_scheduling_mode=CONCURRENT" in on   # measured faster, same tokens (RESULTS)
    assert gpu_flags.xla_flags(False, "default") == ["--xla_gpu_enable_command_buffer="]
    assert gpu_flags.xla_flags(False, "cache:/tmp/at")[-1] == "--xla_gpu_per_fusion_autotune_cache_dir=/tmp/at"
    with pytest.raises(StrataError):
        gpu_flags.xla_flags(True, "fast")
    user = "--xla_gpu_autotune_level=4 --xla_force_host_platform_device_count=4"
    got = gpu_flags.merged(user, on).split()
    assert "--xla_gpu_autotune_level=4" in got and "--xla_gpu_autotune_level=0" not in got
    assert got[:2] == user.split() and len(got) == 5
    # a user's scheduling mode wins (LHS: XLA's default, the old order)
    got = gpu_flags.merged("--xla_gpu_command_buffer_scheduling_mode=LHS", on).split()
    assert [f for f in got if "scheduling_mode" in f] == ["--xla_gpu_command_buffer_scheduling_mode=LHS"]


def test_flags_parse_in_this_jaxlib():
    """This jaxlib's XLA knows every flag and value `xla_flags` sets (an unknown flag or value in XLA_FLAGS aborts
    the process at backend start, on a CPU too: XLA parses its GPU flags there as well)."""
    import os
    import subprocess
    import sys

    for flags in (gpu_flags.xla_flags(True, "off"), gpu_flags.xla_flags(False, "cache:/tmp/at")):
        env = {**os.environ, "XLA_FLAGS": " ".join(flags)}
        proc = subprocess.run([sys.executable, "-c", "import jax; print(int(jax.numpy.ones(2).sum()))"], env=env,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and proc.stdout.strip() == "2", (flags, proc.stderr[-2000:])


def test_apply_after_backend_start_refuses():
    jax.devices()  # the backend is up
    with pytest.raises(StrataError):
        gpu_flags.apply(gpu_flags.xla_flags())


def test_cli_sets_gpu_flags_before_jax_starts(tmp_path):
    """strata-generate / strata-serve put the flags in XLA_FLAGS at start-up where JAX's CUDA plugin is installed
    (simulated here), the autotuning cache beside the XLA cache; --nogpu_graphs turns command buffers off; a user's
    own XLA_FLAGS entries are kept."""
    import os
    import subprocess
    import sys

    code = (
        "import sys, os\n"
        "from strata_jax.cli import flags as f\n"
        "f._cuda_plugin_installed = lambda: True\n"
        "f.FLAGS(['x'] + sys.argv[1:])\n"
        "f.apply_gpu_flags()\n"
        "print(os.environ['XLA_FLAGS'])\n")
    env = dict(os.environ, XLA_FLAGS="--xla_gpu_autotune_level=4")

    def flags_for(*args):
        out = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True,
                             check=True).stdout.split()
        return out

    on = flags_for(f"--cache_dir={tmp_path}")
    assert f"--xla_gpu_enable_command_buffer={gpu_flags.COMMAND_BUFFER_TYPES}" in on
    assert f"--xla_gpu_per_fusion_autotune_cache_dir={tmp_path}/xla/autotune" in on
    assert on[0] == "--xla_gpu_autotune_level=4"
    off = flags_for("--nogpu_graphs")
    assert "--xla_gpu_enable_command_buffer=" in off


def test_cli_sets_memory_fraction_unless_set():
    """JAX's allocator would take 75% of the GPU (59.4 of an H100's 79.2 GiB, below the Flash-Next shape's load
    peak): the GPU start-up sets XLA_PYTHON_CLIENT_MEM_FRACTION to gpu_flags.MEMORY_FRACTION, and keeps a value the
    user set (including one equal to JAX's default)."""
    import os
    import subprocess
    import sys

    code = ("import os\n"
            "from strata_jax.cli import flags as f\n"
            "f._cuda_plugin_installed = lambda: True\n"
            "f.FLAGS(['x'])\n"
            "f.apply_gpu_flags()\n"
            "print(os.environ['XLA_PYTHON_CLIENT_MEM_FRACTION'])\n")

    def fraction(**env):
        base = {k: v for k, v in os.environ.items() if k != "XLA_PYTHON_CLIENT_MEM_FRACTION"}
        return subprocess.run([sys.executable, "-c", code], env=dict(base, **env), capture_output=True, text=True,
                               check=True).stdout.strip()

    assert fraction() == gpu_flags.MEMORY_FRACTION == "0.92"
    assert fraction(XLA_PYTHON_CLIENT_MEM_FRACTION="0.75") == "0.75"
    assert fraction(XLA_PYTHON_CLIENT_MEM_FRACTION="0.5") == "0.5"
