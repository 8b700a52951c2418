"""Several plain decode steps in one device program (`Engine.run_steps`, `generate(..., decode_steps=N)`): the
tokens are those of one step per call, greedy and seeded-sampled, on a dense model (K/V cache) and qwen4exp
(Gated-DeltaNet and QSA state carried through the loop, the n-gram PLE rows gathered on the device), whether the
budget is a multiple of N or not, when an EOS ends the sequence inside a call, in batch slots and through the
command line (solo and batch: the note when it cannot be used, the programs counted); the program's step loop has
a trip count XLA knows and compiles once.

The reference is `plain_decode` (one step per call: it dumps logits, which keeps one step per call).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from strata_jax.errors import StrataError
from strata_jax.pipeline.engine import Engine
from strata_jax.pipeline.solo import generate
from strata_jax.sampling import RowSampling, SamplingParams
from strata_jax.state import Rows

CTX = 96  # the shared engines' context (tests/conftest.py)
FIXTURES = Path(__file__).parent / "fixtures"
SAMPLED = SamplingParams(temperature=0.9, top_k=30, seed=777)
_HYBRID = {}


def _prompt():
    return np.load(FIXTURES / "dense_smollm2-135m.npz")["prompt_ids"].tolist()


@pytest.mark.parametrize("samp, n", [(SamplingParams(), 3), (SAMPLED, 4)], ids=["greedy-3", "seeded-4"])
def test_steps_give_the_plain_tokens_dense(engine_for, plain_decode, samp, n):
    eng = engine_for("smollm2-135m", max_context=CTX, n_slots=2)
    ids = _prompt()
    want = plain_decode(eng, ids, 14, samp).tokens[:14]
    g = generate(eng, ids, max_new_tokens=14, sampling=samp, decode_steps=n)  # 13 after the prefill's: not n * k
    assert g.tokens == want
    assert g.stats.windows == 13 // n + 13 % n  # calls of n steps, then single steps for the rest of the budget
    assert g.stats.generated == 14


def test_steps_stop_at_an_eos_inside_a_call(engine_for, plain_decode):
    eng = engine_for("smollm2-135m", max_context=CTX, n_slots=2)
    ids = _prompt()
    want = plain_decode(eng, ids, 16, SAMPLED).tokens[:16]
    eos = want[6]  # the 7th token: the 2nd step of the 2nd 4-step call (the 1st token comes from the prefill)
    first = want.index(eos)
    streamed = []
    g = generate(eng, ids, max_new_tokens=16, sampling=SAMPLED, eos_ids=(eos,), decode_steps=4,
                 on_token=streamed.append)
    assert g.tokens == want[:first + 1] and g.stats.stop_reason == "eos"
    assert streamed == want[:first]  # the EOS is kept, not streamed
    # the slot is reusable: the same request again gives the same tokens (the prefill resets what ran past the end)
    assert generate(eng, ids, max_new_tokens=16, sampling=SAMPLED, eos_ids=(eos,), decode_steps=4).tokens == g.tokens


def _qwen4exp(ple_table):
    key = "q4_" + ple_table
    if key not in _HYBRID:
        _HYBRID[key] = Engine(str(FIXTURES / "hybrid" / "qwen4exp_q8_0.gguf"), max_context=48, ple_table=ple_table)
    return _HYBRID[key]


def test_device_ple_row_ids_equal_the_host_ones():
    """`DeviceRowIds` (uint32 halves, no x64) against `ple_row_ids` (numpy int64): random predecessors and tokens
    with EOS ids among them, the fixture's hash constants and full-size ones (head sizes ~2e7, 248,320 ids)."""
    import types

    import jax

    from strata_jax.layers.ple import DeviceRowIds, ple_head_sizes, ple_multipliers, ple_row_ids

    V = 248320
    sizes, offs = ple_head_sizes(20_000_000, 16, 0)
    big = types.SimpleNamespace(mult=ple_multipliers(V, 3, 0, 4242), sizes=sizes, offsets=offs, eos=248044, hpn=8,
                                context=2)
    fixture = _qwen4exp("host").ple.table
    rng = np.random.default_rng(11)
    for tab, vocab in ((fixture, _qwen4exp("host").cfg.vocab_size), (big, V)):
        dev = DeviceRowIds(tab, vocab)
        f = jax.jit(dev.__call__)
        for _ in range(6):
            B, T = 3, int(rng.integers(1, 9))
            prev, toks = rng.integers(0, vocab, (B, tab.context)), rng.integers(0, vocab, (B, T))
            toks[rng.random((B, T)) < 0.2] = tab.eos
            prev[rng.random(prev.shape) < 0.2] = tab.eos
            got = np.asarray(f(dev.arrays, prev.astype(np.int32), toks.astype(np.int32)))
            want = np.stack([ple_row_ids(p, t, eos=tab.eos, mult=tab.mult, sizes=tab.sizes, offsets=tab.offsets,
                                         heads_per_ngram=tab.hpn) for p, t in zip(prev, toks)])
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("samp", [SamplingParams(), SAMPLED], ids=["greedy", "seeded"])
def test_steps_give_the_plain_tokens_qwen4exp_device_ple(samp):
    host, dev = _qwen4exp("host"), _qwen4exp("device")
    assert not host.can_run_steps and dev.can_run_steps
    ids = [3, 17, 101, 5, 9, 44, 12]
    want = generate(host, ids, max_new_tokens=14, sampling=samp).tokens
    got = generate(dev, ids, max_new_tokens=14, sampling=samp, decode_steps=4)
    assert got.tokens == want and got.stats.windows == 3 + 1  # 13 steps: three calls of 4, a fourth keeps 1 of 4
    assert got.stats.step_programs == 4
    # the predecessors the device loop left reach the host for what follows: a second prompt in the same slot
    # (reset) and a prompt continued after the loop (host PLE rows from the synced predecessors)
    assert generate(dev, ids[:5], max_new_tokens=6, sampling=samp, decode_steps=4).tokens == \
        generate(host, ids[:5], max_new_tokens=6, sampling=samp).tokens


