"""Compile a planar GEMV / GEMM kernel for an H100 / H200 (sm_90) on a machine without a GPU and report what the
GPU would run: registers, spills, shared memory, MMA kind, and the loop's instruction count per weight byte.

How: Pallas lowers the kernel to Triton IR (as `bench_kernels.py --lower cuda` does); the ``triton`` package
(PyPI, with its bundled ptxas / cuobjdump) runs its ``make_ttir`` passes on that IR (as its compile of a Python
kernel does; before 2026-12-05 this script skipped them: no ``acc + dot`` combining into the MMA, no CSE) and
compiles it for ``cuda:90`` (no driver needed), and this script reads the SASS. The H200's jaxlib compiles with
its own Triton build, so the figures are a close approximation, not the device's binary. ``triton`` conflicts
with nothing here but is large (~1 GB): keep it in its own venv.

  python3 -m venv /tmp/tv && /tmp/tv/bin/pip install triton==3.9.0
  python experiments/sass_probe.py --triton_python /tmp/tv/bin/python --variant tc16 --format Q4_K \\
      --n 8192 --k 28672 --m 8 --cfg BN=128,G=2 --prec bf16x3

Variants: ``tc16`` (`tcgemv`), ``tc`` (`gemm`'s unit kernel, ``gemm.GEMV_TC`` by default), ``kblock`` (`gemm`'s
K-block kernel, ``gemm.kblock_config`` by default; e.g. ``--m 512 --cfg BN=128,BM=128,KB=64,num_warps=8``),
``fma`` (`gemv`). The issue
bound assumes one warp instruction per scheduler per cycle (4 per SM), 132 SMs at 1.98 GHz and the 3.9 TB/s
ceiling (14.9 bytes per SM-cycle): bound = (weight bytes per loop step / 14.9) / (loop instructions x warps / 4),
the fraction of the ceiling the instruction stream alone allows (H200 2026-12-02: the FMA GEMV's bound 0.48 /
0.12 at 1 / 8 rows of Q4_K, measured 0.26 / 0.05).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

B_PER_SM_CYCLE = 3.9e12 / 132 / 1.98e9


def sass_loops(sass: str) -> list[dict]:
    """Loops of a cuobjdump -sass listing (one per backward branch): instruction count and opcode histogram."""
    ins = [(int(m.group(1), 16), m.group(2).strip()) for line in sass.splitlines()
           for m in [re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)] if m]
    loops = []
    for a, s in ins:
        t = re.search(r"BRA .*?0x([0-9a-f]+)", s)
        if t and int(t.group(1), 16) < a:
            body = [b for aa, b in ins if int(t.group(1), 16) <= aa <= a]
            hist = {}
            for b in body:
                op = (b.split()[1] if b.startswith("@") else b.split()[0]).split(".")[0]
                hist[op] = hist.get(op, 0) + 1
            loops.append({"instructions": len(body), "ops": dict(sorted(hist.items(), key=lambda kv: -kv[1])[:16])})
    return loops


def compile_ttir(path: str, num_warps: int, num_stages: int) -> dict:
    """(Run under the Python that has ``triton``.) Compile a .ttir file for sm_90; registers, spills, shared
    memory and the SASS loops."""
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    import triton
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import IRSource, make_backend

    # triton.compile starts an IR file after its own stage, so a .ttir would skip make_ttir (inliner, canonicalize,
    # combine: e.g. ``acc + dot(a, b, 0)`` -> ``dot(a, b, acc)``, cse, loop unroll), which XLA's Triton pipeline
    # runs: run it first
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    opts = backend.parse_options(options)
    ctx = ir.context()
    mod = IRSource(path, ctx, backend).make_ir(target, opts, backend.get_codegen_implementation(opts),
                                               backend.get_module_map(), ctx)
    mod = backend.make_ttir(mod, {}, opts, target.arch)
    path = path[:-len(".ttir")] + ".opt.ttir"
    with open(path, "w") as f:
        f.write(str(mod))
    k = triton.compile(path, target=target, options=options)
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    cubin = path + ".cubin"
    with open(cubin, "wb") as f:
        f.write(k.asm["cubin"])
    res = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "-res-usage", cubin], capture_output=True,
                         text=True).stdout
    sass = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "-sass", cubin], capture_output=True, text=True).stdout
    with open(path + ".sass", "w") as f:
        f.write(sass)
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", res)
    ttgir = k.asm["ttgir"]
    with open(path + ".ttgir", "w") as f:   # the layouts: which tensors ttg.convert_layout moves through shared memory
        f.write(ttgir)
    return {"registers": int(m.group(1)), "stack_bytes": int(m.group(2)), "shared_bytes": k.metadata.shared,
            "wgmma": ttgir.count("ttng.warp_group_dot "), "mma_v2": ttgir.count("tt.dot "),
            "layout_conversions": ttgir.count("ttg.convert_layout"), "async_copies": ttgir.count("async_copy_global"),
            "loops": sass_loops(sass)}


def lower(args) -> tuple[str, dict]:
    """Lower the kernel for CUDA (abstract arrays: no weights are built); returns (.ttir path, launch facts)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import jax
    import jax.numpy as jnp
    from gguf.constants import GGMLQuantizationType as Q
    from jax._src.pallas.triton import lowering as _tl

    from strata_jax.pallas import dispatch
    from strata_jax.pallas.quant_matmul import gemm as G, gemv as V, planar, tcgemv as TC
    from strata_jax.pallas.quant_matmul.formats import FLOAT_TYPES

    dispatch.on_gpu = lambda: True
    qt = Q[args.format]
    n, k, m = args.n, args.k, args.m
    kw = {a.split("=")[0]: int(a.split("=")[1]) for a in args.cfg.split(",") if a}
    if qt in FLOAT_TYPES:
        w = jax.ShapeDtypeStruct((n, k), FLOAT_TYPES[qt])
        group_bytes = 32 * jnp.dtype(FLOAT_TYPES[qt]).itemsize
    else:
        w = jax.ShapeDtypeStruct((n, planar.row_words(qt, k)), jnp.uint32)
        group_bytes = planar.row_words(qt, k) * 4 / (k // 32)
    x = jax.ShapeDtypeStruct((m, k), jnp.float32)
    if args.variant == "tc16":
        cfg = TC.Config(**kw) if kw else TC.choose_config(qt, n, k)
        fn = lambda x, w: TC.gemv(x, w, qt, n, k, interpret=False, precision=args.prec, cfg=cfg)  # noqa: E731
        groups_per_step = TC.tiling(qt, n, k, cfg)["G"]
    elif args.variant == "tc":
        cfg = G.Config(**kw) if kw else G.GEMV_TC
        fn = lambda x, w: G.gemm(x, w, qt, n, k, interpret=False, precision=args.prec, cfg=cfg,  # noqa: E731
                                 variant="unit")
        groups_per_step = 1
    elif args.variant == "kblock":
        cfg = G.kblock_config(qt, n, k) if not kw else G.Config(**{"target_programs": 1, **kw})
        cfg = G.dataclasses.replace(cfg, KB=G.kblock_size(k, cfg.KB or G.kblock_config(qt, n, k).KB))
        fn = lambda x, w: G.gemm(x, w, qt, n, k, interpret=False, precision=args.prec, cfg=cfg,  # noqa: E731
                                 variant="kblock")
        groups_per_step = cfg.KB // 32
    else:
        cfg = V.Config(**kw) if kw else V.choose_config(qt, n, k)
        fn = lambda x, w: V.gemv(x, w, qt, n, k, interpret=False, cfg=cfg)  # noqa: E731
        groups_per_step = V.tiling(qt, n, k, cfg)["G"]
    asms = []
    orig = _tl.lower_jaxpr_to_triton_module

    def hook(jaxpr, *a, **kk):
        res = orig(jaxpr, *a, **kk)
        asms.append(res.module.operation.get_asm())
        return res

    _tl.lower_jaxpr_to_triton_module = hook
    try:
        jax.jit(fn).trace(x, w).lower(lowering_platforms=("cuda",))
    finally:
        _tl.lower_jaxpr_to_triton_module = orig
    out_dir = args.out_dir or tempfile.mkdtemp(prefix="sass_probe_")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{args.variant}_{qt.name}_{n}x{k}_M{m}.ttir")
    with open(path, "w") as f:
        f.write(asms[0])
    facts = {"cfg": str(cfg), "num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
             "step_weight_bytes": cfg.BN * groups_per_step * group_bytes}
    return path, facts


def scan(args) -> int:
    """`--scan`: one line per kernel of the folder, the worst first (pointer conversions, then spills)."""
    rows = []
    for fn in sorted(os.listdir(args.scan)):
        if not fn.endswith(".ttir") or fn.endswith(".opt.ttir"):
            continue
        path = os.path.join(args.scan, fn)
        r = subprocess.run([args.triton_python, os.path.abspath(__file__), "--compile",
                            f"{path},{args.scan_warps},2"], capture_output=True, text=True)
        if r.returncode:
            err = (r.stderr.strip().splitlines() or [f"rc {r.returncode}, no stderr"])[-1]
            rows.append((9, 0, fn, "compile failed: " + err[:120]))
            continue
        res = json.loads(r.stdout.strip().splitlines()[-1])
        ttgir = open(path[:-len(".ttir")] + ".opt.ttir.ttgir").read()
        ptr_cvt = sum(1 for line in ttgir.splitlines() if "ttg.convert_layout" in line and "!tt.ptr" in line)
        loops = res["loops"]
        spills = sum(lp["ops"].get("LDL", 0) + lp["ops"].get("STL", 0) for lp in loops)
        rows.append((ptr_cvt, spills, fn, f"loops {[lp['instructions'] for lp in loops]} regs {res['registers']} "
                     f"spill-ops {spills} ptr-convert {ptr_cvt} convert {res['layout_conversions']} "
                     f"wgmma {res['wgmma']} async {res['async_copies']}"))
    for _, _, fn, line in sorted(rows, key=lambda r: (-r[0], -r[1], r[2])):
        print(f"{fn:48s} {line}")
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--triton_python", help="a Python with the triton package (e.g. /tmp/tv/bin/python)")
    ap.add_argument("--variant", default="tc16", choices=["tc16", "tc", "kblock", "fma"])
    ap.add_argument("--format", default="Q4_K")
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--k", type=int, default=28672)
    ap.add_argument("--m", type=int, default=8)
    ap.add_argument("--cfg", default="", help="launch config fields, e.g. BN=128,G=2,num_warps=4")
    ap.add_argument("--prec", default="bf16x3")
    ap.add_argument("--out_dir", default=None, help="where the .ttir / .sass / .cubin go (default: a temp dir)")
    ap.add_argument("--compile", default=None, help=argparse.SUPPRESS)   # internal: FILE,num_warps,num_stages
    ap.add_argument("--scan", default=None, help="compile every .ttir in this folder (bench_kernels.py --lower cuda "
                    "--ttir_dir DIR) at --scan_warps / 2 stages and list per kernel: loop instructions, registers, "
                    "local-memory (spill) instructions in loops, pointer tensors moved between layouts")
    ap.add_argument("--scan_warps", type=int, default=4)
    args = ap.parse_args(argv)
    if args.compile:
        path, nw, ns = args.compile.rsplit(",", 2)
        print(json.dumps(compile_ttir(path, int(nw), int(ns))))
        return 0
    if not args.triton_python:
        ap.error("--triton_python is required (see the module docstring)")
    if args.scan:
        return scan(args)
    path, facts = lower(args)
    r = subprocess.run([args.triton_python, os.path.abspath(__file__), "--compile",
                        f"{path},{facts['num_warps']},{facts['num_stages']}"], capture_output=True, text=True)
    if r.returncode:
        print(r.stderr[-3000:], file=sys.stderr)
        return 1
    res = {**facts, **json.loads(r.stdout.strip().splitlines()[-1]), "ttir": path}
    if res["loops"]:
        L = max(lp["instructions"] for lp in res["loops"])
        res["issue_bound"] = round((res["step_weight_bytes"] / B_PER_SM_CYCLE) / (L * facts["num_warps"] / 4), 3)
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
