"""qwen4exp per-layer n-gram embedding (PLE): host-side row ids and the gated block.

Sources: HF transformers 5.24 ``modeling_qwen4_exp.Qwen4ExpTextNGramEmbedding`` (hashing, EOS cut) and
``Qwen4ExpTextPLELayer`` (the block); the PLE history advances at commit.

Row ids (host, numpy; `ple_row_ids`): for token t0 with predecessors t1, t2 (missing ones, and those at or before
the most recent EOS among the predecessors, replaced by the EOS id), heads 0..hpn-1 use
``bigram = t0*m0 XOR t1*m1`` and heads hpn..2*hpn-1 ``trigram = bigram XOR t2*m2``; row = ``mix mod vocab_h +
offset_h``. HF computes this in **signed int64** with wrap-around and ``torch.remainder`` (floor modulo, result in
[0, vocab_h)); numpy int64 reproduces it exactly (an unsigned uint64 form would differ; the reference's signed form
wins).

The table (``per_layer_token_embd.weight`` [rows, dim]) is never put on the device by this module: the caller
gathers the rows for a window on the host (memory map) and passes ``emb`` float32 [B, T, n_heads*dim] in.

Block (`PLEBlock`, weights ``blk.L.ple_{key,value,norm_key,norm_query,norm_conv,conv1d}``):
  ``key = norm_k(W_key emb)`` [hc, D]; ``query = norm_q(R)``; ``value = W_value emb`` [D];
  ``s_c = key_c . query_c / sqrt(D)``; ``gate_c = sigmoid(sign(s) sqrt(max(|s|, 1e-6)))``; ``gated = gate * value``;
  ``normed = norm_conv(gated)``; ``R += gated + silu(conv_dilated(normed))`` (depthwise, kernel K, dilation = ngram
  size, history = the last (K-1)*dilation rows of ``normed``, float32 [hist, hc*D] per slot).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from strata_jax.gguf import blocks
from strata_jax.layers.gdn import qcall, rowwise
from strata_jax.layers.hyper import norm_per_stream
from strata_jax.layers.linear import QLinear, load_f32
from strata_jax.pallas import rows as row_ops

TABLE = "per_layer_token_embd.weight"

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15
_PRIME_1 = 10007


def _splitmix64(v: int) -> int:
    v = (v + _GAMMA) & _MASK64
    v = ((v ^ (v >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    v = ((v ^ (v >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (v ^ (v >> 31)) & _MASK64


def ple_multipliers(vocab: int, ngram_size: int, ple_index: int, seed: int) -> np.ndarray:
    """int64 [ngram_size] hash multipliers (HF ``_build_layer_multipliers``)."""
    half = max(1, (((1 << 63) - 1) // max(vocab, 1)) // 2)
    base = seed + _PRIME_1 * ple_index
    return np.array([2 * (_splitmix64((base + _GAMMA * (i + 1)) & _MASK64) % half) + 1 for i in range(ngram_size)],
                    np.int64)


def _is_prime(v: int) -> bool:
    if v < 2 or (v % 2 == 0 and v != 2):
        return v == 2
    return all(v % d for d in range(3, math.isqrt(v) + 1, 2))


def ple_head_sizes(base: int, n_heads: int, ple_index: int) -> tuple[np.ndarray, np.ndarray]:
    """(vocab sizes, offsets) int64 [n_heads]: head h has the (ple_index*n_heads + h + 1)-th prime > base - 1."""
    sizes, p = [], base - 1
    for _ in range(ple_index * n_heads):
        p += 1
        while not _is_prime(p):
            p += 1
    for _ in range(n_heads):
        p += 1
        while not _is_prime(p):
            p += 1
        sizes.append(p)
    sizes = np.array(sizes, np.int64)
    return sizes, np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)


def ple_row_ids(prev: np.ndarray, tokens: np.ndarray, *, eos: int, mult: np.ndarray, sizes: np.ndarray,
                offsets: np.ndarray, heads_per_ngram: int) -> np.ndarray:
    """Table rows of each token.

    Args:
      prev: int [ngram_size-1] the slot's previous tokens, oldest first (EOS-filled at a sequence start).
      tokens: int [T] the new tokens.
      eos, mult, sizes, offsets, heads_per_ngram: see the module docstring.

    Returns:
      int64 [T, 2*heads_per_ngram] row ids (bigram heads, then trigram heads).
    """
    hist = np.concatenate([np.asarray(prev, np.int64), np.asarray(tokens, np.int64)])
    n, ctx = len(hist), len(prev)
    pos = np.arange(n)
    eos_pos = np.where(hist == eos, pos, -1)
    prev_eos = np.concatenate([[-1], np.maximum.accumulate(eos_pos)[:-1]])
    in_seg = pos - (prev_eos + 1)

    def shifted(s):
        src = np.maximum(pos - s, 0)
        ok = (in_seg >= s) & (pos - s >= 0)
        return np.where(ok, hist[src], eos)

    with np.errstate(over="ignore"):
        t = [shifted(s) * mult[s] for s in range(len(mult))]  # int64 wrap-around, as torch
        mixes = []
        for ng in range(2, len(mult) + 1):
            m = t[0]
            for s in range(1, ng):
                m = np.bitwise_xor(m, t[s])
            mixes.append(m)
    cols = []
    for j, m in enumerate(mixes):
        sl = slice(j * heads_per_ngram, (j + 1) * heads_per_ngram)
        cols.append(np.mod(m[:, None], sizes[None, sl]) + offsets[None, sl])
    return np.concatenate(cols, axis=1)[ctx:]


class PLETable:
    """The host side of PLE: row ids and the gather from the memory-mapped table (which never goes to the device).

    Args:
      g: the open `GGUFFile` (kept open: `tensor_bytes` is a view into its memory map).
      ple_index: which PLE layer (0 for the first entry of ``ple.layers``): the row ids use the GGUF's
        ``ple.layer_multipliers`` / ``head_offsets`` / ``head_vocab_sizes`` (one table, one PLE layer in every
        file seen); ``eos``, ``heads_per_ngram``, ``ngram_size`` from the ``ple.*`` keys.

    `gather(prev, tokens)` returns the stored bytes of each token's rows, uint8 [B, T, n_heads, row_bytes] (block
    formats and F16/F32 alike); the stage dequantizes them on the device (`dequant_rows`).
    """

    def __init__(self, g, *, eos: int, mult, sizes, offsets, heads_per_ngram: int):
        self.raw = g.tensor_bytes(TABLE)  # uint8 [rows, row_bytes], a view of the memory map
        info = g.info(TABLE)
        self.qtype, self.dim = info.qtype, int(info.shape[-1])
        self.eos, self.hpn = int(eos), int(heads_per_ngram)
        self.mult = np.asarray(mult, np.int64)
        self.sizes = np.asarray(sizes, np.int64)
        self.offsets = np.asarray(offsets, np.int64)
        self.context = len(self.mult) - 1

    def start_prev(self) -> np.ndarray:
        """The predecessor tokens of a sequence start (all EOS), int64 [ngram_size - 1]."""
        return np.full(self.context, self.eos, np.int64)

    def row_ids(self, prev, tokens) -> np.ndarray:
        """int64 [T, n_heads] (see `ple_row_ids`)."""
        return ple_row_ids(np.asarray(prev), np.asarray(tokens), eos=self.eos, mult=self.mult, sizes=self.sizes,
                           offsets=self.offsets, heads_per_ngram=self.hpn)

    def gather(self, prev, tokens):
        """Stored rows for a window: prev int [B, ngram_size-1] (each segment's slot's committed predecessors,
        oldest first), tokens int [B, T] -> uint8 [B, T, n_heads, row_bytes]: host numpy from a file's memory map;
        from a table that is a device array (random weights made on the device, `strata_jax.testing`) a device
        array, gathered there (reading the rows back made the host wait for the device before every call)."""
        tokens = np.asarray(tokens)
        ids = np.stack([self.row_ids(p, t) for p, t in zip(np.asarray(prev), tokens)])
        if isinstance(self.raw, np.ndarray):
            return np.ascontiguousarray(self.raw[ids])
        return self.raw[ids]

    def advance(self, prev, tokens, keep: int) -> np.ndarray:
        """The predecessors after committing the first ``keep`` of ``tokens`` (one segment)."""
        h = np.concatenate([np.asarray(prev, np.int64), np.asarray(tokens, np.int64)[:keep]])
        return h[len(h) - self.context:]


def _u64_limbs(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int64 values as their two's-complement (hi, lo) uint32 halves."""
    u = np.asarray(v, np.int64).view(np.uint64)
    return (u >> np.uint64(32)).astype(np.uint32), (u & np.uint64(0xFFFFFFFF)).astype(np.uint32)


