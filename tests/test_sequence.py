"""The overlapped host loops (issue 12, "the host loop keeps up") decode exactly what the synchronous loops decoded.

* `Sequence`'s two phases: ``push`` (EOS, max tokens, context end), then ``flush`` (streaming, stop strings) end a
  sequence exactly where ``emit`` token by token ends it, streaming the same tokens, a stop string found in the
  flush dropping the tokens pushed after it.
* The solo loop launches step i + 1 from step i's pick on the device before reading step i: its tokens, streamed
  tokens and stop reasons equal the synchronous reference loop's (one step, one read, one emit), greedy and seeded,
  with EOS, a stop condition and max tokens in the middle; a later request in the same slot after such an early
  stop (the dropped step wrote past its end) decodes its own reference tokens.
* The speculative solo loop: EOS, a stop condition and max tokens inside a verify window; plain steps launched ahead
  while a host-side proposer has nothing to propose, then windows again when it does.
* The text: SmolLM2's streamed text and a stop string in the middle of it are the reference loop's.
* Batch slots (serial windows, the next plain step launched from the one in flight): every request decodes its
  reference tokens, through early stops, a cancellation and slot reuse; its tokens are streamed before its finish.

Engines: the tiny qwen3next hybrid (GDN recurrent state: a step committed past the end of a sequence would show in
the next one) and SmolLM2 for text, both through ``engine_for`` with the shared context.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest

from strata_jax.pipeline.groups import resolve_groups
from strata_jax.pipeline.scheduler import BatchScheduler, Request
from strata_jax.pipeline.sequence import Sequence, stop_strings
from strata_jax.pipeline.solo import generate
from strata_jax.proposers import LookupProposer, ScriptedProposer
from strata_jax.sampling import RowSampling, SamplingParams
from strata_jax.state import Rows

HYBRID = str(Path(__file__).parent / "fixtures" / "hybrid" / "qwen3next_f32.gguf")
CTX = 96  # the shared engines' context (tests/conftest.py)
GREEDY = SamplingParams(0.0)
SEEDED = SamplingParams(0.7, 20, 1.0, 0.0, 11)
BASE = [1, 9, 198, 283, 359, 253, 56, 46, 111, 2, 198, 1, 43, 198, 170, 314, 260, 35]


def _hybrid(engine_for):
    if not Path(HYBRID).exists():
        pytest.fail("committed hybrid fixture is missing (experiments/parity/make_hybrid_fixtures.py makes it)")
    return engine_for(HYBRID, max_context=CTX, n_slots=2)


def _reference(engine, prompt, n, samp, *, eos=(), stop=None, on_token=None, slot=0):
    """The synchronous loop (one plain step, one read, one emit per token): (tokens, stop reason)."""
    first, _ = engine.prefill(slot, list(prompt), samp)
    seq = Sequence(prompt, max_new_tokens=n, max_context=engine.max_context, eos_ids=eos, stop=stop,
                   on_token=on_token)
    seq.emit(first)
    rs = RowSampling.make([samp])
    while not seq.reason:
        res = engine.window(np.array([[seq.last]], np.int32), Rows.make([slot], [seq.pos], [1]), rs, kind="step")
        seq.emit(int(res.picks[0, 0]))
    return seq.tokens, seq.reason


# ---- Sequence: push / flush against emit --------------------------------------------------------------------------
def _seq(**kw):
    streamed = []
    args = dict(max_new_tokens=10, max_context=50, eos_ids=(99,))
    args.update(kw)
    return Sequence([5, 6, 7], on_token=streamed.append, **args), streamed


def test_push_flush_ends_where_emit_ends():
    stream = [10, 11, 12, 13, 99, 14]
    # EOS: kept, not streamed; the stop reason is set by push already
    a, sa = _seq()
    for t in stream:
        if a.emit(t):
            break
    b, sb = _seq()
    assert [b.push(t) for t in stream[:5]] == ["", "", "", "", "eos"]
    assert sb == [] and b.flush() == "eos"
    assert (a.tokens, sa, a.reason) == (b.tokens, sb, b.reason) == ([10, 11, 12, 13, 99], [10, 11, 12, 13], "eos")
    # a stop string completed by the second token: the flush drops the two pushed after it
    stop = lambda toks: toks[-2:] == [11, 12]  # noqa: E731
    c, sc = _seq(stop=stop)
    for t in stream[:4]:
        c.push(t)
    assert c.flush() == "stop string"
    assert (c.tokens, sc, c.history) == ([10, 11, 12], [10, 11, 12], [5, 6, 7, 10, 11, 12])
    assert c.n_flushed == 3 and c.budget == 0
    # the stop string wins over max tokens at the same token, and over an EOS pushed after it
    d, sd = _seq(stop=stop, max_new_tokens=3)
    assert [d.push(t) for t in (10, 11, 12)] == ["", "", "max tokens"]
    assert d.flush() == "stop string" and d.tokens == [10, 11, 12]
    e, se = _seq(stop=stop)
    for t in (10, 11, 12, 99):
        e.push(t)
    assert e.flush() == "stop string" and e.tokens == [10, 11, 12] and se == [10, 11, 12]
    # the context end: 3 prompt tokens + 4 generated reach position 6 of a 7-cell context
    f, _ = _seq(max_context=7)
    assert f.budget == 4
    assert [f.push(t) for t in (10, 11, 12, 13)] == ["", "", "", "context end"]
    with pytest.raises(RuntimeError, match="ended"):
        f.push(1)
    # room(cap, ahead): what a window may carry once `ahead` more tokens are in
    g, _ = _seq(max_new_tokens=6)
    g.push(10)
    assert (g.room(7), g.room(7, ahead=1), g.room(7, ahead=4)) == (4, 3, 0)


def test_push_window_then_flush_is_accept():
    stop = lambda toks: 13 in toks  # noqa: E731
    a, sa = _seq(stop=stop)
    assert a.accept([11, 12, 13, 14], [11, 12, 13, 14, 15], 5) == [11, 12, 13]
    b, sb = _seq(stop=stop)
    assert b.push_window([11, 12, 13, 14], [11, 12, 13, 14, 15], 5) == [11, 12, 13, 14, 15]
    assert b.flush() == "stop string"
    assert (a.tokens, sa, a.reason) == (b.tokens, sb, b.reason)


# ---- the solo loop ------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("samp", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_solo_overlapped_equals_reference(engine_for, samp):
    eng = _hybrid(engine_for)
    prompt = BASE + BASE[:6]
    ref, why = _reference(eng, prompt, 20, samp)
    assert why == "max tokens" and len(ref) == 20
    seen = []
    g = generate(eng, prompt, max_new_tokens=20, sampling=samp, on_token=seen.append)
    assert g.tokens == ref and seen == ref and g.stats.stop_reason == "max tokens"
    assert g.stats.windows == 19 and g.stats.ahead == 18 and g.stats.dropped == 0  # none past max tokens
    # EOS in the middle: the step launched ahead of it is dropped
    eos = {ref[8]}
    want, why = _reference(eng, prompt, 20, samp, eos=eos)
    assert why == "eos" and want == ref[:ref.index(ref[8]) + 1]
    seen = []
    g = generate(eng, prompt, max_new_tokens=20, sampling=samp, eos_ids=eos, on_token=seen.append)
    assert g.tokens == want and seen == want[:-1] and g.stats.stop_reason == "eos" and g.stats.dropped == 1
    # a stop condition in the middle, then another request in the same slot: its own reference tokens
    stop = lambda toks: len(toks) >= 6  # noqa: E731
    g = generate(eng, prompt, max_new_tokens=20, sampling=samp, stop=stop)
    assert g.tokens == ref[:6] and g.stats.stop_reason == "stop string" and g.stats.dropped == 1
    other = BASE[3:15]
    ref2, _ = _reference(eng, other, 12, samp)
    generate(eng, prompt, max_new_tokens=20, sampling=samp, stop=stop)
    assert generate(eng, other, max_new_tokens=12, sampling=samp).tokens == ref2
    # the context end: no step launched past it
    long = (BASE * 6)[:CTX - 7]
    ref3, why = _reference(eng, long, 40, samp)
    assert why == "context end"
    g = generate(eng, long, max_new_tokens=40, sampling=samp)
    assert g.tokens == ref3 and g.stats.stop_reason == "context end" and g.stats.dropped == 0


def _oracle(full):
    """Proposes the known continuation ``full`` (prompt + reference tokens) of the history."""
    def fn(history, max_n):
        n = len(history)
        assert history == full[:n], "the history must be the reference output"
        return full[n:n + max_n]

    return ScriptedProposer(fn, "oracle")


@pytest.mark.slow
@pytest.mark.parametrize("samp", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_speculative_stops_inside_a_window(engine_for, samp):
    eng = _hybrid(engine_for)
    prompt = BASE + BASE[:6]
    ref, _ = _reference(eng, prompt, 24, samp)
    full = list(prompt) + ref

    def spec(n, **kw):
        seen = []
        g = generate(eng, prompt, max_new_tokens=n, sampling=samp, proposer=_oracle(full), spec=4,
                     on_token=seen.append, **kw)
        return g, seen

    # every window fully accepted (4 tokens): windows end at tokens 5, 9, 13, ...
    g, seen = spec(24)
    assert g.tokens == ref and seen == ref and g.stats.accepted == g.stats.proposed > 0
    # EOS at token 7 (inside the second window), a stop condition at token 11 (the third), max tokens at 10
    eos = {ref[6]}
    want = ref[:ref.index(ref[6]) + 1]
    g, seen = spec(24, eos_ids=eos)
    assert g.tokens == want and seen == want[:-1] and g.stats.stop_reason == "eos"
    g, seen = spec(24, stop=lambda toks: len(toks) >= 11)
    assert g.tokens == ref[:11] and seen == ref[:11] and g.stats.stop_reason == "stop string"
    assert g.stats.dropped == 1  # the window after the stop was launched before the flush found it
    assert sum(k * v for k, v in g.stats.window_tokens.items()) == 10
    g, seen = spec(10)
    assert g.tokens == ref[:10] and g.stats.stop_reason == "max tokens" and g.stats.dropped == 0
    # the next request in the slot after the early stop
    other = BASE[2:16]
    ref2, _ = _reference(eng, other, 10, samp)
    spec(24, stop=lambda toks: len(toks) >= 11)
    assert generate(eng, other, max_new_tokens=10, sampling=samp, proposer=LookupProposer(), spec=4).tokens == ref2


@pytest.mark.slow
def test_plain_steps_ahead_while_the_proposer_is_dry(engine_for):
    """A host-side proposer with nothing to say: the plain steps run one ahead of the reads; when it proposes
    again (at two positions of every 6: it is asked at the first while a step is in flight, which only stops the
    steps going ahead, and its proposals at the second fill a window), windows follow; a stop condition in a step
    launched ahead."""
    eng = _hybrid(engine_for)
    prompt = BASE + BASE[:6]
    ref, _ = _reference(eng, prompt, 30, SEEDED)
    full = list(prompt) + ref
    asked = []

    def fn(history, max_n):
        n = len(history)
        asked.append(n)
        return full[n:n + max_n] if n % 6 in (0, 1) else []

    prop = ScriptedProposer(fn, "sometimes")
    assert prop.host_side
    g = generate(eng, prompt, max_new_tokens=30, sampling=SEEDED, proposer=prop, spec=3)
    assert g.tokens == ref
    st = g.stats
    assert st.spec_windows >= 2 and st.accepted == st.proposed > 0
    assert st.windows - st.spec_windows > st.spec_windows and st.ahead > st.spec_windows  # mostly steps ahead
    assert sorted(set(asked)) == sorted(asked)  # asked once per history length
    g = generate(eng, prompt, max_new_tokens=30, sampling=SEEDED, proposer=ScriptedProposer(fn, "sometimes"),
                 spec=3, stop=lambda toks: len(toks) >= 17)
    assert g.tokens == ref[:17] and g.stats.stop_reason == "stop string"


# ---- the text -----------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_streamed_text_and_stop_string_equal_reference(engine_for):
    eng = engine_for("smollm2-135m", max_context=CTX, n_slots=2)
    tok = eng.tokenizer
    prompt = np.load(Path(__file__).parent / "fixtures" / "dense_smollm2-135m.npz")["prompt_ids"].tolist()

    def run(fn, **kw):
        dec = tok.stream_decoder(skip_special=True)
        parts = []
        toks, why = fn(lambda t: parts.append(dec.feed(t)), **kw)
        return toks, why, "".join(parts) + dec.flush()

    def ref(on_token, **kw):
        return _reference(eng, prompt, 24, GREEDY, on_token=on_token, **kw)

    def new(on_token, **kw):
        g = generate(eng, prompt, max_new_tokens=24, sampling=GREEDY, on_token=on_token, **kw)
        return g.tokens, g.stats.stop_reason

    def lookup(on_token, **kw):
        return new(on_token, proposer=LookupProposer(), spec=4, **kw)

    toks, why, text = run(ref)
    assert why == "max tokens" and len(text) > 20
    assert run(new) == (toks, why, text)
    s = text[len(text) // 2: len(text) // 2 + 3]  # a stop string completed in the middle of the text
    stop = stop_strings(tok, [s])
    want = run(ref, stop=stop)
    assert want[1] == "stop string" and s in want[2] and len(want[0]) < 24
    assert run(new, stop=stop) == want
    assert run(lookup, stop=stop) == want


# ---- batch slots --------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_batch_serial_overlapped_equals_reference(engine_for):
    eng = _hybrid(engine_for)
    res = resolve_groups(2, 1, batch_groups=1, batch_groups_given=True)
    assert res.mode == "serial"
    prompts = [BASE[:10 + 2 * i] + BASE[:6] for i in range(5)]
    samps = [GREEDY, SEEDED, SamplingParams(0.7, 20, 1.0, 0.0, 12), GREEDY, SEEDED]
    refs = [_reference(eng, p, 12, s)[0] for p, s in zip(prompts, samps)]
    # request 0 ends early by EOS, 2 by a stop condition, 1 is cancelled; more requests than slots: slots reused
    # right after early stops
    eos0 = (refs[0][3],)
    stop2 = lambda toks: len(toks) >= 5  # noqa: E731
    want = [_reference(eng, prompts[0], 12, GREEDY, eos=eos0)[0], None, refs[2][:5], refs[3], refs[4]]
    reqs = [Request(list(p), max_new_tokens=12, sampling=s, arrival_round=i) for i, (p, s) in
            enumerate(zip(prompts, samps))]
    reqs[0].stop_ids = eos0
    reqs[1].cancel_round = 4
    reqs[2].stop = stop2
    events = {i: [] for i in range(5)}
    for i, r in enumerate(reqs):
        r.rid = i
        r.on_token = lambda t, i=i: events[i].append(t)
        r.on_finish = lambda res_, i=i: events[i].append(("end", res_.stop_reason))
    for solo_spec in (0, 3):  # plain serial steps (chained), then proposals on the solo windows
        for e in events.values():
            e.clear()
        sch = BatchScheduler(eng, res, solo_spec=solo_spec)
        results = sch.run([copy.copy(r) for r in reqs])
        reasons = [r.stop_reason for r in results]
        assert reasons == ["eos", "cancelled", "stop string", "max tokens", "max tokens"], reasons
        for i, r in enumerate(results):
            if i == 1:
                assert r.tokens == refs[1][:len(r.tokens)]
                continue
            assert r.tokens == want[i], (solo_spec, i, r.tokens, want[i])
            streamed = [t for t in r.tokens if t not in reqs[i].stop_ids]
            assert events[i] == streamed + [("end", r.stop_reason)]  # every token streamed before the finish
        assert len({r.slot for r in results}) == 2
        if solo_spec == 0:
            assert sch.stats["chained"] > 0
