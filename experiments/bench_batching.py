"""Batching benchmark (issue 7): every batch arm interleaved in one run, R repetitions, medians (not a test).

One command runs, for each workload and stream count, every arm once per repetition (rep 1: all arms, rep 2: all
arms, ...), after a warm-up pass that compiles every arm's window shapes, and writes ``bench_batching.json`` (every
run, calibration, summary, goals), ``bench_batching.md`` (tables, goals, how it was measured) and
``bench_batching.png`` (total tok/s per arm; skipped with a message when matplotlib is missing) to ``--out``.

Arms (the flags of `strata_jax.pipeline.groups.resolve_groups` they stand for; the engine has ``--slots`` slots,
default the largest stream count, so a run with fewer streams is a server with idle slots):
  pipelined     pipelined groups without proposals (``--batch_groups auto``: one group per stage; the default)
  serial        serial windows (``--batch_groups 1``)
  batch_mtp     serial batch MTP (``--batch_mtp``: each slot's token + 1 proposal, 4 slots per 8-row window)
  piped1..3     piped MTP with N = 1, 2, 3 proposals (``--piped_mtp N --batch_groups <slots>``: groups of one slot)
  piped_lookup  piped with prompt-lookup proposals (N = ``--piped_n``)
  piped_draft   piped with draft-model proposals (N = ``--piped_n``; model set a)
With one stream every arm is a lone slot (the scheduler's solo return); it is then also compared with the solo path
(`strata_jax.pipeline.solo.generate`) given the same proposals and window cap (``solo``, ``solo_<source><P>``).

Proposal sources of the MTP-named arms (batch_mtp, piped1..3): set b and tiny: "synthetic acceptance" (the replay
proposer below at a fixed rate per workload: prose 62%, code 88%, edit 97%); set a: the 0.5B draft model.

Model sets:
  a     Qwen2.5-Coder-1.5B split at layer 14 over 2 devices; prompt lookup and the Qwen2.5-Coder-0.5B draft model.
        ``--weights real`` (the cached files): proposals are made for real. ``--weights random`` (a GPU machine,
        where the 1 GB files cannot travel): both files are rebuilt from experiments/data/*.header with random
        blocks (same shapes, formats and bytes) and acceptance is replayed from ``--acceptance`` (recorded from the
        real weights with ``--record_acceptance``): "replayed acceptance". The real lookup / draft proposers still
        run beside the replay so their cost is in the timing.
  b     the full-size Qwen3.8-Flash-Next geometry (configs/geometries) with random 4-bit-class weights made on the
        devices, split at layer 24; MTP-style proposals at set rates: "synthetic acceptance". When the model has an
        MTP layer and the engine has ``enable_mtp``, the MTP chain runs after every window (its cost is timed; its
        drafts are replaced by the replayed ones); the JSON says whether it ran.
  tiny  the committed tiny qwen4exp fixture with a random MTP block appended (experiments/parity/add_mtp_block.py;
        ``--no_mtp``: without) on 2 CPU devices, a few tokens: a smoke run of the whole pipeline, MTP chain included
        (CPU; no performance claim).

Replayed acceptance (`ReplayProposer`): a first pass decodes every prompt once without proposals (exact: every
batch mode gives the solo tokens, tests/test_slots.py) and keeps the tokens as the reference. A proposal at output
position j offers the reference tokens after j; the first rejected one (and those after it) is replaced by
(reference + 1) % vocab, which the target's exact-match verify rejects. Acceptance draws are keyed by (request,
position, k) (numpy's SeedSequence), so every arm and repetition sees the same draws. The output never changes: the
target verifies every proposal.

Usage:
  # CPU smoke run of the whole pipeline (~30 min on the shared 2-core machine, mostly compiles)
  XLA_FLAGS=--xla_force_host_platform_device_count=2 python experiments/bench_batching.py --model_set tiny \\
      --streams 1,2 --tokens 8 --reps 2 --n_methods 4 --out /tmp/bb_tiny
  # record lookup / draft acceptance from the real 1.5B + 0.5B (CPU; numpy forward, see --record_backend)
  python experiments/bench_batching.py --model_set a --tokens 160 \\
      --record_acceptance experiments/data/acceptance_qwen2.5-coder.json
  # GPU, 2 devices: model set a (random blocks, replayed acceptance) and b (full-size, synthetic acceptance).
  # build/ is git-ignored: the compile cache and the JSON that --resume continues stay on a warm machine between
  # calls, so a run cut by --time_budget_s is finished by the next call.
  python3 experiments/bench_batching.py --model_set a --weights random \\
      --acceptance experiments/data/acceptance_qwen2.5-coder.json --compile_cache_dir build/jax_cache \\
      --time_budget_s 480 --resume --out build/bench_a; cp -r build/bench_a $OUT/
  python3 experiments/bench_batching.py --model_set b --compile_cache_dir build/jax_cache \\
      --time_budget_s 480 --resume --out build/bench_b; cp -r build/bench_b $OUT/

Timing: total output tok/s = tokens generated after each request's first token (which comes from its prefill),
summed over the streams, over the decode wall time (from the last admission to the last token; all requests arrive
at once, so admissions come first and are timed apart as ``prefill_s``). Per-stream tok/s = a request's tokens
after its first over its time from the last admission to its last token. Per-stage window times and each device's
idle fraction are estimated, not traced: every compiled call is counted during the timed runs (per stage, kind and
row layout), each such call is then timed alone on its stage with ``jax.block_until_ready`` (median of
``--calib_reps``; a window's commit on that stage included), and idle = 1 - sum(calls x time alone) / decode wall.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import os
import sys
import time
import zlib
from pathlib import Path
from typing import Any, Callable

import numpy as np

from strata_jax.proposers.base import Proposer

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "experiments" / "data"
HEADER_1P5B = DATA / "qwen2.5-coder-1.5b.header"
HEADER_0P5B = DATA / "qwen2.5-coder-0.5b.header"
TINY_MODEL = ROOT / "tests" / "fixtures" / "hybrid" / "qwen4exp_f32.gguf"

WORKLOADS = ("code", "edit", "prose")
ALL_ARMS = ("pipelined", "serial", "batch_mtp", "piped1", "piped2", "piped3", "piped_lookup", "piped_draft")
DEFAULT_RATES = {"prose": 0.62, "code": 0.88, "edit": 0.97}  # Strata issue #2973's MTP acceptance per workload
# goals at the largest stream count: best piped drafting arm / pipelined default, and / serial batch MTP
GOAL_VS_PIPELINED = {"code": 1.4, "edit": 1.3, "prose": 1.0}
GOAL_VS_BATCH_MTP = 1.2
GOAL_VS_SOLO = 1.0
MAX_PROPOSALS = 7  # a window holds the slot's token + at most 7 proposals


# ==== workloads ==========================================================================================================
CODE_TASKS = [
    ("lru_cache.py", "an LRU cache with a per-entry time-to-live, a maximum size in bytes, hit/miss statistics and "
                     "thread safety"),
    ("rate_limit.py", "a token-bucket rate limiter for an asyncio web client, with per-host buckets, bursts and a "
                      "context manager that waits for a token"),
    ("csv_schema.py", "a CSV loader that validates every row against a declarative schema (types, ranges, required "
                      "fields, regular expressions) and reports all errors with line numbers"),
    ("interval_tree.py", "an interval tree (augmented AVL tree) with insert, delete, point queries and overlap "
                         "queries, plus a pretty printer for debugging"),
]
STORY_TASKS = [
    "a lighthouse keeper on a remote island who finds a message in a bottle written in her own handwriting",
    "two rival bakers in a mountain village who must cooperate when a blizzard cuts the village off for a week",
    "a retired cartographer who discovers that one street on his old maps never existed, yet people live there",
    "a young engineer on a generation ship who learns that the ship arrived at its destination decades ago",
]
RENAMES = [("compute_total", "total_value"), ("restock_item", "replenish_item"), ("find_by_sku", "lookup_sku"),
           ("apply_discount", "discount_prices")]

_METHODS = [
    # (name, argument, docstring, body lines): the body uses `self._items`, `Item` fields and the argument
    ("add_item", "item", "Add ``item`` to the ledger, merging counts when the SKU is already present.",
     ["existing = self._items.get(item.sku)", "if existing is None:", "    self._items[item.sku] = item",
      "else:", "    existing.count += item.count", "self._log('add', item.sku, item.count)"]),
    ("remove_item", "sku", "Remove the item with this SKU; raise KeyError when it is unknown.",
     ["if sku not in self._items:", "    raise KeyError(f'unknown SKU {sku!r}')", "item = self._items.pop(sku)",
      "self._log('remove', sku, item.count)", "return item"]),
    ("find_by_sku", "sku", "The item with this SKU, or None.",
     ["item = self._items.get(sku)", "if item is None:", "    self._misses += 1", "return item"]),
    ("compute_total", "currency", "Value of the stock in ``currency`` (prices are kept in euros).",
     ["rate = self._rates.get(currency, 1.0)", "total = 0.0", "for item in self._items.values():",
      "    total += item.price * item.count", "return round(total * rate, 2)"]),
    ("restock_item", "sku", "Bring the item back to its reorder level; returns the number of units ordered.",
     ["item = self.find_by_sku(sku)", "if item is None:", "    return 0",
      "missing = max(item.reorder_level - item.count, 0)", "item.count += missing",
      "self._log('restock', sku, missing)", "return missing"]),
    ("apply_discount", "percent", "Lower every price by ``percent`` (0..100), never below the floor price.",
     ["if not 0 <= percent <= 100:", "    raise ValueError('percent must lie in 0..100')",
      "for item in self._items.values():", "    item.price = max(item.price * (1 - percent / 100), item.floor)",
      "self._log('discount', '*', percent)"]),
    ("most_expensive", "n", "The ``n`` most expensive items, most expensive first.",
     ["ranked = sorted(self._items.values(), key=lambda it: it.price, reverse=True)", "return ranked[:n]"]),
    ("cheapest", "n", "The ``n`` cheapest items, cheapest first.",
     ["ranked = sorted(self._items.values(), key=lambda it: it.price)", "return ranked[:n]"]),
    ("count_units", "category", "Units in stock in ``category`` (all categories when it is None).",
     ["return sum(it.count for it in self._items.values()", "           if category is None or it.category == category)"]),
    ("categories", "min_items", "Categories that hold at least ``min_items`` distinct items.",
     ["counts = {}", "for item in self._items.values():",
      "    counts[item.category] = counts.get(item.category, 0) + 1",
      "return sorted(c for c, n in counts.items() if n >= min_items)"]),
    ("below_reorder", "margin", "Items whose count is within ``margin`` units of their reorder level.",
     ["return [it for it in self._items.values() if it.count <= it.reorder_level + margin]"]),
    ("restock_all", "margin", "Restock every item close to its reorder level; returns units ordered per SKU.",
     ["ordered = {}", "for item in self.below_reorder(margin):", "    ordered[item.sku] = self.restock_item(item.sku)",
      "return ordered"]),
    ("price_report", "currency", "Lines of 'SKU name price' in ``currency``, sorted by SKU.",
     ["rate = self._rates.get(currency, 1.0)", "lines = []", "for sku in sorted(self._items):",
      "    item = self._items[sku]", "    lines.append(f'{sku:10s} {item.name:30s} {item.price * rate:10.2f}')",
      "return lines"]),
    ("value_by_category", "currency", "Stock value per category in ``currency``.",
     ["rate = self._rates.get(currency, 1.0)", "values = {}", "for item in self._items.values():",
      "    values[item.category] = values.get(item.category, 0.0) + item.price * item.count * rate",
      "return {c: round(v, 2) for c, v in values.items()}"]),
    ("share_of_total", "sku", "Share of the stock value held by one item (0..1).",
     ["total = self.compute_total('EUR')", "item = self.find_by_sku(sku)", "if item is None or total == 0:",
      "    return 0.0", "return item.price * item.count / total"]),
    ("set_rate", "currency", "Fetch and store the exchange rate of ``currency`` from the rate provider.",
     ["rate = self._provider(currency)", "if rate <= 0:", "    raise ValueError(f'bad rate {rate} for {currency}')",
      "self._rates[currency] = rate", "return rate"]),
    ("history", "sku", "Log entries that mention ``sku``, oldest first.",
     ["return [entry for entry in self._journal if entry[1] == sku]"]),
    ("undo_last", "sku", "Undo the last add or remove of ``sku``; returns True when something was undone.",
     ["for i in range(len(self._journal) - 1, -1, -1):", "    action, key, amount = self._journal[i]",
      "    if key == sku and action in ('add', 'remove'):", "        del self._journal[i]", "        return True",
      "return False"]),
    ("merge", "other", "Add every item of another ledger to this one.",
     ["for item in other._items.values():", "    self.add_item(dataclasses.replace(item))",
      "self._log('merge', '*', len(other._items))"]),
    ("split_category", "category", "A new ledger holding this category's items (removed from this one).",
     ["out = type(self)(self._provider)", "for sku in [s for s, it in self._items.items() if it.category == category]:",
      "    out.add_item(self.remove_item(sku))", "return out"]),
    ("rename_item", "sku", "Give the item a normalised display name (title case, single spaces).",
     ["item = self.find_by_sku(sku)", "if item is not None:", "    item.name = ' '.join(item.name.split()).title()",
      "return item"]),
    ("to_rows", "currency", "Rows for a spreadsheet: SKU, name, category, count, unit price, value.",
     ["rate = self._rates.get(currency, 1.0)", "rows = []", "for item in self._items.values():",
      "    value = item.price * item.count * rate",
      "    rows.append((item.sku, item.name, item.category, item.count, item.price * rate, value))",
      "return rows"]),
    ("from_rows", "rows", "Load items from spreadsheet rows (the format of ``to_rows``, prices in euros).",
     ["for sku, name, category, count, price, _value in rows:",
      "    self.add_item(Item(sku, name, category, int(count), float(price)))", "return len(self._items)"]),
    ("audit", "tolerance", "Check the ledger against the journal; returns the SKUs whose counts disagree.",
     ["expected = {}", "for action, sku, amount in self._journal:", "    if action in ('add', 'restock'):",
      "        expected[sku] = expected.get(sku, 0) + amount", "    elif action == 'remove':",
      "        expected[sku] = 0",
      "return sorted(s for s, it in self._items.items() if abs(expected.get(s, 0) - it.count) > tolerance)"]),
    ("oldest_entries", "n", "The ``n`` oldest journal entries as readable lines.",
     ["lines = []", "for action, sku, amount in self._journal[:n]:",
      "    lines.append(f'{action:8s} {sku:10s} {amount}')", "return lines"]),
    ("clear_journal", "keep", "Drop all but the last ``keep`` journal entries; returns how many were dropped.",
     ["dropped = max(len(self._journal) - keep, 0)", "if dropped:", "    del self._journal[:dropped]",
      "return dropped"]),
    ("reprice", "factors", "Multiply prices per category by ``factors`` (a dict); unknown categories keep theirs.",
     ["changed = 0", "for item in self._items.values():", "    factor = factors.get(item.category)",
      "    if factor is not None and factor > 0:", "        item.price = max(item.price * factor, item.floor)",
      "        changed += 1", "self._log('reprice', '*', changed)", "return changed"]),
    ("heaviest_categories", "n", "The ``n`` categories holding the most units, with their unit counts.",
     ["units = {}", "for item in self._items.values():",
      "    units[item.category] = units.get(item.category, 0) + item.count",
      "ranked = sorted(units.items(), key=lambda kv: kv[1], reverse=True)", "return ranked[:n]"]),
    ("check_floors", "strict", "Items priced at or below their floor price (below it only, when ``strict``).",
     ["out = []", "for item in self._items.values():",
      "    if item.price < item.floor or (not strict and item.price == item.floor):", "        out.append(item.sku)",
      "return sorted(out)"]),
    ("transfer", "other", "Move every item that ``other`` lacks into ``other``; returns the moved SKUs.",
     ["moved = []", "for sku in list(self._items):", "    if other.find_by_sku(sku) is None:",
      "        other.add_item(self.remove_item(sku))", "        moved.append(sku)", "return moved"]),
    ("snapshot", "currency", "A dict for JSON export: items, rates, total value in ``currency``.",
     ["return {", "    'items': [dataclasses.asdict(it) for it in self._items.values()],",
      "    'rates': dict(self._rates),", "    'total': self.compute_total(currency),",
      "    'misses': self._misses,", "}"]),
    ("restore", "snapshot", "Replace the ledger's items and rates with those of a ``snapshot``.",
     ["self._items = {d['sku']: Item(**d) for d in snapshot['items']}",
      "self._rates = dict(snapshot.get('rates', {'EUR': 1.0}))", "self._log('restore', '*', len(self._items))",
      "return len(self._items)"]),
    ("summary", "currency", "One line per category: items, units and value in ``currency``.",
     ["values = self.value_by_category(currency)", "lines = []", "for category in self.categories(1):",
      "    units = self.count_units(category)",
      "    lines.append(f'{category:15s} {units:6d} units {values.get(category, 0.0):12.2f} {currency}')",
      "lines.append(f'{\"total\":15s} {self.count_units(None):6d} units {self.compute_total(currency):12.2f}')",
      "return '\\n'.join(lines)"]),
]


def edit_source(n_methods: int = len(_METHODS)) -> str:
    """A deterministic Python module (an inventory ledger) of about ``85 * n_methods + 300`` tokens (~3K tokens for
    the default 33 methods with the Qwen2.5 tokenizer) in which every name of `RENAMES` is defined and used."""
    n = max(4, min(int(n_methods), len(_METHODS)))
    lines = ['"""Inventory ledger of a small warehouse: items, prices in euros, a journal of every change."""', "",
             "from __future__ import annotations", "", "import dataclasses", "from typing import Callable", "", "",
             "@dataclasses.dataclass", "class Item:", '    """One stock-keeping unit."""', "", "    sku: str",
             "    name: str", "    category: str", "    count: int", "    price: float", "    floor: float = 0.0",
             "    reorder_level: int = 10", "", "",
             "class WarehouseLedger:", '    """Items by SKU, exchange rates, and a journal of (action, sku, amount)."""',
             "", "    def __init__(self, provider: Callable[[str], float]):", "        self._items: dict[str, Item] = {}",
             "        self._rates: dict[str, float] = {'EUR': 1.0}", "        self._journal: list[tuple] = []",
             "        self._provider = provider", "        self._misses = 0", "",
             "    def _log(self, action: str, sku: str, amount) -> None:",
             "        self._journal.append((action, sku, amount))", ""]
    methods = _METHODS[:n]
    for name, arg, doc, body in methods:
        lines.append(f"    def {name}(self, {arg}):")
        lines.append(f'        """{doc}"""')
        lines += ["        " + b for b in body]
        lines.append("")
    lines += ["", "def demo() -> None:", '    """A short tour of the ledger."""',
              "    ledger = WarehouseLedger(lambda currency: {'USD': 1.08, 'GBP': 0.86}.get(currency, 1.0))",
              "    ledger.add_item(Item('A-100', 'steel bolts m8', 'hardware', 400, 0.12, 0.08, 100))",
              "    ledger.add_item(Item('B-200', 'oak plank 2m', 'timber', 12, 18.5, 12.0, 5))",
              "    ledger.add_item(Item('C-300', 'wood glue 500ml', 'adhesives', 3, 6.9, 4.0, 10))"]
    names = {m[0] for m in methods}
    for old, _new in RENAMES:
        if old in names:
            lines.append(f"    print('{old}:', ledger.{old}("
                         + {"compute_total": "'USD'", "restock_item": "'C-300'", "find_by_sku": "'B-200'",
                            "apply_discount": "10"}[old] + "))")
    lines += ["", "", "if __name__ == '__main__':", "    demo()", ""]
    return "\n".join(lines)


def prompt_texts(workload: str, n: int, n_methods: int = len(_METHODS)) -> list[str]:
    """The user messages of ``n`` distinct requests of a workload (``code``: write a new module; ``edit``: return the
    ledger module with one method renamed; ``prose``: a story)."""
    out = []
    for i in range(n):
        if workload == "code":
            fname, what = CODE_TASKS[i % len(CODE_TASKS)]
            out.append(f"Write a new Python module `{fname}` that implements {what}. Use type hints and docstrings, "
                       f"and end with a few pytest tests. Return only the code.")
        elif workload == "edit":
            old, new = RENAMES[i % len(RENAMES)]
            out.append(f"Rename the method `{old}` to `{new}` in this file, including every call. Return the whole "
                       f"file, otherwise unchanged, in one code block.\n\n```python\n{edit_source(n_methods)}```")
        elif workload == "prose":
            out.append(f"Write a story of about 700 words about {STORY_TASKS[i % len(STORY_TASKS)]}. Give it a "
                       f"title.")
        else:
            raise ValueError(f"unknown workload {workload!r}; known: {', '.join(WORKLOADS)}")
    return out


def encode_prompts(tokenizer, texts: list[str], vocab: int) -> list[list[int]]:
    """Token ids of each text: the chat template when the tokenizer has one; without a usable tokenizer (the tiny
    fixture's), the UTF-8 bytes modulo the vocabulary (a deterministic stand-in with the text's repetitions)."""
    out = []
    for t in texts:
        if tokenizer is None:
            out.append([b % vocab for b in t.encode("utf-8")])
            continue
        try:
            s = tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - no chat template
            s = t
        out.append([i for i in tokenizer.encode(s)])
    return out


def parse_tokens(spec: str) -> tuple[int, int]:
    """``"600"`` -> (600, 600); ``"300-900"`` -> (300, 900): generated tokens per request (see `tokens_for`)."""
    s = str(spec).strip()
    lo, _, hi = s.partition("-")
    lo, hi = int(lo), int(hi or lo)
    if not 1 <= lo <= hi:
        raise ValueError(f"--tokens {spec!r}: expected N or LO-HI with 1 <= LO <= HI")
    return lo, hi


def tokens_for(i: int, n: int, lo: int, hi: int) -> int:
    """Tokens of stream ``i`` of ``n``: spread evenly over lo..hi (one stream: the middle)."""
    if n <= 1:
        return (lo + hi) // 2
    return lo + (hi - lo) * i // (n - 1)


# ==== acceptance: fixed rates and recorded profiles ====================================================================
@dataclasses.dataclass(frozen=True)
class Acceptance:
    """How replayed proposals are offered and accepted.

    Either ``rate`` (a fixed rate: every window offers as many proposals as it has room for, and proposal k is
    accepted with probability ``rate`` given that proposals 1..k-1 were; with one proposal per window
    accepted / offered = rate), or a recorded profile: ``offered_at_least[k-1]`` = P(at least k proposals offered
    at a position) and ``accept_given[k-1]`` = P(proposal k accepted | proposals 1..k-1 accepted, k offered).

    Attributes:
      label: ``synthetic acceptance`` or ``replayed acceptance`` (printed in every table).
      seed: mixed into every draw.
    """

    rate: float | None = None
    offered_at_least: tuple = ()
    accept_given: tuple = ()
    label: str = "synthetic acceptance"
    seed: int = 7

    @classmethod
    def fixed(cls, rate: float, label: str = "synthetic acceptance") -> "Acceptance":
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"acceptance rate {rate} outside 0..1")
        return cls(rate=float(rate), label=label)

    @classmethod
    def from_profile(cls, prof: dict, label: str = "replayed acceptance") -> "Acceptance":
        return cls(offered_at_least=tuple(float(x) for x in prof["offered_at_least"]),
                   accept_given=tuple(float(x) for x in prof["accept_given"]), label=label)

    def decide(self, key: int, j: int, room: int) -> tuple[int, int]:
        """(offered, accepted) at output position ``j`` of request ``key`` with room for ``room`` proposals.

        The draws are ``default_rng([seed, key, j]).random(1 + room)``: u[0] picks the offered count, u[k] decides
        proposal k; the same (key, j) gives the same first draws whatever the room, so arms with different window
        caps see consistent acceptance."""
        if room <= 0:
            return 0, 0
        u = np.random.default_rng([self.seed, int(key) & 0xFFFFFFFF, int(j)]).random(1 + room)
        if self.rate is not None:
            offered, given = room, [self.rate] * room
        else:
            offered = sum(1 for q in self.offered_at_least[:room] if u[0] < q)
            given = list(self.accept_given[:room]) + [0.0] * room
        acc = 0
        while acc < offered and u[1 + acc] < given[acc]:
            acc += 1
        return offered, acc


def profile_from_positions(offered: list[int], accepted: list[int], max_k: int = MAX_PROPOSALS,
                           rooms: list[int] | None = None) -> dict:
    """A per-position acceptance profile from what a proposer offered / had accepted at every output position.

    Args:
      offered: o_j, proposals offered at position j (with room for ``max_k``).
      accepted: a_j <= o_j, the accepted prefix length at position j.
      rooms: the room at each position (near the end of a reference it is below ``max_k``); P(o >= k) counts only
        positions with room >= k, so the end of a recording does not pass for a proposer that offers less.

    Returns:
      {"offered_at_least": [P(o >= k)], "accept_given": [P(a >= k | o >= k, a >= k-1)], "positions": n,
       "offered": total, "accepted": total, "acceptance": accepted / offered, "mean_accepted": mean a_j} with lists of
      length ``max_k`` (k = 1..max_k; an empty condition gives 0).
    """
    o = np.asarray(offered, np.int64)
    a = np.asarray(accepted, np.int64)
    if o.shape != a.shape or np.any(a > o) or np.any(a < 0):
        raise ValueError("offered/accepted: same length, 0 <= accepted <= offered")
    n = len(o)
    r = np.full(n, max_k, np.int64) if rooms is None else np.asarray(rooms, np.int64)
    at_least, given = [], []
    for k in range(1, max_k + 1):
        at_least.append(float(np.mean(o[r >= k] >= k)) if np.any(r >= k) else 0.0)
        den = np.sum((o >= k) & (a >= k - 1))
        given.append(float(np.sum((o >= k) & (a >= k)) / den) if den else 0.0)
    return {"offered_at_least": at_least, "accept_given": given, "positions": int(n), "offered": int(o.sum()),
            "accepted": int(a.sum()), "acceptance": float(a.sum() / o.sum()) if o.sum() else 0.0,
            "mean_accepted": float(a.mean()) if n else 0.0}


# ==== the replay proposer ==============================================================================================
class ReplayBook:
    """Each request's reference continuation, found by its prompt (a proposer factory gets no request id).

    Args:
      vocab: the target's vocabulary size (a rejected proposal is (reference + 1) % vocab).
    """

    def __init__(self, vocab: int):
        self.vocab = int(vocab)
        self.entries: list[tuple[tuple, int, list]] = []  # (prompt, key, reference tokens)

    def add(self, prompt_ids, reference: list[int], name: str) -> None:
        """Register ``prompt_ids`` -> ``reference`` (the tokens plain decoding emits after it); ``name`` keys the
        acceptance draws (e.g. ``"edit/2"``)."""
        self.entries.append((tuple(int(t) for t in prompt_ids), zlib.crc32(name.encode()), list(reference)))

    def find(self, history) -> tuple[int, int, list] | None:
        """(prompt length, key, reference) of the longest registered prompt that starts ``history``; None if none."""
        best = None
        for prompt, key, ref in self.entries:
            n = len(prompt)
            if n < len(history) and (best is None or n > best[0]) and tuple(history[:n]) == prompt:
                best = (n, key, ref)
        return best


class ReplayProposer(Proposer):
    """Offers the reference continuation with a given acceptance (`Acceptance`); see the module doc.

    Args:
      book: the references (`ReplayBook`).
      acceptance: `Acceptance`.
      name: statistics name.
      cost: a real proposer run beside the replay (its proposals discarded) so that its cost is in the timing, e.g.
        the draft model on random weights; None for none.
      mtp_engine: an engine whose MTP chain runs; once `bind` gave the slot, that slot's drafts are read each window
        (the device read the real `MtpProposer` makes) and discarded.

    Attributes:
      offered, accepted_planned: proposals offered / planned to be accepted (the target's verify decides).
      diverged: windows in which the history had left the reference (0 unless exactness broke).
      mtp_reads: MTP drafts read from the device (0 when no chain runs or no slot was bound).
    """

    def __init__(self, book: ReplayBook, acceptance: Acceptance, name: str = "replay", cost=None, mtp_engine=None):
        super().__init__()
        self.book, self.acceptance, self.name = book, acceptance, name
        self.cost, self.mtp_engine = cost, mtp_engine
        self.slot = None
        self.offered = self.accepted_planned = self.diverged = self.mtp_reads = 0
        self._entry = None

    def reset(self) -> None:
        super().reset()
        self._entry = None
        if self.cost is not None:
            self.cost.reset()

    def bind(self, slot: int) -> None:
        """The request's slot (the batch scheduler and the solo loop call this where they have the hook)."""
        self.slot = int(slot)
        if self.cost is not None and hasattr(self.cost, "bind"):
            self.cost.bind(slot)

    def observe(self, kept_tokens) -> None:
        if self.cost is not None:
            self.cost.observe(kept_tokens)

    def propose(self, history_ids, max_n, min_p=0.0):
        """Up to ``max_n`` reference tokens after the history, the first rejected one and those after it altered."""
        self.last_probs = None
        h = list(history_ids)
        if self.cost is not None:
            self.cost.propose(h, max_n)  # timing only
        eng = self.mtp_engine
        if eng is not None and self.slot is not None and getattr(eng, "mtp", None) is not None:
            eng.mtp_proposal(self.slot)  # the device read MtpProposer makes; the drafts are not used
            self.mtp_reads += 1
        if self._entry is None:
            self._entry = self.book.find(h)
        if self._entry is None or max_n <= 0:
            return []
        n_prompt, key, ref = self._entry
        j = len(h) - n_prompt - 1  # output index of the window's row 0
        if not 0 <= j < len(ref) or h[-1] != ref[j]:
            self.diverged += 1
            return []
        room = min(int(max_n), len(ref) - 1 - j)
        o, a = self.acceptance.decide(key, j, room)
        props = list(ref[j + 1:j + 1 + o])
        for i in range(a, o):
            props[i] = (props[i] + 1) % self.book.vocab
        self.offered += o
        self.accepted_planned += a
        return props


def make_replay_proposer(book: ReplayBook, acceptance: Acceptance, name: str = "replay", cost=None,
                         mtp_engine=None) -> ReplayProposer:
    """A `ReplayProposer` (kept for callers that build proposers through a function)."""
    return ReplayProposer(book, acceptance, name, cost, mtp_engine)


# ==== arms ===============================================================================================================
@dataclasses.dataclass(frozen=True)
class Arm:
    """One benchmark arm.

    Attributes:
      name: arm name (`ALL_ARMS`, or ``solo`` / ``solo_<source><P>`` for the solo-path baselines).
      mode: the `resolve_groups` mode it must resolve to (``solo`` for the baselines).
      n_props: proposals per window (0: none).
      source: ``none``, ``rate`` (synthetic MTP), ``lookup`` or ``draft``.
    """

    name: str
    mode: str
    n_props: int = 0
    source: str = "none"

    def flags(self, n_slots: int) -> dict:
        """`resolve_groups` keyword arguments for this arm on ``n_slots`` slots."""
        if self.mode == "pipelined":
            return {}
        if self.mode == "serial":
            return dict(batch_groups=1, batch_groups_given=True)
        if self.mode == "batch_mtp":
            return dict(batch_mtp=True)
        if self.mode == "piped_mtp":
            return dict(batch_groups=n_slots, batch_groups_given=True, piped_mtp=self.n_props)
        raise ValueError(self.mode)


def make_arms(names: list[str], mtp_source: str, piped_n: int) -> list[Arm]:
    """Arms by name; the MTP-named ones (batch_mtp, piped1..3) draw from ``mtp_source``."""
    table = {"pipelined": Arm("pipelined", "pipelined"), "serial": Arm("serial", "serial"),
             "batch_mtp": Arm("batch_mtp", "batch_mtp", 1, mtp_source),
             "piped1": Arm("piped1", "piped_mtp", 1, mtp_source), "piped2": Arm("piped2", "piped_mtp", 2, mtp_source),
             "piped3": Arm("piped3", "piped_mtp", 3, mtp_source),
             "piped_lookup": Arm("piped_lookup", "piped_mtp", piped_n, "lookup"),
             "piped_draft": Arm("piped_draft", "piped_mtp", piped_n, "draft")}
    out = []
    for n in names:
        if n not in table:
            raise ValueError(f"unknown arm {n!r}; known: {', '.join(ALL_ARMS)}")
        out.append(table[n])
    return out


def solo_baseline(arm: Arm) -> Arm:
    """The solo-path arm a one-stream run of ``arm`` is compared with (same proposals, same window cap)."""
    if arm.n_props == 0:
        return Arm("solo", "solo")
    return Arm(f"solo_{arm.source}{arm.n_props}", "solo", arm.n_props, arm.source)


def is_drafting(name: str) -> bool:
    """Piped arms with proposals (the ones the goals ask about)."""
    return name.startswith("piped")


# ==== summary, goals, outputs (pure) ===================================================================================
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


# ==== engine-side helpers (JAX) ========================================================================================
class CallCounter:
    """Counts the compiled-function calls an engine makes, by compile-cache key (``(stage, kind, B, T, logits)``
    for stage functions, ``("mtp", ...)`` for the MTP chain), by wrapping ``engine.cache.get`` (one get per call)."""

    def __init__(self, engine):
        self.engine = engine
        self.counts: collections.Counter = collections.Counter()
        self.enabled = True
        orig = engine.cache.get

        def get(key, build, _orig=orig):
            if self.enabled:
                self.counts[key] += 1
            return _orig(key, build)

        engine.cache.get = get

    def take(self) -> dict:
        """The counts since the last take (and reset)."""
        c = dict(self.counts)
        self.counts.clear()
        return c


def set_mtp_chain(engine, n: int) -> int:
    """Run the model's MTP chain with ``n`` drafts after every window (0: off) through ``Engine.set_mtp_chain``;
    returns the chain length now running (0 when the engine or the model has none)."""
    if not hasattr(engine, "set_mtp_chain"):
        return 0
    return engine.set_mtp_chain(n)


def _greedy():
    from strata_jax.sampling import SamplingParams

    return SamplingParams(0.0)


def time_call_alone(engine, key: tuple, pos: int, reps: int) -> float:
    """Seconds of one call of compiled function ``key`` = (stage, kind, B, T, logits) alone on its stage (median of
    ``reps`` after one untimed call): the earlier stages run first (untimed) for a hidden of the right shape; a
    ``window``'s commit on the stage is included; everything the call wrote is waited for
    (``jax.block_until_ready``). Slots 0..B-1 at position ``pos`` are overwritten (callers re-read their prompts)."""
    import jax
    import jax.numpy as jnp

    from strata_jax.sampling import RowSampling
    from strata_jax.state import Rows

    k, kind, B, T, logits = key
    pos = max(0, min(int(pos), engine.max_context - T - 2))
    toks = np.ones((B, T), np.int32)
    rows = Rows.make(list(range(B)), [pos] * B, [T] * B)
    samp = RowSampling.make([_greedy()] * B)
    tok_d = jnp.asarray(toks)
    x = tok_d
    for i in range(k):
        out, _ = engine.run_stage(i, kind, x, rows, tok_d, samp, logits)
        x = out["hidden"]
    keep = np.full((B,), 1, np.int32)

    def once():
        out, pending = engine.run_stage(k, kind, x, rows, tok_d, samp, logits)
        if kind == "window" and pending is not None:
            engine.commit_stage(k, rows, pending, keep)
        jax.block_until_ready((out, engine.states[k], getattr(engine, "mtp_state", None)))

    once()
    ts = []
    for _ in range(max(1, reps)):
        t0 = time.perf_counter()
        once()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


# ==== numpy dense forward (recording acceptance on a CPU) ==============================================================
def _gguf_field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


class NumpyDense:
    """Greedy qwen2 forward in numpy float32 with a K/V cache, for recording acceptance from the real files on a CPU
    where the engine's XLA path is too slow (it dequantizes the blocks on every call: ~50 s per 1.5B step on the
    shared 2-core machine). Weights are dequantized once with ``gguf.quants.dequantize`` (which the engine's block
    formats equal bit for bit); the summation order differs from the engine's, so a near-tie argmax can differ.

    Args:
      path: a qwen2 GGUF file.
    """

    def __init__(self, path: str):
        import gguf

        r = gguf.GGUFReader(str(path))
        arch = _gguf_field(r, "general.architecture")
        if arch != "qwen2":
            raise ValueError(f"{path}: NumpyDense handles qwen2, not {arch!r}")
        a = lambda k, d=None: _gguf_field(r, f"qwen2.{k}", d)  # noqa: E731
        self.n_layer = int(a("block_count"))
        self.n_head, self.n_kv = int(a("attention.head_count")), int(a("attention.head_count_kv"))
        self.hidden = int(a("embedding_length"))
        self.hd = self.hidden // self.n_head
        self.eps = float(a("attention.layer_norm_rms_epsilon"))
        theta = float(a("rope.freq_base", 10000.0))
        self.inv_freq = theta ** (-np.arange(0, self.hd, 2, dtype=np.float64) / self.hd)
        self.W = {t.name: np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32))
                  for t in r.tensors}
        self.emb = self.W["token_embd.weight"]
        self.head = self.W.get("output.weight", self.emb)
        self.vocab = self.emb.shape[0]
        self.reset()

    def reset(self) -> None:
        self.k = [np.zeros((0, self.n_kv, self.hd), np.float32) for _ in range(self.n_layer)]
        self.v = [np.zeros((0, self.n_kv, self.hd), np.float32) for _ in range(self.n_layer)]

    def _norm(self, x, w):
        return (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * w).astype(np.float32)

    def _rope(self, x, pos):
        ang = np.outer(pos, self.inv_freq)  # [T, hd/2]
        cos = np.cos(np.concatenate([ang, ang], -1)).astype(np.float32)[:, None, :]
        sin = np.sin(np.concatenate([ang, ang], -1)).astype(np.float32)[:, None, :]
        h = self.hd // 2
        rot = np.concatenate([-x[..., h:], x[..., :h]], -1)
        return x * cos + rot * sin

    def forward(self, ids: list[int]) -> np.ndarray:
        """Read ``ids`` after the cached positions; returns the greedy pick after every one of them (int [T])."""
        W, T = self.W, len(ids)
        p0 = self.k[0].shape[0]
        pos = np.arange(p0, p0 + T)
        x = self.emb[np.asarray(ids)]
        g = self.n_head // self.n_kv
        mask = np.triu(np.full((T, p0 + T), -np.inf, np.float32), k=p0 + 1)
        for i in range(self.n_layer):
            b = f"blk.{i}."
            h = self._norm(x, W[b + "attn_norm.weight"])
            q = (h @ W[b + "attn_q.weight"].T + W[b + "attn_q.bias"]).reshape(T, self.n_head, self.hd)
            k = (h @ W[b + "attn_k.weight"].T + W[b + "attn_k.bias"]).reshape(T, self.n_kv, self.hd)
            v = (h @ W[b + "attn_v.weight"].T + W[b + "attn_v.bias"]).reshape(T, self.n_kv, self.hd)
            q, k = self._rope(q, pos), self._rope(k, pos)
            self.k[i] = np.concatenate([self.k[i], k])
            self.v[i] = np.concatenate([self.v[i], v])
            K = np.repeat(self.k[i], g, axis=1)  # [S, H, hd]
            V = np.repeat(self.v[i], g, axis=1)
            s = np.einsum("thd,shd->hts", q, K) / np.sqrt(self.hd) + mask
            s = np.exp(s - s.max(-1, keepdims=True))
            s /= s.sum(-1, keepdims=True)
            o = np.einsum("hts,shd->thd", s, V).reshape(T, -1)
            x = x + o @ W[b + "attn_output.weight"].T
            h = self._norm(x, W[b + "ffn_norm.weight"])
            gate = h @ W[b + "ffn_gate.weight"].T
            x = x + ((gate / (1 + np.exp(-gate))) * (h @ W[b + "ffn_up.weight"].T)) @ W[b + "ffn_down.weight"].T
        h = self._norm(x, W["output_norm.weight"])
        picks = np.empty(T, np.int64)
        for c in range(0, T, 256):
            picks[c:c + 256] = np.argmax(h[c:c + 256] @ self.head.T, axis=-1)
        return picks

    def greedy(self, prompt: list[int], n: int, stop_ids=(), lookup: bool = True) -> list[int]:
        """Greedy decoding: up to ``n`` tokens after ``prompt`` (a stop id ends it, included). With ``lookup``, each
        forward also verifies up to 7 prompt-lookup proposals (kept while they equal the picks; the cache is cut back
        to the kept rows), which gives the plain greedy tokens in fewer forwards where the output copies the
        prompt."""
        from strata_jax.proposers import LookupProposer

        self.reset()
        picks = []
        for c in range(0, len(prompt), 256):
            picks = self.forward(prompt[c:c + 256])
        out = [int(picks[-1])]
        hist = list(prompt) + out
        lp = LookupProposer()
        while len(out) < n and out[-1] not in stop_ids:
            props = lp.propose(hist, min(MAX_PROPOSALS, n - len(out) - 1)) if lookup else []
            p0 = self.k[0].shape[0]
            picks = self.forward([out[-1]] + list(props))
            keep = 1
            while keep <= len(props) and props[keep - 1] == picks[keep - 1]:
                keep += 1
            self.k = [k[:p0 + keep] for k in self.k]
            self.v = [v[:p0 + keep] for v in self.v]
            for t in list(props[:keep - 1]) + [int(picks[keep - 1])]:
                out.append(int(t))
                hist.append(int(t))
                if out[-1] in stop_ids or len(out) >= n:
                    break
        return out

    def teacher_picks(self, ids: list[int]) -> np.ndarray:
        """The greedy pick after every position of ``ids`` (one pass, chunks of 256 rows)."""
        self.reset()
        return np.concatenate([self.forward(ids[c:c + 256]) for c in range(0, len(ids), 256)])


