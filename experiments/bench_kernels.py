"""Benchmark the strata_jax.pallas kernels against their plain-jnp paths and a bandwidth ceiling, in one run.

Usage:
  python experiments/bench_kernels.py --out bench.json            # on the GPU (H200): full sizes
  python experiments/bench_kernels.py --only formats,head,prefill,moe_variants --budget_s 170 --out k.json
  python experiments/bench_kernels.py --small --out /tmp/b.json   # smoke test anywhere (CPU: kernels interpreted)
  python experiments/bench_kernels.py --small --lower cuda --only formats,prefill --out /tmp/l.json
                                                                  # CPU: lower every case for CUDA, time nothing
  python experiments/bench_kernels.py --only prefill --budget_s 150 --out prefill.json   # issue 14, on the H200

What it measures (each timing = best of 3 batches of --iters calls of a jitted function after warm-up,
synchronised with block_until_ready):
  * ceiling: a bf16 GEMV of a large matrix (8192 x 28672 = 470 MB; 1, 4 and 8 rows) through XLA (cuBLAS), and a
    plain reduction over the same bytes. ceiling_GBps = the best bytes-read / time among them. This is "the
    H200's bandwidth ceiling" as seen by XLA in this very run.
  * sections (--only): qmatmul, gdn, moe, qsa (default: all four), sweep_qmatmul (launch-config search), and the
    kernel variants of issues 13 / 14, side by side per case:
      formats       every block format (the shipped models' first) at 1 / 2 / 4 / 8 rows on 8192 x 28672:
                    ``bytes`` (the kernel on the GGUF bytes), ``planar_fma`` (planar GEMV, float32 FMAs),
                    ``planar_tc`` (gemm's unit kernel on 16-row tiles, bf16x3), ``planar_tc16`` /
                    ``planar_tc16_x2`` (the 16-row tensor-core GEMV `tcgemv`, bf16x3 / bf16x2);
      head          the Flash-Next output head, 248,320 x 2,560 Q6_K, at 1 and 8 rows;
      prefill       the prefill GEMM (issue 14) at 512 and 2048 rows on the 1.5B file's shapes (Q4_K 8960 x 1536,
                    1536 x 8960, Q6_K 1536 x 8960, Q4_K 1536 x 1536) and Flash-Next's Q4_K 10240 x 2560: both
                    kernels of STRATA_QMATMUL_GEMM (``kblock_<prec>``, ``unit_<prec>``) at bf16 / bf16x2 / bf16x3,
                    XLA's dense bf16 dot (``xla_bf16``; ``xla_x3`` on the first shape); TFLOP/s; then
                    ``prefill_sweep``, launch configurations of the K-block kernel (KBLOCK_SWEEP) at 512 rows;
      moe_variants  the Flash-Next experts (Q2_K gate/up, Q4_0 down, 512 x top-10) at 1 / 4 / 8 window rows and a
                    128-row prefill chunk, GGUF bytes vs planar (window: union-slot GEMV; prefill: sorted grouped
                    GEMM);
      sweep_planar  launch configurations of the planar GEMV and the tensor-core GEMVs (BN / G / warps / K
                    splits; tc16 also at bf16x2).
      gdn_prefill   GDN prefill at T = 128 / 512 / 2048 at the models' GDN shapes (configs/geometries): the step
                    recurrence kernel (gdn_scan) vs the chunked kernels (gdn/chunked.py, launch variants) vs the
                    chunked jnp reference; also TFLOP/s of the chunked products.
      moe_prefill   MoE prefill of a 512-row chunk at the Flash-Next experts (uniform and skewed router ids) and of
                    a 2048-row chunk: both GEMM kernels x bf16 / bf16x2 / bf16x3, K-block launch configs, 32-row
                    tiles, row sub-tiles.
      qsa_prefill   QSA over a 512-row prefill chunk at the end of 8192 cells and as a prompt's first chunk
                    (Flash-Next shapes): the tile kernels (qsa/prefill.py, three launch variants) vs the
                    verify-window path over the rows (default split layout, 16 and 32 splits) vs jnp.
  * each op and path: time, bytes the op must read at least (the weights as the path stores them -- GGUF bytes or
    the planar words -- once per call, plus activations), achieved GB/s and that as a fraction of the ceiling.
  * --budget_s: cases are started only while their section is within its share of the budget (formats 3, prefill
    1.5, other sections 1; time a section leaves unused passes on), in priority order (the shipped formats and 1
    and 8 rows first); the rest are listed as skipped.

Prints a table per section and a summary of the best variant per format, and writes JSON {"device", "jax",
"ceiling": [...], "ceiling_GBps", "rows": [...], "summary": [...], "skipped": [...]} to --out. On a machine without
a GPU the kernel columns run Pallas' interpreter (--small only; its times mean nothing); --lower cuda instead
lowers every case for a GPU (Pallas -> Triton IR, no compile) and records each kernel's IR size.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from gguf.constants import GGMLQuantizationType as Q  # noqa: E402


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
    """Random GGUF blocks with finite fp16 scales (`strata_jax.testing.blocks`), as a device array."""
    from strata_jax.testing.blocks import random_blocks
    return jnp.asarray(random_blocks(rng, qtype, n_out, k_in, lead))


class Bench:
    def __init__(self, iters, kernel_impl, budget_s=None, lower=None, ttir_dir=None, cases=None):
        self.iters = iters
        self.cases = cases  # None, or substrings of "op case": only the cases matching one of them run
        self.kernel_impl = kernel_impl
        self.interpret = kernel_impl != "kernel"
        self.rows = []
        self.ceiling = []
        self.ceiling_GBps = None
        self.deadline = None if budget_s is None else time.perf_counter() + budget_s
        self.skipped = []
        self.lower = lower
        self.ttir_dir = ttir_dir

    def out_of_time(self, op, case) -> bool:
        if self.deadline is not None and time.perf_counter() > self.deadline:
            self.skipped.append(f"{op} {case}")
            return True
        return False

    def add(self, op, case, nbytes, fns, args, flops=None, extra=None):
        """Time each path's fn(*args); ``nbytes`` int or {path: bytes} (paths that store the weight differently)."""
        if self.cases and not any(c in f"{op} {case}" for c in self.cases):
            return None
        if self.out_of_time(op, case):
            return None
        row = {"op": op, "case": case, **(extra or {})}
        for path, fn in fns.items():
            nb = nbytes[path] if isinstance(nbytes, dict) else nbytes
            row[f"{path}_bytes"] = int(nb)
            try:
                if self.lower:
                    row[f"{path}_ir"] = lower_ir(fn, args, self.lower, self.ttir_dir)
                    continue
                t = timeit(fn, args, self.iters)
                row[f"{path}_us"] = t * 1e6
                row[f"{path}_GBps"] = nb / t / 1e9
                if flops:
                    row[f"{path}_TFLOPs"] = flops / t / 1e12
                if self.ceiling_GBps:
                    row[f"{path}_frac"] = nb / t / 1e9 / self.ceiling_GBps
            except Exception as e:  # keep going: one failing case must not hide the others
                row[f"{path}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        self.rows.append(row)
        nb0 = nbytes if not isinstance(nbytes, dict) else max(nbytes.values())

        def fmt(p):
            if p + "_ir" in row:
                return f"{p} IR {row[p + '_ir']['ops']:5d} ops"
            if p + "_us" not in row:
                return f"{p} {'ERR':>15}"
            if flops:
                return f"{p} {row[p + '_us']:8.1f} us {row[p + '_TFLOPs']:5.1f} TF/s"
            return f"{p} {row[p + '_us']:8.1f} us {row.get(p + '_frac', 0):4.2f}"
        print(f"{op:<13} {case:<40} {nb0 / 1e6:8.2f} MB | " + " | ".join(fmt(p) for p in fns), flush=True)
        for p in fns:
            if p + "_error" in row:
                print(f"    {p}: {row[p + '_error']}", flush=True)
        return row


def lower_ir(fn, args, platform, ttir_dir=None):
    """Lower fn(*args) for ``platform`` (no compile); the Triton IR size of the Pallas kernels it holds. With
    ``ttir_dir``, each kernel's Triton IR is also written there (`sass_probe.py --scan`)."""
    from jax._src.pallas.triton import lowering as _tl

    seen = []
    orig = _tl.lower_jaxpr_to_triton_module

    def hook(jaxpr, *a, **k):
        res = orig(jaxpr, *a, **k)
        asm = res.module.operation.get_asm()
        seen.append({"ops": asm.count(" = "), "loads": asm.count("tt.load"), "dots": asm.count("tt.dot")})
        if ttir_dir:   # for `sass_probe.py --scan`: every kernel compiled for sm_90 on this machine
            os.makedirs(ttir_dir, exist_ok=True)
            name = re.search(r"tt\.func (?:public )?@([\w.]+)", asm)
            with open(os.path.join(ttir_dir, f"{name.group(1) if name else 'kernel'}_{len(os.listdir(ttir_dir))}.ttir"),
                      "w") as f:
                f.write(asm)
        return res

    _tl.lower_jaxpr_to_triton_module = hook
    try:
        jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,))
    finally:
        _tl.lower_jaxpr_to_triton_module = orig
    return {"kernels": len(seen), "ops": sum(k["ops"] for k in seen), "loads": sum(k["loads"] for k in seen),
            "dots": sum(k["dots"] for k in seen)}