def test_steps_program_is_one_xla_program_device_ple():
    """The device-PLE steps program compiles once: the predecessors of its first call on a slot (the host's, after
    a prefill) are committed to the device as a previous loop's are (an uncommitted argument is a second XLA
    program, which the compile cache does not count)."""
    dev = _qwen4exp("device")
    generate(dev, [3, 17, 101, 5, 9, 44, 12], max_new_tokens=8, decode_steps=3)  # 7 steps: 3 programs of 3
    fn = dev.cache._fns[(0, "steps", 1, 3, dev.n_slots)]  # its own count of steps: compiled by this test alone
    assert fn._cache_size() == 1  # greedy only (`RowSampling.all_greedy` is static: sampled rows are another)


def test_steps_program_runs_its_steps_in_a_loop_of_known_trip_count():
    from strata_jax.pallas.structure import hlo_while_loops
    from strata_jax.pipeline.stages import build_steps_fn

    eng = _qwen4exp("device")
    stage = eng.stages[0]
    fn = build_steps_fn(stage, 4, eng.max_context, eng.ple.ids)
    hlo = fn.lower(stage.leaves, eng.states[0], np.array([[3]], np.int32), Rows.make([0], [7], [1]),
                   RowSampling.make([SamplingParams()]), eng.ple.device_inputs([0])).compile().as_text()
    outer = [w for w in hlo_while_loops(hlo) if w["op_name"].count("while") == 1]
    assert [w["trip_count"] for w in outer] == [4], outer  # one loop of the 4 steps, its count known to XLA


def test_steps_refuse_what_they_cannot_run(engine_for):
    eng = engine_for("smollm2-135m", max_context=CTX, n_slots=2)
    with pytest.raises(StrataError, match="decode_steps 0"):
        generate(eng, _prompt(), max_new_tokens=4, decode_steps=0)
    from strata_jax.pipeline.stages import build_steps_fn

    with pytest.raises(StrataError, match="at least 1"):
        build_steps_fn(eng.stages[0], 0, CTX)