def lookup_positions(prompt: list[int], ref: list[int], max_k: int = MAX_PROPOSALS) -> tuple[list, list]:
    """Prompt lookup at every output position j of a reference decode: (offered o_j, accepted prefix a_j) with room
    for ``max_k`` proposals (lookup proposes what it would in the real run: the history is the same)."""
    from strata_jax.proposers import LookupProposer

    lp = LookupProposer()
    hist = list(prompt)
    off, acc = [], []
    for j in range(len(ref) - 1):
        hist.append(ref[j])
        room = min(max_k, len(ref) - 1 - j)
        props = lp.propose(hist, room)
        a = 0
        while a < len(props) and props[a] == ref[j + 1 + a]:
            a += 1
        off.append(len(props))
        acc.append(a)
    return off, acc


def draft_positions(picks_after: np.ndarray, prompt_len: int, ref: list[int],
                    max_k: int = MAX_PROPOSALS) -> tuple[list, list]:
    """Greedy draft-model proposals at every output position j, from the draft's teacher-forced picks over
    prompt + reference (``picks_after[i]`` = its greedy pick after position i). A greedy chain that matches the
    reference for k tokens is exactly the teacher-forced picks at j, j+1, ..., so a_j = the run of positions from j
    where the pick equals the next reference token; the draft always offers its room."""
    ok = [int(picks_after[prompt_len + j]) == ref[j + 1] for j in range(len(ref) - 1)]
    off, acc = [], []
    run = 0
    runs = [0] * len(ok)
    for j in range(len(ok) - 1, -1, -1):
        run = run + 1 if ok[j] else 0
        runs[j] = run
    for j in range(len(ok)):
        room = min(max_k, len(ref) - 1 - j)
        off.append(room)
        acc.append(min(runs[j], room))
    return off, acc


