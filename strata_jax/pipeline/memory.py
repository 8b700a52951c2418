"""What an engine holds in memory, and how many slots fit: bytes of weights and of state per slot on each stage,
the hand-off rows between stages, and the device's (or the machine's) limit.

Used at start (`memory_lines` is logged, `check_batch_fits` refuses a ``--batch`` that does not fit), by the
load-time choice of the weights' form (`memory_bytes`, `strata_jax.pipeline.engine.Engine`'s ``weights="auto"``), and
at the end of a run (`memory_in_use`: what the devices hold and held at most, for the stats line and
``--stats_json``).
"""

from __future__ import annotations

import os

from strata_jax.errors import StrataError
from strata_jax.state import tree_bytes


def weight_bytes(engine) -> int:
    """Bytes of weights held on the devices (in their block formats, or float32 with ``weights="f32"``)."""
    return sum(tree_bytes(s.params) for s in engine.stages)


def state_bytes_per_slot(engine) -> list[int]:
    """Bytes of state one slot costs on each stage (K/V cells, recurrent state), one entry per stage."""
    return [tree_bytes(st) // engine.n_slots for st in engine.states]


def handoff_bytes_per_row(engine) -> int:
    """Bytes handed from one stage to the next per window row (hidden [D] float32)."""
    return 4 * int(engine.cfg.n_embd)


def memory_report(engine) -> dict:
    """Bytes per stage: weights, state per slot, hand-off per row; and the device's limit where known.

    Returns:
      {"stages": [{"stage", "layers", "device", "weight_bytes", "slot_bytes", "limit_bytes"|None}, ...],
       "handoff_bytes_per_row": int, "n_slots": int}
    """
    stages = []
    for s, sb in zip(engine.stages, state_bytes_per_slot(engine)):
        stages.append({"stage": s.index, "layers": f"{s.start}..{s.stop - 1}", "device": str(s.device),
                       "weight_bytes": tree_bytes(s.params), "slot_bytes": int(sb),
                       "limit_bytes": device_limit(s.device)})
    return {"stages": stages, "handoff_bytes_per_row": handoff_bytes_per_row(engine), "n_slots": engine.n_slots}


def memory_lines(engine) -> list[str]:
    """The memory report as log lines (printed at start), MiB."""
    r = memory_report(engine)
    mib = 1 / 2 ** 20
    out = []
    for st in r["stages"]:
        lim = f", device limit {st['limit_bytes'] * mib:.0f} MiB" if st["limit_bytes"] else ""
        out.append(f"stage {st['stage']} (layers {st['layers']}, {st['device']}): weights "
                   f"{st['weight_bytes'] * mib:.1f} MiB, {st['slot_bytes'] * mib:.2f} MiB per slot{lim}")
    if len(r["stages"]) > 1:
        out.append(f"hand-off: {r['handoff_bytes_per_row']} bytes per row per stage boundary")
    return out


def slots_that_fit(engine, limit_bytes: int | None = None, rows: int = 8) -> int | None:
    """Most slots every stage can hold: (limit - weights - ``rows`` hand-off rows) // bytes per slot, the minimum
    over stages. ``limit_bytes`` per device (``--memory_limit_gib``), else each device's ``memory_stats()`` limit;
    None when no limit is known."""
    best = None
    for st in memory_report(engine)["stages"]:
        lim = limit_bytes if limit_bytes is not None else st["limit_bytes"]
        if lim is None:
            continue
        room = int(lim) - st["weight_bytes"] - rows * handoff_bytes_per_row(engine)
        n = max(room, 0) // max(st["slot_bytes"], 1)
        best = n if best is None else min(best, n)
    return best


def check_batch_fits(engine, n_slots: int, limit_bytes: int | None = None) -> None:
    """Refuse ``n_slots`` slots that do not fit (see `slots_that_fit`).

    Raises:
      StrataError: they do not fit; the message says how many would.
    """
    n = slots_that_fit(engine, limit_bytes)
    if n is not None and n_slots > n:
        per = max(st["slot_bytes"] for st in memory_report(engine)["stages"])
        lim = "--memory_limit_gib" if limit_bytes is not None else "the device memory"
        raise StrataError(f"--batch {n_slots} does not fit in {lim}: {per / 2 ** 20:.2f} MiB per slot on the "
                          f"largest stage; {n} slot(s) would fit (or lower --max_context)")


def memory_bytes() -> int | None:
    """The memory this process may use, bytes: the physical memory, or the cgroup's limit when lower
    (containers), or None when neither can be read."""
    got = []
    try:
        got.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        pass
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                v = f.read().strip()
            if v.isdigit():
                got.append(int(v))
        except OSError:
            pass
    return min(got) if got else None


def device_memory(devices) -> dict | None:
    """``{"bytes_in_use", "peak_bytes_in_use", "bytes_limit"}`` summed over ``devices`` (each device once), from
    ``memory_stats()``; None where the backend reports none (CPU). The peak is the process's since the device was
    first used (JAX cannot reset it); a backend without a peak or a limit reports the bytes in use or 0 for it."""
    tot = {"bytes_in_use": 0, "peak_bytes_in_use": 0, "bytes_limit": 0}
    seen = set()
    for d in devices:
        if d in seen:
            continue
        seen.add(d)
        try:
            st = d.memory_stats()
        except Exception:  # noqa: BLE001 - backends without the call
            st = None
        if not st or "bytes_in_use" not in st:
            return None
        tot["bytes_in_use"] += int(st["bytes_in_use"])
        tot["peak_bytes_in_use"] += int(st.get("peak_bytes_in_use", st["bytes_in_use"]))
        tot["bytes_limit"] += int(st.get("bytes_limit") or 0)
    return tot if seen else None


def process_memory() -> dict | None:
    """This process's resident memory: ``{"bytes_in_use", "peak_bytes_in_use"}`` (the resident set now, from
    /proc/self/statm, and its peak, ``getrusage``'s ru_maxrss); None where neither can be read. On a CPU backend the
    weights and state live there (pages of the model file's memory map count once read)."""
    out = {}
    try:
        with open("/proc/self/statm") as f:
            out["bytes_in_use"] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        pass
    try:
        import resource

        out["peak_bytes_in_use"] = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # KiB on Linux
    except (ImportError, OSError, ValueError):
        pass
    if not out:
        return None
    out.setdefault("bytes_in_use", out.get("peak_bytes_in_use"))
    # ru_maxrss lags the resident set read a moment later (seen in CI: 7,253,671,936 now vs 7,253,479,424 peak)
    out["peak_bytes_in_use"] = max(out.get("peak_bytes_in_use", 0), out["bytes_in_use"])
    return out


def memory_in_use(engine) -> dict | None:
    """What ``engine``'s devices hold now and held at most: `device_memory` over its stages' devices (``"source":
    "device"``, with ``bytes_limit``), or on a backend without memory statistics (CPU) the process's resident memory
    (`process_memory`, ``"source": "process"``, ``bytes_limit`` the machine's, `memory_bytes`); None when neither is
    known."""
    got = device_memory([s.device for s in engine.stages])
    if got is not None:
        return {"source": "device", **got}
    got = process_memory()
    if got is None:
        return None
    return {"source": "process", **got, "bytes_limit": memory_bytes() or 0}


def memory_text(m: dict | None) -> str:
    """`memory_in_use` in words, GiB: ``device memory 52.1 GiB in use, peak 60.3 of 139.8 GiB`` (or ``process memory
    (RSS) ...`` on a CPU); '' for None."""
    if not m:
        return ""
    gib = 1 / 2 ** 30
    what = "device memory" if m["source"] == "device" else "process memory (RSS)"
    lim = f" of {m['bytes_limit'] * gib:.1f}" if m.get("bytes_limit") else ""
    return f"{what} {m['bytes_in_use'] * gib:.1f} GiB in use, peak {m['peak_bytes_in_use'] * gib:.1f}{lim} GiB"


def device_limit(device) -> int | None:
    """The device's memory limit in bytes (``memory_stats()["bytes_limit"]``), None where it reports none (CPU)."""
    try:
        ms = device.memory_stats()
    except Exception:
        return None
    if not ms:
        return None
    return int(ms.get("bytes_limit") or 0) or None
