"""Where a decode step of the full-size Qwen3.8-Flash-Next (qwen4exp) goes: one layer of each kind, plain jnp vs the
Pallas kernels, on random weights drawn on the device (`strata_jax.testing.random_weights`, the geometry's formats).

Usage:
  python experiments/bench_layers.py --out layers.json            # GPU (H200): full-size shapes, ~2-4 min
  python experiments/bench_layers.py --small --out /tmp/l.json    # smoke test anywhere (CPU: kernels interpreted)

Pieces (each the layers' own code, `strata_jax.layers`, jitted alone with its parameters as arguments):
  * gdn_window: one GDN mixer (`GatedDeltaNet`, window mode: projections, conv, gated delta rule, gate, output);
    gdn_commit: its commit of the kept rows (keep = T).
  * qsa_window: one QSA attention mixer (`GatedAttention` with the indexer: projections, K/V + indexer-key cell
    writes, pooled block keys of the whole cache, selection, attention) at --context cells already filled.
  * moe: one MoE block (router, routed experts, shared expert).
  * hc_read: one hyper-connection read (`GatedResidual`; two per layer).
  * head: the output hyper-connection read + the vocabulary projection.
for windows of T = 1 (a decode step) and T = 4 (a verify window), B = 1 segment. Paths: ``jnp`` =
``STRATA_PALLAS_IMPL=reference`` (every op plain jnp), ``kernel`` = ``auto`` on a GPU (``interpret`` elsewhere),
chosen when each piece is traced. Each time is the best of 3 batches of --iters back-to-back calls
(`bench_kernels.timeit`). ``per_token`` multiplies the T = 1 rows by the count of each piece in the model
(48 layers: 36 GDN + 12 QSA, 48 MoE, 96 hyper-connection reads, 1 head; PLE and embedding left out) into an
estimate of the decode step in ms, not counting launch gaps between pieces.

Prints one table and writes JSON {"device", "jax", "geometry", "context", "rows": [...], "per_token": {...}} to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

SMALL = {"hidden": 256, "rope_dim": 16, "vocab": 2048, "heads": 4, "kv_heads": 2, "head_dim": 64, "ssm_k_heads": 2, "ssm_v_heads": 8,
         "ssm_d_k": 32, "ssm_d_v": 32, "experts": 16, "experts_used": 4, "expert_ff": 64, "shared_ff": 64,
         "hc_lowrank": 32, "indexer_heads": 2, "indexer_head_dim": 32, "indexer_top_k": 64, "ple_min_prime": 1000,
         "ple_heads": 8}
COUNT = {"gdn_window": 36, "gdn_commit": 36, "qsa_window": 12, "moe": 48, "hc_read": 96, "head": 1}


def build(small: bool, seed: int = 0):
    """The pieces of layer 0 (GDN) and layer 3 (QSA) of a 4-layer model of the geometry, and its head."""
    from strata_jax.layers.hyper import hyper_read
    from strata_jax.layers.linear import QLinear
    from strata_jax.layers.mlp import make_ffn
    from strata_jax.models.hybrid import make_mixer
    from strata_jax.models.registry import config_from_gguf
    from strata_jax.testing.random_weights import VirtualGGUF, load_geometry

    geom = load_geometry("qwen3.8-flash-next")
    if small:
        geom.update(SMALL)
    g = VirtualGGUF(geom, n_layer=4, seed=seed)
    cfg = config_from_gguf(g)
    assert cfg.layer_recurrent[0] and not cfg.layer_recurrent[3] and cfg.idx_ratio[3] > 0
    pieces = {
        "gdn": make_mixer(g, cfg, 0),
        "qsa": make_mixer(g, cfg, 3),
        "moe": make_ffn(g, "blk.0.", cfg),
        "hc_read": hyper_read(g, cfg, "blk.0.hc_attn_"),
        "out_hc": hyper_read(g, cfg, "output_hc_", inject=False),
        "head": QLinear.from_gguf(g, "output.weight", shape=(cfg.vocab_size, cfg.n_embd)),
    }
    formats = {"experts gate/up/down": "/".join(getattr(pieces["moe"], n).qtype.name
                                                for n in ("gate_exps", "up_exps", "down_exps")),
               "head": pieces["head"].qtype.name, "gdn qkv": pieces["gdn"].wqkv.qtype.name}
    return cfg, pieces, formats


def make_fns(cfg, pieces, context: int):
    """{name: (fn(params, *args), params, args_fn(T))}: jittable pieces with their parameters split out."""
    from flax import nnx

    from strata_jax.state import Rows

    D, hc = cfg.n_embd, cfg.hc
    key = jax.random.key(1)
    fns = {}

    def split(m):
        return nnx.split(m)

    gd_gdn, p_gdn = split(pieces["gdn"])
    shapes = pieces["gdn"].state_shapes()
    st_gdn = {"S": jax.random.normal(key, (1,) + shapes["S"], jnp.float32) * 0.01,
              "conv": jax.random.normal(key, (1,) + shapes["conv"], jnp.float32)}

    def rows_at(T, pos):
        return Rows.make([0], [pos], [T])

    def gdn_window(params, x, st, rows):
        return nnx.merge(gd_gdn, params)(x, st, rows, "window")

    def gdn_commit(params, st, pend, rows):
        return nnx.merge(gd_gdn, params).commit(st, pend, rows, rows.n_valid)

    def commit_args(T, x):  # the pending of a T-row window (computed once, on the jnp path)
        pend = jax.jit(gdn_window)(p_gdn, x, st_gdn, rows_at(T, 100))[2]
        return st_gdn, pend, rows_at(T, 100)

    fns["gdn_window"] = (gdn_window, p_gdn, lambda T, x: (x, st_gdn, rows_at(T, 100)))
    fns["gdn_commit"] = (gdn_commit, p_gdn, commit_args)

    gd_qsa, p_qsa = split(pieces["qsa"])
    q = pieces["qsa"]
    kv_shape = (1, context + 1, cfg.n_head_kv, cfg.head_dim)
    kv = (jax.random.normal(key, kv_shape, jnp.float32), jax.random.normal(jax.random.key(2), kv_shape, jnp.float32),
          jax.random.normal(jax.random.key(3), (1, context + 1, q.indexer.hd), jnp.float32))

    def qsa_window(params, x, kv, rows):
        return nnx.merge(gd_qsa, params)(x, kv, rows, "window", context)

    fns["qsa_window"] = (qsa_window, p_qsa, lambda T, x: (x, kv, rows_at(T, context - 8)))

    gd_moe, p_moe = split(pieces["moe"])
    fns["moe"] = (lambda params, x: nnx.merge(gd_moe, params)(x, True), p_moe, lambda T, x: (x,))

    gd_hc, p_hc = split(pieces["hc_read"])
    fns["hc_read"] = (lambda params, R: nnx.merge(gd_hc, params)(R, True), p_hc,
                      lambda T, x: (jnp.broadcast_to(x[:, :, None, :], (1, T, hc, D)),))

    gd_head, p_head = split({"out": pieces["out_hc"], "head": pieces["head"]})

    def head(params, R):
        m = nnx.merge(gd_head, params)
        return m["head"](m["out"](R, True)[0], True)

    fns["head"] = (head, p_head, lambda T, x: (jnp.broadcast_to(x[:, :, None, :], (1, T, hc, D)),))
    return fns


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="where to write the JSON results")
    ap.add_argument("--small", action="store_true", help="tiny shapes of the same kinds (CPU smoke test)")
    ap.add_argument("--context", type=int, default=None, help="QSA cache cells (default 8192, --small 256)")
    ap.add_argument("--iters", type=int, default=None, help="timed calls per batch (default 20, --small 2)")
    ap.add_argument("--T", default="1,4", help="window rows to time (comma-separated)")
    ap.add_argument("--only", default=None, help=f"comma-separated subset of {list(COUNT)}")
    args = ap.parse_args(argv)
    from bench_kernels import timeit

    on_gpu = jax.default_backend() in ("gpu", "cuda", "rocm")
    if not on_gpu and not args.small:
        print("no GPU: use --small (the kernels would run in Pallas' interpreter)", file=sys.stderr)
        return 2
    context = args.context or (256 if args.small else 8192)
    iters = args.iters or (2 if args.small else 20)
    kernel_env = "auto" if on_gpu else "interpret"
    t0 = time.perf_counter()
    cfg, pieces, formats = build(args.small)
    jax.block_until_ready(jax.tree.leaves(pieces))
    print(f"device: {jax.devices()[0].device_kind}  jax {jax.__version__}  kernel path: {kernel_env}  "
          f"context {context}  built in {time.perf_counter() - t0:.1f} s  formats {formats}", flush=True)
    fns = make_fns(cfg, pieces, context)
    names = args.only.split(",") if args.only else list(COUNT)
    Ts = [int(t) for t in args.T.split(",")]
    rows = []
    print(f"{'piece':<11} {'T':>2} | {'jnp us':>10} {'kernel us':>10} {'speed-up':>8} | compile s (jnp / kernel)")
    for name in names:
        fn, params, args_fn = fns[name]
        for T in Ts:
            x = jax.random.normal(jax.random.key(T), (1, T, cfg.n_embd), jnp.float32)
            os.environ["STRATA_PALLAS_IMPL"] = "reference"
            a = args_fn(T, x)
            row = {"piece": name, "T": T}
            for path, env in (("jnp", "reference"), ("kernel", kernel_env)):
                os.environ["STRATA_PALLAS_IMPL"] = env  # read when the piece is traced (below)
                f = jax.jit(lambda *a, _fn=fn: _fn(*a))  # a new function: traced anew under this path
                try:
                    tc = time.perf_counter()
                    jax.block_until_ready(f(params, *a))
                    row[f"{path}_compile_s"] = time.perf_counter() - tc
                    row[f"{path}_us"] = timeit(f, (params, *a), iters) * 1e6
                except Exception as e:  # keep going: one failing piece must not hide the others
                    row[f"{path}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            os.environ.pop("STRATA_PALLAS_IMPL", None)
            rows.append(row)
            us = lambda p: f"{row[p + '_us']:10.1f}" if p + "_us" in row else f"{'ERR':>10}"
            sp = (f"{row['jnp_us'] / row['kernel_us']:7.2f}x" if "jnp_us" in row and "kernel_us" in row
                  else f"{'':>8}")
            cs = " / ".join(f"{row.get(p + '_compile_s', float('nan')):.1f}" for p in ("jnp", "kernel"))
            print(f"{name:<11} {T:>2} | {us('jnp')} {us('kernel')} {sp} | {cs}", flush=True)
            for p in ("jnp", "kernel"):
                if p + "_error" in row:
                    print(f"    {p}: {row[p + '_error']}", flush=True)
    per_token = {}
    for path in ("jnp", "kernel"):
        parts = {r["piece"]: r.get(f"{path}_us") for r in rows if r["T"] == 1}
        if all(parts.get(n) is not None for n in COUNT):
            per = {n: parts[n] * COUNT[n] / 1e3 for n in COUNT}
            per_token[path] = {"ms_by_piece": per, "ms_total": sum(per.values())}
    if per_token:
        print("\nestimated decode step (T = 1, ms; pieces x count in the 48-layer model):")
        for path, v in per_token.items():
            print(f"  {path:<6} total {v['ms_total']:8.2f}  " +
                  "  ".join(f"{n} {ms:.2f}" for n, ms in v["ms_by_piece"].items()))
    res = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "geometry": "qwen3.8-flash-next",
           "small": args.small, "context": context, "kernel_path": kernel_env, "formats": formats, "count": COUNT,
           "rows": rows, "per_token": per_token, "seconds": time.perf_counter() - t0}
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"\nwrote {args.out} ({res['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