def record_acceptance(args) -> int:
    """``--record_acceptance PATH``: reference decodes of the real Qwen2.5-Coder-1.5B, then what prompt lookup and
    the 0.5B draft model would offer / have accepted at every output position; writes per-workload profiles
    (`profile_from_positions`) and the raw positions as JSON."""
    from strata_jax.gguf import open_gguf
    from strata_jax.models_registry import resolve_model
    from strata_jax.tokenizer import Tokenizer

    t_all = time.perf_counter()
    target_path = str(resolve_model(args.target_model))
    draft_path = str(resolve_model(args.draft_model))
    tok = Tokenizer.from_gguf(open_gguf(target_path))
    stop = tuple(sorted(tok.eos_ids))
    lo, hi = parse_tokens(args.tokens)
    works = args.workloads.split(",")
    prompts = {w: encode_prompts(tok, prompt_texts(w, args.record_streams, args.n_methods), tok.vocab_size)
               for w in works}
    out = {"what": "prompt-lookup and draft-model acceptance per output position, from the real weights",
           "target_model": args.target_model, "draft_model": args.draft_model, "tokens": hi,
           "backend": args.record_backend, "max_k": MAX_PROPOSALS, "workloads": {}}
    refs: dict[str, list] = {}
    partial = Path(str(args.record_acceptance) + ".partial")  # references so far: a killed run starts from here
    if partial.exists():
        got = json.loads(partial.read_text())
        if got.get("tokens") == hi and got.get("target_model") == args.target_model:
            refs.update(got["refs"])
            print(f"  {len(refs)} reference(s) kept from {partial}", flush=True)
    print(f"recording: target {target_path} ({args.record_backend}), {hi} tokens per request", flush=True)
    todo = [(w, i, p) for w in works for i, p in enumerate(prompts[w]) if f"{w}/{i}" not in refs]
    if args.record_backend == "numpy":
        if todo:
            t0 = time.perf_counter()
            m = NumpyDense(target_path)
            print(f"  target dequantized in {time.perf_counter() - t0:.0f} s", flush=True)
            for w, i, p in todo:
                t0 = time.perf_counter()
                refs[f"{w}/{i}"] = m.greedy(p, hi, stop)
                print(f"  {w}/{i}: {len(p)} prompt tokens, {len(refs[f'{w}/{i}'])} generated in "
                      f"{time.perf_counter() - t0:.0f} s", flush=True)
                partial.write_text(json.dumps({"tokens": hi, "target_model": args.target_model, "refs": refs}))
            del m
        d = NumpyDense(draft_path)
        teach = lambda ids: d.teacher_picks(ids)  # noqa: E731
    else:
        from strata_jax.pipeline.engine import Engine
        from strata_jax.pipeline.solo import generate
        from strata_jax.proposers import LookupProposer
        from strata_jax.sampling import RowSampling
        from strata_jax.state import Rows

        ctx = max(len(p) for ps in prompts.values() for p in ps) + hi + 16
        eng = Engine(target_path, max_context=ctx)
        for w, i, p in todo:
            g = generate(eng, p, max_new_tokens=hi, sampling=_greedy(), eos_ids=stop, proposer=LookupProposer(),
                         spec=8)  # exact: the plain tokens, faster where lookup pays
            refs[f"{w}/{i}"] = g.tokens
            print(f"  {w}/{i}: {len(p)} prompt tokens, {len(g.tokens)} generated", flush=True)
        del eng
        deng = Engine(draft_path, max_context=ctx)

        def teach(ids):
            deng.reset_slot(0)
            picks = []
            for c in range(0, len(ids), 128):
                chunk = ids[c:c + 128]
                toks = np.zeros((1, 128), np.int32)
                toks[0, :len(chunk)] = chunk
                o, _ = deng.run("prefill", toks, Rows.make([0], [c], [len(chunk)]), RowSampling.make([_greedy()]),
                                logits="all")
                picks.append(np.asarray(o["picks"])[0, :len(chunk)])
            return np.concatenate(picks)
    for w in works:
        lo_o, lo_a, dr_o, dr_a, rooms = [], [], [], [], []
        raw = {}
        for i, p in enumerate(prompts[w]):
            ref = refs[f"{w}/{i}"]
            o1, a1 = lookup_positions(p, ref)
            picks = teach(list(p) + list(ref))
            o2, a2 = draft_positions(picks, len(p), ref)
            lo_o += o1
            lo_a += a1
            dr_o += o2
            dr_a += a2
            rooms += [min(MAX_PROPOSALS, len(ref) - 1 - j) for j in range(len(ref) - 1)]
            raw[str(i)] = {"prompt_tokens": len(p), "generated": len(ref), "lookup_offered": o1,
                           "lookup_accepted": a1, "draft_offered": o2, "draft_accepted": a2}
        out["workloads"][w] = {"lookup": profile_from_positions(lo_o, lo_a, rooms=rooms),
                               "draft": profile_from_positions(dr_o, dr_a, rooms=rooms), "requests": raw}
        lk, dr = out["workloads"][w]["lookup"], out["workloads"][w]["draft"]
        print(f"  {w}: lookup offers at {100 * lk['offered_at_least'][0]:.0f}% of positions, accepted "
              f"{100 * lk['acceptance']:.0f}%; draft accepted {100 * dr['acceptance']:.0f}% "
              f"(first proposal {100 * dr['accept_given'][0]:.0f}%)", flush=True)
    out["seconds"] = time.perf_counter() - t_all
    out["references"] = refs
    Path(args.record_acceptance).parent.mkdir(parents=True, exist_ok=True)
    with open(args.record_acceptance, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.record_acceptance}")
    return 0