class DeviceRowIds:
    """`ple_row_ids` on the device, bit for bit, with no 64-bit arithmetic (JAX runs without x64): a device loop of
    decode steps (`strata_jax.pipeline.stages.build_steps_fn`) gathers each step's table rows from its own pick.

    How: ``t * mult[s]`` (int64, wrapping) depends only on the token, so its two uint32 halves are tabulated on the
    host for every token id (``[ngram_size, vocab]`` each); the n-gram mix is their XOR, half by half; the signed
    floor modulo by a head's size m (< 2^31) is the unsigned remainder of the 64-bit pattern, taken a few bits at
    a time in uint32 (the running remainder times 2^k stays below 2^32), minus ``2^64 mod m`` for a negative value.

    Args:
      table: the `PLETable` (its eos, multipliers, head sizes / offsets, heads per n-gram).
      vocab: token ids are < vocab (the model's vocabulary).
      device: where the tables go.
    """

    def __init__(self, table: "PLETable", vocab: int, device=None):
        self.eos, self.hpn, self.context = table.eos, table.hpn, table.context
        toks = np.arange(int(vocab), dtype=np.int64)
        with np.errstate(over="ignore"):
            prod = toks[None, :] * table.mult[:, None]  # int64 wrap-around, as ple_row_ids
        hi, lo = _u64_limbs(prod)
        # device arrays passed to the jitted call (`arrays`), not closed over (they would be baked into the program)
        self.arrays = {"hi": jax.device_put(hi, device), "lo": jax.device_put(lo, device)}
        sizes = [int(m) for m in table.sizes]
        if max(sizes) >= 1 << 31:
            raise ValueError(f"PLE head size {max(sizes)} >= 2^31: not supported on the device")
        self.sizes = np.asarray(sizes, np.uint32)
        self.offsets = np.asarray(table.offsets, np.int64)
        self.neg = np.asarray([(1 << 64) % m for m in sizes], np.uint32)  # 2^64 mod m
        self.k = 32 - max(sizes).bit_length()  # bits per remainder step: r < m, so r * 2^k + chunk < 2^32

    def _mod(self, hi, lo, m, neg):
        """Signed floor modulo of the int64 patterns (hi, lo) by m (uint32), as np.mod: uint32 in [0, m)."""
        k = self.k
        r = hi % m
        done = 0
        while done < 32:  # r = (r * 2^32 + lo) mod m, k bits of lo at a time (high bits first)
            b = min(k, 32 - done)
            chunk = (lo >> (32 - done - b)) & ((1 << b) - 1)
            r = ((r << b) | chunk) % m
            done += b
        return jnp.where(hi >> 31 == 1, jnp.where(r >= neg, r - neg, r + m - neg), r)

    def __call__(self, arrays, prev, tokens):
        """Row ids int32 [B, T, 2 * heads_per_ngram] (as `ple_row_ids` per segment; they fit int32, as the table's
        rows do): ``arrays`` this object's `arrays` (inside a jitted call: its argument), prev int32 [B,
        ngram_size - 1] (oldest first), tokens int32 [B, T]."""
        prev, tokens = jnp.asarray(prev, jnp.int32), jnp.asarray(tokens, jnp.int32)
        ctx = self.context
        hist = jnp.concatenate([prev, tokens], axis=1)  # [B, n]
        n = hist.shape[1]
        pos = jnp.arange(n, dtype=jnp.int32)[None, :]
        eos_pos = jnp.where(hist == self.eos, pos, -1)
        prev_eos = jnp.concatenate([jnp.full_like(eos_pos[:, :1], -1),
                                    jax.lax.cummax(eos_pos, axis=1)[:, :-1]], axis=1)
        in_seg = pos - (prev_eos + 1)
        his, los = [], []
        for s in range(ctx + 1):
            src = jnp.maximum(pos - s, 0)
            ok = (in_seg >= s) & (pos - s >= 0)
            t = jnp.where(ok, jnp.take_along_axis(hist, jnp.broadcast_to(src, hist.shape), axis=1), self.eos)
            his.append(arrays["hi"][s][t])
            los.append(arrays["lo"][s][t])
        cols = []
        for j, ng in enumerate(range(2, ctx + 2)):
            h, lo = his[0], los[0]
            for s in range(1, ng):
                h, lo = h ^ his[s], lo ^ los[s]
            h, lo = h[:, ctx:, None], lo[:, ctx:, None]
            sl = slice(j * self.hpn, (j + 1) * self.hpn)
            r = self._mod(h, lo, jnp.asarray(self.sizes[sl]), jnp.asarray(self.neg[sl]))
            cols.append(r.astype(jnp.int32) + jnp.asarray(self.offsets[sl], jnp.int32))
        return jnp.concatenate(cols, axis=-1)