def bench_ceiling(b: Bench, small: bool):
    if b.lower:
        b.ceiling_GBps = None
        return
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


def _gdn_inputs(rng, B, T, H, Dk, Dv):
    """Model-like GDN operands: q, k L2-normalised (q scaled by Dk**-0.5), g = -softplus (< 0), beta in (0, 1)."""
    def l2(x):
        return x / np.sqrt(np.sum(x * x, -1, keepdims=True) + 1e-6)
    q = l2(rng.standard_normal((B, T, H, Dk))) * Dk ** -0.5
    k = l2(rng.standard_normal((B, T, H, Dk)))
    v = rng.standard_normal((B, T, H, Dv))
    g = -np.log1p(np.exp(rng.standard_normal((B, T, H))))
    beta = 1 / (1 + np.exp(-rng.standard_normal((B, T, H))))
    return [jnp.asarray(a, jnp.float32) for a in (q, k, v, g, beta)]


def bench_gdn_prefill(b: Bench, small: bool, rng):
    """GDN prefill at T = 128 / 512 / 2048 rows of one segment, at the GDN shapes of configs/geometries
    (Qwen3.8-Flash-Next: 48 v-heads, Qwen3.6: 32, Dk = Dv = 128): ``scan`` (the step recurrence `kernel.gdn_scan`,
    gdn_chunked's kernel before the chunked kernels), ``chunked`` (`chunked.gdn_chunked_kernel` with its defaults) and
    its launch settings (at T = 512 only), ``jnp`` (the chunked reference). TFLOP/s counts the
    chunked algorithm's tile products (gram, u, w, w S, q k^T, q S, P delta, k^T delta)."""
    from strata_jax.pallas.gdn import chunked as GC, kernel as GK, reference as GR
    from strata_jax.testing.random_weights import load_geometry
    if small:
        shapes, Ts = [("small", 4, 32, 32)], (64, 130)
    else:
        shapes = []
        for name in ("qwen3.8-flash-next", "qwen3.6-35b-a3b"):
            geo = load_geometry(name)
            shapes.append((name, geo["ssm_v_heads"], geo["ssm_d_k"], geo["ssm_d_v"]))
        Ts = (128, 512, 2048)
    it = b.interpret
    B = 1
    slot = jnp.arange(B, dtype=jnp.int32)
    n = jnp.full((B,), 0, jnp.int32)  # not read (masked=False): every row runs
    fns = {"scan": jax.jit(lambda S0, q, k, v, g, beta: GK.gdn_scan(n, slot, S0, q, k, v, g, beta, want_o=True,
                                                                   want_S=True, interpret=it, masked=False))}
    # launch settings (gdn_chunked_kernel's keywords), the default first (H100 2026-12-07 at T = 512, measured with
    # the blocked solve since removed: 8 warps in the output kernel 3% faster, the rest slower; RESULTS.md)
    variants = {"chunked": {}}
    if not small:
        variants.update({
            "bv64": dict(BV=64), "bv16": dict(BV=16), "out128_w8": dict(BV_out=128, out_warps=8),
            "out32": dict(BV_out=32), "ow8": dict(out_warps=8), "st2": dict(state_stages=2), "w8": dict(num_warps=8)})
    for vname, kw in variants.items():
        fns[vname] = jax.jit(lambda *a, kw=kw: GC.gdn_chunked_kernel(slot, *a, interpret=it, **kw))
    fns["jnp"] = jax.jit(lambda *a: GR.gdn_chunked(*a))
    C = GC.CHUNK
    for name, H, Dk, Dv in shapes:
        S0 = jnp.asarray(rng.standard_normal((B, H, Dk, Dv)) * 0.5, jnp.float32)
        for T in sorted(Ts, key=lambda t: t != 512):   # 512 first: the budget may cut the rest
            args = (S0, *_gdn_inputs(rng, B, T, H, Dk, Dv))
            nbytes = 2 * S0.size * 4 + B * T * H * (2 * Dk + 2 * Dv + 2) * 4  # state in + out, q k v o, g beta
            n_chunks = GC.pad_rows(T, C) // C
            flops = 2 * B * H * n_chunks * (3 * C * C * Dk + 2 * C * C * Dv + 3 * C * Dk * Dv)
            # every variant at T = 512 (the GPU's prefill chunk), the main ones at the other lengths
            some = fns if T == 512 or small else {p: fns[p] for p in ("scan", "chunked", "jnp")}
            b.add("gdn_prefill", f"{name} H={H} Dk={Dk} Dv={Dv} T={T}", nbytes, some, args, flops=flops,
                  extra={"T": T, "H": H})


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