# ==== the benchmark ====================================================================================================
@dataclasses.dataclass
class Setup:
    """What a model set resolved to."""

    engine: Any
    draft_engine: Any
    tokenizer: Any
    model: str
    weights: str
    split: str
    arms: list
    mtp_source: str
    sources: dict          # workload -> source -> Acceptance or "real"
    stop_ids: tuple
    smoke: bool
    notes: list


def _build(args) -> Setup:
    import jax

    from strata_jax.pipeline.engine import Engine

    notes = []
    lo, hi = parse_tokens(args.tokens)
    rates = dict(DEFAULT_RATES)
    for kv in filter(None, (args.rates or "").split(",")):
        k, _, v = kv.partition("=")
        rates[k.strip()] = float(v)
    slots = args.slots or max(2, max(int(s) for s in args.streams.split(",")))
    if args.model_set == "tiny":
        split = args.layer_split or "2"
        model, weights = str(TINY_MODEL.relative_to(ROOT)), "real (tiny random fixture)"
        src = str(TINY_MODEL)
        if not args.no_mtp:  # append a random MTP block so that the MTP chain runs as on model set b
            import importlib.util
            import tempfile

            spec = importlib.util.spec_from_file_location("add_mtp_block",
                                                          ROOT / "experiments" / "parity" / "add_mtp_block.py")
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            src = mod.add_mtp_block(src, str(Path(tempfile.gettempdir()) / "bench_batching_tiny_mtp.gguf"), seed=1)
            model += " + a random MTP block (experiments/parity/add_mtp_block.py)"
        names = args.arms.split(",") if args.arms else [a for a in ALL_ARMS if a != "piped_draft"]
        mtp_source, smoke = "rate", True
    elif args.model_set == "a":
        split = args.layer_split or "14"
        names = args.arms.split(",") if args.arms else [a for a in ALL_ARMS if a != "piped_draft"]
        mtp_source, smoke = "draft", False
        notes.append("batch_mtp and piped1..3 draw from the 0.5B draft model on this model set (it has no MTP layer);"
                     " piped_draft would repeat piped3")
    elif args.model_set == "b":
        split = args.layer_split or "24"
        model, weights = args.geometry, "random 4-bit-class blocks made on the devices"
        names = args.arms.split(",") if args.arms else [a for a in ALL_ARMS if a not in ("piped_lookup", "piped_draft")]
        mtp_source, smoke = "rate", False
    else:
        raise SystemExit(f"--model_set {args.model_set!r}: expected a, b or tiny")
    n_stages = len([c for c in split.split(",") if c.strip()]) + 1
    devs = jax.devices()[:n_stages]
    if len(devs) < n_stages:
        raise SystemExit(f"--layer_split {split} needs {n_stages} devices; {len(jax.devices())} visible "
                         f"(on a CPU: XLA_FLAGS=--xla_force_host_platform_device_count={n_stages})")
    arms = make_arms(names, mtp_source, args.piped_n)
    tokenizer, draft_engine = None, None
    if args.model_set == "a":
        from strata_jax.models_registry import resolve_model

        want_random = args.weights == "random"
        if not want_random:
            try:
                src, dsrc = str(resolve_model(args.target_model)), str(resolve_model(args.draft_model))
            except Exception as e:  # noqa: BLE001
                raise SystemExit(f"--weights real: {e} (use --weights random with --acceptance on a machine without "
                                 f"the files)")
            weights = "real"
        else:
            import random_gguf

            src, dsrc = "/tmp/bench_batching_1p5b.gguf", "/tmp/bench_batching_0p5b.gguf"
            t0 = time.perf_counter()

            def fill(header: Path, dst: str) -> None:  # once per machine: a marker says the file is complete
                if not header.exists():
                    raise SystemExit(f"{header} is missing (python experiments/random_gguf.py header <file.gguf> "
                                     f"{header})")
                if not os.path.exists(dst + ".done"):
                    random_gguf.fill(str(header), dst)
                    Path(dst + ".done").write_text("filled\n")

            fill(HEADER_1P5B, src)
            if any(a.source == "draft" for a in arms):
                fill(HEADER_0P5B, dsrc)
            weights = f"random blocks from experiments/data/*.header ({time.perf_counter() - t0:.0f} s to write)"
        model = f"{args.target_model} (draft {args.draft_model})"
    elif args.model_set == "b":
        from strata_jax.models.random_weights import VirtualGGUF, load_geometry
        import inspect

        kw = {"mtp": True} if "mtp" in inspect.signature(VirtualGGUF.__init__).parameters and not args.no_mtp else {}
        src = VirtualGGUF(load_geometry(args.geometry), n_layer=args.n_layer, **kw)
        if not kw:
            notes.append("no MTP block in the random model (--no_mtp, or VirtualGGUF has no mtp option here): the MTP "
                         "chain does not run")
    # the prompts decide the context
    from strata_jax.gguf import open_gguf
    from strata_jax.tokenizer import Tokenizer

    if args.model_set == "a":
        tokenizer = Tokenizer.from_gguf(open_gguf(src))
    elif args.model_set == "b":
        tokenizer = Tokenizer.from_gguf(open_gguf(str(HEADER_1P5B), header_only=True))
        notes.append("prompts tokenized with the Qwen2.5 tokenizer of experiments/data/qwen2.5-coder-1.5b.header "
                     "(the full-size model's own tokenizer is not available; ids < 151936 < its vocabulary)")
    t0 = time.perf_counter()
    eng_kw = dict(n_slots=slots, layer_split=split, devices=devs, compile_cache_size=96)
    # context: longest prompt + most tokens + room for a window
    max_prompt = 0
    for w in args.workloads.split(","):
        texts = prompt_texts(w, slots, args.n_methods)
        if tokenizer is not None:
            ids = encode_prompts(tokenizer, texts, tokenizer.vocab_size)
        else:
            ids = [t.encode() for t in texts]
        max_prompt = max(max_prompt, max(len(x) for x in ids))
    ctx_need = max_prompt + hi + 2 * MAX_PROPOSALS + 4
    ctx = args.max_context or int(math.ceil(ctx_need / 256) * 256)
    engine = Engine(src, max_context=ctx, **eng_kw)
    jax.block_until_ready([s.params for s in engine.stages])
    notes.append(f"engine built in {time.perf_counter() - t0:.0f} s; max_context {ctx}")
    if args.model_set == "a" and any(a.source == "draft" for a in arms):
        draft_engine = Engine(dsrc, max_context=ctx, n_slots=slots, devices=[devs[-1]], compile_cache_size=64)
        if weights == "real":
            from strata_jax.proposers import check_same_tokenizer

            check_same_tokenizer(engine, draft_engine)
        notes.append(f"draft model on {devs[-1]} (the last stage's device), one draft slot per target slot")
    acc = _load_acceptance(args, weights, rates, notes)
    sources = {}
    for w in args.workloads.split(","):
        s = {"rate": Acceptance.fixed(rates[w])}
        for kind in ("lookup", "draft"):
            if args.model_set == "a" and weights == "real" and acc is None:
                s[kind] = "real"
            elif acc is not None and w in acc["workloads"]:
                s[kind] = Acceptance.from_profile(acc["workloads"][w][kind])
            elif args.model_set == "tiny" and kind == "lookup":
                s[kind] = "real"
            else:
                s[kind] = None
        sources[w] = s
    keep = []
    for a in arms:
        if a.source in ("lookup", "draft") and any(sources[w][a.source] is None for w in sources):
            notes.append(f"arm {a.name} left out: no {a.source} acceptance for this model set (give --acceptance, or "
                         f"real weights)")
            continue
        if a.source == "draft" and draft_engine is None:
            notes.append(f"arm {a.name} left out: no draft model on this model set")
            continue
        keep.append(a)
    if args.model_set == "tiny":
        try:
            tokenizer = engine.tokenizer
            tokenizer.encode("x")
        except Exception:  # noqa: BLE001
            tokenizer = None
            notes.append("the tiny fixture's tokenizer does not load: prompts are their UTF-8 bytes as token ids")
    stop = () if args.model_set in ("b", "tiny") or weights != "real" else tuple(sorted(tokenizer.eos_ids))
    if not stop:
        notes.append("no stop ids: every request generates exactly its token count (random weights)")
    return Setup(engine, draft_engine, tokenizer, model, weights, split, keep, mtp_source, sources, stop, smoke, notes)


