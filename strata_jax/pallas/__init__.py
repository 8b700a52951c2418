"""Pallas kernels (and their plain-jnp references) for the hot ops of the hybrid MoE models.

One folder per op; each has ``reference.py`` (plain jnp: the numerical spec, and what the model runs off-GPU),
``kernel.py`` (Pallas, Triton lowering on GPU, interpret mode elsewhere), ``api.py`` (the public functions with
``impl="auto"|"reference"|"kernel"|"interpret"``, see `dispatch`) and ``__init__.py`` exporting the API.

* `strata_jax.pallas.gdn`: the gated delta rule: ``gdn_window`` (verify window, T <= 8, reads the state),
  ``gdn_commit`` (advance the state by the accepted rows), ``gdn_chunked`` (prefill).
* `strata_jax.pallas.quant_matmul`: ``qmatmul(x, w_raw, qtype, n_out, k_in)``, activations times a GGUF
  block-quantized weight (the kernel decodes blocks in registers and reads each weight byte once for 1..8 rows;
  ``row_groups=True``: more rows as 8-row groups in one launch).
* `strata_jax.pallas.grouped_experts`: ``moe_experts(x, topk_ids, topk_w, gate, up, down, qtypes)``, the routed
  SwiGLU experts; the kernel reads each expert of the window's union once (of each 8-row group's union for more
  rows).
* `strata_jax.pallas.qsa`: ``qsa_attention(q, k_cache, v_cache, iq, pooled, n_kv, n_complete)``, QSA indexer
  block selection and GQA softmax attention over the selected cells (verify rows and prefill; rows of several
  sequences in one call with ``seg`` / ``cell_base``).

The model layers call them with ``impl="auto"``: `strata_jax.layers.linear.QLinear` (qmatmul; row groups in verify
windows), `strata_jax.layers.moe.MoE` (moe_experts, windows and prefill), `strata_jax.layers.gdn.GatedDeltaNet`
(gdn_window / gdn_commit / gdn_chunked), `strata_jax.layers.qsa.GatedAttention` with the indexer (qsa_attention,
windows and prefill). The dense attention (dense models, qwen35moe / qwen3next attention layers) has no kernel.

`experiments/bench_kernels.py` times each kernel against its plain-jnp path and a bandwidth ceiling measured in
the same run. The kernels use Pallas' Triton lowering (``jax.experimental.pallas.triton.CompilerParams``), which
JAX 0.11 marks deprecated in favour of Mosaic GPU.

Exactness contract shared by all ops: for T <= 8 rows, row t of a T-row call is bit-identical to the same row
computed alone (T = 1) and does not depend on the other rows' contents (for each impl separately).
"""
