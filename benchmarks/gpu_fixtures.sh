#!/usr/bin/env bash
# GPU-truth fixtures in one short run on a CUDA machine (about 7 minutes), written to DIR (default
# benchmarks/results/gpu-truth/new):
#   1. allocator snapshots and measured peaks of the zoo rows whose no-GPU prediction still misses, and of the
#      rows never measured (benchmarks/gpu_snapshot.py), each in its own process, side by side;
#   2. the out-of-memory boundary with the card capped at CAP_GIB (default 12) for four families
#      (harness.accuracy.largest_batch --cap-gib), side by side: each trial is held to its own cap, so they
#      do not disturb each other while the card has room for all of them;
#   3. what cuDNN's recurrent kernels allocate over a grid of shapes (benchmarks/gpu_cudnn_rnn.py).
# ROWS (one "row:batch" per line) replaces the rows (ROWS=none: no rows), FAMILIES the boundary's families,
# RNN_GRID=workspace the cuDNN grid (see gpu_cudnn_rnn.py), HF_START the batch HF's auto_find_batch_size starts
# from. HF_ONLY names families whose boundary is known: only HF's finder runs for them (from HF_ONLY_START), with
# a check at its choice.
# Every step has a deadline; logs and results land in DIR as they are written.
#   bash benchmarks/gpu_fixtures.sh [DIR]
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out="${1:-benchmarks/results/gpu-truth/new}"
mkdir -p "$out"
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU visible'" || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/device.csv" 2>&1

default_rows=(
  "bert bf16-mixed sgd-momentum ckpt b16:16" "bert bf16-mixed sgd-momentum ckpt b16:32"
  "llama 16-mixed adamw-fused b4:4" "llama bf16-mixed sgd-momentum ckpt b4:4"
  "resnet-bn fp32 adamw b8:16"
  "lstm fp32 adamw b8:8" "lstm fp32 adamw b8:16"
  "lstm bf16-mixed sgd-momentum b16:16" "lstm bf16-mixed sgd-momentum b16:32"
  "lstm 16-mixed adamw-fused b16:16" "lstm 16-mixed adamw-fused b16:32"
)
if [ "${ROWS:-}" = none ]; then rows=(); elif [ -n "${ROWS:-}" ]; then mapfile -t rows <<< "$ROWS"
else rows=("${default_rows[@]}"); fi
grid="${RNN_GRID:-base}" rnn_out="$out/cudnn_rnn.json.gz"
[ "$grid" = base ] || rnn_out="$out/cudnn_rnn-$grid.json.gz"
timeout "${RNN_SECONDS:-200}" python benchmarks/gpu_cudnn_rnn.py "$rnn_out" --grid "$grid" > "${rnn_out%.json.gz}.log" 2>&1 &
for row in ${rows[@]+"${rows[@]}"}; do
  name="${row%:*}" batch="${row##*:}"
  log="$out/row-${name// /-}-at$batch.log"
  timeout "${ROW_SECONDS:-240}" python benchmarks/gpu_snapshot.py "$name" "$batch" "$out" > "$log" 2>&1 &
done
# The capped boundary runs beside the rows only where the card holds both (each family's cap, and 24 GiB more).
families=(${FAMILIES:-gpt2 resnet50 vit bert})
total_gib=$(python -c "import torch; print(torch.cuda.get_device_properties(0).total_memory >> 30)")
hf_only=(${HF_ONLY:-})
[ "$total_gib" -ge "$(python -c "print(int((${#families[@]} + ${#hf_only[@]}) * ${CAP_GIB:-12} + 24))")" ] || wait
for family in "${families[@]}"; do
  timeout "${BOUNDARY_SECONDS:-400}" python -m harness.accuracy.largest_batch --only "$family" \
    --cap-gib "${CAP_GIB:-12}" --check-steps "${CHECK_STEPS:-10}" --hf-start "${HF_START:-4096}" \
    --output "$out/largest_batch-$family.json" > "$out/largest_batch-$family.log" 2>&1 &
done
for family in ${HF_ONLY:-}; do
  FAMILY="$family" timeout "${BOUNDARY_SECONDS:-400}" python - > "$out/largest_batch-$family-hf.log" 2>&1 <<'EOF' &
import os
from harness.accuracy.largest_batch import in_fresh_process
base = {"family": os.environ["FAMILY"], "precision": "bf16-mixed", "optimizer": "adamw", "size": "gpu",
        "device": "cuda", "ceiling": None, "cap_bytes": round(float(os.environ.get("CAP_GIB", 12)) * 2**30)}
found = in_fresh_process({**base, "kind": "hf_auto_find", "hf_start": int(os.environ.get("HF_ONLY_START", os.environ.get("HF_START", 4096)))})
if found.get("batch_size"):
    in_fresh_process({**base, "kind": "probe", "batch_size": found["batch_size"],
                      "steps": int(os.environ.get("CHECK_STEPS", 10))})
EOF
done
wait
[ ${#rows[@]} -eq 0 ] || grep -h '^{' "$out"/row-*.log > "$out/rows.jsonl"
[ ${#rows[@]} -eq 0 ] || echo "rows measured: $(wc -l < "$out/rows.jsonl") of ${#rows[@]}"
