"""Stages of a layer split: which layers each device runs, their weights and state placed there, and the jitted
calls that run one stage.

``--layer_split K1,K2,...`` gives the first layer of each later stage: ``12,24,36`` on 48 layers is
four stages of 12. The first stage owns the embedding, the last the final norm, the head and the sampler. Hidden rows
are handed from stage to stage with `jax.device_put` (a small [B, T, D] array per window).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from strata_jax.errors import StrataError
from strata_jax.sampling import RowSampling, pick_tokens
from strata_jax.state import Rows

MAX_WINDOW = 8  # most rows of a verify window (the last accepted token + up to 7 proposals)


def parse_layer_split(spec: str | None, n_layer: int, n_devices: int) -> list[tuple[int, int]]:
    """Layer ranges per stage from ``--layer_split``.

    Args:
      spec: ``"K1,K2,..."`` (first layer of each later stage), or None/"" for one stage.
      n_layer: trunk layers.
      n_devices: devices available.

    Returns:
      [(start, stop), ...], one per stage.

    Raises:
      StrataError: boundaries not strictly increasing inside (0, n_layer), or more stages than devices.
    """
    if not spec:
        return [(0, n_layer)]
    try:
        cuts = [int(s) for s in str(spec).split(",") if s.strip()]
    except ValueError:
        raise StrataError(f"--layer_split {spec!r}: expected comma-separated layer numbers, e.g. 12,24,36") from None
    bounds = [0] + cuts + [n_layer]
    for a, b in zip(bounds, bounds[1:]):
        if not a < b:
            raise StrataError(f"--layer_split {spec!r}: boundaries must increase strictly inside 1..{n_layer - 1} "
                              f"(the model has {n_layer} layers)")
    n_stages = len(bounds) - 1
    if n_stages > n_devices:
        raise StrataError(f"--layer_split {spec!r} needs {n_stages} devices, only {n_devices} available "
                          f"(on CPU, XLA_FLAGS=--xla_force_host_platform_device_count={n_stages} gives more)")
    return list(zip(bounds[:-1], bounds[1:]))


@dataclasses.dataclass
class Stage:
    """One stage: its layer range, device, and the split Flax module (graphdef + params).

    ``leaves`` / ``treedef`` are ``params`` flattened once: the engine's per-step calls take the flat list, so a call
    does not walk the Flax state (hundreds of Python-level flattens per call on a 28-layer model)."""

    index: int
    start: int
    stop: int
    device: Any
    graphdef: Any
    params: Any
    module: Any
    first: bool
    last: bool
    leaves: list = dataclasses.field(default_factory=list)
    treedef: Any = None


def make_stage(module, index: int, device) -> Stage:
    graphdef, params = nnx.split(module)
    leaves, treedef = jax.tree.flatten(params)
    return Stage(index, module.start, module.stop, device, graphdef, params, module, module.first, module.last,
                 leaves, treedef)


def acceptance(tokens: jax.Array, picks: jax.Array, n_valid: jax.Array) -> jax.Array:
    """Keep counts of a verify window by exact match: a proposal is kept while it equals the target's pick.

    Args:
      tokens: int32 [B, T] the window's input tokens (row 0 the last accepted token, then the proposals).
      picks: int32 [B, T] the target's pick after each row.
      n_valid: int32 [B] real rows per segment.

    Returns:
      int32 [B]: ``1 + number of leading t with tokens[t + 1] == picks[t]`` among the valid rows.
    """
    T = tokens.shape[1]
    if T == 1:
        return jnp.ones(tokens.shape[:1], jnp.int32)
    t = jnp.arange(T - 1)[None, :]
    match = (tokens[:, 1:] == picks[:, :-1]) & (t + 1 < n_valid[:, None])
    return 1 + jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)


def build_stage_fn(stage: Stage, kind: str, max_context: int, logits: str = "all"):
    """The jitted function of one stage for one kind of call (`stage_fn_body`, ``state`` donated); its ``params``
    may be ``stage.params`` or the flat ``stage.leaves`` (the engine's calls: no walk of the Flax state per call)."""
    return jax.jit(stage_fn_body(stage, kind, max_context, logits), donate_argnums=(1,))


def stage_fn_body(stage: Stage, kind: str, max_context: int, logits: str = "all"):
    """The function of one stage for one kind of call (to be jitted: `build_stage_fn`, `build_steps_fn`).

    kinds:
      ``window``: a verify window; state's recurrent parts untouched; returns pending for commit.
      ``step``: a window whose every valid row is kept (plain decode), commit fused in.
      ``prefill``: a prompt chunk, committed.

    The function's signature is ``fn(params, state, x, rows, tokens, sampling, extra=None) -> (out, state,
    pending)`` (``extra``: per-row inputs a stage needs besides x, e.g. qwen4exp's PLE table rows): ``x`` is
    the token ids [B, T] on the first stage or the hidden rows [B, T, D] later; on the last stage ``out`` holds
    ``picks`` [B, T] (sampled on the device), ``n_keep`` [B] (acceptance against ``tokens``) and, when asked,
    ``logits``; otherwise ``out["hidden"]`` is what the next stage takes.
    """
    graphdef, treedef = stage.graphdef, stage.treedef
    mode = "prefill" if kind == "prefill" else "window"

    def fn(params, state, x, rows: Rows, tokens, sampling: RowSampling, extra=None):
        if isinstance(params, list):  # stage.leaves
            params = jax.tree.unflatten(treedef, params)
        m = nnx.merge(graphdef, params)
        out, state, pending = m(state, x, rows, mode, max_context, logits, **(extra or {}))
        if kind in ("step", "prefill"):
            state = m.commit(state, pending, rows, rows.n_valid) if pending is not None else state
            pending = None
        res = {}
        if stage.last:
            lg = out["logits"]
            B, T, V = lg.shape
            if logits == "last":
                pos = (rows.pos0 + jnp.maximum(rows.n_valid - 1, 0))[:, None]
            else:
                pos = rows.positions(T)
            samp = jax.tree.map(lambda a: jnp.repeat(a, T), sampling)
            picks = pick_tokens(lg.reshape(B * T, V), samp, pos.reshape(-1)).reshape(B, T)
            res["picks"] = picks
            res["n_keep"] = acceptance(tokens, picks, rows.n_valid) if logits == "all" else jnp.ones((B,), jnp.int32)
            res["logits"] = lg
            res["hidden"] = out["hidden"]
            for k in out:
                if k not in ("logits", "hidden"):
                    res[k] = out[k]
        else:
            res["hidden"] = out["hidden"]
        return res, state, pending

    return fn


def build_steps_fn(stage: Stage, n_steps: int, max_context: int, ple_ids=None):
    """``steps(leaves, state, token, rows, sampling) -> (out, state)``: ``n_steps`` plain decode steps in one
    device program, each step's pick the next step's token (a `jax.lax.fori_loop` with a trip count XLA knows).

    For a model in one stage (first and last): the host launches one program per ``n_steps`` tokens instead of one
    per token. Why: on the H200 the 1.5B shape's step is host-bound (a 655-command
    CUDA graph: 4.4 ms of host time to launch for 2.1 ms of GPU work, 2026-12-03); a program of several steps pays
    that once. Each iteration is the one-row ``step`` body (`stage_fn_body`: the same kernels, the commit fused
    in, the pick keyed by its position), so the tokens are those of ``n_steps`` separate steps.

    qwen4exp's PLE rows come from the table on the device (``ple_ids``: `strata_jax.layers.ple.DeviceRowIds`, the
    same row ids as the host's `PleHost`): each step gathers its token's rows and advances the predecessors.

    Args (of the jitted function): ``leaves`` (``stage.leaves``); ``state`` (donated); ``token`` int32 [B, 1] (host
    or the previous call's ``last`` on the device); ``rows`` the first step's layout (``n_valid`` 1; step i runs at
    ``pos0 + i``); ``sampling`` per segment; ``ple`` (with ``ple_ids``; else None): `PleHost.device_inputs`.

    Returns:
      (out, state): ``out["picks"]`` int32 [B, n_steps] and ``out["last"]`` int32 [B, 1] (the last pick: the next
      call's ``token``, with no slicing op of its own); with PLE ``out["prev"]`` int32 [B, ngram_size - 1], the
      predecessors after the last step.

    Raises:
      StrataError: ``n_steps`` < 1, or the stage is not the whole model.
    """
    if n_steps < 1:
        raise StrataError(f"decode steps per call: {n_steps} (must be at least 1)")
    if not (stage.first and stage.last):
        raise StrataError("several decode steps per call need the whole model in one stage")
    body = stage_fn_body(stage, "step", max_context, "all")
    treedef = stage.treedef

    def fn(leaves, state, token, rows: Rows, sampling: RowSampling, ple=None):
        params = jax.tree.unflatten(treedef, leaves)
        token = jnp.asarray(token, jnp.int32)
        B = token.shape[0]

        def one(i, carry):
            state, tok, picks, prev = carry
            r = Rows(rows.slot, rows.pos0 + i, rows.n_valid)
            extra = None
            if ple is not None:  # this step's table rows, uint8 [B, 1, heads, row_bytes], as PleHost.rows_for
                extra = {"ple": ple["raw"][ple_ids(ple, prev, tok)]}
                prev = jnp.concatenate([prev, tok], axis=1)[:, 1:]
            out, state, _ = body(params, state, tok, r, tok, sampling, extra)
            pick = out["picks"][:, :1]
            # a select, not a dynamic_update_slice: XLA:GPU ran that update as an async fusion (fusion-start /
            # -done), which split each iteration into 2-3 CUDA graphs the host launches one by one (H200,
            # 2026-12-04: 3.35 ms idle per Flash-Next token)
            picks = jnp.where(jnp.arange(n_steps)[None, :] == i, pick, picks)
            return state, pick, picks, prev

        prev0 = ple["prev"] if ple is not None else jnp.zeros((B, 0), jnp.int32)
        state, last, picks, prev = jax.lax.fori_loop(
            0, n_steps, one, (state, token, jnp.zeros((B, n_steps), jnp.int32), prev0))
        out = {"picks": picks, "last": last}
        if ple is not None:
            out["prev"] = prev
        return out, state

    return jax.jit(fn, donate_argnums=(1,))


def build_commit_fn(stage: Stage):
    """``commit(leaves, state, pending, rows, keep) -> state``: advance each segment's slot by ``keep[b]`` rows
    (``leaves``: ``stage.leaves``)."""
    graphdef, treedef = stage.graphdef, stage.treedef

    def fn(leaves, state, pending, rows: Rows, keep):
        m = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
        return m.commit(state, pending, rows, keep)

    return jax.jit(fn, donate_argnums=(1,))


def build_mtp_fn(graphdef, mode: str, n_draft: int):
    """The jitted MTP proposer step of the last stage: catch up on a window's kept rows (or a prefill chunk's rows),
    then chain ``n_draft`` greedy drafts (llama.cpp ``draft-mtp``; Strata's MTP chain).

    ``fn(params, state, h, next_tokens, rows, n_use) -> (drafts, probs, state)``:
      h: the last stage's ``out["mtp_hidden"]`` [B, T, D] (or [B, T, hc, D] for qwen4exp) float32;
      next_tokens: int32 [B, T], the token after each row (a window's picks; a prompt's next ids);
      rows: the window's `Rows`; n_use: int32 [B], rows to catch up on (a window's ``n_keep``, else ``n_valid``).
    The MTP cell of row i (position ``pos0 + i``) combines ``h_i`` with the token at ``pos0 + i + 1``; the last used
    row's logits give draft 1 (the token after the bonus token); draft k >= 2 feeds the previous draft's hidden and
    token at position ``q + k - 1`` (q = the last used row's position). Chain cells are overwritten by the next
    catch-up before any query reads them. Returns drafts int32 [B, n_draft] (argmax, ties to the lower id) and each
    draft's probability under the MTP head (float32 [B, n_draft]; for ``--spec_min_p``). ``state`` is donated.
    """

    def pick(lg):
        d = jnp.argmax(lg, axis=-1).astype(jnp.int32)
        p = jnp.exp(jnp.take_along_axis(lg, d[:, None], axis=1)[:, 0] - jax.nn.logsumexp(lg, axis=-1))
        return d, p

    def fn(params, state, h, next_tokens, rows: Rows, n_use):
        m = nnx.merge(graphdef, params)
        use = Rows(rows.slot, rows.pos0, n_use)
        lg, nh, state = m.draft(state, h, next_tokens, use, mode)
        B = h.shape[0]
        last = jnp.maximum(n_use - 1, 0)
        d, p = pick(lg[jnp.arange(B), last].astype(jnp.float32))
        if n_draft == 1:
            return d[:, None], p[:, None], state
        q = rows.pos0 + last
        ones = jnp.ones_like(n_use)

        def body(carry, k):
            st, hl, dl = carry
            lg1, h1, st = m.draft(st, hl[:, None], dl[:, None], Rows(rows.slot, q + k, ones), "window")
            d1, p1 = pick(lg1[:, 0].astype(jnp.float32))
            return (st, h1[:, 0], d1), (d1, p1)

        (state, _, _), (ds, ps) = jax.lax.scan(body, (state, nh[jnp.arange(B), last], d),
                                               jnp.arange(1, n_draft, dtype=jnp.int32))
        return (jnp.concatenate([d[:, None], ds.T], axis=1), jnp.concatenate([p[:, None], ps.T], axis=1), state)

    return jax.jit(fn, donate_argnums=(1,))


def slot_axes(module, max_context: int, kv_dtype):
    """The slot axis of each leaf of ``module``'s state (a pytree of ints, None for a leaf without one), found by
    comparing the state shapes for 1 and 2 slots (nothing is allocated)."""
    a = jax.eval_shape(lambda: module.init_state(1, max_context, kv_dtype))
    b = jax.eval_shape(lambda: module.init_state(2, max_context, kv_dtype))

    def slot_axis(x, y):
        d = [i for i, (p, q) in enumerate(zip(x.shape, y.shape)) if p != q]
        return d[0] if d else None

    return jax.tree.map(slot_axis, a, b)


def build_reset_fn(stage: Stage, max_context: int, kv_dtype):
    """``reset(state, slot) -> state``: one slot's entries of every state leaf zeroed (`slot_axes`), the other
    slots' untouched bit for bit (leaves without a slot axis are kept). ``state`` is donated."""
    axes = slot_axes(stage.module, max_context, kv_dtype)

    def reset(state, s):
        return jax.tree.map(lambda x, ax: x if ax is None else jax.lax.dynamic_update_index_in_dim(
            x, jnp.zeros_like(jax.lax.index_in_dim(x, 0, ax, keepdims=True)), s, ax), state, axes)

    return jax.jit(reset, donate_argnums=(0,))