def dequant_rows(raw: jax.Array, qtype, dim: int) -> jax.Array:
    """uint8 [B, T, n_heads, row_bytes] table rows -> float32 [B, T, n_heads * dim] (head-major concat)."""
    e = blocks.dequantize(raw, qtype, dim)
    return e.reshape(*e.shape[:-2], e.shape[-2] * e.shape[-1])


class PLEBlock(nnx.Module):
    """The gated PLE update of the residual streams (see module docstring).

    Args: g; prefix ``"blk.L."``; hc; dim: D; emb: E, the width of a token's gathered table rows (heads x table
    columns); conv_kernel: K; dilation; eps. Tensors (expected shapes): ``ple_key`` [hc*D, E], ``ple_value`` [D, E],
    ``ple_norm_{key,query,conv}`` [hc*D], ``ple_conv1d`` [hc*D, K]."""

    def __init__(self, g, prefix: str, *, hc: int, dim: int, emb: int, conv_kernel: int, dilation: int, eps: float,
                 device=None):
        p = prefix
        self.hc, self.D, self.K, self.dil, self.eps = int(hc), int(dim), int(conv_kernel), int(dilation), eps
        C = hc * dim
        self.wkey = QLinear.from_gguf(g, p + "ple_key.weight", device, shape=(C, emb))
        self.wvalue = QLinear.from_gguf(g, p + "ple_value.weight", device, shape=(dim, emb))
        self.norm_key = nnx.Param(load_f32(g, p + "ple_norm_key.weight", device, shape=(C,)))
        self.norm_query = nnx.Param(load_f32(g, p + "ple_norm_query.weight", device, shape=(C,)))
        self.norm_conv = nnx.Param(load_f32(g, p + "ple_norm_conv.weight", device, shape=(C,)))
        self.conv_w = nnx.Param(load_f32(g, p + "ple_conv1d.weight", device, shape=(C, conv_kernel)))

    @property
    def hist_len(self) -> int:
        return (self.K - 1) * self.dil

    def __call__(self, R, emb, hist, exact: bool):
        """R float32 [B, T, hc, D]; emb float32 [B, T, E]; hist float32 [B, hist_len, hc*D].

        Returns (update [B, T, hc, D] to add to R, normed [B, T, hc*D] -- the conv inputs to keep as history)."""
        B, T, hc, D = R.shape
        key = norm_per_stream(qcall(self.wkey, emb, exact).reshape(B, T, hc, D), self.norm_key[...], self.eps)
        value = qcall(self.wvalue, emb, exact)
        query = norm_per_stream(R, self.norm_query[...], self.eps)
        s = row_ops.row_sum(key * query) / math.sqrt(D)
        gate = jnp.sqrt(jnp.maximum(jnp.abs(s), 1e-6)) * jnp.sign(s)  # [B, T, hc, 1]
        gate = rowwise(jax.nn.sigmoid, gate[..., 0], exact)[..., None]
        gated = gate * value[..., None, :]
        normed = norm_per_stream(gated, self.norm_conv[...], self.eps).reshape(B, T, hc * D)
        seq = jnp.concatenate([hist, normed], axis=1)  # [B, hist+T, C]
        out = 0.0
        for i in range(self.K):
            off = i * self.dil
            out = out + seq[:, off:off + T] * self.conv_w[...][:, i]
        upd = gated + jax.nn.silu(out).reshape(B, T, hc, D)
        return upd, normed
