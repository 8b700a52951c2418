"""Pallas kernels (and their plain-jnp references) for the hot ops of the hybrid MoE models.

One folder per op; each has ``reference.py`` (plain jnp: the numerical spec, and what the model runs off-GPU),
``kernel.py`` (Pallas, Triton lowering on GPU, interpret mode elsewhere), ``api.py`` (the public functions with
``impl="auto"|"reference"|"kernel"|"interpret"``, see `dispatch`) and ``__init__.py`` exporting the API.

* `strata_jax.pallas.gdn`: the gated delta rule: ``gdn_window`` (verify window, T <= 8, reads the state),
  ``gdn_commit`` (advance the state by the accepted rows), ``gdn_chunked`` (prefill).
* `strata_jax.pallas.quant_matmul`: ``qmatmul(x, w_raw, qtype, n_out, k_in)``, activations times a GGUF
  block-quantized weight (the kernel decodes blocks in registers and reads each weight byte once for 1..8 rows;
  ``row_groups=True``: more rows as 8-row groups in one launch; otherwise more rows take a 16-row GEMM, as do
  prefill rows at any count, ``prefill=True``).
  ``STRATA_QMATMUL=planar`` (the default; ``bytes`` selects the kernel on the GGUF bytes) is the second family: weights
  repacked at load into word-aligned planes (`quant_matmul.planar`, exact, every block format incl. the IQ ones),
  a float32 GEMV (`quant_matmul.gemv`) and tensor-core kernels with a precision switch (`quant_matmul.gemm`:
  prefill GEMM, grouped-expert GEMM, tensor-core GEMV).
* `strata_jax.pallas.rows`: the per-row ops of the row path (``rms_norm`` incl. the L2 norm, ``row_sum``,
  ``softmax``, ``row_map`` of a narrow elementwise function), one program per row.
* `strata_jax.pallas.grouped_experts`: ``moe_experts(x, topk_ids, topk_w, gate, up, down, qtypes)``, the routed
  SwiGLU experts; the kernel reads each expert of the window's union once (of each 8-row group's union for more
  rows; with planar weights, prefill chunks are sorted by expert into one grouped GEMM per projection).
* `strata_jax.pallas.qsa`: ``qsa_attention(q, k_cache, v_cache, iq, pooled, n_kv, n_complete)``, QSA indexer
  block selection and GQA softmax attention over the selected cells (verify rows and prefill; rows of several
  sequences in one call with ``seg`` / ``cell_base``); ``qsa_prefill``, the same for prefill chunks (by default the
  verify-window kernel over the chunk's rows; ``STRATA_QSA_PREFILL=tiles``: tiled scores and block-sparse flash
  attention on tensor cores); ``attend_cells``, the attention over an explicit cell list (what
  the dense attention layers run on the kernel path).

Beside the ops: `structure` (which loops a step program holds, which kernel operands XLA would copy), `trace` (a
profiler trace of steps summarised per step), `gpu_flags` (XLA command buffers, pinned autotuning).

The model layers call them with ``impl="auto"``: `strata_jax.layers.linear.QLinear` (qmatmul; row groups in verify
windows), `strata_jax.layers.moe.MoE` (moe_experts, windows and prefill), `strata_jax.layers.gdn.GatedDeltaNet`
(gdn_window / gdn_commit / gdn_chunked), `strata_jax.layers.qsa.GatedAttention` with the indexer (qsa_attention in
windows, qsa_prefill in prefill), `strata_jax.layers.attention` (attend_cells: dense models, qwen35moe / qwen3next
attention layers), the norms / router softmax / narrow gates (rows).

Row invariance is the kernels' (the batch-invariant rule): the reduction order of output (row r, column n) depends
only on the reduced length and compile-time constants -- fixed K chunks and splits chosen from the weight, one
program per row for norms, a fixed split layout for split-KV attention, MoE kernels that compute a row the same
whichever other rows chose its experts -- so the kernel path holds no XLA-level devices for it (no loops over
rows, no hidden trip counts); its inner loops have compile-time trip counts, except the QSA prefill tile kernel's
loop (``STRATA_QSA_PREFILL=tiles``) over the key tiles some row of its query tile attends (a tile a row does not
attend leaves that row's state untouched, so the row's bits do not depend on which tiles the other rows make live).
The plain-jnp references (the CPU path) keep what XLA on a CPU needs for the same property (fixed pairwise trees,
loops over rows).

`experiments/bench_kernels.py` times each kernel against its plain-jnp path and a bandwidth ceiling measured in
the same run. The kernels use Pallas' Triton lowering (``jax.experimental.pallas.triton.CompilerParams``), which
JAX 0.11 marks deprecated in favour of Mosaic GPU.

Exactness contract shared by all ops: row t of a T-row call is bit-identical to the same row computed alone
(T = 1) and does not depend on the other rows' contents (for each impl separately; for qmatmul the GEMV and the
prefill GEMM are each row-invariant, not equal to each other).
"""
