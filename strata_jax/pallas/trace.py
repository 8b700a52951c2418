"""A `jax.profiler` trace of some decode steps, summarised per step: device busy time, kernel launches,
host<->device and device-to-device copies (count and bytes), the top kernels.

The trace is the Perfetto JSON that ``jax.profiler.trace(dir, create_perfetto_trace=True)`` writes
(``dir/plugins/profile/*/perfetto_trace.json.gz``). Device activity is every complete event (``"ph": "X"``) of
the processes named ``/device:GPU:N`` (CUPTI's kernels and memcpys on the GPU streams). A trace of a CPU run has no
device process; there the events of XLA:CPU's executor threads (``tf_XLA...`` threads other than the Eigen pool)
stand in for kernels, so the same summary runs on a CPU (copies are then zero).

Classification: an event named ``Memcpy{H2D,D2H,D2D,P2P}`` (CUPTI's names) or ``Memset`` is a copy of that
direction; its bytes come from the event's args (``bytes`` / ``num_bytes`` / ``size``, or ``size:N`` inside a
``memcpy_details`` string). A kernel whose name starts with ``copy`` or holds ``memcpy`` is an XLA copy kernel
(counted as a device-to-device copy too, bytes unknown). Everything else on the device is a kernel launch.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re

_MEMCPY = re.compile(r"memcpy\s*([HDP])\s*(?:to)?\s*2?\s*([HDP])", re.I)
_SKIP_CPU = ("ThreadpoolListener", "ThunkExecutor", "end: ")


def load_events(trace_dir: str) -> list[dict]:
    """The trace events of the newest Perfetto trace under ``trace_dir``.

    Raises:
      FileNotFoundError: no ``perfetto_trace.json.gz`` under the directory.
    """
    files = sorted(glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True),
                   key=os.path.getmtime)
    if not files:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {trace_dir}")
    with gzip.open(files[-1], "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def _bytes(args: dict) -> int:
    for k in ("bytes", "num_bytes", "size", "size_bytes"):
        v = args.get(k)
        if isinstance(v, (int, float)) or (isinstance(v, str) and v.isdigit()):
            return int(v)
    for v in args.values():
        if isinstance(v, str):
            m = re.search(r"size:(\d+)", v)
            if m:
                return int(m.group(1))
    return 0


def copy_kind(name: str) -> str | None:
    """``"H2D"``, ``"D2H"``, ``"D2D"``, ``"P2P"``, ``"memset"``, ``"copy_kernel"`` or None (a kernel)."""
    m = _MEMCPY.search(name)
    if m:
        a, b = m.group(1).upper(), m.group(2).upper()
        return "P2P" if "P" in (a, b) else f"{a}2{b}"
    low = name.lower()
    if low.startswith("memset"):
        return "memset"
    if low.startswith("copy") or "memcpy" in low:
        return "copy_kernel"
    return None


def _union(intervals) -> float:
    total, end = 0.0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def summarize(events: list[dict], n_steps: int, top: int = 10) -> dict:
    """Per-step figures of the device activity in ``events`` (all of it belongs to ``n_steps`` steps).

    Returns:
      dict: ``device`` ("gpu" or "cpu"), ``busy_ms`` (union of the device's event intervals, per step),
      ``span_ms`` (first device event start to last end, per step), ``launches`` (kernels per step), ``copies``
      ({kind: {"count", "bytes"}} per step; kinds of `copy_kind`), ``top_kernels`` ([(name, ms per step, calls per
      step)] by time), ``kernel_families`` (the same with names stripped of their trailing numbers --
      ``loop_add_fusion_12`` and ``loop_add_fusion.3`` count as ``loop_add_fusion`` -- by calls: what the launches
      of a step are), ``unclassified`` (the most frequent event names on the device, to check the rules),
      ``gaps`` (the device's idle stretches per step, `_gaps`) and ``host_top`` (the host's events, `_host_top`).
    """
    procs, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            procs[e.get("pid")] = str(e.get("args", {}).get("name", ""))
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e.get("pid"), e.get("tid"))] = str(e.get("args", {}).get("name", ""))
    gpu_pids = {p for p, n in procs.items() if "/device:GPU" in n or "/device:gpu" in n}
    if gpu_pids:
        device = "gpu"
        on_device = lambda e: e.get("pid") in gpu_pids
    else:
        device = "cpu"
        cpu_tids = {k for k, n in threads.items() if n.startswith("tf_XLA") and "Eigen" not in n}
        on_device = lambda e: (e.get("pid"), e.get("tid")) in cpu_tids and not str(e.get("name", "")).startswith(
            _SKIP_CPU)
    dev = [e for e in events if e.get("ph") == "X" and on_device(e) and "dur" in e]
    n = max(int(n_steps), 1)
    copies = collections.defaultdict(lambda: [0, 0])
    kernels = collections.defaultdict(lambda: [0.0, 0])
    for e in dev:
        name = str(e.get("name", ""))
        kind = copy_kind(name)
        if kind is not None:
            copies[kind][0] += 1
            copies[kind][1] += _bytes(e.get("args", {}))
            if kind != "copy_kernel":
                continue
        kernels[name][0] += float(e["dur"])
        kernels[name][1] += 1
    ivs = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in dev]
    span = (max(b for _, b in ivs) - min(a for a, _ in ivs)) if ivs else 0.0
    names = collections.Counter(str(e.get("name", "")) for e in dev)
    return {
        "device": device,
        "steps": n,
        "busy_ms": _union(ivs) / 1e3 / n,
        "span_ms": span / 1e3 / n,
        "launches": sum(c for _, c in kernels.values()) / n,
        "copies": {k: {"count": c / n, "bytes": b / n} for k, (c, b) in sorted(copies.items())},
        "top_kernels": [(k, t / 1e3 / n, c / n) for k, (t, c) in
                        sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]],
        "kernel_families": [(k, t / 1e3 / n, c / n) for k, (t, c) in
                            sorted(_families(kernels).items(), key=lambda kv: -kv[1][1])[:4 * top]],
        "unclassified": names.most_common(top),
        "gaps": _gaps(ivs, n),
        "host_top": _host_top(events, set(gpu_pids) if gpu_pids else set(), n, 2 * top),
    }


def _gaps(ivs, n: int) -> dict:
    """Idle stretches between the device's busy intervals, per step: count and ms of those over 5 / 20 / 100 us."""
    out, end = {5: [0, 0.0], 20: [0, 0.0], 100: [0, 0.0]}, None
    for s, e in sorted(ivs):
        if end is not None and s > end:
            for lim, acc in out.items():
                if s - end > lim:
                    acc[0] += 1
                    acc[1] += (s - end) / 1e3
        end = e if end is None else max(end, e)
    return {f">{lim}us": {"count": c / n, "ms": t / n} for lim, (c, t) in out.items()}


def _host_top(events: list[dict], device_pids: set, n: int, top: int) -> list:
    """The host's trace events (JAX / XLA TraceMe scopes and the CUDA driver calls CUPTI records) by time per step:
    [(name, ms per step, calls per step)], names stripped of trailing numbers. Scopes nest, so times overlap."""
    acc = collections.defaultdict(lambda: [0.0, 0])
    for e in events:
        if e.get("ph") != "X" or "dur" not in e or e.get("pid") in device_pids or "profiler" in str(e.get("name")):
            continue
        name = re.sub(r"([._#:]\d+)+$", "", str(e.get("name", "")))[:80]
        acc[name][0] += float(e["dur"])
        acc[name][1] += 1
    return [(k, t / 1e3 / n, c / n) for k, (t, c) in sorted(acc.items(), key=lambda kv: -kv[1][0])[:top]]


def _families(kernels: dict) -> dict:
    """{name: [us, calls]} -> the same summed over names that differ only in trailing numbers."""
    out = collections.defaultdict(lambda: [0.0, 0])
    for name, (t, c) in kernels.items():
        fam = re.sub(r"([._]\d+)+$", "", name)
        out[fam][0] += t
        out[fam][1] += c
    return out
