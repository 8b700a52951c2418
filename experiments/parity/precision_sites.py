"""Which prefill GEMMs a hybrid fixture's oracle test is sensitive to: the Q8_0 fixture's prompt read in one
prefill chunk on the kernel path (interpret mode), with ``--f16`` naming the call sites whose GEMM runs at f16
(`gemm.F16`) and ``--keep`` those that keep the base precision, against the oracle logits of
``tests/test_hybrid.py::test_q8_0_matches_oracle`` (bound 1e-3). The base is the engine's choice
(`quant_matmul.api.precision`: f16, GDN's q/k/v bf16x2), or ``STRATA_QMATMUL_PRECISION`` when set: with
``STRATA_QMATMUL_PRECISION=bf16x2`` a run measures "f16 on the sites, bf16x2 elsewhere". A site matches a frame on
the stack when the GEMM's precision is chosen (at trace time) by ``dir/file:function:line`` (or a part of it,
e.g. ``linear.py``: every QLinear; ``gdn.py``; ``moe.py``; ``head_logits``; ``grouped_experts``: the routed
experts' GEMM) or by the text of the frame's source
line (e.g. ``self.wqkv``: the call that names that projection).

  STRATA_PALLAS_IMPL=interpret STRATA_QMATMUL_PRECISION=bf16x2 \
      python experiments/parity/precision_sites.py --family qwen3next --f16 gdn.py
  STRATA_PALLAS_IMPL=interpret STRATA_QMATMUL_PRECISION=bf16x2 \
      python experiments/parity/precision_sites.py --family qwen3next --f16 linear.py --keep self.wqkv

(2026-12-07, fourth session: f16 on GDN's q/k/v projection alone gave 5.9e-2 on qwen3next; f16 on every other
GEMM 5.5e-4 / 6.2e-4 / 5.1e-4 on qwen3next / qwen35moe / qwen4exp: `QLinear.precise`.)
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", default="qwen3next", help="a fixture of tests/test_hybrid.py")
    ap.add_argument("--f16", default="", help="comma-separated call sites whose GEMM runs at f16")
    ap.add_argument("--keep", default="", help="comma-separated call sites that keep the default (wins over --f16)")
    args = ap.parse_args()
    if os.environ.get("STRATA_PALLAS_IMPL") != "interpret":
        sys.exit("precision_sites.py: set STRATA_PALLAS_IMPL=interpret (the kernel path's GEMM)")
    import numpy as np
    from strata_jax.pallas.quant_matmul import api, gemm
    import test_hybrid as th

    f16 = [s for s in args.f16.split(",") if s]
    keep = [s for s in args.keep.split(",") if s]
    default = api.precision

    def precision(gemm_call=True, precise=False):
        if gemm_call:
            frames = [f"{'/'.join(f.filename.split(os.sep)[-2:])}:{f.function}:{f.lineno} "
                      f"{''.join(f.code_context or ())}"
                      for f in inspect.stack()[1:40]]
            hit = lambda sites: any(s in fr for s in sites for fr in frames)  # noqa: E731
            if hit(f16) and not hit(keep):
                return gemm.F16
        return default(gemm_call, precise)

    api.precision = precision
    ref = np.load(th.FIX / f"{args.family}_ref.npz")
    d = th._driver(args.family, "q8_0")
    pre, _ = d.prefill(d.init(), ref["prompt_ids"])
    rel = th._rel(pre, ref["oracle_q8_prefill_logits"])
    print(f"{args.family} f16={args.f16 or '-'} keep={args.keep or '-'}: prefill logits {rel:.3g} of the oracle "
          f"({'within' if rel < 1e-3 else 'past'} the 1e-3 bound)")


if __name__ == "__main__":
    main()
