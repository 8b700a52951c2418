"""Launch configurations of the decode kernels at a model's own shapes, timed on the device (not a test).

For every matrix shape a model's decode step multiplies by (the 2-D weights of a GGUF file or a geometry, the
gate / up pairs the step runs as one launch, the routed experts' stacks with their ``experts_used`` slots), the
planar GEMV (`strata_jax.pallas.quant_matmul.gemv`) runs under each candidate `gemv.Config`; the attention kernel
(`strata_jax.pallas.qsa.kernel.attend_kernel`) under each `AttendConfig` at the model's head shape and cell-list
length. Times are the kernels' own device time from one `jax.profiler` trace (each variant's kernel is named
apart by its config's ``tag``), so launch overhead and the host's dispatch do not enter; each call reads a
different copy of the weights (``--cold_mb``), so they come from HBM as in a decode step, not from the L2 cache;
the split-K sum XLA adds after a split GEMV is left out (it fuses into the consumer). What the step spends is
``us x count`` (calls per token). Prints the best config per shape next to the default and writes every figure to ``--out``:

  python experiments/sweep_kernels.py --model /tmp/q15.gguf --geometry qwen3.8-flash-next --out sweep.json
  python experiments/sweep_kernels.py --small          # CPU plumbing: interpret mode, tiny shapes, no timings

Every candidate config keeps the GEMV row-invariant (a config is a function of the weight only); choosing one
per shape is `gemv.choose_config`'s job, from this sweep's figures.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_kernels

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from gguf.constants import GGMLQuantizationType as Q  # noqa: E402

# (BN, G, num_warps, target_programs, num_stages); the first is gemv.DEFAULT (2026-12-03), the second the one before
GEMV_CONFIGS = [(32, 4, 4, 1056, 2), (16, 8, 4, 2112, 2), (16, 8, 4, 528, 2), (16, 8, 4, 132, 2), (32, 8, 4, 528, 2),
                (32, 8, 8, 528, 2), (16, 16, 4, 528, 2), (16, 16, 8, 1056, 2), (8, 8, 2, 1056, 2),
                (8, 16, 4, 1056, 2), (64, 8, 8, 264, 2), (32, 16, 8, 264, 3), (16, 8, 4, 1056, 3),
                (4, 8, 1, 2112, 2), (16, 8, 2, 2112, 2), (16, 32, 8, 528, 2),
                # 2026-12-07d: one loop step per program (K split until >= 4 programs per SM-slot: loads of different
                # programs overlap instead of a program's steps waiting in turn), and 8 warps at the default tile
                (32, 4, 4, 4224, 2), (16, 4, 4, 4224, 2), (32, 8, 4, 4224, 2), (32, 4, 8, 1056, 2)]
# (NC, max_split, num_warps, num_stages, DC: the head-dim slice, 0 = all of D); the first is the 2026-12-03 default
# of D = 256 and of lists over 2,048 cells, the second that of D <= 128 up to 2,048 cells
ATTEND_CONFIGS = [(32, 128, 8, 2, 0), (16, 128, 4, 2, 0), (16, 32, 4, 2, 0), (16, 64, 4, 2, 0), (32, 32, 8, 2, 0),
                  (16, 64, 8, 2, 0), (32, 64, 8, 2, 0), (16, 128, 8, 2, 0), (32, 64, 8, 2, 128), (32, 64, 4, 2, 128),
                  (16, 64, 4, 2, 128), (16, 128, 4, 2, 64), (32, 64, 8, 2, 64), (32, 64, 8, 1, 0),
                  (64, 32, 8, 2, 128), (32, 64, 16, 2, 0)]
_TAG = re.compile(r"_c(\d+)x")


def model_shapes(src) -> tuple[list[dict], dict]:
    """The GEMV shapes of a model's decode step: [{"name", "qtype", "n_out", "k_in", "n_mats", "slots",
    "count"}] (count: calls per token) and its attention shape {"Hq", "Hkv", "D", "cells", "qsa"}."""
    from strata_jax.gguf.reader import open_gguf
    from strata_jax.pallas.quant_matmul import planar
    from strata_jax.pallas.quant_matmul.formats import FLOAT_TYPES

    f = open_gguf(src, header_only=True) if isinstance(src, str) else src
    arch = f.architecture
    get = lambda k, d=None: f.get(f"{arch}.{k}", d)
    used = int(get("expert_used_count", 0) or 0)
    shapes = collections.Counter()
    for name, t in f.tensors.items():
        if len(t.shape) < 2 or "token_embd" in name or "per_layer_token_embd" in name:
            continue
        q = Q(t.qtype)
        if (q not in planar.FORMATS and q not in FLOAT_TYPES) or t.shape[-1] % planar.GROUP:
            continue                                 # no planar GEMV (e.g. the conv weights, K = 4)
        tail = name.split(".", 2)[-1] if name.startswith("blk.") else name
        if len(t.shape) == 3:                        # routed experts: [E, n_out, k_in], `used` slots per token
            if "ffn_up_exps" in tail:
                continue                             # runs with the gate in one launch
            n_mats = 2 if "ffn_gate_exps" in tail else 1
            shapes[(tail, q, t.shape[1], t.shape[2], n_mats, used)] += 1
            continue
        if "ffn_up" in tail and name.replace("ffn_up", "ffn_gate") in f.tensors:
            continue
        n_mats = 2 if "ffn_gate" in tail and name.replace("ffn_gate", "ffn_up") in f.tensors else 1
        shapes[(tail, q, t.shape[0], t.shape[1], n_mats, 0)] += 1
    rows = [{"name": k[0], "qtype": k[1].name, "n_out": int(k[2]), "k_in": int(k[3]), "n_mats": k[4],
             "slots": k[5], "count": c} for k, c in shapes.items()]
    rows.sort(key=lambda r: -r["count"] * r["n_out"] * r["k_in"] * r["n_mats"] * max(r["slots"], 1))
    Hq, Hkv = int(get("attention.head_count")), int(get("attention.head_count_kv"))
    D = int(get("attention.key_length", 0) or 0) or int(get("embedding_length")) // Hq
    top_k = int(get("attention.indexer.top_k", 0) or 0)
    attn = {"Hq": Hq, "Hkv": Hkv, "D": D, "qsa": bool(top_k), "cells": top_k + 3 if top_k else None}
    return rows, attn


def _compile_all(jobs, workers=8):
    """[(key, jitted fn, args)] -> {key: compiled} (compiles in threads: XLA releases the GIL)."""
    def one(j):
        key, fn, args = j
        try:
            return key, fn.lower(*args).compile(), None
        except Exception as e:  # one failing variant must not hide the rest
            return key, None, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    with ThreadPoolExecutor(workers) as ex:
        return list(ex.map(one, jobs))


def cold_copies(ws, min_bytes: float) -> list:
    """Copies of the weights ``ws`` (an array or a tuple of arrays) for timing a kernel out of the L2 cache: ``ws``
    itself, then copies, each its own device buffer, until they hold ``min_bytes`` together. Used in turn, a call
    never finds its weights cached by the previous calls (the H100 / H200 L2: 50 MB), as in a decode step, where
    every weight is read once per token. ``min_bytes`` 0: ``[ws]``."""
    per = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(ws))
    n = max(1, -(-int(min_bytes) // max(1, per))) if min_bytes else 1
    return [ws] + [jax.tree.map(lambda a: a + jnp.zeros((), a.dtype), ws) for _ in range(n - 1)]


def _device_us(runs, reps: int) -> dict:
    """{tag id: device microseconds per call} of the tagged kernels, from one profiler trace of ``reps`` calls
    of each compiled fn (warmed first); a run's arguments are a list of tuples (`cold_copies`) used in turn."""
    from strata_jax.pallas import trace

    for _, f, sets in runs:
        jax.block_until_ready(f(*sets[0]))
    d = tempfile.mkdtemp(prefix="strata_sweep_")
    with jax.profiler.trace(d, create_perfetto_trace=True):
        for _, f, sets in runs:
            out = None
            for r in range(reps):
                out = f(*sets[r % len(sets)])
            jax.block_until_ready(out)
    s = trace.summarize(trace.load_events(d), 1, top=100000)
    tot = collections.defaultdict(float)
    for name, ms, _calls in s["top_kernels"]:
        m = _TAG.search(name)
        if m:
            tot[int(m.group(1))] += ms * 1e3
    return {k: v / reps for k, v in tot.items()}


