"""The batching benchmark's report (``experiments/bench_batching.py``): medians per (workload, streams, arm), the
issue's goals, a markdown report and a PNG (pure functions of the timed runs' records).
"""

from __future__ import annotations

import collections
import math

import numpy as np

from strata_jax.testing.batching.workload import ALL_ARMS, WORKLOADS, is_drafting

# goals at the largest stream count: best piped drafting arm / pipelined default, and / serial batch MTP
GOAL_VS_PIPELINED = {"code": 1.4, "edit": 1.3, "prose": 1.0}
GOAL_VS_BATCH_MTP = 1.2
GOAL_VS_SOLO = 1.0


def _median(xs):
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return float(np.median(xs)) if xs else None


def summarize(records: list[dict]) -> list[dict]:
    """One row per (workload, streams, arm): medians over the repetitions (and min / max of total tok/s), with the
    ratios to the pipelined default and to serial batch MTP at the same workload and streams, and for one stream to
    the arm's solo-path baseline.

    Args:
      records: timed runs, each with ``workload``, ``streams``, ``arm``, ``total_tok_s``, ``per_stream_tok_s`` and
        optional ``windows_per_slot``, ``proposed``, ``accepted``, ``stage_ms`` (list), ``idle`` (list),
        ``compiles``, ``exact``, ``label``, ``solo_ref``.
    """
    groups: dict[tuple, list[dict]] = collections.OrderedDict()
    for r in records:
        if r.get("warmup"):
            continue
        groups.setdefault((r["workload"], r["streams"], r["arm"]), []).append(r)
    rows = []
    for (w, s, a), rs in groups.items():
        tot = [r["total_tok_s"] for r in rs]
        row = {"workload": w, "streams": s, "arm": a, "reps": len(rs), "label": rs[0].get("label", ""),
               "mode": rs[0].get("mode", ""), "total_tok_s": _median(tot), "total_min": min(tot),
               "total_max": max(tot), "per_stream_tok_s": _median([r["per_stream_tok_s"] for r in rs]),
               "windows_per_slot": _median([r.get("windows_per_slot") for r in rs]),
               "proposed": _median([r.get("proposed", 0) for r in rs]),
               "accepted": _median([r.get("accepted", 0) for r in rs]),
               "compiles": max(r.get("compiles", 0) for r in rs), "exact": all(r.get("exact", True) for r in rs),
               "solo_ref": rs[0].get("solo_ref"), "mtp_chain": rs[0].get("mtp_chain", 0)}
        row["kept"] = row["accepted"] / row["proposed"] if row["proposed"] else None
        n_st = max((len(r.get("stage_ms") or []) for r in rs), default=0)
        row["stage_ms"] = [_median([(r.get("stage_ms") or [None] * n_st)[k] for r in rs]) for k in range(n_st)]
        n_dev = max((len(r.get("idle") or []) for r in rs), default=0)
        row["idle"] = [_median([(r.get("idle") or [None] * n_dev)[k] for r in rs]) for k in range(n_dev)]
        rows.append(row)
    by = {(r["workload"], r["streams"], r["arm"]): r for r in rows}
    for r in rows:
        base = by.get((r["workload"], r["streams"], "pipelined"))
        bm = by.get((r["workload"], r["streams"], "batch_mtp"))
        solo = by.get((r["workload"], r["streams"], r["solo_ref"])) if r["solo_ref"] else None
        r["vs_pipelined"] = r["total_tok_s"] / base["total_tok_s"] if base and base["total_tok_s"] else None
        r["vs_batch_mtp"] = r["total_tok_s"] / bm["total_tok_s"] if bm and bm["total_tok_s"] else None
        r["vs_solo"] = r["total_tok_s"] / solo["total_tok_s"] if solo and solo["total_tok_s"] else None
    return rows


def _goal(name: str, workload: str, streams: int, arm: str | None, measured: float | None, target: float) -> dict:
    g = {"goal": name, "workload": workload, "streams": streams, "arm": arm, "measured": measured, "target": target}
    if measured is None:
        g.update(met=None, note="not measured")
    elif measured >= target:
        g.update(met=True, note="met")
    else:
        short = target - measured
        g.update(met=False, note=f"missed by {max(short, 0.01):.2f}x ({100 * short / target:.0f}% below the goal; "
                                 f"needs {100 * (target / measured - 1):.0f}% more)" if measured > 0 else
                 "missed (0 tok/s)")
    return g


