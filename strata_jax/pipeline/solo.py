"""The solo path: one sequence, prefill then decode windows, streamed.

Plain decoding runs one-row windows with the commit fused in (one jitted call per stage per token). With a proposer
(`strata_jax.proposers`), each window carries the last accepted token plus up to T-1 proposals; the picks decide
``n_keep`` by exact match (SERVING.md §3.1) and the commit advances the state by the kept rows, so the output is
token for token what plain decoding gives.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import numpy as np

from strata_jax.pipeline.engine import Engine
from strata_jax.sampling import RowSampling, SamplingParams
from strata_jax.state import Rows


@dataclasses.dataclass
class GenerationStats:
    """Counters of one generation (times in seconds)."""

    prompt_tokens: int = 0
    prefill_seconds: float = 0.0
    generated: int = 0
    decode_seconds: float = 0.0
    windows: int = 0
    stop_reason: str = ""

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        # the first token comes from the prefill; decode speed counts the windows after it
        n = max(self.generated - 1, 0)
        return n / self.decode_seconds if self.decode_seconds > 0 else 0.0

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(prefill_tok_s=self.prefill_tok_s, decode_tok_s=self.decode_tok_s)
        return d


@dataclasses.dataclass
class Generation:
    """Result: the generated token ids (EOS included when it ended the generation), stats, and with
    ``dump_logits`` the prompt's logits [T, V] and the logits each generated token was picked from [S, V]."""

    tokens: list[int]
    stats: GenerationStats
    prefill_logits: np.ndarray | None = None
    step_logits: np.ndarray | None = None


def generate(engine: Engine, prompt_ids: list[int], *, max_new_tokens: int = 256,
             sampling: SamplingParams = SamplingParams(), eos_ids=(), stop: Callable[[list[int]], bool] | None = None,
             on_token: Callable[[int], None] | None = None, slot: int = 0, dump_logits: bool = False) -> Generation:
    """Generate up to ``max_new_tokens`` tokens after ``prompt_ids`` in ``slot``.

    Args:
      engine: a loaded engine.
      prompt_ids: the prompt's token ids.
      max_new_tokens: most tokens generated.
      sampling: sampler settings (greedy when temperature <= 0).
      eos_ids: ids that end the generation (included in the output, not streamed).
      stop: called with the tokens so far after each token; True ends the generation (stop strings).
      on_token: called with each new token id (streaming).
      dump_logits: keep float32 logits (prompt and each step).

    Returns:
      `Generation`.

    Raises:
      StrataError: the prompt does not fit the context.
    """
    stats = GenerationStats(prompt_tokens=len(prompt_ids))
    eos = set(int(e) for e in eos_ids)
    t0 = time.perf_counter()
    first, prefill_logits = engine.prefill(slot, list(prompt_ids), sampling, all_logits=dump_logits)
    stats.prefill_seconds = time.perf_counter() - t0
    tokens: list[int] = []
    step_logits: list[np.ndarray] = []
    if dump_logits:
        step_logits.append(prefill_logits[-1])
    samp = RowSampling.make([sampling])
    pos = len(prompt_ids)  # position of the next input token
    token = first
    t1 = time.perf_counter()
    while True:
        tokens.append(token)
        if token in eos:
            stats.stop_reason = "eos"
            break
        if on_token is not None:
            on_token(token)
        if stop is not None and stop(tokens):
            stats.stop_reason = "stop string"
            break
        if len(tokens) >= max_new_tokens:
            stats.stop_reason = "max tokens"
            break
        if pos >= engine.max_context - 1:
            stats.stop_reason = "context end"
            break
        res = engine.window(np.array([[token]], np.int32), Rows.make([slot], [pos], [1]), samp, kind="step")
        stats.windows += 1
        if dump_logits:
            step_logits.append(np.asarray(res.device_out["logits"][0, 0]))
        token = int(res.picks[0, 0])
        pos += 1
    stats.decode_seconds = time.perf_counter() - t1
    stats.generated = len(tokens)
    return Generation(tokens, stats, prefill_logits,
                      np.stack(step_logits) if dump_logits else None)
