"""Where a compiled step program's kernel launches come from: launches per token by kind and source line.

Reads the optimized GPU HLO text a device call saved (``profile_step.py --hlo_out``, e.g.
``experiments/results/h200_2026-12-04/call1/full_steps_hlo.txt.xz``; ``.xz`` / ``.gz`` read as such). By default
the body of the program's largest while loop (a steps program's loop: one iteration = one token) is walked
(`strata_jax.pallas.structure.hlo_attribution`): every fusion, custom call (a Pallas kernel is named as the
profile names it, e.g. ``qmatmul_planar_BF16``), sort and copy is one launch, attributed through its
``stack_frame_id`` to the innermost frame in ``strata_jax/`` (``--depth`` frames; ``--caller`` skips the Pallas
wrappers and the row-exact helpers, naming the model line that called them).

    python experiments/hlo_attribution.py experiments/results/h200_2026-12-04/call1/full_steps_hlo.txt.xz \\
        --top 30 [--caller] [--depth 2] [--kinds loop_multiply_fusion,sort] [--json out.json]

Prints the launches per token by kind, then the table: source, launches, {kind: count}. (The line numbers are
those of the tree the HLO was compiled from.)
"""

from __future__ import annotations

import argparse
import gzip
import json
import lzma
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from strata_jax.pallas import structure  # noqa: E402

CALLER_SKIP = ("pallas/", "layers/exact.py", "layers/linear.py", "layers/norms.py")


def read_text(path: str) -> str:
    if path.endswith(".xz"):
        return lzma.open(path, "rt").read()
    if path.endswith(".gz"):
        return gzip.open(path, "rt").read()
    return Path(path).read_text()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("hlo", help="optimized HLO text (.txt, .txt.xz, .txt.gz)")
    ap.add_argument("--computation", default=None, help="walk this computation (default: the largest while body)")
    ap.add_argument("--depth", type=int, default=1, help="frames per source (innermost first)")
    ap.add_argument("--caller", action="store_true", help="skip frames in " + ", ".join(CALLER_SKIP))
    ap.add_argument("--kinds", default="", help="only these kinds (comma-separated)")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--json", default=None, help="write {source: {kind: count}} here")
    args = ap.parse_args(argv)
    launches = structure.hlo_attribution(read_text(args.hlo), args.computation)
    kinds = {k for k in args.kinds.split(",") if k}
    if kinds:
        launches = [r for r in launches if r["kind"] in kinds]
    by_kind = {}
    for r in launches:
        by_kind[r["kind"]] = by_kind.get(r["kind"], 0) + 1
    print(f"{len(launches)} launches per loop iteration (token)")
    print("by kind: " + "; ".join(f"{k} {n}" for k, n in sorted(by_kind.items(), key=lambda kv: -kv[1])))
    table = structure.attribution_table(launches, depth=args.depth, skip=CALLER_SKIP if args.caller else ())
    rows = sorted(table.items(), key=lambda kv: (-sum(kv[1].values()), kv[0]))
    print(f"\n{'launches':>8}  source  {{kind: launches}}")
    for src, d in rows[:args.top]:
        kinds_s = ", ".join(f"{k} {n}" for k, n in sorted(d.items(), key=lambda kv: -kv[1]))
        print(f"{sum(d.values()):8d}  {src}  {{{kinds_s}}}")
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