def compute_goals(rows: list[dict]) -> list[dict]:
    """The issue's goals, from `summarize` rows.

    At the largest stream count: the best piped drafting arm vs the pipelined default (code >= 1.4x, edit >= 1.3x,
    prose >= 1.0x) and vs serial batch MTP (>= 1.2x on every workload). At one stream: every batch arm vs the solo
    path with the same proposals (>= 1.0x). A missed goal says by how much.
    """
    goals = []
    if not rows:
        return goals
    top = max(r["streams"] for r in rows)
    for w in [x for x in WORKLOADS if any(r["workload"] == x for r in rows)]:
        piped = [r for r in rows if r["workload"] == w and r["streams"] == top and is_drafting(r["arm"])
                 and r["total_tok_s"] is not None]
        best = max(piped, key=lambda r: r["total_tok_s"]) if piped else None
        if w in GOAL_VS_PIPELINED:
            goals.append(_goal("piped drafting / pipelined default", w, top, best and best["arm"],
                               best and best["vs_pipelined"], GOAL_VS_PIPELINED[w]))
        goals.append(_goal("piped drafting / serial batch MTP", w, top, best and best["arm"],
                           best and best["vs_batch_mtp"], GOAL_VS_BATCH_MTP))
        for r in rows:
            if r["workload"] == w and r["streams"] == 1 and r["solo_ref"] and not r["arm"].startswith("solo"):
                goals.append(_goal("one stream / solo path", w, 1, f"{r['arm']} vs {r['solo_ref']}", r["vs_solo"],
                                   GOAL_VS_SOLO))
    return goals


def _f(x, fmt="{:.1f}", none="-"):
    return none if x is None else fmt.format(x)