def _load_acceptance(args, weights: str, rates: dict, notes: list):
    if args.acceptance:
        with open(args.acceptance) as f:
            acc = json.load(f)
        notes.append(f"lookup / draft acceptance replayed from {args.acceptance} (recorded from {acc.get('target_model')}"
                     f" + {acc.get('draft_model')}, {acc.get('tokens')} tokens per request, backend "
                     f"{acc.get('backend')})")
        return acc
    if args.model_set == "a" and weights != "real":
        raise SystemExit("--weights random needs --acceptance PATH (record it with --record_acceptance on a machine "
                         "with the real files)")
    return None


def _factory(setup: Setup, arm: Arm, workload: str, book: ReplayBook, chain: int) -> tuple[Callable | None, str]:
    """``() -> Proposer`` for an arm (None for arms without proposals) and its acceptance label."""
    if arm.n_props == 0:
        return None, ""
    src = setup.sources[workload][arm.source]
    eng, deng = setup.engine, setup.draft_engine
    slot = [0]

    def draft_cost():
        from strata_jax.proposers import DraftModelProposer

        s = slot[0] % deng.n_slots
        slot[0] += 1
        return DraftModelProposer(deng, None, slot=s, window=arm.n_props + 1)

    if src == "real":
        if arm.source == "lookup":
            from strata_jax.proposers import LookupProposer

            return LookupProposer, "real acceptance"
        return draft_cost, "real acceptance"
    if arm.source == "rate":
        mtp_eng = eng if chain else None
        return (lambda: make_replay_proposer(book, src, "mtp-synthetic", mtp_engine=mtp_eng)), src.label
    if arm.source == "lookup":
        from strata_jax.proposers import LookupProposer

        return (lambda: make_replay_proposer(book, src, "lookup-replay", cost=LookupProposer())), src.label
    return (lambda: make_replay_proposer(book, src, "draft-replay", cost=draft_cost())), src.label


