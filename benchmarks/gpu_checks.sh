#!/usr/bin/env bash
# Every GPU measurement the project publishes, in one command, on a machine with a CUDA GPU.
# Raw results land in benchmarks/results/ (commit them). Each step is independent: a failure is
# reported and the next step still runs.
set -u
cd "$(dirname "$0")/.."
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU visible'" || exit 1
status=0
run() { echo "== $*"; "$@" || { echo "!! failed: $*"; status=1; }; }
run python -m pytest -q -m gpu tests/test_gpu.py
run python benchmarks/trace_zoo.py --measure
run python -m integrations.accuracy.run --gpu
run python examples/lightning_quickstart.py --budget "" --accelerator gpu --steps 50 --out benchmarks/results/lightning_gpu
run python examples/hf_trainer_quickstart.py --budget "" --steps 50 --out benchmarks/results/hf_gpu
run python benchmarks/oom_recovery_demo.py --out benchmarks/results/oom_recovery
exit $status