def markdown(rows: list[dict], goals: list[dict], meta: dict) -> str:
    """The report: what ran, how it was measured, one table per workload, the goals."""
    labels = sorted({r["label"] for r in rows if r["label"]})
    out = [f"# Batching benchmark: model set {meta.get('model_set')} ({meta.get('model')})", ""]
    if meta.get("smoke"):
        out += ["**CPU smoke run of the whole pipeline: the numbers below say nothing about performance.**", ""]
    if labels:
        out += ["Acceptance: " + "; ".join(f"**{x}**" for x in labels) + " (see below).", ""]
    out += [f"- command: `{meta.get('command', '')}`",
            f"- devices: {meta.get('devices')}; jax {meta.get('jax')}; backend {meta.get('backend')}",
            f"- layer split: {meta.get('layer_split')} ({meta.get('stages')} stages); slots: {meta.get('slots')}; "
            f"weights: {meta.get('weights')}",
            f"- tokens per request: {meta.get('tokens')}; repetitions: {meta.get('reps')} (medians; total tok/s "
            f"also min-max); prompt tokens: {meta.get('prompt_tokens')}",
            f"- MTP chain: {meta.get('mtp_note', 'n/a')}", ""]
    for note in meta.get("notes", []):
        out.append(f"- {note}")
    out += ["", "Columns: total = output tok/s over all streams (median [min-max]); per stream = median of the "
            "streams' tok/s; x pipe / x bmtp = total over the pipelined default / serial batch MTP at the same "
            "streams; x solo (one stream) = over the solo path with the same proposals; win/slot = windows each "
            "request took part in; kept = accepted / offered proposals; ms/win = time of one window (+ its commit) "
            "alone on each stage, the arm's most frequent window shape; idle = estimated idle fraction of each device "
            "(1 - calls x time alone / decode wall); comp = compiles during the timed runs (0 expected); exact = "
            "every request's tokens equal the reference decode.", ""]
    for w in [x for x in WORKLOADS if any(r["workload"] == x for r in rows)]:
        out += [f"## {w}", "", "| streams | arm | acceptance | total tok/s | per stream | x pipe | x bmtp | x solo | "
                "win/slot | kept | ms/win per stage | idle per device | comp | exact |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in sorted((r for r in rows if r["workload"] == w), key=lambda r: (r["streams"], _arm_order(r["arm"]))):
            kept = "-" if r["kept"] is None else f"{r['accepted']:.0f}/{r['proposed']:.0f} ({100 * r['kept']:.0f}%)"
            out.append(
                f"| {r['streams']} | {r['arm']} | {(r['label'] or '-') + _chain(r)} | {_f(r['total_tok_s'], '{:.2f}')} "
                f"[{_f(r['total_min'], '{:.2f}')}-{_f(r['total_max'], '{:.2f}')}] | {_f(r['per_stream_tok_s'], '{:.2f}')}"
                f" | {_f(r['vs_pipelined'], '{:.2f}')} | {_f(r['vs_batch_mtp'], '{:.2f}')} | {_f(r['vs_solo'], '{:.2f}')}"
                f" | {_f(r['windows_per_slot'], '{:.0f}')} | {kept} | "
                f"{' / '.join(_f(x, '{:.1f}') for x in r['stage_ms']) or '-'} | "
                f"{' / '.join(_f(None if x is None else 100 * x, '{:.0f}%') for x in r['idle']) or '-'} | "
                f"{r['compiles']} | {'yes' if r['exact'] else '**NO**'} |")
        out.append("")
    out += ["## Goals", "", "| goal | workload | streams | arm | measured | goal | result |", "|---|---|---|---|---|---|---|"]
    for g in goals:
        res = {True: "met", False: f"**{g['note']}**", None: "not measured"}[g["met"]]
        out.append(f"| {g['goal']} | {g['workload']} | {g['streams']} | {g['arm'] or '-'} | "
                   f"{_f(g['measured'], '{:.2f}x')} | {g['target']:.2f}x | {res} |")
    out.append("")
    return "\n".join(out)


def _chain(row: dict) -> str:
    return f" + MTP chain ({row['mtp_chain']})" if row.get("mtp_chain") else ""


def _arm_order(name: str) -> tuple:
    return (ALL_ARMS.index(name) if name in ALL_ARMS else len(ALL_ARMS), name)  # then the solo baselines


def plot(rows: list[dict], path: str, title: str) -> str:
    """Grouped bars of total tok/s (median, min-max whiskers) per arm and stream count, one panel per workload.
    Returns a message (written, or why not)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no PNG written"
    ws = [x for x in WORKLOADS if any(r["workload"] == x for r in rows)]
    if not ws:
        return "nothing to plot"
    fig, axes = plt.subplots(1, len(ws), figsize=(5.5 * len(ws), 4.2), squeeze=False)
    for ax, w in zip(axes[0], ws):
        rs = [r for r in rows if r["workload"] == w]
        streams = sorted({r["streams"] for r in rs})
        arms = sorted({r["arm"] for r in rs}, key=_arm_order)
        width = 0.8 / max(len(arms), 1)
        colors = plt.get_cmap("tab20")
        for i, a in enumerate(arms):
            lab = next((r["label"] for r in rs if r["arm"] == a and r["label"]), "")
            xs, ys, lo, hi = [], [], [], []
            for k, s in enumerate(streams):
                r = next((r for r in rs if r["streams"] == s and r["arm"] == a), None)
                if r is None or r["total_tok_s"] is None:
                    continue
                xs.append(k + (i - (len(arms) - 1) / 2) * width)
                ys.append(r["total_tok_s"])
                lo.append(r["total_tok_s"] - r["total_min"])
                hi.append(r["total_max"] - r["total_tok_s"])
            ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, color=colors(i % 20),
                   hatch="//" if a.startswith("solo") else None, label=f"{a} ({lab})" if lab else a)
        ax.set_xticks(range(len(streams)))
        ax.set_xticklabels([f"{s} stream{'s' if s > 1 else ''}" for s in streams])
        ax.set_title(w)
        ax.set_ylabel("total output tok/s")
    axes[0][-1].legend(fontsize=6, ncol=2)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)
    return f"wrote {path}"