def test_batch_serial_windows_with_steps_give_the_solo_tokens(engine_for):
    """Batch slots in serial windows with `BatchScheduler(decode_steps=4)`: a third request waits for a slot (single
    steps meanwhile), budgets not multiples of 4, an EOS inside a program, greedy and seeded: each request's tokens
    are its solo tokens, and programs of several steps did run."""
    from strata_jax.pipeline.groups import resolve_groups
    from strata_jax.pipeline.scheduler import BatchScheduler, Request
    from strata_jax.testing import exactness as bx

    eng = engine_for("smollm2-135m", max_context=CTX, n_slots=2)
    base = _prompt()
    reqs = [Request(base[:12], max_new_tokens=11, sampling=bx.GREEDY, rid="a"),
            Request(base[3:20], max_new_tokens=14, sampling=SAMPLED, rid="b"),
            Request(base[5:15], max_new_tokens=9, sampling=bx.seeded(31), rid="c")]
    solo = [bx.solo_tokens(eng, r) for r in reqs]
    reqs[1] = Request(base[3:20], max_new_tokens=14, sampling=SAMPLED, rid="b", stop_ids=(solo[1][6],))
    solo[1] = solo[1][:solo[1].index(solo[1][6]) + 1]
    sch = BatchScheduler(eng, resolve_groups(2, 1), decode_steps=4, solo_return=False)
    assert sch.mode == "serial"
    out = {r.rid: r.tokens for r in sch.run(reqs)}
    assert [out["a"], out["b"], out["c"]] == solo
    assert sch.stats["step_programs"] > 0


