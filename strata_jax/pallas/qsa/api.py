"""Public API: QSA sparse attention (the 12 full-attention layers of qwen4exp) for verify rows and prefill.

Source: Strata ``include/strata/kernels/qsa.hpp`` (``qsa_attend``, top-k with ties to the
lower index); mlx-vlm ``qwen4_exp/language.py`` (``Qwen4ExpQSAIndexer``, ``Qwen4ExpAttention``).

``qsa_attention(q, k_cache, v_cache, iq, pooled, n_kv, n_complete, *, top_blocks=512, block=4, scale=None,
seg=None, cell_base=None, impl="auto") -> float32 [T, Hq, D]``

* ``q`` [T, Hq, D]: the query rows (normed and RoPE'd; D = 256 in qwen4exp, Hq = 24).
* ``k_cache``, ``v_cache`` [N, Hkv, D] float32/bfloat16/float16: the cache cells 0..N-1 (Hkv = 2). GQA: query head h
  uses kv head ``h // (Hq // Hkv)`` (integer division).
* ``iq`` [T, Hi, Di]: the indexer queries (normed, RoPE'd; Hi = 4, Di = 128). ``pooled`` [NB, Di]: the pooled
  key of every complete block of ``block`` cells (block b = cells b*block .. b*block+block-1), in block order.
* ``n_kv`` [T] int32: cells row t may see (its causal prefix, 1 <= n_kv[t] <= N). ``n_complete`` [T] int32:
  complete blocks row t may see (0 <= n_complete[t] <= NB; the caller decides whether a block completed by the
  row's own token counts); the cells ``n_complete*block <= c < n_kv`` are the row's unfinished tail, which must
  hold at most ``block - 1`` cells, and is always attended.
* Selection: block score ``sum_h ReLU(iq[t, h] . pooled[b])`` (ReLU per head, no softmax, no 1/sqrt scaling: it
  would not change the ranking); the ``top_blocks`` best complete blocks are chosen, ties to the lower index; with
  n_complete[t] <= top_blocks every complete block is chosen (so every visible cell is attended).
* Attention: softmax of ``scale * q_h . k_c`` over the selected cells (scale defaults to D**-0.5), times v_c.
* Result: float32 [T, Hq, D]; the caller applies the output gate and W_o.
* Rows of several sequences in one call (the B segments of a verify window): ``pooled`` [S, NB, Di] with ``seg``
  [T] int32 (row t scores the blocks ``pooled[seg[t]]``), and ``cell_base`` [T] int32: row t's cell c is
  ``k_cache[cell_base[t] + c]`` (the caches given flat, [n_slots * cells_per_slot, Hkv, D], and cell_base =
  slot * cells_per_slot). n_kv and n_complete stay relative to the row's own sequence.

Paths: the reference scores, selects and attends one row at a time in plain jnp (`reference`); the kernel path
scores the blocks in a Pallas kernel (`kernel.block_scores_kernel`), selects in jnp (`reference.select_blocks`,
exact integer work) and attends with a Pallas flash-decoding kernel over the selected cells. Each is
row-independent (row t of a T-row call == the row alone, bit for bit); they agree to ~1e-5 relative.

``qsa_prefill(q, k_cache, v_cache, iq, pooled, n_kv, n_complete, *, top_blocks=512, block=4, scale=None,
cell_base=None, impl="auto") -> float32 [B, T, Hq, D]``: the same attention for prefill chunks, B segments of T
rows (each the rows of one sequence, usually at consecutive positions): ``q`` [B, T, Hq, D], ``iq`` [B, T, Hi, Di],
``pooled`` [B, NB, Di] (segment b's blocks), ``n_kv`` / ``n_complete`` [B, T] (as above, per row), ``cell_base``
[B] (segment b's cell c is ``k_cache[cell_base[b] + c]``; None = 0). The reference path is `qsa_attention`'s over
the B*T rows. Two kernel paths (``STRATA_QSA_PREFILL``, `prefill_variant`):

* ``rows`` (the default): `qsa_attention`'s kernel path over the B*T rows (one program per (row, kv head, split of
  the row's selected cells)), with `PREFILL_ATTEND`'s 16 splits per row (a window's rows take 65 at Flash-Next's
  shapes), in slices of `PREFILL_ROWS` rows so that the partial sums stay small (~0.5 MB per row). Its work
  follows the cells each row selects. On the H100 (2026-12-06, `experiments/bench_kernels.py --only qsa_prefill`,
  Flash-Next shapes, 512 rows): 3.9 ms at the end of 8,192 cells and 1.0 ms as a prompt's first chunk, against
  106.6 / 4.0 ms for ``tiles`` (and 4.2 / 1.5 ms with a window's 65 splits).
* ``tiles`` (`prefill`): scores as tiled products, selection in jnp, a block-sparse flash-attention kernel over key
  tiles at fixed cells (tensor-core products for tiles of query rows); it needs ``block`` a power of two <= 16. It
  runs every key tile any row of a query tile selects, so scattered selections cost it the whole cache.

On either, row t's result depends only on its own inputs and compile-time constants, not on T, B or the other rows;
the two need not give the same bits for a row (other summation orders; both agree with float64 to ~1e-5 relative).
`prefill_variant` reads ``STRATA_QSA_PREFILL`` on every call but impl="reference"'s.

``attend_cells(q, k_cache, v_cache, cells, *, scale=None, impl="auto") -> float32 [T, Hq, D]``: the attention part
alone, over an explicit cell list int32 [T, C] (-1 = none; every row must list at least one cell): what the dense
(unindexed) attention layers run on the kernel path, with each row's causal cells listed
(`strata_jax.layers.attention`). Its kernel's split layout depends on C only.

Errors: `strata_jax.errors.UnsupportedError` for inconsistent shapes, an unknown impl, an unknown
``STRATA_QSA_PREFILL``, or impl="kernel"/"interpret" where the kernel cannot serve (D not a power of two >= 16, Hq
not a multiple of Hkv; ``tiles``: ``block`` not a power of two <= 16).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from strata_jax.errors import UnsupportedError
from strata_jax.pallas import dispatch
from strata_jax.pallas.qsa import kernel as _k
from strata_jax.pallas.qsa import prefill as _p
from strata_jax.pallas.qsa import reference as _ref


def _check(q, k_cache, v_cache, iq, pooled, n_kv, n_complete, top_blocks, block, seg, cell_base):
    op = "qsa.qsa_attention"
    if q.ndim != 3 or k_cache.ndim != 3 or v_cache.shape != k_cache.shape:
        raise UnsupportedError(f"{op}: q {q.shape} must be [T, Hq, D], k/v caches {k_cache.shape} / "
                               f"{v_cache.shape} [N, Hkv, D]")
    T, Hq, D = q.shape
    if k_cache.shape[2] != D or Hq % k_cache.shape[1]:
        raise UnsupportedError(f"{op}: q {q.shape} does not fit the cache {k_cache.shape} (GQA needs Hq % Hkv == 0)")
    if iq.ndim != 3 or iq.shape[0] != T or pooled.ndim != (2 if seg is None else 3) or pooled.shape[-1] != iq.shape[2]:
        raise UnsupportedError(f"{op}: iq {iq.shape} must be [{T}, Hi, Di] and pooled {pooled.shape} [NB, Di] "
                               "(or [S, NB, Di] with seg)")
    for name, a in (("seg", seg), ("cell_base", cell_base)):
        if a is not None and a.shape != (T,):
            raise UnsupportedError(f"{op}: {name} has shape {a.shape}, expected [{T}]")
    if n_kv.shape != (T,) or n_complete.shape != (T,):
        raise UnsupportedError(f"{op}: n_kv {n_kv.shape} and n_complete {n_complete.shape} must be [{T}]")
    if top_blocks < 1 or block < 1:
        raise UnsupportedError(f"{op}: top_blocks={top_blocks} and block={block} must be >= 1")


@functools.partial(jax.jit, static_argnames=("top_blocks", "block", "scale", "path", "poison"))
def _qsa(q, k_cache, v_cache, iq, pooled, n_kv, n_complete, seg, cell_base, *, top_blocks, block, scale, path,
         poison):
    if path == "reference":
        return _ref.qsa_attention(q, k_cache, v_cache, iq, pooled, n_kv, n_complete, top_blocks=top_blocks,
                                  block=block, scale=scale, seg=seg, cell_base=cell_base)
    with dispatch.poison_outputs(poison):
        return _qsa_rows(q, k_cache, v_cache, iq, pooled, n_kv, n_complete, seg, cell_base, top_blocks=top_blocks,
                         block=block, scale=scale, interpret=path == "interpret")


def _qsa_rows(q, k_cache, v_cache, iq, pooled, n_kv, n_complete, seg, cell_base, *, top_blocks, block, scale,
              interpret, attend_cfg=None):
    """The kernel path over rows: block scores (Pallas), selection (jnp), flash decoding over each row's cells
    (``attend_cfg``: `kernel.attend_kernel`'s launch parameters, None = its default; benchmarks try others)."""
    if _k.scores_why_not(iq.shape[1], iq.shape[2], pooled.shape[-2]) is None:
        scores = _k.block_scores_kernel(iq, pooled, seg, interpret=interpret)
    else:  # (an indexer head dim the scores kernel cannot serve: the reference's row loop)
        scores = _ref.block_scores(iq, pooled, seg)
    cells = _ref.cells_from_scores(scores, n_kv, n_complete, top_blocks=top_blocks, block=block, cell_base=cell_base)
    return _k.attend_kernel(q, k_cache, v_cache, cells, scale, interpret=interpret, cfg=attend_cfg)


def qsa_attention(q, k_cache, v_cache, iq, pooled, n_kv, n_complete, *, top_blocks: int = 512, block: int = 4,
                  scale: float | None = None, seg=None, cell_base=None, impl: str = "auto"):
    """float32 [T, Hq, D]: QSA attention of T query rows. See the module docstring for the contract."""
    _check(q, k_cache, v_cache, iq, pooled, n_kv, n_complete, top_blocks, block, seg, cell_base)
    D = q.shape[2]
    scale = float(D ** -0.5 if scale is None else scale)
    path = dispatch.resolve(
        "qsa.qsa_attention", impl,
        lambda: _k.why_not(q.shape[1], k_cache.shape[1], D, k_cache.shape[0], [q.dtype, k_cache.dtype, v_cache.dtype]))
    return _qsa(q, k_cache, v_cache, iq, pooled, n_kv, n_complete, seg, cell_base, top_blocks=top_blocks,
                block=block, scale=scale, path=path, poison=dispatch.poisoning())


PREFILL_VARIANTS = ("rows", "tiles")
# The ``rows`` path's launch parameters: 16 splits of a row's cell list, 32 cells per step, 8 warps (H100,
# 2026-12-06: 0.67x the time of the window's layout for a first chunk, 0.92x at 8,192 cells; a quarter of the
# partial sums to merge). A function of the prefill path alone, never of the rows.
PREFILL_ATTEND = _k.AttendConfig(NC=32, max_split=16, num_warps=8, num_stages=2, tag="_rows_prefill")
# rows per slice of the ``rows`` path: the partial sums take ~0.5 MB per row at Flash-Next's shapes (2 kv heads x
# 16 splits x 16 heads x 256 floats), ~256 MB per slice
PREFILL_ROWS = 512


def prefill_variant() -> str:
    """``STRATA_QSA_PREFILL``: the kernel path of `qsa_prefill`, ``rows`` (default) or ``tiles`` (module
    docstring). Read when a call is traced.

    Raises:
      UnsupportedError: another value."""
    return dispatch.env_choice("STRATA_QSA_PREFILL", "rows", PREFILL_VARIANTS)


@functools.partial(jax.jit, static_argnames=("top_blocks", "block", "scale", "path", "poison", "variant",
                                             "slice_rows"))
def _qsa_prefill(q, k_cache, v_cache, iq, pooled, n_kv, n_complete, cell_base, *, top_blocks, block, scale, path,
                 poison, variant, slice_rows):
    B, T = q.shape[:2]
    interpret = path == "interpret"
    if path != "reference" and variant == "tiles":
        with dispatch.poison_outputs(poison):
            return _p.qsa_prefill_kernel(q, k_cache, v_cache, iq, pooled, n_kv, n_complete, cell_base,
                                         top_blocks=top_blocks, block=block, scale=scale, interpret=interpret)
    rows = lambda a: a.reshape(B * T, *a.shape[2:])
    seg = jnp.repeat(jnp.arange(B, dtype=jnp.int32), T)
    base = jnp.repeat(cell_base.astype(jnp.int32), T)
    if path == "reference":
        o = _ref.qsa_attention(rows(q), k_cache, v_cache, rows(iq), pooled, rows(n_kv), rows(n_complete),
                               top_blocks=top_blocks, block=block, scale=scale, seg=seg, cell_base=base)
        return o.reshape(q.shape)
    args = [rows(q), rows(iq), rows(n_kv), rows(n_complete), seg, base]
    outs = []
    with dispatch.poison_outputs(poison):
        for r0 in range(0, B * T, slice_rows):  # static slices: each row's programs are its own
            qs, iqs, nkv, nc, sg, cb = (a[r0:r0 + slice_rows] for a in args)
            outs.append(_qsa_rows(qs, k_cache, v_cache, iqs, pooled, nkv, nc, sg, cb, top_blocks=top_blocks,
                                  block=block, scale=scale, interpret=interpret, attend_cfg=PREFILL_ATTEND))
    return jnp.concatenate(outs).reshape(q.shape)


def qsa_prefill(q, k_cache, v_cache, iq, pooled, n_kv, n_complete, *, top_blocks: int = 512, block: int = 4,
                scale: float | None = None, cell_base=None, impl: str = "auto"):
    """float32 [B, T, Hq, D]: QSA attention of B prefill segments of T rows each (q [B, T, Hq, D], iq
    [B, T, Hi, Di], pooled [B, NB, Di], n_kv / n_complete int32 [B, T], cell_base int32 [B] or None). See the
    module docstring for the contract; `UnsupportedError` for shapes that do not fit."""
    op = "qsa.qsa_prefill"
    if q.ndim != 4 or iq.ndim != 4 or pooled.ndim != 3:
        raise UnsupportedError(f"{op}: q {q.shape} must be [B, T, Hq, D], iq {iq.shape} [B, T, Hi, Di] and pooled "
                               f"{pooled.shape} [B, NB, Di]")
    B, T = q.shape[:2]
    if iq.shape[:2] != (B, T) or pooled.shape[0] != B or n_kv.shape != (B, T) or n_complete.shape != (B, T) \
            or (cell_base is not None and cell_base.shape != (B,)):
        raise UnsupportedError(f"{op}: iq {iq.shape}, pooled {pooled.shape}, n_kv {n_kv.shape}, n_complete "
                               f"{n_complete.shape}, cell_base {None if cell_base is None else cell_base.shape} do "
                               f"not fit q {q.shape}")
    rows = lambda a: jax.ShapeDtypeStruct((B * T, *a.shape[2:]), a.dtype)  # shapes only: no device work
    _check(rows(q), k_cache, v_cache, rows(iq), pooled, rows(n_kv), rows(n_complete), top_blocks, block,
           jax.ShapeDtypeStruct((B * T,), jnp.int32), None)
    D = q.shape[3]
    scale = float(D ** -0.5 if scale is None else scale)
    cell_base = jnp.zeros((B,), jnp.int32) if cell_base is None else cell_base
    variant = "rows" if impl == "reference" else prefill_variant()  # the reference has one path
    dtypes = [q.dtype, k_cache.dtype, v_cache.dtype]
    Hq, Hkv, N = q.shape[2], k_cache.shape[1], k_cache.shape[0]
    path = dispatch.resolve(op, impl, lambda: _p.why_not(Hq, Hkv, D, N, block, dtypes) if variant == "tiles"
                            else _k.why_not(Hq, Hkv, D, N, dtypes))
    return _qsa_prefill(q, k_cache, v_cache, iq, pooled, n_kv, n_complete, cell_base, top_blocks=top_blocks,
                        block=block, scale=scale, path=path, poison=dispatch.poisoning(), variant=variant,
                        slice_rows=PREFILL_ROWS)


def _attend_why_not(q, k_cache, v_cache):
    return lambda: _k.why_not(q.shape[1], k_cache.shape[1], q.shape[2], k_cache.shape[0],
                              [q.dtype, k_cache.dtype, v_cache.dtype])


def attend_cells_path(q, k_cache, v_cache, impl: str = "auto") -> str:
    """The path `attend_cells` takes for these operands: "reference", "kernel" or "interpret" (for callers that
    build the cell list only on the kernel path)."""
    return dispatch.resolve("qsa.attend_cells", impl, _attend_why_not(q, k_cache, v_cache))


@functools.partial(jax.jit, static_argnames=("scale", "path", "poison"))
def _attend_cells(q, k_cache, v_cache, cells, *, scale, path, poison):
    if path == "reference":
        return _ref.attend(q, k_cache, v_cache, cells, scale)
    with dispatch.poison_outputs(poison):
        return _k.attend_kernel(q, k_cache, v_cache, cells, scale, interpret=path == "interpret")


def attend_cells(q, k_cache, v_cache, cells, *, scale: float | None = None, impl: str = "auto"):
    """float32 [T, Hq, D]: softmax attention of each row of q [T, Hq, D] over its cells (int32 [T, C], -1 = none)
    of the caches [N, Hkv, D] (GQA as `qsa_attention`). See the module docstring."""
    if q.ndim != 3 or k_cache.ndim != 3 or v_cache.shape != k_cache.shape or cells.ndim != 2 \
            or cells.shape[0] != q.shape[0] or q.shape[2] != k_cache.shape[2] or q.shape[1] % k_cache.shape[1]:
        raise UnsupportedError(f"qsa.attend_cells: q {q.shape} [T, Hq, D], caches {k_cache.shape} / "
                               f"{v_cache.shape} [N, Hkv, D] and cells {cells.shape} [T, C] do not fit")
    scale = float(q.shape[2] ** -0.5 if scale is None else scale)
    path = attend_cells_path(q, k_cache, v_cache, impl)
    return _attend_cells(q, k_cache, v_cache, cells, scale=scale, path=path, poison=dispatch.poisoning())


def attend_range_path(q, k_cache, v_cache, impl: str = "auto") -> str:
    """The path `attend_range` takes: "reference", "kernel" or "interpret" (q [B, T, Hq, D])."""
    return dispatch.resolve("qsa.attend_range", impl,
                            _attend_why_not(jax.ShapeDtypeStruct(q.shape[1:], q.dtype), k_cache, v_cache))


@functools.partial(jax.jit, static_argnames=("n_cells", "scale", "path", "poison"))
def _attend_range(q, k_cache, v_cache, lo, hi, cell_base, *, n_cells, scale, path, poison):
    if path == "reference":
        B, T, Hq, D = q.shape
        c = jnp.arange(n_cells, dtype=jnp.int32)
        ok = (c >= lo[..., None]) & (c < hi[..., None])                            # [B, T, n_cells]
        cells = jnp.where(ok, cell_base[:, None, None] + c, -1).reshape(B * T, n_cells)
        return _ref.attend(q.reshape(B * T, Hq, D), k_cache, v_cache, cells, scale).reshape(q.shape)
    with dispatch.poison_outputs(poison):
        return _p.attend_range_kernel(q, k_cache, v_cache, lo, hi, cell_base, n_cells=n_cells, scale=scale,
                                      interpret=path == "interpret")


def attend_range(q, k_cache, v_cache, lo, hi, cell_base, *, n_cells: int, scale: float | None = None,
                 impl: str = "auto"):
    """float32 [B, T, Hq, D]: dense attention of B prefill segments (q [B, T, Hq, D]) over the flat caches
    [N, Hkv, D]: row (b, t) attends cells ``lo[b, t] <= c < hi[b, t]`` (int32 [B, T], at least one cell, hi <=
    n_cells) of its segment, cache cell ``cell_base[b] + c`` (int32 [B]). What the dense attention layers run for a
    prefill chunk on the kernel path (`prefill.attend_range_kernel`: tensor-core tiles shared by the chunk's rows;
    a row's bits never depend on T or the other rows); the reference lists the cells for `reference.attend`.

    Raises:
      UnsupportedError: shapes that do not fit, or impl="kernel"/"interpret" where the kernel cannot serve."""
    if q.ndim != 4 or k_cache.ndim != 3 or v_cache.shape != k_cache.shape or q.shape[3] != k_cache.shape[2] \
            or q.shape[2] % k_cache.shape[1] or lo.shape != q.shape[:2] or hi.shape != q.shape[:2] \
            or cell_base.shape != q.shape[:1]:
        raise UnsupportedError(f"qsa.attend_range: q {q.shape} [B, T, Hq, D], caches {k_cache.shape} / "
                               f"{v_cache.shape} [N, Hkv, D], lo {lo.shape} / hi {hi.shape} [B, T] and cell_base "
                               f"{cell_base.shape} [B] do not fit")
    scale = float(q.shape[3] ** -0.5 if scale is None else scale)
    path = attend_range_path(q, k_cache, v_cache, impl)
    return _attend_range(q, k_cache, v_cache, lo.astype(jnp.int32), hi.astype(jnp.int32),
                         cell_base.astype(jnp.int32), n_cells=int(n_cells), scale=scale, path=path,
                         poison=dispatch.poisoning())
