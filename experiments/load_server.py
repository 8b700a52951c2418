"""A bounded loopback load test of strata-serve: N concurrent streaming clients on three workloads.

Workloads (those of Strata issue #2973): ``code`` (write a new Python module), ``edit`` (return a file with one
method renamed, a copy-heavy answer) and ``prose`` (a short story). Each prompt starts with a random tag, as there,
so two requests never share a prompt. For every arm (a set of strata-serve flags; a fresh server per arm, as that
issue runs "a fresh engine for each arm") and every stream count C: C = 1 is the mean of ``--rounds`` sequential
requests, C > 1 one round of C concurrent requests. Reported per (arm, workload, C):

* total output tok/s: output tokens of the round / its wall time (first request sent to last token);
* per-stream tok/s: each stream's own decode rate, (tokens - 1) / (last token - first token), shown as a range;
* time to first token and request latency (sent to last token), p50 and p95 over the round's requests;
* from the server's /metrics: proposals accepted / offered, and windows that compiled during the round (an untimed
  warm-up round per stream count, and one request alone, compiles the arm's window shapes first).

Loopback only: the servers it starts listen on 127.0.0.1, and ``--url`` must name a loopback host. Bounded: at most
``--deadline`` seconds in all (arms not started by then are skipped and listed), ``--timeout`` per request.

Usage (the CPU table in experiments/RESULTS.md):
  python experiments/load_server.py --model smollm2-135m --streams 1,4 --max_tokens 32 --max_context 512 \\
      --arm "serial=--batch 4" --arm "lookup-solo=--batch 4 --draft lookup --spec 4" --out /tmp/load.json
On a GPU (Strata issue #2973's shape: 900-token answers, 4 users):
  python experiments/load_server.py --model Q.gguf --streams 1,4 --max_tokens 900 --edit_lines 300 \\
      --arm "pipelined=--batch 4 --layer_split 12,24,36" \\
      --arm "piped-mtp=--batch 4 --layer_split 12,24,36 --piped_mtp 3"
Against a server already running on this machine: ``--url http://127.0.0.1:8000`` (one arm, named by ``--arm``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.parse

WORKLOADS = ("code", "edit", "prose")


def edit_file(n_lines: int) -> str:
    """A deterministic Python file of about ``n_lines`` lines (a class of small methods) with ``get_total`` in it."""
    out = ["class Ledger:", '    """A small ledger of named amounts."""', "", "    def __init__(self):",
           "        self.items = {}", ""]
    i = 0
    while len(out) < max(n_lines - 4, 8):
        out += [f"    def add_{i}(self, amount):", f"        self.items['k{i}'] = self.items.get('k{i}', 0) + amount",
                f"        return self.items['k{i}']", ""]
        i += 1
    out += ["    def get_total(self):", "        return sum(self.items.values())", ""]
    return "\n".join(out)


def prompt(workload: str, tag: str, edit_lines: int) -> str:
    if workload == "code":
        return (f"[{tag}] Write a Python module that implements an LRU cache class with get, put and a fixed "
                f"capacity, with docstrings and a short usage example.")
    if workload == "edit":
        return (f"[{tag}] Return the following file with the method get_total renamed to compute_total and nothing "
                f"else changed. Answer with the whole file only.\n\n```python\n{edit_file(edit_lines)}\n```")
    if workload == "prose":
        return f"[{tag}] Write a short story about a lighthouse keeper who finds a message in a bottle."
    raise ValueError(workload)


def one_request(client, model: str, text: str, max_tokens: int) -> dict:
    """One streaming chat request; times in seconds since it was sent."""
    t0 = time.perf_counter()
    first = last = None
    n = 0
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": text}],
                                            max_tokens=max_tokens, stream=True,
                                            stream_options={"include_usage": True})
    for ch in stream:
        now = time.perf_counter() - t0
        if ch.usage is not None:
            n = ch.usage.completion_tokens
        if ch.choices and (ch.choices[0].delta.content or ch.choices[0].finish_reason):
            first = now if first is None else first
            last = now
    return {"tokens": n, "ttft": first, "latency": last,
            "stream_tok_s": (n - 1) / (last - first) if n > 1 and last and last > first else None}


def run_round(client, model: str, texts: list[str], max_tokens: int) -> dict:
    """The requests of ``texts`` at once; the round's totals."""
    out: list = [None] * len(texts)

    def go(i):
        out[i] = one_request(client, model, texts[i], max_tokens)

    t0 = time.perf_counter()
    ths = [threading.Thread(target=go, args=(i,)) for i in range(len(texts))]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    wall = time.perf_counter() - t0
    return {"wall": wall, "requests": out, "tokens": sum(r["tokens"] for r in out)}


def pct(xs, q):
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    k = (len(xs) - 1) * q
    lo = int(k)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (k - lo)


