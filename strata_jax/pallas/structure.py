"""The structure of a step program: which loops XLA runs, and which Pallas kernel operands XLA must copy.

What makes a GPU step wait or copy is visible before it runs:

* a while loop without a trip count XLA knows: XLA:GPU copies its predicate to the host every iteration
  (`hlo_while_loops` reads the optimized HLO text, where a known count is annotated as ``known_trip_count``);
* a loop at the XLA level at all (a ``lax.map`` over rows, a scan over layers), and a loop inside a kernel whose
  bounds are traced values (`jaxpr_report` walks a traced program, kernel bodies included);
* a Pallas-Triton call whose operand is a slice or gather of a weight or state array (a scan's per-layer slice of
  stacked weights, ``state[slot]``): XLA materialises the slice, a device-to-device copy on every call
  (`jaxpr_report`'s ``sliced_operands``).

Used by tests/pallas/test_program_structure.py and `experiments/compile_probe.py` (``--structure``).
"""

from __future__ import annotations

import dataclasses
import math
import re

# primitives whose output is the operand's buffer seen differently (no copy when XLA lowers them)
_VIEW = {"reshape", "squeeze", "expand_dims", "bitcast_convert_type", "copy_p"}
# primitives that read part of an array (a copy when a custom call consumes the result)
_SLICE = {"dynamic_slice", "slice", "gather", "index_in_dim", "dynamic_index_in_dim"}
_CALLS = {"pjit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr",
          "remat", "checkpoint", "jit"}


def hlo_while_loops(hlo_text: str) -> list[dict]:
    """The while loops of an optimized HLO module's text.

    Returns:
      one dict per ``while`` instruction: ``name``, ``trip_count`` (int, or None when XLA does not know it) and
      ``op_name`` (the JAX name stack, e.g. ``jit(fn)/jit(_qmatmul)/qmatmul_Q8_0/while``).
    """
    out = []
    for line in hlo_text.splitlines():
        m = re.search(r"%(\S+) = .*\bwhile\(", line)
        if not m:
            continue
        n = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
        op = re.search(r'op_name="([^"]*)"', line)
        out.append({"name": m.group(1), "trip_count": int(n.group(1)) if n else None,
                    "op_name": op.group(1) if op else ""})
    return out


# HLO instructions that launch nothing (buffers seen differently, control flow whose bodies are counted instead)
_NO_LAUNCH = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "call", "while", "conditional",
              "after-all", "partition-id", "replica-id", "opt-barrier", "add-dependency", "domain"}