def bench_qsa_prefill(b: Bench, small: bool, rng):
    """QSA over one sequence's prefill chunk of T = 512 rows at the end of N = 8192 cells, then (full size) as a
    prompt's first chunk in a 1,024-cell cache, Flash-Next shapes (Hq = 24, Hkv = 2, D = 256, indexer 4 x 128, 512
    blocks of 4 per row, bf16 K/V): ``prefill`` (`qsa/prefill.py`, ``STRATA_QSA_PREFILL=tiles``: tiled scores, jnp
    selection, block-sparse flash attention; at D = 256 by default 32 (row, head) pairs x key tiles of 32 cells) and
    launch variants of it (8 warps; 64 pairs) vs ``rows`` (the verify-window path over the T rows, `qsa_prefill`'s
    path: per-row scores, a gathered cell list, flash decoding, in the window's split layout), ``qsa_prefill`` (the
    public op on its default path: the rows path with 16 splits per row, in slices of 512 rows), ``rows_s32`` (32
    splits) and ``jnp`` (the reference). The random indexer inputs select scattered blocks (about a quarter of every
    64-cell tile), so the tile kernel runs nearly every tile: a model's clustered selections skip more. TFLOP/s
    counts the dense q.k and p.v products over the T rows' causal cells (padded heads included)."""
    from strata_jax.pallas.qsa import prefill as P, qsa_attention, qsa_prefill
    if small:
        N, T, Hq, Hkv, D, Hi, Di, top = 256, 64, 4, 2, 32, 2, 16, 8
    else:
        N, T, Hq, Hkv, D, Hi, Di, top = 8192, 512, 24, 2, 256, 4, 128, 512
    it = b.interpret
    base = jnp.zeros((1,), jnp.int32)
    pre = lambda **kw: jax.jit(lambda q, k, v, iq, p, n, c: P.qsa_prefill_kernel(
        q, k, v, iq, p, n, c, base, top_blocks=top, block=4, scale=D ** -0.5, interpret=it, **kw))
    fns = {"prefill": pre()}
    if not small:
        fns["prefill_w8"] = pre(num_warps=8)
        fns["prefill_m64"] = pre(m_tile=64)   # (m_tile 64 x tk 64 dropped: over the H100's shared memory)
    fns["rows"] = jax.jit(lambda q, k, v, iq, p, n, c: qsa_attention(q[0], k, v, iq[0], p[0], n[0], c[0],
                                                                      top_blocks=top, impl=b.kernel_impl))
    # the public op as the model calls it (STRATA_QSA_PREFILL's default: the rows path with
    # qsa.api.PREFILL_ATTEND's 16 splits, in slices of PREFILL_ROWS rows)
    fns["qsa_prefill"] = jax.jit(lambda *a: qsa_prefill(*a, top_blocks=top, impl=b.kernel_impl))
    if not small:  # the rows path with 32 splits of each row's cell list
        from strata_jax.pallas.qsa import api as A, kernel as K
        for ms in (32,):
            cfg = K.AttendConfig(NC=32, max_split=ms, num_warps=8, num_stages=2, tag=f"_s{ms}")
            fns[f"rows_s{ms}"] = jax.jit(lambda q, k, v, iq, p, n, c, cfg=cfg: A._qsa_rows(
                q[0], k, v, iq[0], p, n[0], c[0], jnp.zeros((T,), jnp.int32), jnp.zeros((T,), jnp.int32),
                top_blocks=top, block=4, scale=D ** -0.5, interpret=it, attend_cfg=cfg))
    fns["jnp"] = jax.jit(lambda *a: qsa_prefill(*a, top_blocks=top, impl="reference"))
    # the chunk at the end of N cells (sparse: each row keeps top of N / 4 blocks), then (full size) a prompt's
    # first chunk in a 1,024-cell cache (rows 0..T-1: every block kept, causal)
    for N, first in ((N, False),) + (() if small else ((1024, True),)):
        k = jnp.asarray(rng.standard_normal((N, Hkv, D)), jnp.bfloat16)
        v = jnp.asarray(rng.standard_normal((N, Hkv, D)), jnp.bfloat16)
        pooled = jnp.asarray(rng.standard_normal((1, N // 4, Di)), jnp.float32)
        q = jnp.asarray(rng.standard_normal((1, T, Hq, D)), jnp.float32)
        iq = jnp.asarray(rng.standard_normal((1, T, Hi, Di)), jnp.float32)
        n_kv = (jnp.arange(1, T + 1, dtype=jnp.int32) if first else jnp.arange(N - T + 1, N + 1, dtype=jnp.int32))[None]
        n_complete = n_kv // 4
        cells = np.minimum(np.asarray(n_kv[0]), top * 4 + 3)
        nbytes = {p: (N if p.startswith("prefill") else int(cells.sum())) * Hkv * D * 4 + pooled.size * 4
                  for p in fns}
        flops = 2 * 2 * Hkv * P.tiling(Hq, Hkv, D, 4)[0] * D * float(np.sum(np.asarray(n_kv)))
        b.add("qsa_prefill", f"N={N} T={T} {'first chunk' if first else 'last rows'} Hq={Hq} Hkv={Hkv} D={D} "
              f"top={top}", nbytes, fns, (q, k, v, iq, pooled, n_kv, n_complete), flops=flops,
              extra={"T": T, "N": N, "first": first})


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
            if b.cases and not any(c in f"sweep_qmatmul {qt.name} {n}x{k} M={m}" for c in b.cases):
                continue
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



# --- the kernel variants of issues 13 / 14 -------------------------------------------------------------------------

# the shipped models' formats first (Qwen2.5-Coder 1.5B: Q4_K / Q6_K; Flash-Next: Q2_K / Q4_0 / Q8_0 / BF16 and the
# IQ files' experts), then the rest of the list
FORMAT_ORDER = [Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.Q2_K, Q.Q4_0, Q.BF16, Q.IQ4_NL, Q.IQ4_XS, Q.IQ2_S, Q.IQ3_S, Q.IQ2_XS,
                Q.IQ3_XXS, Q.IQ1_M, Q.Q5_0, Q.Q5_K, Q.Q3_K, Q.Q4_1, Q.Q5_1, Q.F16, Q.IQ2_XXS, Q.IQ1_S]
FLOATS = (Q.F32, Q.F16, Q.BF16)


def _weights(rng, qt, n, k, lead=()):
    """(GGUF array, planar / float array the planar kernels read)."""
    from strata_jax.pallas.quant_matmul import planar
    w = random_weight(rng, qt, n, k, lead)
    return w, (w if qt in FLOATS else planar.repack(w, qtype=qt, n_cols=k))


def _nbytes(a):
    return a.size * a.dtype.itemsize


def _gemv_paths(b: Bench, qt, n, k, with_jnp: bool):
    """{path: fn(x, w_raw, w_planar)} of the GEMV variants for one weight."""
    from strata_jax.pallas.quant_matmul import gemm as G, gemv as V, kernel as K, reference as R, tcgemv as TC
    it = b.interpret
    fns = {}
    if qt in K.FORMATS or qt in FLOATS:
        fns["bytes"] = jax.jit(lambda x, w, wp: K.qmatmul_kernel(x, w, qt, n, k, interpret=it))
    fns["planar_fma"] = jax.jit(lambda x, w, wp: V.gemv(x, wp, qt, n, k, interpret=it))
    fns["planar_tc"] = jax.jit(lambda x, w, wp: G.gemm(x, wp, qt, n, k, interpret=it, precision="bf16x3",
                                                       cfg=G.GEMV_TC, variant="unit"))
    for prec, tag in (("bf16x3", ""), ("bf16x2", "_x2")):   # the 16-row tensor-core GEMV (tcgemv)
        fns[f"planar_tc16{tag}"] = jax.jit(lambda x, w, wp, prec=prec: TC.gemv(x, wp, qt, n, k, interpret=it,
                                                                              precision=prec))
    if with_jnp:
        fns["jnp"] = jax.jit(lambda x, w, wp: R.qmatmul(x, w, qt, n, k))
    return fns


def bench_formats(b: Bench, small: bool, rng):
    """Every format x GEMV variant at 1 / 2 / 4 / 8 rows (1 and 8 first, for all formats, then 2 and 4)."""
    n, k = (64, 512) if small else (8192, 28672)
    types = FORMAT_ORDER[:4] + [Q.IQ2_S, Q.BF16] if small else FORMAT_ORDER
    for ms in ((1, 8), (2, 4)):
        for qt in types:
            if b.deadline is not None and time.perf_counter() > b.deadline:
                b.skipped += [f"formats {qt.name} M={m}" for m in ms]
                continue
            w, wp = _weights(rng, qt, n, k)
            fns = _gemv_paths(b, qt, n, k, with_jnp=False)  # the jnp path of a 0.9 GB f32 copy: section qmatmul
            nb = {p: _nbytes(w) if p == "bytes" else _nbytes(wp) for p in fns}
            for m in ms:
                x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
                b.add("formats", f"{qt.name} {n}x{k} M={m}", {p: v + x.size * 4 + m * n * 4 for p, v in nb.items()},
                      fns, (x, w, wp), extra={"format": qt.name, "M": m})
            del w, wp


def bench_head(b: Bench, small: bool, rng):
    """The Flash-Next output head (248,320 x 2,560 Q6_K, 0.52 GB) at 1 and 8 rows."""
    n, k = (1000, 512) if small else (248320, 2560)
    qt = Q.Q6_K
    w, wp = _weights(rng, qt, n, k)
    fns = _gemv_paths(b, qt, n, k, with_jnp=False)
    for m in (1, 8):
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
        nb = {p: _nbytes(w) if p == "bytes" else _nbytes(wp) for p in fns}
        b.add("head", f"{qt.name} {n}x{k} M={m}", {p: v + x.size * 4 + m * n * 4 for p, v in nb.items()}, fns,
              (x, w, wp), extra={"format": qt.name, "M": m})


# The prefill GEMM (issue 14): the weights of the Qwen2.5-Coder 1.5B file (gate / up 8960 x 1536, down 1536 x 8960 in
# Q4_K and in Q6_K, q / o 1536 x 1536) and a Qwen3.8-Flash-Next projection (10240 x 2560), in that order
PREFILL_SHAPES = [(Q.Q4_K, 8960, 1536), (Q.Q4_K, 1536, 8960), (Q.Q6_K, 1536, 8960), (Q.Q4_K, 1536, 1536),
                  (Q.Q4_K, 10240, 2560)]
PREFILL_SHAPES_SMALL = [(Q.Q4_K, 64, 512), (Q.Q6_K, 32, 256)]
# Launch configurations of the K-block kernel swept beside its default (`gemm.kblock_config`): (BN, BM, KB, warps,
# stages, target_programs). Registers / shared memory per CTA from experiments/sass_probe.py (triton 3.9, sm_90,
# Q4_K, bf16x2 / bf16x3): the default (128, 128, 64, 8, 2) 161 / 171 regs, 105 / 153 KB (one CTA per SM);
# KB = 32 with 3 stages 116 / 118 regs, 73 / 105 KB (two CTAs per SM: one decodes while the other multiplies);
# (256, 128, 32) 219 / 225 regs; (128, 256, 32) 194 / 194; (128, 64, 64, 4 warps) 194 / 213; (64, 128, 64, 4)
# 167 / 178. No spills. target_programs 48 splits K in 4 for 1536 output rows at BN = 128 (12 weight tiles: 48 of
# 132 SMs busy at 512 rows without it), none for 8960 or 10240.
KBLOCK_SWEEP = [(128, 128, 64, 8, 2, 1), (128, 128, 32, 8, 3, 48), (256, 128, 32, 8, 2, 48), (128, 256, 32, 8, 2, 48),
                (128, 64, 64, 4, 2, 48), (64, 128, 64, 4, 2, 48)]


def _prefill_paths(b: Bench, qt, n, k, small: bool, xla_x3: bool):
    """{path: fn(x, w_planar, w_dense_bf16)}: both GEMM kernels at each precision (``kblock_f16``: the K-block
    kernel's one float16 product), XLA's dense bf16 dot."""
    from strata_jax.pallas.quant_matmul import gemm as G
    it = b.interpret
    fns = {}
    for var in G.VARIANTS:
        for prec in G.GEMM_PRECISIONS if var == "kblock" else G.PRECISIONS:
            fns[f"{var}_{prec}"] = jax.jit(lambda x, wp, wd, var=var, prec=prec: G.gemm(
                x, wp, qt, n, k, interpret=it, precision=prec, variant=var))
    if not small:   # the tensor cores' reference at this shape: cuBLAS / XLA on a dense bfloat16 weight
        fns["xla_bf16"] = jax.jit(lambda x, wp, wd: jnp.dot(x.astype(jnp.bfloat16), wd.T,
                                                            preferred_element_type=jnp.float32))
        if xla_x3:   # XLA's own 3-product split of float32 operands (the K-block kernel's bf16x2 scheme)
            fns["xla_x3"] = jax.jit(lambda x, wp, wd: jnp.dot(
                x, wd.astype(jnp.float32).T, precision=jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3))
    return fns


def bench_prefill(b: Bench, small: bool, rng):
    """The prefill GEMM (`gemm.gemm`, the row tiles of a prefill chunk) per shape at 512 and 2048 rows: both kernels
    of ``STRATA_QMATMUL_GEMM`` (``kblock``: a K block dequantized per step, whole-block tensor-core dots; ``unit``:
    one scale unit per step and a float32 epilogue) at each precision (bfloat16 pieces per operand), beside XLA's
    dot of a dense bfloat16 weight (``xla_bf16``, one product; ``xla_x3``: float32 operands at
    BF16_BF16_F32_X3, gate/up shape only); TFLOP/s = 2 M N K / time. Then ``prefill_sweep``: launch configurations
    of the K-block kernel (`KBLOCK_SWEEP`) at 512 rows on the gate/up shape (bf16x2 and bf16x3) and the down shape
    (bf16x2). Order (what --budget_s keeps first): every shape at 512 rows, the sweep, every shape at 2048 rows."""
    from strata_jax.pallas.quant_matmul import gemm as G
    shapes = PREFILL_SHAPES_SMALL if small else PREFILL_SHAPES
    rows = (32, 48) if small else (512, 2048)
    it = b.interpret
    weights = {}

    def weight(qt, n, k):
        if (qt, n, k) not in weights:
            w, wp = _weights(rng, qt, n, k)
            wd = jnp.asarray(rng.standard_normal((n, k)) * 0.05, jnp.bfloat16)
            weights[(qt, n, k)] = (wp, wd)
        return weights[(qt, n, k)]

    def case(qt, n, k, m):
        wp, wd = weight(qt, n, k)
        fns = _prefill_paths(b, qt, n, k, small, xla_x3=(qt, n, k) == shapes[0])
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
        nb = {p: (_nbytes(wd) if p.startswith("xla") else _nbytes(wp)) + x.size * 4 + m * n * 4 for p in fns}
        b.add("prefill", f"{qt.name} {n}x{k} rows={m}", nb, fns, (x, wp, wd), flops=2 * m * n * k,
              extra={"format": qt.name, "N": n, "K": k, "M": m})

    for qt, n, k in shapes:
        case(qt, n, k, rows[0])
    sweep = KBLOCK_SWEEP[:2] if small else KBLOCK_SWEEP
    for (qt, n, k), precs in ((shapes[0], ("bf16x2", "bf16x3")), (shapes[1], ("bf16x2",))):
        wp, wd = weight(qt, n, k)
        m = rows[0]
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
        for prec in precs:
            fns = {}
            for bn, bm, kb, nw, ns, tp in sweep:
                cfg = G.Config(BN=bn, BM=bm, KB=kb, num_warps=nw, num_stages=ns, target_programs=tp)
                fns[f"kb_{bn}_{bm}_{kb}_w{nw}_s{ns}_t{tp}"] = jax.jit(
                    lambda x, wp, wd, cfg=cfg, prec=prec: G.gemm(x, wp, qt, n, k, interpret=it, precision=prec,
                                                                 cfg=cfg, variant="kblock"))
            b.add("prefill_sweep", f"{qt.name} {n}x{k} rows={m} {prec}", _nbytes(wp) + x.size * 4 + m * n * 4, fns,
                  (x, wp, wd), flops=2 * m * n * k, extra={"format": qt.name, "N": n, "K": k, "M": m,
                                                             "precision": prec})
    for qt, n, k in shapes:
        case(qt, n, k, rows[1])


# The f16 sweep (2026-12-07, fifth session): the prefill default is f16 since 2026-12-07d, and both tile configs were
# tuned at bf16x2. f16 has one product per step where bf16x2 had three, so decoding the weights weighs more: larger
# KB and row sub-tiles (SUB: one decoded block serves SUB x BM rows, the same bits as SUB = 1) are the candidates.
# (BN, BM, KB, warps, stages, target_programs, SUB); the first is KBLOCK_PREFILL.
KBLOCK_SWEEP_F16 = [(64, 128, 64, 4, 2, 48, 1), (64, 128, 128, 4, 2, 48, 1), (64, 128, 64, 4, 3, 48, 1),
                    (64, 128, 64, 8, 2, 48, 1), (128, 128, 64, 8, 2, 48, 1), (128, 128, 32, 8, 3, 48, 1),
                    (64, 64, 64, 4, 2, 48, 1), (64, 64, 64, 4, 2, 48, 2), (64, 128, 64, 4, 2, 48, 2),
                    (128, 64, 64, 4, 2, 48, 1), (64, 256, 64, 8, 2, 48, 1), (32, 128, 64, 4, 2, 48, 1),
                    (64, 128, 32, 4, 3, 48, 1), (128, 128, 64, 8, 3, 48, 1)]
# MoE prefill tiles at f16, around MOE_PREFILL (BN 64, BM 16, KB 64, 4 warps, 1 stage): (BN, BM, KB, warps, stages,
# SUB); the moe_prefill run of 2026-12-07e (call 4) had KB 128 / 256 at 0.86 / 0.85x MOE_PREFILL's time at 512
# rows, SUB 2 / 4 at 0.80 / 0.72x at 2048 rows (1.11 / 1.56x at 512 uniform)
MOE_SWEEP_F16 = [(64, 16, 64, 4, 1, 1), (64, 16, 128, 4, 1, 1), (64, 16, 256, 4, 1, 1), (64, 16, 128, 4, 1, 2),
                 (64, 16, 256, 4, 1, 2), (64, 16, 128, 4, 1, 4), (64, 16, 256, 4, 1, 4), (32, 16, 256, 4, 1, 1),
                 (64, 16, 256, 8, 1, 1), (64, 16, 256, 4, 2, 1), (128, 16, 128, 8, 1, 1), (64, 16, 512, 4, 1, 1),
                 (32, 16, 128, 2, 1, 1), (64, 32, 128, 4, 1, 1)]


def bench_f16_sweep(b: Bench, small: bool, rng):
    """Launch configs of the K-block kernel at the f16 prefill default: the dense prefill GEMM (`KBLOCK_SWEEP_F16`)
    on every `PREFILL_SHAPES` weight at 512 rows and the gate/up / down shapes at 2048; the grouped-expert GEMM of
    MoE prefill (`MOE_SWEEP_F16`) at the Flash-Next experts, 512 rows uniform / skewed and 2048 uniform. TFLOP/s;
    the first config of each list is the tiles as tuned at bf16x2 (`KBLOCK_PREFILL`, `MOE_PREFILL`); ``--small``
    runs the first three of each (sub-tiles are in ``moe_prefill --small``)."""
    import dataclasses
    from strata_jax.pallas.grouped_experts import kernel as GK
    from strata_jax.pallas.quant_matmul import gemm as G
    it = b.interpret
    dense = KBLOCK_SWEEP_F16[:3] if small else KBLOCK_SWEEP_F16
    cases = ([(PREFILL_SHAPES_SMALL[0], 32)] if small
             else [(s, 512) for s in PREFILL_SHAPES] + [(PREFILL_SHAPES[0], 2048), (PREFILL_SHAPES[1], 2048)])
    for (qt, n, k), m in cases:
        wp = _weights(rng, qt, n, k)[1]
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
        fns = {}
        for bn, bm, kb, nw, ns, tp, sub in dense:
            cfg = G.Config(BN=bn, BM=bm, KB=kb, num_warps=nw, num_stages=ns, target_programs=tp, SUB=sub)
            fns[f"kb_{bn}_{bm}_{kb}_w{nw}_s{ns}_S{sub}"] = jax.jit(
                lambda x, wp, cfg=cfg, qt=qt, n=n, k=k: G.gemm(x, wp, qt, n, k, interpret=it, precision=G.F16,
                                                               cfg=cfg, variant="kblock"))
        b.add("f16_dense", f"{qt.name} {n}x{k} rows={m}", _nbytes(wp) + x.size * 4 + m * n * 4, fns, (x, wp),
              flops=2 * m * n * k, extra={"format": qt.name, "N": n, "K": k, "M": m})
    E, H, F, k, M = (8, 256, 64, 2, 64) if small else (512, 2560, 640, 10, 512)
    qts = (Q.Q2_K, Q.Q2_K, Q.Q4_0)
    ws = [_weights(rng, q, nn, kk, (E,))[1] for q, nn, kk in ((qts[0], F, H), (qts[1], F, H), (qts[2], H, F))]
    fns = {}
    for bn, bm, kb, nw, ns, sub in (MOE_SWEEP_F16[:3] if small else MOE_SWEEP_F16):
        cfg = dataclasses.replace(G.MOE_PREFILL, BN=bn, BM=bm, KB=kb, num_warps=nw, num_stages=ns, SUB=sub)
        fns[f"kb_{bn}_{bm}_{kb}_w{nw}_s{ns}_S{sub}"] = jax.jit(
            lambda x, i, tw, *w, cfg=cfg: GK.moe_prefill(x, i, tw, *w, qts, interpret=it, precision=G.F16,
                                                         variant="kblock", cfg=cfg))
    bias = rng.standard_normal(E) * 1.5
    for dist, m in [("uniform", M), ("skewed", M)] + ([] if small else [("uniform", 4 * M)]):
        x = jnp.asarray(rng.standard_normal((m, H)), jnp.float32)
        tw = jnp.asarray(rng.uniform(0.1, 1, (m, k)), jnp.float32)
        logits = rng.gumbel(size=(m, E)) + (bias if dist == "skewed" else 0.0)
        ids = np.argsort(-logits, axis=1)[:, :k].astype(np.int32)
        counts = np.bincount(ids.reshape(-1), minlength=E)
        b.add("f16_moe", f"{qts[0].name}/{qts[2].name} E={E} k={k} M={m} {dist} max_rows={counts.max()}",
              sum(_nbytes(w) for w in ws), fns, (x, jnp.asarray(ids), tw, *ws), flops=2 * m * k * 3 * H * F,
              extra={"M": m, "dist": dist})


def bench_moe_variants(b: Bench, small: bool, rng):
    """Grouped experts on GGUF bytes vs planar: windows (1 / 4 / 8 rows) and a 128-row prefill chunk."""
    from strata_jax.pallas.grouped_experts import kernel as GK
    from strata_jax.pallas.quant_matmul import gemv as V
    E, H, F, k = (8, 256, 64, 2) if small else (512, 2560, 640, 10)
    qts = (Q.Q2_K, Q.Q2_K, Q.Q4_0)
    ws = [_weights(rng, q, nn, kk, (E,)) for q, nn, kk in ((qts[0], F, H), (qts[1], F, H), (qts[2], H, F))]
    raw, pl_ = [w for w, _ in ws], [p for _, p in ws]
    it = b.interpret
    fns = {"bytes": jax.jit(lambda x, i, tw, *w: GK.moe_experts_kernel(x, i, tw, *w[:3], qts, interpret=it)),
           "planar_fma": jax.jit(lambda x, i, tw, *w: GK.moe_experts_kernel(x, i, tw, *w[3:], qts, interpret=it,
                                                                           grouped=V.grouped_gemv,
                                                                           fused_gate_up=True)),
           "planar_tc": jax.jit(lambda x, i, tw, *w: GK.moe_experts_planar(x, i, tw, *w[3:], qts, interpret=it,
                                                                          prefill=False, gemv="tc",
                                                                          precision="bf16x3"))}
    pre = {"bytes": fns["bytes"],
           **{f"tc_{p}": jax.jit(lambda x, i, tw, *w, p=p: GK.moe_prefill(x, i, tw, *w[3:], qts, interpret=it,
                                                                          precision=p))
              for p in ("bf16", "f16", "bf16x3")}}
    per_expert = [sum(_nbytes(a[0]) for a in arrs) for arrs in (raw, pl_)]
    for m in ((1, 4, 8, 128) if not small else (1, 8, 16)):
        ids = np.stack([rng.choice(E, k, replace=False) for _ in range(m)]).astype(np.int32)
        n_union = len(np.unique(ids))
        x = jnp.asarray(rng.standard_normal((m, H)), jnp.float32)
        tw = jnp.asarray(rng.uniform(0.1, 1, (m, k)), jnp.float32)
        use = fns if m <= 8 else pre
        nb = {p: n_union * per_expert[0 if p == "bytes" else 1] + x.size * 8 for p in use}
        b.add("moe_variants", f"{qts[0].name}/{qts[2].name} E={E} k={k} M={m} union={n_union}", nb, use,
              (x, jnp.asarray(ids), tw, *raw, *pl_), extra={"M": m})


def bench_moe_prefill(b: Bench, small: bool, rng):
    """MoE prefill (`grouped_experts.kernel.moe_prefill`) at the Flash-Next experts (Q2_K gate/up, Q4_0 down, 512
    experts, top-10) for a 512-row chunk: both kernels of STRATA_QMATMUL_GEMM at bf16 / bf16x2 / bf16x3 / f16 on
    `gemm.MOE_PREFILL`'s tiles (BM = 16 rows per tile, no sub-tiles), then K-block launch configs, 32-row tiles and
    row sub-tiles (`gemm.Config.SUB`) at `gemm.DEFAULT_PRECISION`. Router ids uniform over the experts (about 10
    rows per expert) and skewed (a per-expert bias, as real routers: a few experts take many rows); then a 2048-row
    chunk (uniform, ~40 rows per expert). Bytes: every expert's planar words once (each expert is chosen)."""
    import dataclasses
    from strata_jax.pallas.grouped_experts import kernel as GK
    from strata_jax.pallas.quant_matmul import gemm as G
    E, H, F, k, M = (8, 256, 64, 2, 64) if small else (512, 2560, 640, 10, 512)
    qts = (Q.Q2_K, Q.Q2_K, Q.Q4_0)
    ws = [_weights(rng, q, nn, kk, (E,))[1] for q, nn, kk in ((qts[0], F, H), (qts[1], F, H), (qts[2], H, F))]
    it = b.interpret
    base = G.MOE_PREFILL

    def fn(variant, prec, cfg=base):
        return jax.jit(lambda x, i, tw, *w: GK.moe_prefill(x, i, tw, *w, qts, interpret=it, precision=prec,
                                                            variant=variant, cfg=cfg))
    fns = {f"{v}_{p}": fn(v, p) for v in ("kblock", "unit") for p in ("bf16x2", "bf16x3", "bf16")}
    fns["kblock_f16"] = fn("kblock", "f16")
    fns["kblock_f16_default"] = fn("kblock", "f16", None)   # the engine's tiles: gemm.moe_prefill_config
    sweep = {"kb_BN128_KB64": dataclasses.replace(base, BN=128, KB=64),
             "kb_KB128": dataclasses.replace(base, KB=128),   # f16's KB since 2026-12-07e (gemm.MOE_F16_KB)
             "kb_BN64_KB256": dataclasses.replace(base, BN=64, KB=256),
             "kb_BN128_KB128_w8": dataclasses.replace(base, BN=128, KB=128, num_warps=8),
             "kb_BN32_KB128": dataclasses.replace(base, BN=32, KB=128),
             "kb_BM32": dataclasses.replace(base, BM=32, KB=128),   # (KB as on 2026-12-06's first run)
             # around the default (KB = 64): pipelining depth, warps, narrower weight tiles, one group per step
             "kb_st3": dataclasses.replace(base, num_stages=3), "kb_st2": dataclasses.replace(base, num_stages=2),
             "kb_w2": dataclasses.replace(base, num_warps=2), "kb_w8": dataclasses.replace(base, num_warps=8),
             "kb_BN32": dataclasses.replace(base, BN=32), "kb_KB32": dataclasses.replace(base, KB=32),
             # row sub-tiles: 2 / 4 tiles of 16 rows per program share each decoded weight block (same bits)
             "kb_SUB2": dataclasses.replace(base, SUB=2), "kb_SUB4": dataclasses.replace(base, SUB=4)}
    # the launch configs at the experts' default precision (f16 since 2026-12-07c; re-swept at it on 2026-12-07e)
    if small:   # the sub-tiles only (the CPU smoke run exercises them)
        fns.update({name: fn("kblock", G.DEFAULT_PRECISION, sweep[name]) for name in ("kb_SUB2", "kb_SUB4")})
    else:
        fns.update({name: fn("kblock", G.DEFAULT_PRECISION, cfg) for name, cfg in sweep.items()})
        fns["unit_bf16x2_BM32"] = fn("unit", "bf16x2", dataclasses.replace(base, BM=32))
    nbytes = sum(_nbytes(w) for w in ws)
    bias = rng.standard_normal(E) * 1.5
    later = (["kblock_bf16x2", "kblock_bf16x3", "kblock_bf16", "kblock_f16", "kblock_f16_default"] if small
             else ["kblock_bf16x2", "kblock_bf16", "kblock_f16", "kblock_f16_default", "kb_SUB2", "kb_SUB4"])
    cases = [("uniform", M), ("skewed", M)] + ([] if small else [("uniform", 4 * M)])
    for dist, M in cases:   # 4M: a 2048-row chunk, ~40 rows per expert (each decoded weight used 4x as often)
        x = jnp.asarray(rng.standard_normal((M, H)), jnp.float32)
        tw = jnp.asarray(rng.uniform(0.1, 1, (M, k)), jnp.float32)
        logits = rng.gumbel(size=(M, E)) + (bias if dist == "skewed" else 0.0)
        ids = np.argsort(-logits, axis=1)[:, :k].astype(np.int32)
        counts = np.bincount(ids.reshape(-1), minlength=E)
        tiles = int(np.sum(-(-counts // base.tile_m)))
        flops = 2 * M * k * 3 * H * F
        b.add("moe_prefill", f"{qts[0].name}/{qts[2].name} E={E} k={k} M={M} {dist} max_rows={counts.max()} "
              f"tiles={tiles}", nbytes, fns if (dist, M) == cases[0] else {p: fns[p] for p in later},
              (x, jnp.asarray(ids), tw, *ws), flops=flops, extra={"M": M, "dist": dist})


def sweep_planar(b: Bench, small: bool, rng):
    """Launch configurations of the planar GEMV (fma), the tensor-core tiles (tc) and the 16-row tensor-core GEMV
    (tc16), to choose `gemv.choose_config` / `gemm.GEMV_TC` / `tcgemv.choose_config` (first guesses today); the
    likeliest candidates first. tc16 at 1 and 8 rows must take the same time (one kernel for M <= 16)."""
    from strata_jax.pallas.quant_matmul import gemm as G, gemv as V, tcgemv as TC
    n, k = (64, 512) if small else (8192, 28672)
    fma = [(16, 8, 4), (32, 8, 4), (64, 8, 4), (32, 4, 4), (32, 16, 8), (64, 8, 8), (8, 8, 2), (16, 16, 4)]
    tc = [(32, 4), (64, 4), (128, 8), (64, 8)]
    # tc16 (BN, G, warps, target programs, stages, precision): the default, more groups per step, more programs,
    # no cp.async pipelining (fewer instructions: 639 vs 731 per step for Q4_K by experiments/sass_probe.py, but
    # the latency exposed), wider and narrower tiles, the bf16x2 activations (fewer MMAs: the bound for <= 4-bit)
    tc16 = [(128, 2, 4, 264, 2, "bf16x3"), (128, 4, 4, 264, 2, "bf16x3"), (128, 2, 4, 396, 2, "bf16x3"),
            (128, 4, 4, 264, 1, "bf16x3"), (128, 2, 4, 396, 1, "bf16x3"), (64, 2, 4, 528, 2, "bf16x3"),
            (256, 2, 8, 132, 2, "bf16x3"), (128, 2, 4, 264, 2, "bf16x2"), (128, 4, 4, 264, 1, "bf16x2")]
    it = b.interpret
    for qt in ([Q.Q4_K] if small else [Q.Q4_K, Q.Q6_K, Q.Q2_K, Q.IQ4_XS]):
        w, wp = _weights(rng, qt, n, k)
        for m in (1, 8):
            x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
            fns = {}
            for bn, g, nw in (fma[:2] if small else fma):
                cfg = V.Config(BN=bn, G=g, num_warps=nw)
                fns[f"fma_{bn}_{g}_{nw}"] = jax.jit(lambda x, w, wp, cfg=cfg: V.gemv(x, wp, qt, n, k, interpret=it,
                                                                                     cfg=cfg))
            for bn, nw in (tc[:1] if small else tc):
                cfg = G.Config(BN=bn, BM=16, target_programs=2112, num_warps=nw)
                fns[f"tc_{bn}_{nw}"] = jax.jit(lambda x, w, wp, cfg=cfg: G.gemm(x, wp, qt, n, k, interpret=it,
                                                                               precision="bf16x3", cfg=cfg,
                                                                               variant="unit"))
            for bn, g, nw, tp, ns, prec in ([(16, 2, 4, 264, 2, "bf16x3"), (16, 2, 4, 264, 1, "bf16x2")] if small
                                            else tc16):
                cfg = TC.Config(BN=bn, G=g, num_warps=nw, target_programs=tp, num_stages=ns)
                fns[f"tc16_{bn}_{g}_{nw}_{tp}_s{ns}{'_x2' if prec == 'bf16x2' else ''}"] = jax.jit(
                    lambda x, w, wp, cfg=cfg, prec=prec: TC.gemv(x, wp, qt, n, k, interpret=it, precision=prec,
                                                                 cfg=cfg))
            b.add("sweep_planar", f"{qt.name} {n}x{k} M={m}", _nbytes(wp) + x.size * 4 + m * n * 4, fns,
                  (x, w, wp), extra={"format": qt.name, "M": m})
        del w, wp


def summary(b: Bench) -> list[dict]:
    """Per (section, format, M): the best path and its fraction of the ceiling, with every path's fraction (the
    prefill sections: the fastest path and every path's TFLOP/s)."""
    out = []
    for r in b.rows:
        if r["op"] in ("prefill", "prefill_sweep"):
            tf = {k[:-7]: v for k, v in r.items() if k.endswith("_TFLOPs")}
            if tf:
                best = max(tf, key=tf.get)
                out.append({"op": r["op"], "case": r["case"], "best": best, "best_TFLOPs": round(tf[best], 1),
                            **{p: round(v, 1) for p, v in tf.items()}})
            continue
        if r["op"] not in ("formats", "head", "moe_variants", "sweep_planar"):
            continue
        fr = {k[:-5]: v for k, v in r.items() if k.endswith("_frac")}
        if not fr:
            continue
        best = max(fr, key=fr.get)
        out.append({"op": r["op"], "case": r["case"], "best": best, "best_frac": round(fr[best], 3),
                    **{p: round(v, 3) for p, v in fr.items()}})
    return out


SECTIONS = {"qmatmul": bench_qmatmul, "gdn": bench_gdn, "moe": bench_moe, "qsa": bench_qsa,
            "sweep_qmatmul": sweep_qmatmul, "formats": bench_formats, "head": bench_head, "prefill": bench_prefill,
            "moe_variants": bench_moe_variants, "sweep_planar": sweep_planar,
            "gdn_prefill": bench_gdn_prefill, "qsa_prefill": bench_qsa_prefill,
            "moe_prefill": bench_moe_prefill, "f16_sweep": bench_f16_sweep}
DEFAULT_SECTIONS = "qmatmul,gdn,moe,qsa"
SECTION_WEIGHT = {"formats": 3.0, "prefill": 1.5, "sweep_planar": 1.5}   # shares of --budget_s


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="where to write the JSON results")
    ap.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke test)")
    ap.add_argument("--iters", type=int, default=None, help="timed calls per case (default 20, --small 2)")
    ap.add_argument("--only", default=DEFAULT_SECTIONS, help=f"comma-separated subset of {list(SECTIONS)}")
    ap.add_argument("--budget_s", type=float, default=None,
                    help="start no new case after this many seconds (the rest are listed as skipped)")
    ap.add_argument("--cases", default=None, help="comma-separated substrings of \"op case\" (as printed, e.g. "
                    "'M=2048'): only the matching cases of the sections run")
    ap.add_argument("--ttir_dir", default=None, help="with --lower: also write each kernel's Triton IR here (for "
                    "experiments/sass_probe.py --scan)")
    ap.add_argument("--lower", default=None, help="lower every case for this platform (e.g. cuda) instead of "
                    "timing it: Triton IR size per case, works on a CPU")
    args = ap.parse_args(argv)
    on_gpu = jax.default_backend() in ("gpu", "cuda", "rocm")
    unknown = [n for n in args.only.split(",") if n not in SECTIONS]
    if unknown:
        print(f"error: unknown section(s) {unknown}; known: {list(SECTIONS)}", file=sys.stderr)
        return 2
    if not on_gpu and not args.small and not args.lower:
        print("error: no GPU: use --small (the kernels would run in Pallas' interpreter) or --lower cuda",
              file=sys.stderr)
        return 2
    if args.lower:
        from strata_jax.pallas import dispatch
        dispatch.on_gpu = lambda: True
    impl = "kernel" if on_gpu or args.lower else "interpret"
    b = Bench(args.iters or (2 if args.small else 20), impl, args.budget_s, args.lower, args.ttir_dir,
              args.cases.split(",") if args.cases else None)
    print(f"device: {jax.devices()[0].device_kind}  jax {jax.__version__}  kernel impl: {b.kernel_impl}"
          f"{'  lowering for ' + args.lower if args.lower else ''}\n")
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    bench_ceiling(b, args.small)
    names = args.only.split(",")
    end = None if args.budget_s is None else t0 + args.budget_s
    for i, name in enumerate(names):
        if end is not None:  # each section gets its weighted share of what is left (unused time passes on)
            w = [SECTION_WEIGHT.get(n, 1.0) for n in names[i:]]
            b.deadline = time.perf_counter() + max(0.0, end - time.perf_counter()) * w[0] / sum(w)
        SECTIONS[name](b, args.small, rng)
    summ = summary(b)
    if summ:
        print(f"\nsummary (fraction of the {b.ceiling_GBps or 0:.0f} GB/s ceiling; best path first):")
        for r in summ:
            key = "best_TFLOPs" if "best_TFLOPs" in r else "best_frac"
            rest = ", ".join(f"{p} {v:.2f}" for p, v in r.items() if p not in ("op", "case", "best", key))
            unit = " TF/s" if key == "best_TFLOPs" else ""
            print(f"  {r['op']:<12} {r['case']:<40} best {r['best']:<11} {r[key]:.2f}{unit}   ({rest})")
    if b.cases and not b.rows:
        print(f"\nno case matched --cases {args.cases}")
    if b.skipped:
        print(f"\nskipped ({len(b.skipped)}, over --budget_s): " + "; ".join(b.skipped[:12])
              + (" ..." if len(b.skipped) > 12 else ""))
    res = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "small": args.small,
           "kernel_impl": b.kernel_impl, "lower": args.lower, "cases": args.cases, "ceiling": b.ceiling,
           "ceiling_GBps": b.ceiling_GBps,
           "rows": b.rows, "summary": summ, "skipped": b.skipped, "wall_s": round(time.perf_counter() - t0, 1)}
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"\nwrote {args.out} ({res['wall_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
