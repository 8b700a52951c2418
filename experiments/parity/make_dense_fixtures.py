"""HF-transformers reference fixtures for the dense GGUF models (SmolLM2-135M, Qwen2.5-Coder-0.5B).

The oracle for a quantized GGUF: dequantize every GGUF tensor to float32
with `gguf.quants.dequantize`, undo llama.cpp's converter transforms, load the result into the HF class
(`LlamaForCausalLM` / `Qwen2ForCausalLM`, float32, eager attention) and record its logits.

Runs in the parity venv, not in /work/venv (see experiments/parity/README.md):

    /work/venv-parity/bin/python experiments/parity/make_dense_fixtures.py [--models smollm2-135m qwen2.5-coder-0.5b]

Writes tests/fixtures/dense_<name>.npz; the array layout is documented in experiments/parity/README.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
MODELS_DIR = Path(os.environ.get("STRATA_JAX_MODELS", Path.home() / ".cache" / "strata_jax" / "models"))
TOPK = 16
N_PROMPT_POSITIONS = 32
N_DECODE = 32

# name -> (HF class name, user message, expected fully rendered chat prompt, reference sentence ids)
MODELS = {
    "smollm2-135m": dict(
        hf_class="LlamaForCausalLM",
        user="What is the capital of France?",
        rendered=(
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
            "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
        ),
        ref_ids=[504, 3575, 282, 4649, 314, 7042, 30],
    ),
    "qwen2.5-coder-0.5b": dict(
        hf_class="Qwen2ForCausalLM",
        user="Write a Python function that returns the square of x.",
        rendered=(
            "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
            "<|im_start|>user\nWrite a Python function that returns the square of x.<|im_end|>\n"
            "<|im_start|>assistant\n"
        ),
        ref_ids=[785, 6722, 315, 9625, 374, 12095, 13],
    ),
}
REF_SENTENCE = "The capital of France is Paris."


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp convert_hf_to_gguf `LlamaModel.permute` (HF half-split -> GGUF interleaved rows).

    permute: w.reshape(n_head, 2, d // n_head // 2, *rest).swapaxes(1, 2).reshape(w.shape)
    inverse: w.reshape(n_head, d // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)
    (n_head is the KV head count for attn_k.)
    """
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf_as_hf(path: Path):
    """Return (arch, HF config kwargs, float32 state dict of torch tensors, reader)."""
    import gguf
    import torch

    reader = gguf.GGUFReader(str(path))
    arch = field(reader, "general.architecture")
    if arch not in ("llama", "qwen2"):
        raise ValueError(f"unsupported architecture {arch!r}")
    a = lambda k, d=None: field(reader, f"{arch}.{k}", d)  # noqa: E731
    n_head, n_kv = int(a("attention.head_count")), int(a("attention.head_count_kv"))
    hidden = int(a("embedding_length"))

    names = {t.name for t in reader.tensors}
    tied = "output.weight" not in names
    vocab = next(int(t.shape[1]) for t in reader.tensors if t.name == "token_embd.weight")
    cfg = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(a("feed_forward_length")),
        num_hidden_layers=int(a("block_count")),
        num_attention_heads=n_head,
        num_key_value_heads=n_kv,
        head_dim=int(a("rope.dimension_count", hidden // n_head)),
        max_position_embeddings=int(a("context_length")),
        rms_norm_eps=float(a("attention.layer_norm_rms_epsilon")),
        rope_parameters={"rope_type": "default", "rope_theta": float(a("rope.freq_base"))},
        tie_word_embeddings=tied,
        bos_token_id=field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=field(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=field(reader, "tokenizer.ggml.padding_token_id"),
        hidden_act="silu",
    )
    if arch == "llama":
        cfg.update(attention_bias=False, mlp_bias=False)
    else:
        cfg.update(use_sliding_window=False)

    top = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
    blk = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
           "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
           "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
           "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
           "attn_v.bias": "self_attn.v_proj.bias",
           "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
           "ffn_down.weight": "mlp.down_proj.weight"}
    sd = {}
    qtypes = {}
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        qtypes[t.tensor_type.name] = qtypes.get(t.tensor_type.name, 0) + 1
        if t.name in top:
            hf = top[t.name]
        else:
            _, i, rest = t.name.split(".", 2)
            hf = f"model.layers.{int(i)}.{blk[rest]}"
        # Norms are stored as-is for llama/qwen2 (no +1 / -1). Only llama's Q/K were permuted (weights and,
        # if present, biases: LlamaModel.modify_tensors permutes every attn_q / attn_k tensor).
        if arch == "llama" and (".attn_q." in t.name or ".attn_k." in t.name):
            w = unpermute_rope_rows(w, n_head if ".attn_q." in t.name else n_kv)
        sd[hf] = torch.from_numpy(np.array(w, dtype=np.float32, copy=True))
    log(f"  dequantized {len(sd)} tensors: {qtypes}")
    return arch, cfg, sd, reader


def build_model(hf_class: str, cfg: dict, sd: dict):
    import torch
    import transformers

    config_cls = {"LlamaForCausalLM": transformers.LlamaConfig, "Qwen2ForCausalLM": transformers.Qwen2Config}[hf_class]
    config = config_cls(**cfg)
    config._attn_implementation = "eager"
    model = getattr(transformers, hf_class)(config).to(torch.float32)
    missing, unexpected = model.load_state_dict(sd, strict=False)  # copies into the (tied) parameters
    if cfg["tie_word_embeddings"]:
        missing = [m for m in missing if m != "lm_head.weight"]
        model.tie_weights()
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    if missing or unexpected:
        raise RuntimeError(f"state dict mismatch: missing={missing} unexpected={unexpected}")
    model.eval()
    return model


def load_tokenizer(path: Path):
    """transformers' GGUF tokenizer route: AutoTokenizer.from_pretrained(dir, gguf_file=name)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def topk(logits, k=TOPK):
    """logits [..., V] float32 torch -> (ids int32 [..., k], values float32 [..., k]), sorted descending."""
    v, i = logits.float().topk(k, dim=-1)
    return i.numpy().astype(np.int32), v.numpy().astype(np.float32)


def make_fixture(name: str, out_dir: Path) -> dict:
    import torch
    import transformers
    import gguf

    spec = MODELS[name]
    path = MODELS_DIR / f"{name}.gguf"
    registry = json.loads((REPO / "configs" / "models.json").read_text())[name]
    t0 = time.time()
    sha = sha256_file(path)
    if sha != registry["sha256"]:
        raise RuntimeError(f"{path}: sha256 {sha} != configs/models.json {registry['sha256']}")
    log(f"{name}: sha256 ok ({time.time() - t0:.1f}s)")

    t = time.time()
    arch, cfg, sd, reader = load_gguf_as_hf(path)
    model = build_model(spec["hf_class"], cfg, sd)
    del sd
    t_load = time.time() - t
    log(f"{name}: arch={arch} config={json.dumps(cfg)} loaded in {t_load:.1f}s")

    t = time.time()
    tok = load_tokenizer(path)
    t_tok = time.time() - t
    ref = tok.encode(REF_SENTENCE, add_special_tokens=False)
    if ref != spec["ref_ids"]:
        raise RuntimeError(f"{name}: tokenizer gives {ref} for {REF_SENTENCE!r}, the reference ids are "
                           f"{spec['ref_ids']}")
    rendered = spec["rendered"]
    template = field(reader, "tokenizer.chat_template")
    if template:
        tok.chat_template = template
        via_template = tok.apply_chat_template([{"role": "user", "content": spec["user"]}], tokenize=False,
                                               add_generation_prompt=True)
        if via_template != rendered:
            raise RuntimeError(f"{name}: chat template renders {via_template!r}, expected {rendered!r}")
        log(f"{name}: GGUF chat template renders the expected prompt")
    # add_special_tokens=True: whatever BOS policy the GGUF declares (both say add_bos_token=False).
    prompt_ids = tok.encode(rendered, add_special_tokens=True)
    if tok.decode(prompt_ids) != rendered:
        raise RuntimeError(f"{name}: prompt does not round-trip: {tok.decode(prompt_ids)!r}")
    log(f"{name}: tokenizer in {t_tok:.1f}s; prompt has {len(prompt_ids)} tokens: {prompt_ids}")

    torch.manual_seed(0)
    T = len(prompt_ids)
    positions = np.unique(np.linspace(0, T - 1, min(N_PROMPT_POSITIONS, T)).round().astype(np.int32))
    with torch.inference_mode():
        t = time.time()
        ids = torch.tensor([prompt_ids], dtype=torch.long)
        out = model(input_ids=ids, use_cache=True)
        t_prefill = time.time() - t
        prompt_logits = out.logits[0]  # [T, V]
        p_ids, p_vals = topk(prompt_logits[torch.from_numpy(positions).long()])
        last_logits = prompt_logits[-1].float().numpy().astype(np.float32)

        # Greedy decode with HF's KV cache; the logits of step i are the ones that chose token i
        # (step 0 = the prefill's last position). EOS does not stop the loop: all N_DECODE steps are recorded.
        t = time.time()
        cache = out.cache
        logits = prompt_logits[-1]
        greedy, d_ids, d_vals = [], [], []
        for step in range(N_DECODE):
            i_, v_ = topk(logits)
            d_ids.append(i_)
            d_vals.append(v_)
            nxt = int(logits.argmax())
            greedy.append(nxt)
            if step == N_DECODE - 1:
                break
            o = model(input_ids=torch.tensor([[nxt]]), cache=cache, use_cache=True,
                      position_ids=torch.tensor([[T + step]]))
            cache = o.cache
            logits = o.logits[0, -1]
        t_decode = time.time() - t

        # Sanity: the cached decode agrees with one uncached forward over prompt + generated tokens.
        full = model(input_ids=torch.tensor([prompt_ids + greedy[:-1]]), use_cache=False).logits[0, T - 1:]
        f_ids, f_vals = topk(full)
        cache_vs_full = float(np.abs(np.stack(d_vals) - f_vals).max())
        if not np.array_equal(np.stack(d_ids)[:, 0], f_ids[:, 0]):
            raise RuntimeError(f"{name}: cached and uncached greedy disagree")
        log(f"{name}: cached-vs-uncached decode top-16 max |diff| = {cache_vs_full:.2e}")

    d_ids, d_vals = np.stack(d_ids), np.stack(d_vals)
    eos = cfg["eos_token_id"]
    eos_step = greedy.index(eos) if eos in greedy else -1
    text_all = tok.decode(greedy)
    text_until_eos = tok.decode(greedy[: eos_step + 1] if eos_step >= 0 else greedy)
    margins = d_vals[:, 0] - d_vals[:, 1]
    n_checked = eos_step + 1 if eos_step >= 0 else N_DECODE
    log(f"{name}: prefill {t_prefill:.2f}s, {N_DECODE} decode steps {t_decode:.2f}s; "
        f"eos at step {eos_step}; min top1-top2 margin up to eos {margins[:n_checked].min():.3f}")

    meta = dict(
        model=name, gguf=path.name, sha256=sha, arch=arch, hf_class=spec["hf_class"], hf_config=cfg,
        prompt_text=rendered, greedy_text=text_all, greedy_text_until_eos=text_until_eos, eos_token_id=eos,
        eos_step=eos_step, topk=TOPK, n_decode=N_DECODE, dtype="float32", attn_implementation="eager",
        decode_convention="decode_*[i] are the logits that chose greedy_ids[i]; step 0 is the last prompt position",
        versions=dict(torch=torch.__version__, transformers=transformers.__version__,
                      gguf=getattr(gguf, "__version__", "0.19.0"), numpy=np.__version__, python=sys.version.split()[0]),
        timing_s=dict(load=round(t_load, 1), tokenizer=round(t_tok, 1), prefill=round(t_prefill, 2),
                      decode=round(t_decode, 2)),
    )
    arrays = dict(
        prompt_ids=np.asarray(prompt_ids, np.int32),
        prompt_positions=positions,
        prompt_topk_ids=p_ids,
        prompt_topk_values=p_vals,
        last_logits=last_logits,
        greedy_ids=np.asarray(greedy, np.int32),
        decode_topk_ids=d_ids,
        decode_topk_values=d_vals,
        eos_step=np.asarray(eos_step, np.int32),
        model_sha256=np.asarray(sha),
        meta_json=np.asarray(json.dumps(meta, indent=1)),
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    dest = out_dir / f"dense_{name}.npz"
    np.savez_compressed(dest, **arrays)
    size = dest.stat().st_size
    if size >= 1 << 20:
        raise RuntimeError(f"{dest} is {size} bytes (>= 1 MiB)")
    log(f"{name}: wrote {dest.relative_to(REPO) if dest.is_relative_to(REPO) else dest} ({size} bytes)")
    print(f"===== {name} greedy ({N_DECODE} tokens, eos at step {eos_step}) =====\n{text_all}\n=====", flush=True)
    del model
    return meta


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--out", type=Path, default=REPO / "tests" / "fixtures")
    # 1 thread: on the shared 2-core machine, OpenMP spin-waits under contention made 2 threads ~10x slower.
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    t0 = time.time()
    for name in args.models:
        make_fixture(name, args.out)
    log(f"all done in {time.time() - t0:.1f}s")


if __name__ == "__main__":
    main()
