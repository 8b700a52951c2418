"""Workloads and arms of the batching benchmark (``experiments/bench_batching.py``): what runs.

Three workloads of distinct requests (`prompt_texts`): ``code`` (write a new module), ``edit`` (return a ~3K-token
module with one method renamed, `edit_source`: it mostly copies the prompt) and ``prose`` (a story); their token
ids (`encode_prompts`, chat template); generated tokens per stream (`parse_tokens`, `tokens_for`); the greedy
requests of one run (`requests`); and the arms (`Arm`, `make_arms`): the batch modes of
`strata_jax.pipeline.groups.resolve_groups` with their proposal sources, and the solo-path baseline of each
(`solo_baseline`).
"""

from __future__ import annotations

import dataclasses

WORKLOADS = ("code", "edit", "prose")
ALL_ARMS = ("pipelined", "serial", "batch_mtp", "piped1", "piped2", "piped3", "piped_lookup", "piped_draft")


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


N_METHODS = len(_METHODS)


def edit_source(n_methods: int = N_METHODS) -> str:
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


def prompt_texts(workload: str, n: int, n_methods: int = N_METHODS) -> list[str]:
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


def requests(prompts: list[list[int]], n: int, lo: int, hi: int, stop: tuple, workload: str) -> list:
    """Greedy `strata_jax.pipeline.scheduler.Request` objects for the first ``n`` prompts, ``tokens_for`` tokens
    each, ids ``"<workload>/<i>"`` (the replay book's names)."""
    from strata_jax.pipeline.scheduler import Request
    from strata_jax.sampling import SamplingParams

    return [Request(list(prompts[i]), max_new_tokens=tokens_for(i, n, lo, hi), sampling=SamplingParams(0.0),
                    stop_ids=stop, rid=f"{workload}/{i}") for i in range(n)]


# ---- arms ------------------------------------------------------------------------------------------------------------
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