def test_cli_decode_steps_note_stats_and_tokens(tmp_path):
    """strata-generate on qwen4exp: with the n-gram table on the host, --decode_steps 4 is refused in a note and one
    step per call runs; with --ple_table device it runs (the stats line counts its programs) and the tokens are
    the same, for a budget of 14 and up to the context end. The host run decodes to the context end once: its first
    14 tokens are those of a 14-token run (decoding is causal)."""
    import json
    import subprocess
    import sys

    runs = []

    def cli(*extra):
        out = tmp_path / f"s{len(runs)}.json"
        runs.append(out)
        # one compilation cache for the three runs: the last one reuses the second one's programs
        proc = subprocess.run([sys.executable, "-m", "strata_jax.cli.generate", "--model",
                               str(FIXTURES / "hybrid" / "qwen4exp_q8_0.gguf"), "--prompt_ids", "3,17,101,5,9",
                               "--max_new_tokens", "14", "--max_context", "64", "--decode_steps", "4",
                               "--xla_cache_dir", str(tmp_path / "xla"), "--stats_json", str(out), *extra],
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr
        return proc.stderr, json.loads(out.read_text())

    # near the context end: 1 + 64 - 1 - 5 = 59 tokens
    err, host = cli("--ple_table", "host", "--max_new_tokens", "100")
    assert "--decode_steps 4: not used (the n-gram table is on the host" in err
    assert host["decode_steps"] == 1 and len(host["tokens"]) == 59
    # the memory the run held (a CPU: the process's resident memory) in the stats line and the JSON
    assert "process memory (RSS) " in err.strip().splitlines()[-1] and host["memory"]["source"] == "process"
    assert host["memory"]["peak_bytes_in_use"] > 0 and host["memory_report"]["stages"][0]["weight_bytes"] > 0
    assert host["compiled_ahead"] == 0   # no program of several steps to compile beside the prefill
    err, dev = cli("--ple_table", "device")
    # 13 steps: 4 programs of 4 (the last keeps 1: no one-step program to compile)
    assert "not used" not in err and "[4 of 4 steps, 0 single steps]" in err
    assert dev["tokens"] == host["tokens"][:14] and len(dev["tokens"]) == 14
    # the steps program compiled beside the prefill (CompileCache.ahead; its first call runs that program)
    assert dev["compiled_ahead"] == 1
    # near the context end the tail runs one step per call: the last 2 single
    err, end = cli("--ple_table", "device", "--max_new_tokens", "100")
    assert "[14 of 4 steps, 2 single steps]" in err and end["tokens"] == host["tokens"]
    # 2 cells left after the prompt: only single steps run, so no steps program is compiled beside the prefill
    err, short = cli("--ple_table", "device", "--max_context", "8")
    assert "[0 of 4 steps, 2 single steps]" in err and short["compiled_ahead"] == 0
    assert short["tokens"] == host["tokens"][:3]   # the prefill's token and the 2 single steps


@pytest.fixture
def decode_steps_flag():
    """Sets ``--decode_steps`` in the process's flags (parsed with their defaults if not yet) for the test."""
    from strata_jax.cli import flags as shared  # defines the flags

    F = shared.FLAGS
    if not F.is_parsed():
        F(["test"])
    saved = F.decode_steps

    def set_(n):
        F.decode_steps = n
    yield set_
    F.decode_steps = saved


def test_batch_note_when_steps_cannot_run(engine_for, capsys, decode_steps_flag):
    """The batch scheduler of the command line (`strata_jax.cli.flags.batch_scheduler`) says in the solo path's
    note why --decode_steps 4 cannot be used (the n-gram table on the host) and then runs one step per program; with
    the table on the device it runs 4, silently. Proposals for every request (a server's --draft, --batch_mtp) rule
    the programs out too."""
    from strata_jax.cli import flags as shared
    from strata_jax.pipeline.groups import resolve_groups
    from strata_jax.pipeline.scheduler import BatchScheduler

    decode_steps_flag(4)
    sch, _, _ = shared.batch_scheduler(_qwen4exp("host"))
    err = capsys.readouterr().err
    assert "--decode_steps 4: not used (the n-gram table is on the host: --ple_table device puts it on the device); " \
        "one step per call\n" in err and sch.decode_steps == 1
    sch, _, _ = shared.batch_scheduler(_qwen4exp("device"))
    assert "not used" not in capsys.readouterr().err and (sch.decode_steps, sch.steps_unavailable) == (4, "")
    eng = engine_for("smollm2-135m", max_context=CTX, n_slots=2)
    for res, spec, why in [(resolve_groups(2, 1), 4, "--draft decodes in verify windows"),
                           (resolve_groups(2, 1, batch_mtp=True), 0, "--batch_mtp decodes in verify windows")]:
        sch = BatchScheduler(eng, res, solo_spec=spec, decode_steps=4)
        assert (sch.steps_unavailable, sch.decode_steps) == (why, 1)


def test_cli_batch_counts_step_programs(tmp_path):
    """strata-generate --prompts_file on qwen4exp with the n-gram table on the device and --decode_steps 4: the batch
    line counts the step programs the scheduler ran (--stats_json), and each request's tokens are its solo tokens
    (one step per call)."""
    import json
    import subprocess
    import sys

    reqs = tmp_path / "reqs.jsonl"
    reqs.write_text('{"prompt_ids": [3, 17, 101, 5, 9], "id": "a"}\n'
                    '{"prompt_ids": [3, 17, 44], "id": "b", "max_new_tokens": 11}\n')
    st, out = tmp_path / "stats.json", tmp_path / "out.jsonl"
    proc = subprocess.run([sys.executable, "-m", "strata_jax.cli.generate", "--model",
                           str(FIXTURES / "hybrid" / "qwen4exp_q8_0.gguf"), "--prompts_file", str(reqs), "--batch",
                           "2", "--max_new_tokens", "14", "--max_context", "48", "--decode_steps", "4",
                           "--xla_cache_dir", "", "--ple_table", "device", "--stats_json", str(st), "--out_jsonl",
                           str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    d = json.loads(st.read_text())
    n = d["step_programs"]
    assert "not used" not in proc.stderr and d["decode_steps"] == 4 and n > 0
    assert f"[{n} step program{'' if n == 1 else 's'} of 4 steps]" in proc.stderr.strip().splitlines()[-1]
    toks = {r["id"]: r["tokens"] for r in map(json.loads, out.read_text().splitlines())}
    host = _qwen4exp("host")
    assert toks == {"a": generate(host, [3, 17, 101, 5, 9], max_new_tokens=14).tokens,
                    "b": generate(host, [3, 17, 44], max_new_tokens=11).tokens}


def test_ple_table_placed_in_pieces():
    """The PLE table goes to the device in pieces written in place into one buffer (what a 28.8 GB table needs):
    the device copy equals the file's table bit for bit, and the progress callback is told every byte."""
    eng = _qwen4exp("device")
    ref = np.asarray(eng.ple.table.raw)
    seen = []
    eng.ple.place(eng.stages[eng.ple.stage].device, eng.cfg.vocab_size, progress=seen.append,
                  chunk_bytes=ref.shape[1] * 97 + 5)  # 97 rows per piece: a ragged last piece
    assert len(seen) == -(-ref.shape[0] // 97) and sum(seen) == ref.nbytes
    np.testing.assert_array_equal(np.asarray(eng.ple.raw), ref)