def _requests(prompts: list[list[int]], n: int, lo: int, hi: int, stop: tuple, workload: str):
    from strata_jax.pipeline.scheduler import Request

    return [Request(list(prompts[i]), max_new_tokens=tokens_for(i, n, lo, hi), sampling=_greedy(), stop_ids=stop,
                    rid=f"{workload}/{i}") for i in range(n)]


def _compiles(setup: Setup) -> int:
    return setup.engine.cache.compiles + (setup.draft_engine.cache.compiles if setup.draft_engine else 0)


def run_batch(setup: Setup, arm: Arm, reqs: list, factory, refs: dict | None) -> dict:
    """One scheduler run of ``reqs`` in ``arm``'s mode; returns its record (times in seconds)."""
    import jax

    from strata_jax.pipeline.groups import resolve_groups
    from strata_jax.pipeline.scheduler import BatchScheduler

    eng = setup.engine
    res = resolve_groups(eng.n_slots, len(eng.stages), **arm.flags(eng.n_slots))
    if res.mode != arm.mode:
        raise SystemExit(f"arm {arm.name}: resolves to {res.mode} ({res.message})")
    c0 = _compiles(setup)
    kw = {"proposer_factory": factory} if factory is not None else {}
    sch = BatchScheduler(eng, res, **kw)
    t0 = time.perf_counter()
    results = sch.run(reqs)
    jax.block_until_ready(eng.states)
    wall = time.perf_counter() - t0
    t_dec = max(r.first_token_s for r in results)
    end = max(r.finished_s for r in results)
    dec = max(end - t_dec, 1e-9)
    per = [(len(r.tokens) - 1) / max(r.finished_s - t_dec, 1e-9) for r in results]
    rec = {"mode": res.mode, "resolution": res.message, "wall_s": wall, "prefill_s": t_dec, "decode_s": dec,
           "tokens": [len(r.tokens) for r in results], "total_tok_s": sum(len(r.tokens) - 1 for r in results) / dec,
           "per_stream_tok_s": float(np.median(per)), "per_stream": per,
           "windows": sch.stats["windows"], "solo_windows": sch.stats["solo_windows"],
           "windows_per_slot": float(np.mean([r.windows for r in results])),
           "proposed": sum(r.proposed for r in results), "accepted": sum(r.accepted for r in results),
           "stop": [r.stop_reason for r in results], "compiles": _compiles(setup) - c0}
    if refs is not None:
        rec["exact"] = all(r.tokens == refs[r.rid][:len(r.tokens)] for r in results)
    return rec


