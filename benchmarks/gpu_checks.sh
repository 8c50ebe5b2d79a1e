#!/usr/bin/env bash
# Every GPU measurement the project publishes, on a machine with a CUDA GPU.
#   bash benchmarks/gpu_checks.sh                      # every step in turn (well over an hour)
#   bash benchmarks/gpu_checks.sh tests accuracy       # some steps
#   FAMILIES="gpt2 llama" bash benchmarks/gpu_checks.sh accuracy largest_batch readme   # those families only
#   COPY_RESULTS_TO=/some/dir bash benchmarks/gpu_checks.sh loops   # results also copied there, even if a step dies
# Steps: tests trace_zoo accuracy loops quickstarts oom_recovery largest_batch lora, and readme, which
# renders docs/accuracy.md's figures and the README's accuracy status from the result files (no GPU work; run it
# last). Raw results land in benchmarks/results/ (commit them with docs/accuracy.md and README.md). Each step is independent: a failure is
# reported and the next step still runs.
set -u
cd "$(dirname "$0")/.."
# Works from a checkout without installing memfit (the GPU machine keeps its own torch).
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU visible'" || exit 1
# Say at once what is missing, before any step spends its time: lightning (the finders, loops and
# quickstarts; pytorch-lightning alone is not enough for them), transformers with accelerate (HF rows),
# nvidia-ml-py (NVML figures), rich (every table), matplotlib (the quickstarts' pictures).
python - <<'EOF'
import importlib.util
missing = [n for n in ("lightning", "transformers", "accelerate", "pynvml", "rich", "matplotlib")
           if importlib.util.find_spec(n) is None]
if missing:
    print(f"!! missing Python packages: {' '.join(missing)} (install them, or the steps that need them fail)")
EOF
# COPY_RESULTS_TO=DIR: copy benchmarks/results/ there when the script ends, whatever ended it.
trap '[ -n "${COPY_RESULTS_TO:-}" ] && mkdir -p "$COPY_RESULTS_TO" && cp -r benchmarks/results/. "$COPY_RESULTS_TO"/' EXIT
status=0
run() { echo "== $*"; "$@" || { echo "!! failed: $*"; status=1; }; }
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests trace_zoo accuracy loops quickstarts oom_recovery largest_batch lora)
for step in "${steps[@]}"; do
  case "$step" in
    tests) run python -m pytest -q -m gpu tests/test_gpu.py ;;
    trace_zoo) run python benchmarks/trace_zoo.py --measure ;;
    accuracy)  # in parts that each fit a time limit: FAMILIES="gpt2 llama" replaces those families' rows
      families=()
      for family in ${FAMILIES:-}; do families+=(--family "$family"); done
      run python -m harness.accuracy.run --gpu ${families[@]+"${families[@]}"} ;;
    loops) run python -m harness.accuracy.loops --gpu ;;
    quickstarts)
      run python examples/lightning_quickstart.py --budget "" --accelerator gpu --steps 50 --out benchmarks/results/lightning_gpu
      run python examples/hf_trainer_quickstart.py --budget "" --steps 50 --out benchmarks/results/hf_gpu ;;
    oom_recovery) run python benchmarks/oom_recovery_demo.py --out benchmarks/results/oom_recovery ;;
    largest_batch)  # whole card, then every trial held to CAP_GIB (default 12 GiB) as a smaller budget
      only=()
      for family in ${FAMILIES:-gpt2 resnet50 vit}; do only+=(--only "$family"); done
      run python -m harness.accuracy.largest_batch "${only[@]}"
      run python -m harness.accuracy.largest_batch "${only[@]}" --cap-gib "${CAP_GIB:-12}" ;;
    lora) run python benchmarks/lora_gpu.py ;;  # a 3B Llama: about 60 GB of GPU memory
    readme) run python -m harness.accuracy.readme --write ;;
    *) echo "!! unknown step: $step"; status=1 ;;
  esac
done
exit $status
