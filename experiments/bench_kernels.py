"""Benchmark the strata_jax.pallas kernels against their plain-jnp paths and a bandwidth ceiling, in one run.

Usage:
  python experiments/bench_kernels.py --out bench.json            # on the GPU (H200): full sizes
  python experiments/bench_kernels.py --small --out /tmp/b.json   # smoke test anywhere (CPU: kernels interpreted)

What it measures (each timing = median of --iters calls of a jitted function after warm-up, synchronised with
block_until_ready):
  * ceiling: a bf16 GEMV of a large matrix (8192 x 28672 = 470 MB; 1, 4 and 8 rows) through XLA (cuBLAS), and a
    plain reduction over the same bytes. ceiling_GBps = the best bytes-read / time among them. This is "the
    H200's bandwidth ceiling" as seen by XLA in this very run.
  * sections (--only): qmatmul, gdn, moe, qsa (default: all four) and sweep_qmatmul (launch-config search).
  * each op, for the kernel path and the plain-jnp reference path: time, bytes the op must read at least (weights
    / state once per call, activations), achieved GB/s and that as a fraction of the ceiling.

Prints a table and writes JSON: {"device", "jax", "ceiling": [...], "ceiling_GBps", "rows": [...]} to --out.
On a machine without a GPU the kernel column runs Pallas' interpreter (--small only; its times mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as Q  # noqa: E402


def timeit(fn, args, iters: int, warmup: int = 2, reps: int = 3) -> float:
    """Seconds per call of fn(*args) (already jitted): `iters` calls dispatched back to back (JAX dispatches
    asynchronously, so the device runs them one after another without waiting for Python), then one sync;
    the best of `reps` such batches."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        out = None
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - t) / iters)
    return best