def run_solo(setup: Setup, arm: Arm, req, factory, refs: dict | None) -> dict:
    """The solo path (`strata_jax.pipeline.solo.generate`, slot 0) with ``arm``'s proposals and window cap."""
    from strata_jax.pipeline.solo import generate

    c0 = _compiles(setup)
    prop = factory() if factory is not None else None
    g = generate(setup.engine, list(req.prompt_ids), max_new_tokens=req.max_new_tokens, sampling=req.sampling,
                 eos_ids=req.stop_ids, slot=0, proposer=prop, spec=arm.n_props + 1 if prop is not None else 0)
    st = g.stats
    n = max(st.generated - 1, 0)
    rec = {"mode": "solo", "resolution": "solo path", "wall_s": st.prefill_seconds + st.decode_seconds,
           "prefill_s": st.prefill_seconds, "decode_s": st.decode_seconds, "tokens": [st.generated],
           "total_tok_s": n / st.decode_seconds if st.decode_seconds > 0 else 0.0,
           "per_stream_tok_s": n / st.decode_seconds if st.decode_seconds > 0 else 0.0,
           "windows": st.windows, "solo_windows": st.windows, "windows_per_slot": float(st.windows),
           "proposed": st.proposed, "accepted": st.accepted, "stop": [st.stop_reason],
           "compiles": _compiles(setup) - c0}
    if refs is not None:
        rec["exact"] = g.tokens == refs[req.rid][:len(g.tokens)]
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model_set", default="tiny", choices=("a", "b", "tiny"))
    ap.add_argument("--streams", default="1,2,4", help="concurrent requests per run, comma-separated")
    ap.add_argument("--workloads", default="code,edit,prose")
    ap.add_argument("--tokens", default="600", help="generated tokens per request: N, or LO-HI spread over streams")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--arms", default=None, help=f"comma-separated, of {', '.join(ALL_ARMS)} (default: the set's)")
    ap.add_argument("--layer_split", default=None, help="default: a 14, b 24, tiny 2")
    ap.add_argument("--slots", type=int, default=0, help="engine slots (default: the largest stream count)")
    ap.add_argument("--piped_n", type=int, default=3, help="proposals per window of piped_lookup / piped_draft")
    ap.add_argument("--rates", default="", help="synthetic acceptance per workload, e.g. prose=0.62,code=0.88")
    ap.add_argument("--out", default=None, help="output folder (bench_batching.json/.md/.png)")
    ap.add_argument("--acceptance", default=None, help="replay lookup / draft acceptance from this JSON")
    ap.add_argument("--record_acceptance", default=None, help="record acceptance from the real weights to this JSON")
    ap.add_argument("--record_backend", default="numpy", choices=("numpy", "engine"))
    ap.add_argument("--record_streams", type=int, default=1, help="requests per workload to record")
    ap.add_argument("--weights", default="real", choices=("real", "random"), help="model set a")
    ap.add_argument("--target_model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft_model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--geometry", default="qwen3.8-flash-next", help="model set b")
    ap.add_argument("--n_layer", type=int, default=None, help="model set b: fewer layers (same shapes)")
    ap.add_argument("--n_methods", type=int, default=len(_METHODS), help="methods in the edit file (33: ~3K tokens)")
    ap.add_argument("--max_context", type=int, default=0)
    ap.add_argument("--warmup_tokens", type=int, default=6)
    ap.add_argument("--calib_reps", type=int, default=5)
    ap.add_argument("--no_solo", action="store_true", help="skip the solo-path baselines at one stream")
    ap.add_argument("--no_mtp", action="store_true", help="sets b and tiny: no MTP block, so no MTP chain runs")
    ap.add_argument("--dry_run", action="store_true", help="build the engines and prompts, print the plan, stop")
    ap.add_argument("--compile_cache_dir", default=None, help="JAX persistent compilation cache (kept across runs)")
    ap.add_argument("--time_budget_s", type=float, default=0, help="start no new timed run after this (0: none)")
    ap.add_argument("--resume", action="store_true",
                    help="keep the timed runs and references already in --out/bench_batching.json (same model set "
                         "and tokens) and run only the missing ones")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    if args.record_acceptance:
        return record_acceptance(args)
    t_start = time.perf_counter()
    import jax

    if args.compile_cache_dir:
        jax.config.update("jax_compilation_cache_dir", args.compile_cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    setup = _build(args)
    eng = setup.engine
    counter = CallCounter(eng)
    dcounter = CallCounter(setup.draft_engine) if setup.draft_engine is not None else None
    streams = sorted(int(s) for s in args.streams.split(","))
    if max(streams) > eng.n_slots:
        raise SystemExit(f"--streams {args.streams}: more streams than --slots {eng.n_slots}")
    works = args.workloads.split(",")
    lo, hi = parse_tokens(args.tokens)
    V = eng.cfg.vocab_size
    tok_vocab = setup.tokenizer.vocab_size if setup.tokenizer is not None else V
    prompts = {w: encode_prompts(setup.tokenizer, prompt_texts(w, eng.n_slots, args.n_methods), min(V, tok_vocab))
               for w in works}
    out_dir = Path(args.out) if args.out else None
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"model_set": args.model_set, "model": setup.model, "weights": setup.weights, "smoke": setup.smoke,
            "command": "python " + " ".join([os.path.relpath(__file__, ROOT)]
                                            + (sys.argv[1:] if argv is None else list(argv))),
            "devices": [str(s.device) for s in eng.stages], "jax": jax.__version__, "backend": jax.default_backend(),
            "layer_split": setup.split, "stages": len(eng.stages), "slots": eng.n_slots, "tokens": args.tokens,
            "reps": args.reps, "streams": streams, "arms": [a.name for a in setup.arms],
            "prompt_tokens": {w: [len(p) for p in prompts[w]] for w in works}, "notes": setup.notes}
    has_mtp = hasattr(eng, "enable_mtp") and int(getattr(eng.cfg, "n_nextn", 0) or 0) > 0
    meta["mtp_chain_available"] = bool(has_mtp)
    meta["mtp_note"] = ("runs after every window of the MTP-named arms (N drafts), off in the others" if has_mtp else
                        "not run (" + ("the model has no MTP layer" if hasattr(eng, "enable_mtp") else
                                       "this engine has no enable_mtp") + ")")
    print(f"model set {args.model_set}: {setup.model}, {len(eng.stages)} stages, {eng.n_slots} slots, "
          f"arms {', '.join(a.name for a in setup.arms)}", flush=True)
    for n in setup.notes:
        print("  " + n, flush=True)
    if args.dry_run:
        print(json.dumps({k: meta[k] for k in ("model", "weights", "devices", "layer_split", "slots", "arms",
                                                "prompt_tokens", "mtp_note")}, indent=1))
        print(f"max_context {eng.max_context}; per run: streams {streams}, workloads {works}, tokens {args.tokens}; "
              f"{len(setup.arms)} arms (+ solo baselines at one stream) x {args.reps} repetitions")
        return 0
    records: list[dict] = []
    prev_refs: dict[str, list] = {}
    if args.resume and out_dir and (out_dir / "bench_batching.json").exists():
        prev = json.loads((out_dir / "bench_batching.json").read_text())
        pm = prev.get("meta", {})
        if (pm.get("model_set"), pm.get("tokens"), pm.get("slots")) != (args.model_set, args.tokens, eng.n_slots):
            raise SystemExit(f"--resume: {out_dir}/bench_batching.json is for model set {pm.get('model_set')}, "
                             f"tokens {pm.get('tokens')}, {pm.get('slots')} slots")
        records += [r for r in prev.get("records", []) if not r.get("warmup")]
        prev_refs = prev.get("references", {})
        print(f"resume: {len(records)} timed runs kept from {out_dir}/bench_batching.json", flush=True)
    done = {(r["rep"], r["workload"], r["streams"], r["arm"]) for r in records}
    refs: dict[str, list] = {}
    state = {"meta": meta, "records": records, "references": refs}

    def save():
        if out_dir:
            with open(out_dir / "bench_batching.json", "w") as f:
                json.dump(state, f, indent=1, default=str)

    # ---- reference pass: every prompt decoded once without proposals (exact); the replay proposer offers these
    from strata_jax.pipeline.groups import resolve_groups
    from strata_jax.pipeline.scheduler import BatchScheduler

    book = ReplayBook(V)
    ref_arm = Arm("pipelined", "pipelined") if len(eng.stages) > 1 else Arm("serial", "serial")
    t_ref = time.perf_counter()
    for w in works:
        reqs = _requests(prompts[w], eng.n_slots, hi, hi, setup.stop_ids, w)
        if all(q.rid in prev_refs for q in reqs):
            for q in reqs:
                refs[q.rid] = list(prev_refs[q.rid])
                book.add(q.prompt_ids, refs[q.rid], q.rid)
            print(f"reference {w}: kept from the earlier run", flush=True)
            continue
        set_mtp_chain(eng, 0)
        t0 = time.perf_counter()
        res = resolve_groups(eng.n_slots, len(eng.stages), **ref_arm.flags(eng.n_slots))
        out = BatchScheduler(eng, res).run(reqs)
        for r, q in zip(out, reqs):
            refs[r.rid] = list(r.tokens)
            book.add(q.prompt_ids, r.tokens, r.rid)
        print(f"reference {w}: {eng.n_slots} requests x {hi} tokens ({res.mode}) in {time.perf_counter() - t0:.1f} s",
              flush=True)
    meta["reference_seconds"] = time.perf_counter() - t_ref

    def one(arm: Arm, w: str, s: int, rep: int, tokens: tuple[int, int], warmup: bool) -> dict:
        chain = set_mtp_chain(eng, arm.n_props if arm.source == "rate" else 0)
        factory, label = _factory(setup, arm, w, book, chain)
        made = []
        if factory is not None:
            def factory(inner=factory):
                p = inner()
                made.append(p)
                return p
        reqs = _requests(prompts[w], s, tokens[0], tokens[1], setup.stop_ids, w)
        counter.take()
        if dcounter:
            dcounter.take()
        if arm.mode == "solo":
            rec = run_solo(setup, arm, reqs[0], factory, refs)
        else:
            rec = run_batch(setup, arm, reqs, factory, refs)
        rec.update(arm=arm.name, workload=w, streams=s, rep=rep, label=label, warmup=warmup, mtp_chain=chain,
                   source=arm.source, n_props=arm.n_props,
                   calls={repr(k): v for k, v in counter.take().items()},
                   draft_calls={repr(k): v for k, v in (dcounter.take() if dcounter else {}).items()})
        replays = [p for p in made if isinstance(p, ReplayProposer)]
        if replays:
            rec["replay"] = {k: sum(getattr(p, k) for p in replays)
                             for k in ("offered", "accepted_planned", "diverged", "mtp_reads")}
        if s == 1 and arm.mode != "solo" and not args.no_solo:
            rec["solo_ref"] = solo_baseline(arm).name
        return rec

    def plan(s: int) -> list[Arm]:
        arms = list(setup.arms)
        if s == 1 and not args.no_solo:
            seen = []
            for a in setup.arms:
                b = solo_baseline(a)
                if b.name not in [x.name for x in seen]:
                    seen.append(b)
            arms += seen
        return arms

    # ---- warm-up: every arm's shapes compile here (shortest prompts, few tokens)
    wshort = min(works, key=lambda w: max(len(p) for p in prompts[w]))
    t0 = time.perf_counter()
    c0 = _compiles(setup)
    for s in streams:
        for arm in plan(s):
            rec = one(arm, wshort, s, 0, (args.warmup_tokens, args.warmup_tokens), True)
            records.append(rec)
    meta["warmup"] = {"seconds": time.perf_counter() - t0, "compiles": _compiles(setup) - c0, "workload": wshort}
    print(f"warm-up: {meta['warmup']['compiles']} compiles in {meta['warmup']['seconds']:.1f} s", flush=True)
    save()

    # ---- timed repetitions: rep 1 all arms, rep 2 all arms, ...
    stopped = None
    for rep in range(1, args.reps + 1):
        for w in works:
            for s in streams:
                for arm in plan(s):
                    if (rep, w, s, arm.name) in done:
                        continue
                    if args.time_budget_s and time.perf_counter() - t_start > args.time_budget_s:
                        stopped = f"time budget of {args.time_budget_s:.0f} s reached at rep {rep}, {w}, {s} streams"
                        break
                    rec = one(arm, w, s, rep, (lo, hi), False)
                    records.append(rec)
                    print(f"rep {rep} {w:5s} {s} stream(s) {arm.name:14s} {rec['total_tok_s']:9.2f} tok/s total "
                          f"{rec['per_stream_tok_s']:8.2f} per stream | windows {rec['windows']:4d} | proposals "
                          f"{rec['accepted']}/{rec['proposed']} | compiles {rec['compiles']} | exact "
                          f"{rec.get('exact')}", flush=True)
                    save()
                if stopped:
                    break
            if stopped:
                break
        if stopped:
            break
    if stopped:
        print("stopped: " + stopped, flush=True)
        meta["stopped"] = stopped

    # ---- calibration: each counted call alone on its stage
    t0 = time.perf_counter()
    counter.enabled = False
    if dcounter:
        dcounter.enabled = False
    calib: dict[tuple, float] = {}
    import ast

    timed = [r for r in records if not r["warmup"]]
    need = collections.defaultdict(set)  # (workload, chain) -> keys
    dneed = collections.defaultdict(set)
    for r in timed:
        for k in r["calls"]:
            key = ast.literal_eval(k)
            if key[0] != "mtp" and key[1] != "prefill":
                need[(r["workload"], r["mtp_chain"])].add(key)
        for k in r["draft_calls"]:
            dneed[r["workload"]].add(ast.literal_eval(k))
    pos_of = {w: max(len(p) for p in prompts[w]) + hi // 2 for w in works}
    for (w, chain), keys in sorted(need.items()):
        set_mtp_chain(eng, chain)
        for key in sorted(keys):
            calib[("t", w, chain, key)] = time_call_alone(eng, key, pos_of[w], args.calib_reps)
    set_mtp_chain(eng, 0)
    if setup.draft_engine is not None:
        for w, keys in dneed.items():
            for key in sorted(keys):
                calib[("d", w, 0, key)] = _time_draft_call(setup.draft_engine, key, pos_of[w], args.calib_reps)
    meta["calibration_seconds"] = time.perf_counter() - t0
    n_dev = len(eng.stages)
    last_dev = n_dev - 1
    for r in timed:
        busy = [0.0] * n_dev
        per_stage: dict[int, tuple] = {}
        for k, c in r["calls"].items():
            key = ast.literal_eval(k)
            t = calib.get(("t", r["workload"], r["mtp_chain"], key))
            if t is None:
                continue
            busy[key[0]] += c * t
            if key[0] not in per_stage or c > per_stage[key[0]][0]:
                per_stage[key[0]] = (c, t, key)
        for k, c in r["draft_calls"].items():
            t = calib.get(("d", r["workload"], 0, ast.literal_eval(k)))
            if t is not None:
                busy[last_dev] += c * t
        r["stage_ms"] = [per_stage[i][1] * 1e3 if i in per_stage else None for i in range(n_dev)]
        r["stage_shape"] = [str(per_stage[i][2]) if i in per_stage else None for i in range(n_dev)]
        r["busy_s"] = busy
        r["idle"] = [max(0.0, 1.0 - b / r["decode_s"]) for b in busy]
    state["calibration"] = {repr(k): v for k, v in calib.items()}
    div = sum(r.get("replay", {}).get("diverged", 0) for r in timed)
    if div:
        setup.notes.append(f"**{div} replayed windows found the history off the reference** (exactness broke)")
    reads = sum(r.get("replay", {}).get("mtp_reads", 0) for r in timed)
    if any(r.get("mtp_chain") for r in timed):
        setup.notes.append(f"the MTP chain ran in the MTP-named arms; the replay proposers read its drafts from the "
                           f"device {reads} times, as MtpProposer does, and offered the replayed tokens instead"
                           + (" (0 reads: this scheduler does not bind proposers to slots, so the read is not in "
                              "the timing)" if reads == 0 else ""))
    rows = summarize(timed)
    goals = compute_goals(rows)
    state["summary"], state["goals"] = rows, goals
    meta["seconds"] = time.perf_counter() - t_start
    meta["notes"] = setup.notes + [
        "total tok/s: tokens after each request's first (which its prefill made) over the decode wall (last "
        "admission to last token); admissions (prompt reads) are timed apart",
        "ms/win and idle are estimates: each compiled call counted during the timed runs was then timed alone on its "
        "stage (jax.block_until_ready, median of --calib_reps; a window's commit included); idle = 1 - sum(calls x "
        "time alone) / decode wall, so overlap and launch gaps are not observed directly"
        + ("; the draft model's calls count on the last device" if setup.draft_engine is not None else ""),
        "compile time is discounted by a warm-up pass over every arm and stream count before the timed runs; "
        "'comp' counts compiles that still happened during timing",
    ]
    md = markdown(rows, goals, meta)
    print(md)
    if out_dir:
        save()
        (out_dir / "bench_batching.md").write_text(md)
        labels = sorted({r["label"] for r in rows if r["label"]})
        title = (f"model set {args.model_set}: {setup.model}" + (" — " + ", ".join(labels) if labels else "")
                 + (" — CPU smoke run, no performance claim" if setup.smoke else ""))
        print(plot(rows, str(out_dir / "bench_batching.png"), title))
    bad = [r for r in timed if r.get("exact") is False]
    if bad:
        print(f"error: {len(bad)} run(s) did not reproduce the reference tokens", file=sys.stderr)
        return 1
    return 0


def _time_draft_call(deng, key: tuple, pos: int, reps: int) -> float:
    """Seconds of one call of the draft engine's function ``key`` (one stage), alone (median of ``reps``)."""
    import jax

    from strata_jax.sampling import RowSampling
    from strata_jax.state import Rows

    _, kind, B, T, logits = key
    pos = max(0, min(int(pos), deng.max_context - T - 2))
    toks = np.ones((B, T), np.int32)
    rows = Rows.make(list(range(B)), [pos] * B, [T] * B)
    samp = RowSampling.make([_greedy()] * B)

    def once():
        out, _ = deng.run(kind, toks, rows, samp, logits)
        jax.block_until_ready((out, deng.states))

    once()
    ts = []
    for _ in range(max(1, reps)):
        t0 = time.perf_counter()
        once()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


if __name__ == "__main__":
    sys.exit(main())