def sweep_gemv(shapes, rows_list, reps, interpret, rng, ceiling, ids, deadline=None, cold_bytes=0.0):
    from bench_kernels import _weights  # (GGUF blocks, the planar / float array the kernels read)

    from strata_jax.pallas.quant_matmul import gemv as V

    out = []
    for sh in shapes:
        if deadline is not None and time.perf_counter() > deadline:
            print(f"gemv    {sh['name']} {sh['qtype']} {sh['n_out']}x{sh['k_in']}: skipped (--budget_s)")
            continue
        qt, n, k, nm, U = Q[sh["qtype"]], sh["n_out"], sh["k_in"], sh["n_mats"], sh["slots"]
        # routed experts: M rows read a union of up to M x U experts (the engine's union slots); distinct here
        E = U * max(rows_list) if U else 0
        ws = tuple(_weights(rng, qt, n, k, (E,) if E else (1,))[1] for _ in range(nm))
        order = rng.permutation(E) if U else None
        wsets = cold_copies(ws, 0.0 if interpret else cold_bytes)   # once per shape, for every row count
        for M in rows_list:
            x = jnp.asarray(rng.standard_normal((M, k)), jnp.float32)
            slots = jnp.asarray(order[:M * U] if U else [0], jnp.int32)
            nbytes = sum(w.size * w.dtype.itemsize for w in ws) * (M * U / E if U else 1)
            jobs, meta = [], {}
            for c in GEMV_CONFIGS:
                i = next(ids)
                cfg = V.Config(BN=c[0], G=c[1], num_warps=c[2], target_programs=c[3], num_stages=c[4],
                               tag=f"_c{i}x")
                fn = jax.jit(lambda x, ws, s, cfg=cfg: V.grouped_gemv(x, ws if nm > 1 else ws[0], s, qt, n, k,
                                                                      interpret=interpret, cfg=cfg,
                                                                      split_units=max(U, 1)))
                jobs.append((i, fn, (x, ws, slots)))
                t = V.tiling(qt, n, k, cfg, per_unit=max(U, 1))   # as the engine's grouped experts size it
                meta[i] = {"cfg": list(c), "split": t["split"], "cps": t["cps"]}
            comp = _compile_all(jobs)
            runs = [(i, f, [(x, w, slots) for w in wsets]) for (i, f, err) in comp if f is not None]
            us = _device_us(runs, reps) if not interpret else {}
            for (i, f, err) in comp:
                r = {**sh, "M": M, **meta[i], "bytes": int(nbytes), "weight_copies": len(wsets)}
                if err:
                    r["error"] = err
                elif i in us:
                    r["us"] = us[i]
                    r["GBps"] = nbytes / us[i] / 1e3
                    r["frac"] = r["GBps"] / ceiling if ceiling else None
                out.append(r)
            _print_best("gemv", f"{sh['name']} {sh['qtype']} {n}x{k}" + (f" x{nm}" if nm > 1 else "")
                        + (f" slots={U}" if U else "") + f" M={M} (x{sh['count']}/token)", out[-len(comp):])
        ws = wsets = runs = None  # the weights and their copies freed before the next shape's
    return out


