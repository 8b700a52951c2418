"""What the tensor-core kernels' activation precision (`strata_jax.pallas.quant_matmul.gemm.PRECISIONS`) does to a
real model's logits, measured on a CPU against the HF-on-dequantized-GGUF fixtures of tests/test_dense_parity.py.

The planar tensor-core kernels multiply exact integer codes by the activations cut into 1 / 2 / 3 bfloat16 pieces
(bf16 / bf16x2 / bf16x3); every product is exact and accumulated in float32, so their only loss against float32
is that rounding of the activations. This script emulates exactly that rounding on the plain-jnp path (each
matmul's activations replaced by the float32 sum of their bfloat16 pieces, then the float32 product), for the
prefill matmuls only (``prefill``: what ``STRATA_QMATMUL=planar`` does with the default GEMV) or for every matmul
(``all``: with ``STRATA_QMATMUL_GEMV=tc``), and reports the test's metrics: the relative L2 error of the prompt
logits (top-16 ids at the fixture's positions, and the last row) and of the 32 greedy steps' logits, and whether
the greedy tokens match. The test's bound is 1e-3.

  python experiments/precision_logits.py --model smollm2-135m --out /tmp/precision.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from strata_jax.pallas.quant_matmul import gemm as G  # noqa: E402
from strata_jax.pallas.quant_matmul import reference as R  # noqa: E402

FIXTURES = os.path.join(os.path.dirname(HERE), "tests", "fixtures")


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def run(name: str, precision: str, scope: str, n_tokens: int) -> dict:
    from strata_jax.models_registry import fetch_model
    from strata_jax.pipeline.engine import Engine
    from strata_jax.pipeline.solo import generate
    from strata_jax.sampling import SamplingParams

    orig = R.matmul_rows
    pieces = G.PRECISIONS.get(precision)

    def rounded(x, w):
        if pieces is not None and (scope == "all" or x.shape[0] > 8):
            x = sum(p.astype(jnp.float32) for p in G.bf16_pieces(x.astype(jnp.float32), pieces))
        return orig(x, w)

    R.matmul_rows = rounded
    jax.clear_caches()  # the jitted qmatmul of an earlier case must be traced again with the patch
    try:
        fx = np.load(os.path.join(FIXTURES, f"dense_{name}.npz"))
        eng = Engine(str(fetch_model(name, quiet=True)), max_context=96, n_slots=1)
        gen = generate(eng, fx["prompt_ids"].tolist(), max_new_tokens=n_tokens, sampling=SamplingParams(0.0),
                       eos_ids=(), dump_logits=True)
    finally:
        R.matmul_rows = orig
    prompt = max(_rel(gen.prefill_logits[p, fx["prompt_topk_ids"][i]], fx["prompt_topk_values"][i])
                 for i, p in enumerate(fx["prompt_positions"]))
    steps = max(_rel(gen.step_logits[i, fx["decode_topk_ids"][i]], fx["decode_topk_values"][i])
                for i in range(n_tokens))
    return {"model": name, "precision": precision, "scope": scope, "prompt_rel": prompt,
            "last_rel": _rel(gen.prefill_logits[-1], fx["last_logits"]), "steps_rel": steps,
            "greedy_match": gen.tokens[:n_tokens] == fx["greedy_ids"].tolist()[:n_tokens]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", help="a model with a tests/fixtures/dense_<name>.npz fixture")
    ap.add_argument("--cases", default="f32:all,bf16x2:prefill,bf16:prefill,bf16x2:all,bf16:all",
                    help="comma list of precision:scope (precision f32 = no rounding; scope prefill or all)")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not os.path.exists(os.path.join(FIXTURES, f"dense_{args.model}.npz")):
        print(f"error: no fixture tests/fixtures/dense_{args.model}.npz", file=sys.stderr)
        return 2
    res = []
    for case in args.cases.split(","):
        prec, _, scope = case.partition(":")
        if prec != "f32" and prec not in G.PRECISIONS or scope not in ("prefill", "all"):
            print(f"error: bad case {case!r} (precision f32 or one of {sorted(G.PRECISIONS)}; scope prefill|all)",
                  file=sys.stderr)
            return 2
        r = run(args.model, prec, scope, args.tokens)
        res.append(r)
        print(f"{r['model']:<14} {prec:<7} {scope:<8} prompt {r['prompt_rel']:.2e}  last {r['last_rel']:.2e}  "
              f"steps {r['steps_rel']:.2e}  greedy {'same' if r['greedy_match'] else 'DIFFERENT'}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