def random_weight(rng, qtype, n_out, k_in, lead=()):
    """Random GGUF blocks with finite fp16 scales (see tests/pallas/pallas_testlib.py)."""
    f16 = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q2_K": (80, 82),
           "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
    if qtype in (Q.F32, Q.F16, Q.BF16):
        dt = {Q.F32: jnp.float32, Q.F16: jnp.float16, Q.BF16: jnp.bfloat16}[qtype]
        return (jax.random.normal(jax.random.key(int(rng.integers(1 << 30))), (*lead, n_out, k_in)) * 0.1).astype(dt)
    qb, bpb = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (*lead, n_out, k_in // qb, bpb), dtype=np.uint8)
    for off in f16.get(qtype.name, ()):
        scale = {"Q8_0": 1.5e-3, "Q4_0": 0.02, "Q4_1": 0.01, "Q5_0": 0.01, "Q5_1": 0.005, "Q2_K": 5e-3,
                 "Q3_K": 1e-3, "Q4_K": 2e-4, "Q5_K": 1e-4, "Q6_K": 1e-4}[qtype.name]
        d = (rng.uniform(0.5, 1, raw.shape[:-1]) * scale).astype(np.float16)
        raw[..., off:off + 2] = d.view(np.uint8).reshape(*raw.shape[:-1], 2)
    return jnp.asarray(raw.reshape(*lead, n_out, -1))


class Bench:
    def __init__(self, iters, kernel_impl):
        self.iters = iters
        self.kernel_impl = kernel_impl
        self.rows = []
        self.ceiling = []
        self.ceiling_GBps = None

    def add(self, op, case, nbytes, fns, args):
        row = {"op": op, "case": case, "bytes": int(nbytes)}
        for path, fn in fns.items():
            try:
                t = timeit(fn, args, self.iters)
                row[f"{path}_us"] = t * 1e6
                row[f"{path}_GBps"] = nbytes / t / 1e9
                if self.ceiling_GBps:
                    row[f"{path}_frac"] = nbytes / t / 1e9 / self.ceiling_GBps
            except Exception as e:  # keep going: one failing case must not hide the others
                row[f"{path}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        self.rows.append(row)
        fmt = lambda p: (f"{row[p + '_us']:9.1f} us {row.get(p + '_frac', 0):5.2f}" if p + "_us" in row
                         else f"{'ERR':>18}")
        print(f"{op:<14} {case:<34} {nbytes / 1e6:9.2f} MB | kernel {fmt('kernel')} | jnp {fmt('jnp')}",
              flush=True)
        for p in fns:
            if p + "_error" in row:
                print(f"    {p}: {row[p + '_error']}", flush=True)


def bench_ceiling(b: Bench, small: bool):
    n, k = (512, 1024) if small else (8192, 28672)
    key = jax.random.key(0)
    w = jax.random.normal(key, (n, k), jnp.bfloat16)
    for m in (1, 4, 8):
        x = jax.random.normal(key, (m, k), jnp.bfloat16)
        f = jax.jit(lambda x, w: jnp.dot(x, w.T, preferred_element_type=jnp.float32))
        t = timeit(f, (x, w), b.iters)
        nbytes = w.size * 2 + x.size * 2 + m * n * 4
        b.ceiling.append({"what": f"bf16 GEMV {n}x{k}, {m} rows (XLA)", "us": t * 1e6, "GBps": nbytes / t / 1e9})
    f = jax.jit(lambda w: jnp.sum(w, axis=1, dtype=jnp.float32))
    t = timeit(f, (w,), b.iters)
    b.ceiling.append({"what": f"row sums of bf16 {n}x{k} (XLA reduce)", "us": t * 1e6, "GBps": w.size * 2 / t / 1e9})
    b.ceiling_GBps = max(c["GBps"] for c in b.ceiling)
    for c in b.ceiling:
        print(f"ceiling: {c['what']:<44} {c['us']:9.1f} us {c['GBps']:8.1f} GB/s")
    print(f"ceiling_GBps = {b.ceiling_GBps:.1f}\n", flush=True)


def bench_qmatmul(b: Bench, small: bool, rng):
    from strata_jax.pallas.quant_matmul import qmatmul
    shapes = [(256, 512)] if small else [(10240, 2560), (8192, 28672)]
    types = [Q.Q8_0, Q.Q4_K] if small else [Q.Q8_0, Q.Q4_K, Q.Q6_K, Q.Q5_0, Q.BF16]
    for qt in types:
        for n, k in shapes:
            w = random_weight(rng, qt, n, k)
            wbytes = w.size * w.dtype.itemsize
            for m in (1, 4, 8):
                x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
                fns = {path: jax.jit(lambda x, w, impl=impl: qmatmul(x, w, qt, n, k, impl=impl))
                       for path, impl in (("kernel", b.kernel_impl), ("jnp", "reference"))}
                b.add("qmatmul", f"{qt.name} {n}x{k} M={m}", wbytes + x.size * 4 + m * n * 4, fns, (x, w))


def bench_gdn(b: Bench, small: bool, rng):
    from strata_jax.pallas.gdn import gdn_chunked, gdn_commit, gdn_window
    B, H, D = (1, 4, 32) if small else (1, 48, 128)
    S0 = jnp.asarray(rng.standard_normal((B, H, D, D)), jnp.float32)
    sbytes = S0.size * 4
    for T in (1, 4, 8):
        q, k = (jnp.asarray(rng.standard_normal((B, T, H, D)) * 0.08, jnp.float32) for _ in range(2))
        v = jnp.asarray(rng.standard_normal((B, T, H, D)), jnp.float32)
        g = -jnp.asarray(rng.uniform(0.01, 1, (B, T, H)), jnp.float32)
        beta = jnp.asarray(rng.uniform(0, 1, (B, T, H)), jnp.float32)
        io = (q.size * 3 + g.size * 2) * 4
        fns = {"kernel": jax.jit(lambda *a: gdn_window(*a, impl=b.kernel_impl)),
               "jnp": jax.jit(lambda *a: gdn_window(*a, impl="reference"))}
        b.add("gdn_window", f"B={B} H={H} D={D} T={T}", sbytes + io + q.size * 4, fns, (S0, q, k, v, g, beta))
        n_keep = jnp.full((B,), T, jnp.int32)
        fns = {"kernel": jax.jit(lambda *a: gdn_commit(*a, impl=b.kernel_impl)),
               "jnp": jax.jit(lambda *a: gdn_commit(*a, impl="reference"))}
        b.add("gdn_commit", f"B={B} H={H} D={D} n_keep={T}", 2 * sbytes + io, fns, (S0, k, v, g, beta, n_keep))
    T = 64 if small else 2048
    q, k = (jnp.asarray(rng.standard_normal((B, T, H, D)) * 0.08, jnp.float32) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((B, T, H, D)), jnp.float32)
    g = -jnp.asarray(rng.uniform(0.01, 1, (B, T, H)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0, 1, (B, T, H)), jnp.float32)
    fns = {"kernel": jax.jit(lambda *a: gdn_chunked(*a, impl=b.kernel_impl)),
           "jnp": jax.jit(lambda *a: gdn_chunked(*a, impl="reference"))}
    b.add("gdn_chunked", f"B={B} H={H} D={D} T={T}", 2 * sbytes + (q.size * 4 + g.size * 2) * 4, fns,
          (S0, q, k, v, g, beta))


def bench_moe(b: Bench, small: bool, rng):
    from strata_jax.pallas.grouped_experts import moe_experts
    E, H, F, k = (8, 256, 64, 2) if small else (512, 2560, 640, 10)
    qts = (Q.Q2_K, Q.Q2_K, Q.Q4_0)  # Qwen3.8-Flash-Next experts (configs/geometries/qwen3.8-flash-next.json)
    gate = random_weight(rng, qts[0], F, H, lead=(E,))
    up = random_weight(rng, qts[1], F, H, lead=(E,))
    down = random_weight(rng, qts[2], H, F, lead=(E,))
    per_expert = (gate[0].size + up[0].size + down[0].size)
    for m in (1, 4, 8, 16):  # 16 rows: two 8-row groups (a window of several segments)
        ids = np.stack([rng.choice(E, k, replace=False) for _ in range(m)]).astype(np.int32)
        n_union = len(np.unique(ids))
        x = jnp.asarray(rng.standard_normal((m, H)), jnp.float32)
        w = jnp.asarray(rng.uniform(0.1, 1, (m, k)), jnp.float32)
        fns = {path: jax.jit(lambda *a, impl=impl: moe_experts(*a, qts, impl=impl))
               for path, impl in (("kernel", b.kernel_impl), ("jnp", "reference"))}
        b.add("moe_experts", f"{qts[0].name}/{qts[2].name} E={E} H={H} F={F} k={k} M={m} union={n_union}",
              n_union * per_expert + x.size * 8, fns, (x, jnp.asarray(ids), w, gate, up, down))


def bench_qsa(b: Bench, small: bool, rng):
    from strata_jax.pallas.qsa import qsa_attention
    N, Hq, Hkv, D, Hi, Di, top = (256, 4, 2, 32, 2, 16, 8) if small else (32768, 24, 2, 256, 4, 128, 512)
    k = jnp.asarray(rng.standard_normal((N, Hkv, D)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((N, Hkv, D)), jnp.bfloat16)
    pooled = jnp.asarray(rng.standard_normal((N // 4, Di)), jnp.float32)
    for T in (1, 4, 8):
        q = jnp.asarray(rng.standard_normal((T, Hq, D)), jnp.float32)
        iq = jnp.asarray(rng.standard_normal((T, Hi, Di)), jnp.float32)
        n_kv = jnp.arange(N - T + 1, N + 1, dtype=jnp.int32)
        n_complete = n_kv // 4
        cells = min(N, top * 4 + 3)
        nbytes = T * cells * Hkv * D * 2 * 2 + pooled.size * 4
        fns = {path: jax.jit(lambda *a, impl=impl: qsa_attention(*a, top_blocks=top, impl=impl))
               for path, impl in (("kernel", b.kernel_impl), ("jnp", "reference"))}
        b.add("qsa_attention", f"N={N} Hq={Hq} Hkv={Hkv} D={D} top={top} T={T}", nbytes, fns,
              (q, k, v, iq, pooled, n_kv, n_complete))


def sweep_qmatmul(b: Bench, small: bool, rng):
    """Time the qmatmul kernel over launch configurations (to choose `kernel.choose_config`)."""
    import itertools
    from strata_jax.pallas.quant_matmul import kernel as K
    cases = [(Q.Q8_0, 256, 512)] if small else [(Q.Q8_0, 8192, 28672), (Q.Q4_K, 8192, 28672)]
    grid = [dict(BN=bn, chunk=ch, num_warps=nw, target_programs=2112, mode=md)
            for bn, ch, nw, md in itertools.product((8, 16), (128, 256), (2, 4), ("reduce", "elementwise"))]
    grid += [dict(BN=64, chunk=256, num_warps=4, target_programs=2112, mode="dot")]
    if small:
        grid = grid[:2] + grid[-2:]
    for qt, n, k in cases:
        w = random_weight(rng, qt, n, k)
        wbytes = w.size * w.dtype.itemsize
        for m in (1, 4, 8):
            x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
            res = []
            for g in grid:
                cfg = K.Config(**g)
                f = jax.jit(lambda x, w, cfg=cfg: K.qmatmul_kernel(x, w, qt, n, k, interpret=b.kernel_impl != "kernel",
                                                                   cfg=cfg))
                try:
                    t = timeit(f, (x, w), b.iters)
                except Exception as e:
                    print(f"  {g}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
                    continue
                res.append((t, g))
                b.rows.append({"op": "sweep_qmatmul", "case": f"{qt.name} {n}x{k} M={m}", "cfg": g,
                               "kernel_us": t * 1e6, "kernel_frac": wbytes / t / 1e9 / b.ceiling_GBps})
            res.sort(key=lambda r: r[0])
            print(f"sweep {qt.name} {n}x{k} M={m}: " + "; ".join(
                f"{t * 1e6:.0f}us {wbytes / t / 1e9 / b.ceiling_GBps:.2f} {g}" for t, g in res[:3]), flush=True)


SECTIONS = {"qmatmul": bench_qmatmul, "gdn": bench_gdn, "moe": bench_moe, "qsa": bench_qsa,
            "sweep_qmatmul": sweep_qmatmul}
DEFAULT_SECTIONS = "qmatmul,gdn,moe,qsa"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="where to write the JSON results")
    ap.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke test)")
    ap.add_argument("--iters", type=int, default=None, help="timed calls per case (default 20, --small 2)")
    ap.add_argument("--only", default=DEFAULT_SECTIONS, help=f"comma-separated subset of {list(SECTIONS)}")
    args = ap.parse_args(argv)
    on_gpu = jax.default_backend() in ("gpu", "cuda", "rocm")
    if not on_gpu and not args.small:
        print("no GPU: use --small (the kernels would run in Pallas' interpreter)", file=sys.stderr)
        return 2
    b = Bench(args.iters or (2 if args.small else 20), "kernel" if on_gpu else "interpret")
    print(f"device: {jax.devices()[0].device_kind}  jax {jax.__version__}  kernel impl: {b.kernel_impl}\n")
    rng = np.random.default_rng(0)
    bench_ceiling(b, args.small)
    for name in args.only.split(","):
        SECTIONS[name](b, args.small, rng)
    res = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "small": args.small,
           "kernel_impl": b.kernel_impl, "ceiling": b.ceiling, "ceiling_GBps": b.ceiling_GBps, "rows": b.rows}
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