def sweep_attend(attn, cells_list, valid_list, reps, interpret, rng, ids):
    from strata_jax.pallas.qsa import kernel as QK

    out = []
    Hq, Hkv, D = attn["Hq"], attn["Hkv"], attn["D"]
    for n_cells in cells_list:
        N = max(n_cells, 4096) if attn["qsa"] else n_cells
        kc = jnp.asarray(rng.standard_normal((N, Hkv, D)), jnp.float32)
        vc = jnp.asarray(rng.standard_normal((N, Hkv, D)), jnp.float32)
        q = jnp.asarray(rng.standard_normal((1, Hq, D)), jnp.float32)
        for valid in valid_list:
            v = min(valid, n_cells)
            sel = np.sort(rng.choice(N, v, replace=False)) if attn["qsa"] else np.arange(v)
            cells = np.full((1, n_cells), -1, np.int32)
            cells[0, :v] = sel
            cells = jnp.asarray(cells)
            jobs = []
            for c in ATTEND_CONFIGS:
                i = next(ids)
                cfg = QK.AttendConfig(NC=c[0], max_split=c[1], num_warps=c[2], num_stages=c[3], DC=c[4],
                                      tag=f"_c{i}x")
                fn = jax.jit(lambda q, kc, vc, cells, cfg=cfg: QK.attend_kernel(q, kc, vc, cells, D ** -0.5,
                                                                               interpret=interpret, cfg=cfg))
                jobs.append((i, fn, (q, kc, vc, cells), list(c)))
            comp = _compile_all([j[:3] for j in jobs])
            runs = [(i, f, [j[2]]) for (i, f, err), j in zip(comp, jobs) if f is not None]
            us = _device_us(runs, reps) if not interpret else {}
            rows = []
            for (i, f, err), j in zip(comp, jobs):
                r = {"Hq": Hq, "Hkv": Hkv, "D": D, "cells": n_cells, "valid": v, "cfg": j[3]}
                if err:
                    r["error"] = err
                elif i in us:
                    r["us"] = us[i]
                rows.append(r)
            out += rows
            _print_best("attend", f"Hq={Hq} Hkv={Hkv} D={D} cells={n_cells} valid={v}", rows)
    return out