_COMP = re.compile(r"^(ENTRY )?%?([\w.\-]+) \(.*\{\s*$")
_INST = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*?\b([a-z][\w\-]*)\((.*)$")
_REFS = re.compile(r"\b(to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


def hlo_launches(hlo_text: str) -> dict:
    """Where a compiled GPU program's kernel launches sit: inside XLA command buffers (CUDA graphs, replayed with
    one launch each) or outside them (each launched alone, a few microseconds of host and driver time each).

    Reads the final HLO of an executable (``jit(f).lower(...).compile().as_text()``), in which XLA's
    command-buffer-scheduling pass has moved runs of commands into computations named ``command_buffer*``
    called from the entry (or a loop body). Walks the computations the entry reaches through ``call`` / ``while`` /
    ``conditional`` (fusion bodies and reducers are not walked: a fusion is one launch).

    Returns:
      dict: ``graphs`` (calls of command-buffer computations, counted once per call site), ``in_graphs`` and
      ``outside`` ({what: count}: ``fusion``, ``custom-call:TARGET``, or another op name, per call site; a loop
      body counts once, not per iteration).
    """
    comps, entry, cur = {}, None, None
    for line in hlo_text.splitlines():
        m = _COMP.match(line)
        if m:
            cur = m.group(2)
            comps[cur] = []
            if m.group(1):
                entry = cur
            continue
        if line.startswith("}"):
            cur = None
            continue
        if cur is None:
            continue
        i = _INST.match(line)
        if i:
            comps[cur].append((i.group(2), line))
    out = {"graphs": 0, "in_graphs": {}, "outside": {}}

    def walk(name, in_graph, seen):
        if name not in comps or name in seen:
            return
        seen = seen | {name}
        for op, line in comps[name]:
            refs = [r for k, r in _REFS.findall(line) if op != "fusion" and (op != "call" or k == "to_apply")
                    and (op in ("call", "while", "conditional"))]
            b = _BRANCHES.search(line)
            if b and op == "conditional":
                refs += [x.strip().lstrip("%") for x in b.group(1).split(",") if x.strip()]
            for r in refs:
                graph = r.startswith("command_buffer")
                out["graphs"] += int(graph and op == "call")
                walk(r, in_graph or graph, seen)
            if op in _NO_LAUNCH:
                continue
            what = op
            if op == "custom-call":
                t = re.search(r'custom_call_target="([^"]*)"', line)
                what = f"custom-call:{t.group(1) if t else '?'}"
            d = out["in_graphs" if in_graph else "outside"]
            d[what] = d.get(what, 0) + 1

    if entry is not None:
        walk(entry, entry.startswith("command_buffer"), set())
    return out


_IR = re.compile(r'\bir = "(?:[^"\\]|\\.)*"')
_FILE = re.compile(r'^(\d+) "(.*)"$')
_LOC = re.compile(r"^(\d+) \{file_name_id=(\d+) function_name_id=(\d+) line=(\d+)")
_FRAME = re.compile(r"^(\d+) \{file_location_id=(\d+) parent_frame_id=(\d+)\}")


def hlo_stack_frames(hlo_text: str) -> dict:
    """The stack-frame table of an HLO module's text: {frame id: [(file, line, function), ...] innermost first}.

    The text prints a frame's parent as its id plus one (0 + 1 for a frame without parent): checked against a
    small jitted function whose call chain is known.
    """
    tables = {"FileNames": {}, "FunctionNames": {}, "FileLocations": {}, "StackFrames": {}}
    cur = None
    for line in hlo_text.splitlines():
        if line in tables:
            cur = line
            continue
        if cur is None:
            continue
        if not line.strip():
            if tables[cur]:
                cur = None
            continue
        if cur in ("FileNames", "FunctionNames"):
            m = _FILE.match(line)
            if m:
                tables[cur][int(m.group(1))] = m.group(2)
        elif cur == "FileLocations":
            m = _LOC.match(line)
            if m:
                tables[cur][int(m.group(1))] = (tables["FileNames"].get(int(m.group(2)), "?"),
                                                int(m.group(4)),
                                                tables["FunctionNames"].get(int(m.group(3)), "?"))
        else:
            m = _FRAME.match(line)
            if m:
                tables[cur][int(m.group(1))] = (int(m.group(2)), int(m.group(3)) - 1)
    frames, out = tables["StackFrames"], {}
    for fid in frames:
        chain, f = [], fid
        while f in frames and len(chain) < 64:
            loc, parent = frames[f]
            chain.append(tables["FileLocations"].get(loc, ("?", 0, "?")))
            f = parent
        out[fid] = chain
    return out


def _launch_kind(op: str, name: str, line: str, comps: dict) -> str:
    """What one launching instruction runs, named as a GPU profile names it (a fusion's name without its number,
    a Pallas kernel's name, ``sort`` for a fusion that sorts)."""
    if op == "custom-call":
        o = re.search(r'op_name="([^"]*)"', line)
        if o and o.group(1).endswith("/pallas_call"):
            return o.group(1).split("/")[-2]
        t = re.search(r'custom_call_target="([^"]*)"', line)
        return f"custom-call:{t.group(1) if t else '?'}"
    if op == "fusion":
        c = re.search(r"\bcalls=%?([\w.\-]+)", line)
        body = comps.get(c.group(1), []) if c else []
        if any(o == "sort" for o, _ in body):
            return "sort"
        return re.sub(r"(\.\d+)+$", "", name)
    return op


def hlo_attribution(hlo_text: str, computation: str | None = None) -> list[dict]:
    """Each kernel launch of one computation of a compiled GPU program (by default the body of its largest while
    loop: a steps program's one token), with the source line it comes from.

    Walks the computation and the ``call`` / ``while`` / ``conditional`` computations it reaches (fusion bodies
    are one launch each, as in `hlo_launches`).

    Returns:
      one dict per launching instruction: ``kind`` (`_launch_kind`), ``name``, ``op_name`` (the JAX name stack)
      and ``frames`` ([(file, line, function), ...] innermost first; empty where the instruction has no
      ``stack_frame_id``).
    """
    text = _IR.sub('ir = ""', hlo_text)
    comps, entry, cur, insts = {}, None, None, _INST
    for line in text.splitlines():
        m = _COMP.match(line)
        if m:
            cur = m.group(2)
            comps[cur] = []
            if m.group(1):
                entry = cur
            continue
        if line.startswith("}"):
            cur = None
            continue
        if cur is None:
            continue
        i = insts.match(line)
        if i:
            comps[cur].append((i.group(2), line))
    if computation is None:
        bodies = [b.group(1) for c in comps.values() for op, line in c if op == "while"
                  for b in [re.search(r"\bbody=%?([\w.\-]+)", line)] if b]
        computation = max(bodies, key=lambda b: len(comps.get(b, [])), default=entry)
    frames = hlo_stack_frames(hlo_text)
    out = []

    def walk(name, seen):
        if name not in comps or name in seen:
            return
        seen = seen | {name}
        for op, line in comps[name]:
            if op in ("call", "while", "conditional"):
                for k, r in _REFS.findall(line):
                    if op != "call" or k == "to_apply":
                        walk(r, seen)
                b = _BRANCHES.search(line)
                if b and op == "conditional":
                    for r in b.group(1).split(","):
                        walk(r.strip().lstrip("%"), seen)
            if op in _NO_LAUNCH or op == "fusion-done" or op.endswith("-done"):
                continue
            nm = re.match(r"^\s*(?:ROOT )?%?([\w.\-]+) =", line).group(1)
            sf = re.search(r"\bstack_frame_id=(\d+)", line)
            o = re.search(r'op_name="([^"]*)"', line)
            out.append({"kind": _launch_kind(op, nm, line, comps), "name": nm, "op_name": o.group(1) if o else "",
                        "frames": frames.get(int(sf.group(1)), []) if sf else []})

    walk(computation, set())
    return out


def attribution_table(launches: list[dict], *, depth: int = 1, under: str = "strata_jax/",
                      skip: tuple = ()) -> dict:
    """{source: {kind: count}} of `hlo_attribution`'s launches.

    A launch's source is its ``depth`` innermost frames in files whose path contains ``under`` (joined by
    `` < ``, inner first), leaving out frames in files whose path contains one of ``skip`` (helpers such as the
    kernels' api modules, to see their callers instead); ``?`` when none is left.
    """
    table = {}
    for r in launches:
        fr = [f for f in r["frames"] if under in f[0] and not any(s in f[0] for s in skip)][:depth]
        src = " < ".join(f"{f[0].split(under, 1)[-1]}:{f[1]} {f[2]}" for f in fr) or "?"
        row = table.setdefault(src, {})
        row[r["kind"]] = row.get(r["kind"], 0) + 1
    return table


@dataclasses.dataclass
class _Origin:
    root: int | None  # index of the traced function's argument the value comes from (None: computed)
    sliced: str | None = None  # the first slicing primitive on the way, if any


@dataclasses.dataclass
class Report:
    """What `jaxpr_report` found.

    Attributes:
      kernels: names of the Pallas calls (one entry per call site).
      xla_while: loops outside kernels whose trip count is a traced value (``while`` primitives).
      xla_scan: loops outside kernels with a static trip count (scans: ``lax.map``, a layer scan).
      kernel_while: loops inside kernel bodies with traced bounds.
      barriers: ``optimization_barrier`` calls outside kernels.
      sliced_operands: one dict per kernel operand that is a slice of an argument of the traced function:
        ``kernel``, ``arg`` (the argument index), ``via`` (the slicing primitive), ``shape``, ``bytes``.
      ops: {primitive: count} of the equations outside kernel bodies (calls and loops walked, not counted), e.g.
        ``sort`` / ``top_k``, which XLA:GPU runs as sort kernels.
    """

    kernels: list = dataclasses.field(default_factory=list)
    xla_while: list = dataclasses.field(default_factory=list)
    xla_scan: list = dataclasses.field(default_factory=list)
    kernel_while: list = dataclasses.field(default_factory=list)
    barriers: int = 0
    sliced_operands: list = dataclasses.field(default_factory=list)
    ops: dict = dataclasses.field(default_factory=dict)

    def summary(self) -> dict:
        return {"kernels": len(self.kernels), "kernel_variants": len(set(self.kernels)),
                "xla_while": len(self.xla_while), "xla_scan": len(self.xla_scan),
                "kernel_while": len(self.kernel_while), "barriers": self.barriers,
                "sliced_operands": len(self.sliced_operands),
                "sliced_bytes": sum(s["bytes"] for s in self.sliced_operands)}


def _subjaxprs(params):
    for v in params.values():
        for x in (v if isinstance(v, (tuple, list)) else (v,)):
            if hasattr(x, "eqns"):
                yield x
            elif hasattr(x, "jaxpr") and hasattr(x.jaxpr, "eqns"):
                yield x.jaxpr


def _nbytes(aval) -> int:
    return int(math.prod(aval.shape)) * aval.dtype.itemsize


def _is_full(eqn) -> bool:
    a, b = eqn.invars[0].aval, eqn.outvars[0].aval
    return math.prod(a.shape) == math.prod(b.shape)


def jaxpr_report(closed_jaxpr, arg_leaves: list[int] | None = None) -> Report:
    """Walk a traced program (``jax.make_jaxpr(fn)(*args)`` or ``jitted.trace(*args).jaxpr``), kernel bodies and
    nested calls included.

    Args:
      closed_jaxpr: the program.
      arg_leaves: the number of flat inputs of each argument of the traced function (to name an input by its
        argument: 0 = params, 1 = state for a stage function); None numbers the flat inputs instead.
    """
    rep = Report()
    jaxpr = closed_jaxpr.jaxpr if hasattr(closed_jaxpr, "jaxpr") else closed_jaxpr
    roots = []
    if arg_leaves is None:
        roots = list(range(len(jaxpr.invars)))
    else:
        for i, n in enumerate(arg_leaves):
            roots += [i] * n
    origins = {v: _Origin(r) for v, r in zip(jaxpr.invars, roots)}
    _walk(jaxpr, origins, rep, in_kernel=False, kernel_name=None)
    return rep


def _walk(jaxpr, origins: dict, rep: Report, *, in_kernel: bool, kernel_name):
    def origin(v):
        return origins.get(v, _Origin(None)) if not hasattr(v, "val") else _Origin(None)

    for eqn in jaxpr.eqns:
        prim = eqn.primitive.name
        if prim == "pallas_call":
            name = eqn.params.get("name_and_src_info", None)
            name = getattr(name, "name", None) or eqn.params.get("name") or "pallas_call"
            rep.kernels.append(name)
            for v in eqn.invars:
                o = origin(v)
                if o.root is not None and o.sliced:
                    rep.sliced_operands.append({"kernel": name, "arg": o.root, "via": o.sliced,
                                                "shape": tuple(v.aval.shape), "bytes": _nbytes(v.aval)})
            for sub in _subjaxprs(eqn.params):
                _walk(sub, {}, rep, in_kernel=True, kernel_name=name)
            continue
        if not in_kernel and prim not in _CALLS and prim not in ("cond", "while", "scan"):
            rep.ops[prim] = rep.ops.get(prim, 0) + 1
        if prim == "while":
            (rep.kernel_while if in_kernel else rep.xla_while).append(kernel_name or prim)
        elif prim == "scan" and not in_kernel:
            rep.xla_scan.append(eqn.params.get("length"))
        elif prim == "optimization_barrier" and not in_kernel:
            rep.barriers += 1
        ins = [origin(v) for v in eqn.invars]
        if prim in _VIEW or (prim == "broadcast_in_dim" and _is_full(eqn)):
            outs = [ins[0]] if ins else []
        elif prim in _SLICE or prim.startswith("dynamic_slice"):
            o = ins[0] if ins else _Origin(None)
            full = _is_full(eqn)
            outs = [_Origin(o.root, o.sliced or (None if full else prim)) if o.root is not None else _Origin(None)]
        else:
            outs = None
        sub_origins = None
        if prim in _CALLS or prim in ("cond", "while", "scan"):
            subs = list(_subjaxprs(eqn.params))
            if prim == "scan":
                nc, nk = eqn.params.get("num_consts", 0), eqn.params.get("num_carry", 0)
                sub_in = ins[:nc + nk] + [_Origin(o.root, o.sliced or "scan xs") if o.root is not None else o
                                          for o in ins[nc + nk:]]
                sub_origins = [sub_in]
            elif prim == "cond":
                sub_origins = [ins[1:]] * len(subs)
            elif prim == "while":
                cn, bn = eqn.params.get("cond_nconsts", 0), eqn.params.get("body_nconsts", 0)
                carry = ins[cn + bn:]
                if "body_jaxpr" in eqn.params and "cond_jaxpr" in eqn.params:
                    body, cond = eqn.params["body_jaxpr"].jaxpr, eqn.params["cond_jaxpr"].jaxpr
                    subs = [body, cond]
                    sub_origins = [ins[cn:cn + bn] + carry, ins[:cn] + carry]
                else:  # (parameter names of another jax version: walk the bodies, origins unknown)
                    sub_origins = [[_Origin(None)] * len(sb.invars) for sb in subs]
            else:
                sub_origins = [ins] * len(subs)
            for sub, so in zip(subs, sub_origins):
                inner = {v: o for v, o in zip(sub.invars, so)}
                _walk(sub, inner, rep, in_kernel=in_kernel, kernel_name=kernel_name)
                if prim in _CALLS and outs is None:
                    outs = [inner.get(v, _Origin(None)) if not hasattr(v, "val") else _Origin(None)
                            for v in sub.outvars]
        if outs is None:
            outs = [_Origin(None)] * len(eqn.outvars)
        for v, o in zip(eqn.outvars, outs):
            origins[v] = o
