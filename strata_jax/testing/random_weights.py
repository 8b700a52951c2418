"""Full-size geometries with random weights, made on the device (no file): for speed and memory runs of models whose
real weights are not reachable here (Qwen3.8-Flash-Next, Qwen3.6-35B-A3B, Qwen3-Next-80B-A3B).

`VirtualGGUF` looks like an open `strata_jax.gguf.GGUFFile` to the loaders: the metadata keys and tensor names that
llama.cpp's converter writes for the architecture, block formats from the geometry's ``quant`` map, and
`tensor_bytes(name, device)` that draws the tensor's bytes with `jax.random` directly on that device, then writes
small finite fp16 block scales (0.002) so every value is finite. Norm weights are ones; ``ssm_a`` is negative.
Geometries live in ``configs/geometries/<name>.json``.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as Q

from strata_jax.errors import StrataError
from strata_jax.gguf.reader import TensorInfo
from strata_jax.models_registry import configs_dir

GEOMETRIES = configs_dir() / "geometries"

# byte ranges of the fp16 scales inside each block format's block (ggml-common.h structs); random blocks get
# RANDOM_SCALE there, so every dequantized value stays small and finite (also used by `strata_jax.testing.random_gguf`)
SCALE_BYTES = {Q.Q4_0: [(0, 2)], Q.Q4_1: [(0, 4)], Q.Q5_0: [(0, 2)], Q.Q5_1: [(0, 4)], Q.Q8_0: [(0, 2)],
               Q.Q2_K: [(80, 84)], Q.Q3_K: [(108, 110)], Q.Q4_K: [(0, 4)], Q.Q5_K: [(0, 4)], Q.Q6_K: [(208, 210)],
               Q.IQ4_NL: [(0, 2)], Q.IQ4_XS: [(0, 2)], Q.IQ2_XS: [(0, 2)], Q.IQ2_S: [(0, 2)],
               Q.IQ3_XXS: [(0, 2)], Q.IQ3_S: [(0, 2)], Q.IQ2_XXS: [(0, 2)]}
RANDOM_SCALE = 0.002


def scale_pattern() -> np.ndarray:
    """RANDOM_SCALE as its two little-endian fp16 bytes (uint8 [2])."""
    return np.frombuffer(np.array([RANDOM_SCALE], np.float16).tobytes(), np.uint8)


def load_geometry(name: str) -> dict:
    """The geometry ``configs/geometries/<name>.json``. Raises StrataError for an unknown name."""
    p = GEOMETRIES / f"{name}.json"
    if not p.exists():
        known = sorted(x.stem for x in GEOMETRIES.glob("*.json"))
        raise StrataError(f"unknown geometry {name!r}; known: {', '.join(known)}")
    return json.loads(p.read_text())


def _primes_above(n: int, k: int) -> list[int]:
    out = []
    while len(out) < k:
        n += 1
        if n > 1 and all(n % p for p in range(2, int(n ** 0.5) + 1)):
            out.append(n)
    return out


class VirtualGGUF:
    """A GGUF-shaped description of a geometry with random weights (see module docstring).

    Args:
      geom: a geometry dict (`load_geometry`).
      n_layer: override the layer count (smaller runs of the same shape).
      seed: random seed.
      mtp: add one MTP draft block (block ``n_layer``, ``nextn_predict_layers`` = 1) in the dense format.
    """

    virtual = True

    def __init__(self, geom: dict, n_layer: int | None = None, seed: int = 0, mtp: bool = False):
        self.geom = dict(geom)
        self.mtp = bool(mtp)
        if n_layer is not None:
            self.geom["n_layer"] = n_layer
        self.path = f"<random {geom['arch']} geometry>"
        self.seed = seed
        self.metadata: dict = {}
        self.tensors: dict[str, TensorInfo] = {}
        self._build()

    # -- GGUFFile interface ------------------------------------------------------------------------------------
    @property
    def architecture(self) -> str:
        return self.geom["arch"]

    def get(self, key, default=None):
        return self.metadata.get(key, default)

    def has(self, name: str) -> bool:
        return name in self.tensors

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise StrataError(f"{self.path}: tensor {name!r} is missing") from None

    def tensor_bytes(self, name: str, device=None):
        """Random bytes of tensor ``name`` as a device array: uint8 [..., row_bytes] for block formats, else the
        float values' bytes viewed as uint8 [..., n_cols * itemsize]."""
        t = self.info(name)
        block, bsize = GGML_QUANT_SIZES[t.qtype]
        rows = int(np.prod(t.shape[:-1])) if len(t.shape) > 1 else 1
        key = jax.random.fold_in(jax.random.key(self.seed), abs(hash(name)) % (1 << 31))
        with jax.default_device(device) if device is not None else _nullctx():
            if t.qtype in (Q.F32, Q.F16, Q.BF16):
                if "norm" in name:
                    v = jnp.ones(t.shape, jnp.float32)
                elif name.endswith("ssm_a"):
                    v = -jnp.abs(jax.random.normal(key, t.shape, jnp.float32))
                else:
                    v = jax.random.normal(key, t.shape, jnp.float32) * 0.02
                dt = {Q.F32: jnp.float32, Q.F16: jnp.float16, Q.BF16: jnp.bfloat16}[t.qtype]
                b = jax.lax.bitcast_convert_type(v.astype(dt), jnp.uint8)
                return b.reshape(*t.shape[:-1], -1) if len(t.shape) > 1 else b.reshape(-1)
            nblk = t.shape[-1] // block
            b = jax.random.bits(key, (rows, nblk, bsize), jnp.uint8)
            scale = jnp.asarray(scale_pattern())
            for lo, hi in SCALE_BYTES[t.qtype]:
                b = b.at[:, :, lo:hi].set(jnp.tile(scale, (hi - lo) // 2))
            return b.reshape(*t.shape[:-1], nblk * bsize)

    def close(self):
        pass

    # -- the tensor table --------------------------------------------------------------------------------------
    def _t(self, name: str, shape: tuple, q: str | Q):
        qt = Q[q] if isinstance(q, str) else q
        block, bsize = GGML_QUANT_SIZES[qt]
        if shape[-1] % block:
            raise StrataError(f"geometry: {name} row of {shape[-1]} is no multiple of the {qt.name} block")
        n = int(np.prod(shape))
        self.tensors[name] = TensorInfo(name, tuple(int(s) for s in shape), qt, 0, n // block * bsize)

    def _build(self):
        g, A = self.geom, self.geom["arch"]
        L, H, V = g["n_layer"], g["hidden"], g["vocab"]
        NH, NKV, HD = g["heads"], g["kv_heads"], g["head_dim"]
        HK, HV, DK, DV = g["ssm_k_heads"], g["ssm_v_heads"], g["ssm_d_k"], g["ssm_d_v"]
        E, K, F, FS = g["experts"], g["experts_used"], g["expert_ff"], g["shared_ff"]
        qm = g["quant"]
        inner, conv = HV * DV, 2 * HK * DK + HV * DV
        p = A + "."
        md = self.metadata
        md.update({
            "general.architecture": A, f"{p}block_count": L, f"{p}context_length": g["context"],
            f"{p}embedding_length": H, f"{p}attention.head_count": NH, f"{p}attention.head_count_kv": NKV,
            f"{p}attention.key_length": HD, f"{p}attention.value_length": HD, f"{p}rope.freq_base": g["rope_theta"],
            f"{p}rope.dimension_count": g["rope_dim"], f"{p}attention.layer_norm_rms_epsilon": g["rms_eps"],
            f"{p}expert_count": E, f"{p}expert_used_count": K, f"{p}expert_feed_forward_length": F,
            f"{p}expert_shared_feed_forward_length": FS, f"{p}ssm.conv_kernel": g["ssm_conv"],
            f"{p}ssm.state_size": DK, f"{p}ssm.group_count": HK, f"{p}ssm.time_step_rank": HV,
            f"{p}ssm.inner_size": inner, f"{p}full_attention_interval": g["full_attention_interval"],
            f"{p}attention.recurrent_layers": np.array([(i + 1) % g["full_attention_interval"] != 0
                                                        for i in range(L)]),
            f"{p}vocab_size": V, "tokenizer.ggml.eos_token_id": g["eos"],
            f"{p}rope.dimension_sections": np.array([11, 11, 10, 0], np.int32),
        })
        if A == "qwen3next":
            md[f"{p}feed_forward_length"] = F
        t = self._t
        t("token_embd.weight", (V, H), qm["embd"])
        t("output.weight", (V, H), qm["head"])
        hc = g.get("hc", 0)
        if A == "qwen4exp":
            R, IXH, IXD = g["hc_lowrank"], g["indexer_heads"], g["indexer_head_dim"]
            heads = g["ple_heads"]
            sizes = _primes_above(g["ple_min_prime"], heads)
            offs = [0]
            for s in sizes[:-1]:
                offs.append(offs[-1] + s)
            rows = (sum(sizes) + 127) // 128 * 128
            md.update({
                f"{p}hyper_connection.count": hc, f"{p}hyper_connection.low_rank": R,
                f"{p}attention.indexer.head_count": IXH, f"{p}attention.indexer.key_length": IXD,
                f"{p}attention.indexer.top_k": g["indexer_top_k"],
                f"{p}attention.compress_ratios": np.array([g["compress_ratio"] if (i + 1) % 4 == 0 else 0
                                                           for i in range(L)], np.int32),
                f"{p}ple.layers": np.array(g["ple_layers"], np.int32), f"{p}ple.ngram_size": 3,
                f"{p}ple.heads_per_ngram": heads // 2, f"{p}ple.conv_kernel": 4, f"{p}ple.eos_token_id": g["eos"],
                f"{p}embedding_length_per_layer_input": H // heads,
                f"{p}ple.layer_multipliers": np.array([23703573157769, 20109073645365, 8052911324071], np.uint64),
                f"{p}ple.head_offsets": np.array(offs, np.uint64),
                f"{p}ple.head_vocab_sizes": np.array(sizes, np.uint64),
            })
            t("output_hc_norm.weight", (hc * H,), "F32")
            t("output_hc_down.weight", (R, hc * H), qm["small"])
            t("output_hc_up.weight", (hc * H, R), qm["small"])
            t("per_layer_token_embd.weight", (rows, H // heads), qm["ple"])
        else:
            t("output_norm.weight", (H,), "F32")
        for i in range(L):
            b = f"blk.{i}."
            if A == "qwen4exp":
                self._hc(b)
            else:
                t(b + "attn_norm.weight", (H,), "F32")
                t(b + "post_attention_norm.weight", (H,), "F32")
            if (i + 1) % g["full_attention_interval"] != 0:
                t(b + "ssm_a", (HV,), "F32")
                t(b + "ssm_dt.bias", (HV,), "F32")
                t(b + "ssm_conv1d.weight", (conv, g["ssm_conv"]), "F32")
                if A == "qwen3next":
                    t(b + "ssm_ba.weight", (2 * HV, H), qm["small"])
                else:
                    t(b + "ssm_alpha.weight", (HV, H), qm["small"])
                    t(b + "ssm_beta.weight", (HV, H), qm["small"])
                t(b + "attn_qkv.weight", (conv, H), qm["dense"])
                t(b + "attn_gate.weight", (inner, H), qm["dense"])
                t(b + "ssm_norm.weight", (DV,), "F32")
                t(b + "ssm_out.weight", (H, inner), qm["dense"])
            else:
                self._attention(b, indexer=A == "qwen4exp")
            if A == "qwen4exp" and i in g.get("ple_layers", []):
                t(b + "ple_conv1d.weight", (hc * H, 4), "F32")
                t(b + "ple_key.weight", (hc * H, H), qm["small"])
                t(b + "ple_norm_conv.weight", (hc * H,), "F32")
                t(b + "ple_norm_key.weight", (hc * H,), "F32")
                t(b + "ple_norm_query.weight", (hc * H,), "F32")
                t(b + "ple_value.weight", (H, H), qm["small"])
            self._moe(b)
        if self.mtp:
            self._mtp_block()

    def _hc(self, b: str):
        g, qm, H, hc = self.geom, self.geom["quant"], self.geom["hidden"], self.geom.get("hc", 0)
        for half in ("attn", "ffn"):
            self._t(b + f"hc_{half}_inject.weight", (hc, hc * H), qm["small"])
            self._t(b + f"hc_{half}_norm.weight", (hc * H,), "F32")
            self._t(b + f"hc_{half}_down.weight", (g["hc_lowrank"], hc * H), qm["small"])
            self._t(b + f"hc_{half}_up.weight", (hc * H, g["hc_lowrank"]), qm["small"])

    def _attention(self, b: str, indexer: bool):
        g, qm, t, H = self.geom, self.geom["quant"], self._t, self.geom["hidden"]
        NH, NKV, HD = g["heads"], g["kv_heads"], g["head_dim"]
        if indexer:
            IXH, IXD = g["indexer_heads"], g["indexer_head_dim"]
            t(b + "indexer.q_proj.weight", (IXH * IXD, H), qm["small"])
            t(b + "indexer.k_proj.weight", (IXD, H), qm["small"])
            t(b + "indexer.k_norm.weight", (IXD,), "F32")
            t(b + "indexer.q_norm.weight", (IXD,), "F32")
        t(b + "attn_q.weight", (2 * NH * HD, H), qm["dense"])
        t(b + "attn_k.weight", (NKV * HD, H), qm["dense"])
        t(b + "attn_v.weight", (NKV * HD, H), qm["attn_v"])
        t(b + "attn_output.weight", (H, NH * HD), qm["dense"])
        t(b + "attn_q_norm.weight", (HD,), "F32")
        t(b + "attn_k_norm.weight", (HD,), "F32")

    def _moe(self, b: str):
        g, qm, t, H = self.geom, self.geom["quant"], self._t, self.geom["hidden"]
        E, F, FS = g["experts"], g["expert_ff"], g["shared_ff"]
        t(b + "ffn_gate_inp.weight", (E, H), qm["router"])
        t(b + "ffn_gate_exps.weight", (E, F, H), qm["exp_gate_up"])
        t(b + "ffn_up_exps.weight", (E, F, H), qm["exp_gate_up"])
        t(b + "ffn_down_exps.weight", (E, H, F), qm["exp_down"])
        t(b + "ffn_gate_shexp.weight", (FS, H), qm["shexp_gate_up"])
        t(b + "ffn_up_shexp.weight", (FS, H), qm["shexp_gate_up"])
        t(b + "ffn_down_shexp.weight", (H, FS), qm["shexp_down"])
        t(b + "ffn_gate_inp_shexp.weight", (1, H), qm["small"])

    def _mtp_block(self):
        """One MTP draft block in block ``n_layer`` (the names `strata_jax.layers.mtp` reads)."""
        g, A, qm, t, H = self.geom, self.geom["arch"], self.geom["quant"], self._t, self.geom["hidden"]
        L = g["n_layer"]
        b = f"blk.{L}."
        self.metadata[f"{A}.block_count"] = L + 1
        self.metadata[f"{A}.nextn_predict_layers"] = 1
        if A == "qwen4exp":
            hc = g["hc"]
            self._hc(b)
            t(b + "nextn.enorm.weight", (H,), "F32")
            t(b + "nextn.hnorm.weight", (hc * H,), "F32")
            t(b + "nextn.fc_embedding.weight", (H, H), qm["dense"])
            t(b + "nextn.fc_hidden.weight", (H, H), qm["dense"])
        else:
            t(b + "nextn.eh_proj.weight", (H, 2 * H), qm["dense"])
            for k in ("nextn.enorm", "nextn.hnorm", "nextn.shared_head_norm", "attn_norm", "post_attention_norm"):
                t(b + k + ".weight", (H,), "F32")
        self._attention(b, indexer=False)
        self._moe(b)

    def weight_bytes(self) -> int:
        """Bytes of all tensors (the PLE table included)."""
        return sum(t.nbytes for t in self.tensors.values())


class _nullctx:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False
