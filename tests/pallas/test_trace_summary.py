"""`strata_jax.pallas.trace`: the per-step summary of a profiler trace (what experiments/profile_step.py prints),
on a hand-made GPU-style trace with known figures and on a real trace of a CPU run (the plumbing)."""

import jax
import jax.numpy as jnp
import pytest

from strata_jax.pallas import trace


def _gpu_events():
    meta = [{"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
            {"ph": "M", "name": "thread_name", "pid": 7, "tid": 3, "args": {"name": "Stream #13(Compute)"}}]
    ev = []
    for step in range(2):  # two steps of 100 us: two kernels overlapping, one D2H, one D2D, one copy kernel
        t = 1000.0 + 100.0 * step
        ev += [{"ph": "X", "pid": 7, "tid": 3, "name": "qmatmul_Q4_K", "ts": t, "dur": 30.0},
               {"ph": "X", "pid": 7, "tid": 4, "name": "fusion_3", "ts": t + 20, "dur": 20.0},
               {"ph": "X", "pid": 7, "tid": 5, "name": "MemcpyD2H", "ts": t + 50, "dur": 2.0,
                "args": {"memcpy_details": "kind_src:device kind_dst:pinned size:4 dest:0 async:1"}},
               {"ph": "X", "pid": 7, "tid": 5, "name": "MemcpyD2D", "ts": t + 60, "dur": 8.0, "args": {"bytes": 4096}},
               {"ph": "X", "pid": 7, "tid": 3, "name": "copy_fusion.1", "ts": t + 70, "dur": 5.0},
               {"ph": "X", "pid": 1, "tid": 9, "name": "host work", "ts": t, "dur": 90.0}]
    return meta + ev


def test_gpu_style_trace():
    s = trace.summarize(_gpu_events(), n_steps=2)
    assert s["device"] == "gpu"
    assert s["launches"] == 3  # two kernels and the copy kernel per step (memcpys are not launches)
    assert s["copies"]["D2H"] == {"count": 1, "bytes": 4}
    assert s["copies"]["D2D"] == {"count": 1, "bytes": 4096}
    assert s["copies"]["copy_kernel"]["count"] == 1
    assert s["busy_ms"] == pytest.approx((40 + 2 + 8 + 5) / 1e3)  # union: [0, 40) + memcpys + copy kernel
    assert s["span_ms"] == pytest.approx((100 + 75) / 2 / 1e3)
    assert s["top_kernels"][0][0] == "qmatmul_Q4_K" and s["top_kernels"][0][1] == pytest.approx(0.03)
    fams = {k: (t, c) for k, t, c in s["kernel_families"]}  # fusion_3 -> fusion, copy_fusion.1 -> copy_fusion
    assert fams == {"qmatmul_Q4_K": (pytest.approx(0.03), 1), "fusion": (pytest.approx(0.02), 1),
                    "copy_fusion": (pytest.approx(0.005), 1)}


@pytest.mark.parametrize("name,kind", [("MemcpyH2D", "H2D"), ("Memcpy DtoH (Device -> Pinned)", "D2H"),
                                       ("MemcpyP2P", "P2P"), ("memcpy32_post", "copy_kernel"),
                                       ("Memset (Device)", "memset"), ("gdn_scan", None)])
def test_copy_kind(name, kind):
    assert trace.copy_kind(name) == kind


def test_cpu_trace_plumbing(tmp_path):
    f = jax.jit(lambda x: jnp.sin(x) @ x + 1.0)
    x = jax.device_put(jnp.ones((64, 64)), jax.devices("cpu")[0])  # on the CPU also where a GPU is the default
    f(x).block_until_ready()
    with jax.profiler.trace(str(tmp_path), create_perfetto_trace=True):
        for _ in range(3):
            y = f(x)
        y.block_until_ready()
    s = trace.summarize(trace.load_events(str(tmp_path)), n_steps=3)
    assert s["device"] == "cpu"
    assert s["launches"] >= 1 and s["top_kernels"]
    assert not any(k in s["copies"] for k in ("H2D", "D2H", "D2D"))
    with pytest.raises(FileNotFoundError):
        trace.load_events(str(tmp_path / "none"))