def measure(client, model: str, workload: str, streams: int, rounds: int, max_tokens: int, edit_lines: int,
            rng: random.Random) -> dict:
    """C = 1: ``rounds`` sequential requests (mean rate); C > 1: one round of C concurrent requests."""
    def tag():
        return "%08x" % rng.getrandbits(32)

    if streams == 1:
        rs = [run_round(client, model, [prompt(workload, tag(), edit_lines)], max_tokens) for _ in range(rounds)]
    else:
        rs = [run_round(client, model, [prompt(workload, tag(), edit_lines) for _ in range(streams)], max_tokens)]
    reqs = [q for r in rs for q in r["requests"]]
    total = statistics.mean(r["tokens"] / r["wall"] for r in rs)
    per = [q["stream_tok_s"] for q in reqs if q["stream_tok_s"] is not None]
    return {"workload": workload, "streams": streams, "total_tok_s": total, "per_stream_min": min(per, default=None),
            "per_stream_max": max(per, default=None), "ttft_p50": pct([q["ttft"] for q in reqs], 0.5),
            "ttft_p95": pct([q["ttft"] for q in reqs], 0.95), "latency_p50": pct([q["latency"] for q in reqs], 0.5),
            "latency_p95": pct([q["latency"] for q in reqs], 0.95), "tokens": [q["tokens"] for q in reqs],
            "rounds": rs}


def start_server(model: str, flags: list[str], max_context: int, timeout: float):
    """strata-serve on a free loopback port; returns (process, url)."""
    cmd = [sys.executable, "-m", "strata_jax.cli.serve", "--model", model, "--host", "127.0.0.1", "--port", "0",
           "--max_context", str(max_context), *flags]
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    t0 = time.time()
    while True:
        line = proc.stderr.readline()
        if not line and proc.poll() is not None:
            raise SystemExit(f"strata-serve exited with status {proc.returncode} before listening")
        if line.startswith("strata-serve:") and "http://" in line:
            url = "http://" + line.split("http://")[1].split()[0]
            break
        if time.time() - t0 > timeout:
            proc.kill()
            raise SystemExit("strata-serve did not start in time")
    threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()  # keep its stderr drained
    return proc, url


