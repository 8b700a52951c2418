"""Plain vs speculative decoding speed on one sequence, on three workloads (issue "Speculative decoding on one
sequence").

Workloads (chat-templated prompts):
  code:   write new code (little repetition: lookup rarely proposes, a draft model helps);
  rename: return a ~100-line file with one method renamed (the output copies the prompt: lookup's best case);
  prose:  a short essay (no code, no copying).

Modes: ``plain`` (one-row steps), ``lookup`` (prompt lookup) and ``model`` (a smaller GGUF with the
same tokenizer drafting greedily). Every speculative run is checked to give token for token the plain output.
Default: Qwen2.5-Coder-1.5B with the 0.5B as draft model. ``--small`` is a CPU smoke run: SmolLM2-135M drafting
for itself, a 20-line file, few tokens.

Usage:
  python experiments/bench_spec.py --small --out /tmp/bench_spec.json
  python experiments/bench_spec.py --max_new_tokens 128 --spec 4 --out bench_spec.json

Output: one line per (workload, mode) and a JSON list of records {workload, mode, tokens, decode_tok_s,
speedup, acceptance_rate, tokens_per_window, window_ms, propose_ms, accepted_at, offered_at, same_output}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def make_file(n_methods: int) -> str:
    """A Python file of about ``6 * n_methods + 12`` lines with a ``compute_total`` method to rename."""
    lines = ['"""Inventory of a small shop."""', "", "import dataclasses", "", "",
             "@dataclasses.dataclass", "class Item:", "    name: str", "    price: float", "    count: int", "", "",
             "class Inventory:", "    def __init__(self):", "        self.items = {}", ""]
    names = ["add_item", "remove_item", "compute_total", "restock", "discount", "most_expensive", "cheapest",
             "count_items", "names", "find", "clear", "report", "value_of", "has_item", "rename_item", "merge"]
    for i in range(n_methods):
        nm = names[i % len(names)] + ("" if i < len(names) else f"_{i}")
        lines += [f"    def {nm}(self, key=None, amount={i + 1}):",
                  f'        """{nm.replace("_", " ").capitalize()} (amount {i + 1})."""',
                  "        total = 0",
                  "        for item in self.items.values():",
                  f"            total += item.price * item.count * amount  # {nm}",
                  "        return total", ""]
    return "\n".join(lines) + "\n"


def workloads(small: bool) -> dict[str, str]:
    src = make_file(3 if small else 13)
    return {
        "code": "Write a Python function that parses a CSV file into a list of dictionaries, with a docstring.",
        "rename": ("Rename the method `compute_total` to `total_value` in this file. Return the whole file, "
                   "otherwise unchanged, in one code block.\n\n```python\n" + src + "```"),
        "prose": "Write a short essay about the history of the printing press.",
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft_model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--max_new_tokens", type=int, default=128)
    ap.add_argument("--max_context", type=int, default=2048)
    ap.add_argument("--spec", type=int, default=4)
    ap.add_argument("--workloads", default="code,rename,prose")
    ap.add_argument("--modes", default="plain,lookup,model")
    ap.add_argument("--no_policy", action="store_true", help="always ask the proposer (no stepping aside)")
    ap.add_argument("--small", action="store_true", help="CPU smoke: SmolLM2-135M drafting for itself, 12 tokens")
    ap.add_argument("--out", default=None, help="write the records as JSON here")
    args = ap.parse_args(argv)
    if args.small:
        args.model, args.draft_model = "smollm2-135m", "smollm2-135m"
        args.max_new_tokens = min(args.max_new_tokens, 12)
        args.max_context = min(args.max_context, 512)

    from strata_jax.models_registry import resolve_model
    from strata_jax.pipeline.engine import Engine
    from strata_jax.pipeline.solo import generate
    from strata_jax.proposers import DraftModelProposer, LookupProposer, SpecPolicy
    from strata_jax.sampling import SamplingParams

    modes = args.modes.split(",")
    self_draft = args.draft_model == args.model
    target = Engine(resolve_model(args.model), max_context=args.max_context, n_slots=2 if self_draft else 1)
    draft = None
    if "model" in modes:
        if self_draft:
            draft = DraftModelProposer(target, target, slot=1, window=args.spec)
        else:
            draft = DraftModelProposer.load(resolve_model(args.draft_model), target, window=args.spec)
    tok = target.tokenizer
    greedy = SamplingParams()
    records = []
    for wname in args.workloads.split(","):
        text = workloads(args.small)[wname]
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True))
        # warm up every compiled shape on this prompt length so that timings exclude compiles
        generate(target, ids, max_new_tokens=2, sampling=greedy)
        plain = None
        for mode in modes:
            prop = {"plain": None, "lookup": LookupProposer(), "model": draft}[mode]
            if prop is not None:
                generate(target, ids, max_new_tokens=3, sampling=greedy, proposer=prop, spec=args.spec)
            t0 = time.perf_counter()
            g = generate(target, ids, max_new_tokens=args.max_new_tokens, sampling=greedy, eos_ids=tok.eos_ids,
                         proposer=prop, spec=args.spec if prop is not None else 0,
                         policy=None if (prop is None or args.no_policy) else SpecPolicy())
            wall = time.perf_counter() - t0
            st = g.stats
            if plain is None and mode == "plain":
                plain = g
            rec = {"workload": wname, "mode": mode, "model": args.model,
                   "draft_model": args.draft_model if mode == "model" else None, "spec": args.spec if prop else 1,
                   "prompt_tokens": len(ids), "tokens": st.generated, "wall_s": wall,
                   "decode_tok_s": st.decode_tok_s, "acceptance_rate": st.acceptance_rate,
                   "tokens_per_window": st.tokens_per_window, "window_ms": st.window_ms,
                   "propose_ms": st.propose_seconds * 1e3, "windows": st.windows, "spec_windows": st.spec_windows,
                   "stepped_aside": st.stepped_aside, "accepted_at": st.accepted_at, "offered_at": st.offered_at,
                   "compiles": st.compiles,
                   "same_output": None if plain is None else g.tokens == plain.tokens}
            rec["speedup"] = rec["decode_tok_s"] / plain.stats.decode_tok_s if plain is not None else None
            records.append(rec)
            print(f"{wname:7s} {mode:7s} {st.generated:4d} tok  {st.decode_tok_s:7.2f} tok/s  "
                  f"x{rec['speedup'] or 0:.2f}  accept {100 * st.acceptance_rate:5.1f}%  "
                  f"{st.tokens_per_window:.2f} tok/window  {st.window_ms:8.1f} ms/window  same={rec['same_output']}",
                  flush=True)
            if rec["same_output"] is False:
                print("error: speculative output differs from plain", file=sys.stderr)
                return 1
    if args.out:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
