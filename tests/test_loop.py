"""The engine loop (`strata_jax.pipeline.loop.EngineLoop`): requests submitted from several threads while others
decode (continuous batching) on the 2-stage SmolLM2 split in piped-MTP mode (pipelined groups of one slot, prompt
lookup proposals) decode exactly their solo tokens; a cancellation from another thread frees the slot; the stream
delivers the streamed tokens then the result; a bounded queue refuses one request too many; close drains.

The engine and mode are tests/test_slots.py's (same key and window shapes), so the compiled functions are shared.
"""

import threading
import time

import jax
import pytest

from strata_jax.pipeline.groups import resolve_groups
from strata_jax.pipeline.loop import EngineLoop, LoopClosed, QueueFull
from strata_jax.pipeline.scheduler import BatchScheduler, Request
from strata_jax.testing import exactness as bx

CTX = 96
BASE = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575]


@pytest.mark.slow
def test_loop_submissions_from_threads_are_exact(engine_for):
    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices (XLA_FLAGS=--xla_force_host_platform_device_count=2)")
    eng = engine_for("smollm2-135m", max_context=CTX, n_slots=2, layer_split="15", devices=jax.devices()[:2])
    V = eng.cfg.vocab_size
    prompts = [[t % V for t in BASE[:10 + 2 * i] + BASE[:6]] for i in range(4)]
    samp = [bx.GREEDY, bx.seeded(1001), bx.seeded(1002), bx.GREEDY]
    reqs = [Request(p, max_new_tokens=8, sampling=s) for p, s in zip(prompts, samp)]
    solo = [bx.solo_tokens(eng, r) for r in reqs]
    res = resolve_groups(2, 2, piped_mtp=2)
    assert res.mode == "piped_mtp"
    sch = BatchScheduler(eng, res)
    loop = EngineLoop(sch, max_queue=1).start()
    got, streamed, errors = {}, {}, []

    def client(i, delay):
        time.sleep(delay)
        try:
            s = loop.submit(Request(list(prompts[i]), max_new_tokens=8 if i != 1 else 60, sampling=samp[i],
                                    rid=f"r{i}"))
        except QueueFull as e:
            errors.append((i, e))
            return
        toks = []
        for ev in s:  # iterate: tokens as they come, then the result
            toks += ev.tokens
            if i == 1 and len(toks) >= 2:
                loop.cancel("r1")  # from the client's thread, while r1 decodes
        streamed[i], got[i] = toks, s.result

    ths = [threading.Thread(target=client, args=(i, 0.3 * i)) for i in range(3)]
    for t in ths:
        t.start()
    for t in ths:
        t.join(600)
    assert not errors, errors
    n = min(len(got[1].tokens), len(solo[1]))  # solo[1] holds its first 8 tokens
    assert got[1].stop_reason == "cancelled" and 2 <= len(got[1].tokens) < 60 and got[1].tokens[:n] == solo[1][:n]
    for i in (0, 2):
        assert got[i].tokens == solo[i] and got[i].stop_reason == "max tokens", (i, got[i].tokens, solo[i])
        assert streamed[i] == [t for t in got[i].tokens if t not in reqs[i].stop_ids]
    assert sch.stats["drains"] > 0 and sch.stats["windows"] > 0  # admissions drained the pipeline
    assert not sch.results and loop.running == 0  # finished requests leave the scheduler
    # a bounded queue: two decoding, one waiting (max_queue 1), the next is refused
    streams = [loop.submit(Request(list(prompts[j]), max_new_tokens=8, sampling=samp[j])) for j in (3, 0, 2)]
    with pytest.raises(QueueFull):
        loop.submit(Request(list(prompts[1]), max_new_tokens=4))
    assert loop.close(drain=True, timeout=600)  # the queued and running ones finish first
    assert [s.result.tokens for s in streams] == [solo[3], solo[0], solo[2]]
    with pytest.raises(LoopClosed):
        loop.submit(Request(list(prompts[0]), max_new_tokens=2))
