cd "$(dirname "$0")/../../.."
P="env STRATA_PALLAS_IMPL=interpret STRATA_QMATMUL_PRECISION=bf16x2 .venv/bin/python experiments/parity/precision_sites.py"
$P --family qwen3next
$P --family qwen3next --f16 gdn.py
$P --family qwen3next --f16 self.wqkv
$P --family qwen3next --f16 "self.wz,self.wout,_beta_alpha"
$P --family qwen3next --f16 "attention.py,qsa.py"
$P --family qwen3next --f16 "moe.py,grouped_experts"
$P --family qwen3next --f16 head_logits
for f in qwen3next qwen35moe qwen4exp; do
  $P --family $f --f16 "linear.py,grouped_experts"
  $P --family $f --f16 "linear.py,grouped_experts" --keep self.wqkv
done
for f in qwen3next qwen35moe qwen4exp; do
  env STRATA_PALLAS_IMPL=interpret .venv/bin/python experiments/parity/precision_sites.py --family $f
done