def scrape(url: str) -> dict:
    """The server's counters that qualify a measurement: windows that compiled, proposals offered / accepted."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    want = {"strata_compiled_windows": "compiled_windows", "strata_proposals_offered": "offered",
            "strata_proposals_accepted": "accepted"}
    out = dict.fromkeys(want.values(), 0.0)
    for fam in text_string_to_metric_families(httpx.get(url.rstrip("/") + "/metrics", timeout=30).text):
        if fam.name in want:
            out[want[fam.name]] = sum(s.value for s in fam.samples if s.name.endswith("_total"))
    return out


def fmt(x, nd=0):
    return "n/a" if x is None else f"{x:.{nd}f}"


def tables(results: list[dict], streams: list[int], workloads: list[str]) -> str:
    """Strata issue #2973's table (total tok/s by workload, "1 user / C users (per-stream range each)"), then the
    latencies."""
    hi = max(streams)
    head = " | ".join(f"{w}: " + " / ".join(f"{c} user{'s' if c > 1 else ''}" for c in streams) for w in workloads)
    lines = [f"| tok/s | {head} |", "| --- |" + " --- |" * len(workloads)]
    lat = [f"| ms at {hi} user{'s' if hi > 1 else ''} | "
           + " | ".join(f"{w}: TTFT p50 / p95, latency p50 / p95" for w in workloads) + " |",
           "| --- |" + " --- |" * len(workloads)]
    props = ["| all rounds | " + " | ".join(f"{w}: proposals accepted / offered, windows that compiled"
                                            for w in workloads) + " |", "| --- |" + " --- |" * len(workloads)]
    arms = list(dict.fromkeys(r["arm"] for r in results))
    for arm in arms:
        cells, lcells = [], []
        for w in workloads:
            parts = []
            for c in streams:
                r = next((x for x in results if x["arm"] == arm and x["workload"] == w and x["streams"] == c), None)
                if r is None:
                    parts.append("-")
                    continue
                s = fmt(r["total_tok_s"], 1)
                if c > 1:
                    s += f" ({fmt(r['per_stream_min'], 1)}-{fmt(r['per_stream_max'], 1)} each)"
                parts.append(s)
            cells.append(" / ".join(parts))
            r = next((x for x in results if x["arm"] == arm and x["workload"] == w and x["streams"] == hi), None)
            lcells.append("-" if r is None else
                          f"{fmt(r['ttft_p50'] * 1e3 if r['ttft_p50'] is not None else None)} / "
                          f"{fmt(r['ttft_p95'] * 1e3 if r['ttft_p95'] is not None else None)}, "
                          f"{fmt(r['latency_p50'] * 1e3 if r['latency_p50'] is not None else None)} / "
                          f"{fmt(r['latency_p95'] * 1e3 if r['latency_p95'] is not None else None)}")
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
        lat.append(f"| {arm} | " + " | ".join(lcells) + " |")
        pcells = []
        for w in workloads:
            rs = [x for x in results if x["arm"] == arm and x["workload"] == w]
            pcells.append(f"{sum(x.get('accepted', 0) for x in rs):.0f} / {sum(x.get('offered', 0) for x in rs):.0f}, "
                          f"{sum(x.get('compiled_windows', 0) for x in rs):.0f}")
        props.append(f"| {arm} | " + " | ".join(pcells) + " |")
    return "\n".join(lines) + "\n\n" + "\n".join(lat) + "\n\n" + "\n".join(props)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="strata-serve --model (registry name or .gguf)")
    ap.add_argument("--arm", action="append", default=[],
                    help="NAME=FLAGS: one server configuration (repeatable), e.g. \"serial=--batch 4\"")
    ap.add_argument("--url", default=None, help="a running server on this machine instead (one arm)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--streams", default="1,4", help="concurrent streams per round, comma-separated")
    ap.add_argument("--rounds", type=int, default=2, help="sequential requests averaged for 1 stream")
    ap.add_argument("--max_tokens", type=int, default=32)
    ap.add_argument("--max_context", type=int, default=512)
    ap.add_argument("--edit_lines", type=int, default=16, help="lines of the file the edit workload returns")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per request (and for a server start)")
    ap.add_argument("--deadline", type=float, default=3600.0, help="seconds in all; later arms are skipped")
    ap.add_argument("--seed", type=int, default=0, help="seed of the prompt tags")
    ap.add_argument("--out", default=None, help="JSON with every request's numbers")
    a = ap.parse_args(argv)
    import openai

    streams = [int(s) for s in a.streams.split(",") if s.strip()]
    workloads = [w for w in a.workloads.split(",") if w]
    bad = [w for w in workloads if w not in WORKLOADS]
    if bad or not streams or min(streams) < 1 or a.max_tokens < 1:
        ap.error(f"workloads must be among {WORKLOADS}, streams >= 1, max_tokens >= 1")
    arms = []
    for spec in a.arm or ["default="]:
        name, _, flags = spec.partition("=")
        arms.append((name.strip() or "default", flags.split()))
    if a.url:
        host = urllib.parse.urlparse(a.url).hostname
        if host not in ("127.0.0.1", "localhost", "::1"):
            ap.error(f"--url {a.url}: loopback only (127.0.0.1, localhost, ::1)")
        arms = arms[:1]
    rng = random.Random(a.seed)
    t_start = time.time()
    results, skipped = [], []
    for name, flags in arms:
        if time.time() - t_start > a.deadline:
            skipped.append(name)
            continue
        proc = None
        if a.url:
            url = a.url
        else:
            proc, url = start_server(a.model, flags, a.max_context, a.timeout)
        try:
            client = openai.OpenAI(base_url=url.rstrip("/") + "/v1", api_key=os.environ.get("STRATA_API_KEY", "-"),
                                   timeout=a.timeout, max_retries=0)
            model = client.models.list().data[0].id
            # untimed: the window shapes of this arm compile before the measured rounds (every stream count, then a
            # request alone: the solo path's windows)
            for c in sorted(set(streams) | {1}, reverse=True):
                run_round(client, model, [prompt(workloads[i % len(workloads)], "warm", a.edit_lines)
                                          for i in range(c)], 8)
            for w in workloads:
                for c in streams:
                    if time.time() - t_start > a.deadline:
                        break
                    m0 = scrape(url)
                    r = measure(client, model, w, c, a.rounds, a.max_tokens, a.edit_lines, rng)
                    m1 = scrape(url)
                    r.update(arm=name, flags=" ".join(flags), **{k: m1[k] - m0[k] for k in m0})
                    results.append(r)
                    print(f"{name} {w} x{c}: {r['total_tok_s']:.1f} tok/s total, per stream "
                          f"{fmt(r['per_stream_min'], 1)}-{fmt(r['per_stream_max'], 1)}, TTFT p50 "
                          f"{fmt(r['ttft_p50'], 2)} s, latency p50 {fmt(r['latency_p50'], 2)} s, tokens {r['tokens']}, "
                          f"proposals {r['accepted']:.0f}/{r['offered']:.0f}, windows that compiled "
                          f"{r['compiled_windows']:.0f}", file=sys.stderr, flush=True)
        finally:
            if proc is not None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    proc.kill()
    print(tables(results, streams, workloads))
    if skipped:
        print(f"\nskipped (past --deadline {a.deadline:.0f} s): {', '.join(skipped)}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "results": results, "skipped": skipped}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