def _print_best(op, case, rows):
    timed = [r for r in rows if "us" in r]
    errs = sum("error" in r for r in rows)
    if not timed:
        print(f"{op:<7} {case:<72} (no timings; {errs} errors)", flush=True)
        return
    d = rows[0].get("us")
    b = min(timed, key=lambda r: r["us"])
    print(f"{op:<7} {case:<72} default {d if d is not None else float('nan'):8.2f} us | best {b['us']:8.2f} us "
          f"{b['cfg']}" + (f" frac {b['frac']:.2f}" if b.get("frac") else "") + (f" ({errs} errors)" if errs else ""),
          flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", default=[], help="a GGUF file (repeatable)")
    ap.add_argument("--geometry", action="append", default=[], help="configs/geometries/<name> (repeatable)")
    ap.add_argument("--rows", default="1", help="activation rows per GEMV (comma-separated)")
    ap.add_argument("--rows_top", type=int, default=3, help="the rows after the first only for this many of the "
                    "largest shapes of each model")
    ap.add_argument("--only", default="gemv,attend")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--ceiling_GBps", type=float, default=3910.0, help="bandwidth for the fractions (H200: "
                    "RESULTS.md's XLA bf16 GEMV)")
    ap.add_argument("--budget_s", type=float, default=None, help="GEMV shapes are started only within this time")
    ap.add_argument("--small", action="store_true", help="CPU plumbing: interpret mode, two configs, tiny shapes")
    ap.add_argument("--gemv_configs", default="", help="GEMV configs instead of the built-in list: "
                    "BN,G,warps,programs,stages;... (the first is reported as the default)")
    ap.add_argument("--qtypes", default="", help="GEMV shapes of these block formats only (comma-separated, "
                    "e.g. Q4_K,Q2_K; default: all)")
    ap.add_argument("--cold_mb", type=float, default=200.0, help="GEMV weights out of the L2 cache: copies of each "
                    "shape's weights, used in turn, until they hold this many MB (0: one copy, the weights stay "
                    "in L2 when they fit, as in the sweeps before 2026-12-07c, whose small shapes read too fast)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    interpret = args.small or jax.default_backend() != "gpu"
    global GEMV_CONFIGS, ATTEND_CONFIGS
    if args.gemv_configs:
        GEMV_CONFIGS = [tuple(int(v) for v in c.split(",")) for c in args.gemv_configs.split(";") if c.strip()]
    if args.small:
        GEMV_CONFIGS, ATTEND_CONFIGS = GEMV_CONFIGS[:2], ATTEND_CONFIGS[:2]
    ids = iter(range(10 ** 9))
    rows_list = [int(r) for r in args.rows.split(",")]
    res = {"device": str(jax.devices()[0]), "jax": jax.__version__, "gemv": [], "attend": [],
           "gemv_configs": GEMV_CONFIGS, "attend_configs": ATTEND_CONFIGS}
    srcs = list(args.model)
    if args.geometry:
        from strata_jax.testing.random_weights import VirtualGGUF, load_geometry
        srcs += [VirtualGGUF(load_geometry(g), n_layer=None) for g in args.geometry]
    if args.small and not srcs:
        srcs = ["tests/fixtures/hybrid/qwen4exp_q8_0.gguf"]
    t0 = time.perf_counter()
    deadline = None if args.budget_s is None else t0 + args.budget_s
    for src in srcs:
        shapes, attn = model_shapes(src)
        if args.qtypes:
            shapes = [sh for sh in shapes if sh["qtype"] in args.qtypes.split(",")]
        label = src if isinstance(src, str) else src.path
        print(f"== {label}: {len(shapes)} GEMV shapes; attention {attn}", flush=True)
        if args.small:
            shapes = shapes[:3]
        if "gemv" in args.only:
            cold = args.cold_mb * 1e6
            res["gemv"] += [dict(r, model=label) for r in sweep_gemv(shapes, rows_list[:1], args.reps, interpret,
                                                                    rng, args.ceiling_GBps, ids, deadline, cold)]
            if len(rows_list) > 1:
                res["gemv"] += [dict(r, model=label) for r in sweep_gemv(shapes[:args.rows_top], rows_list[1:],
                                                                        args.reps, interpret, rng,
                                                                        args.ceiling_GBps, ids, deadline, cold)]
        if "attend" in args.only:
            cells = [attn["cells"]] if attn["qsa"] else [1025, 4097]
            res["attend"] += [dict(r, model=label) for r in sweep_attend(attn, cells if not args.small else [64],
                                                                          [64, 1024] if not args.small else [8],
                                                                          args.reps, interpret, rng, ids)]
    res["seconds"] = time.perf_counter() - t0
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()
