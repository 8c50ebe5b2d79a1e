#!/usr/bin/env bash
# The test suite against other framework versions than the ones CI installs: the lowest ones
# pyproject.toml declares, and the GPU image's. Each row gets a fresh virtual environment.
#   bash benchmarks/compat.sh              # every row (about 10 minutes each on 2 cores)
#   bash benchmarks/compat.sh lowest       # one row
# Exit status: non-zero if any row's suite failed.
set -u
cd "$(dirname "$0")/.."
declare -A rows=(
  [lowest]="transformers==4.57.6 accelerate==1.10.0 lightning==2.4.0"
  [gpu-image]="transformers==5.17.0 accelerate==1.15.0"
)
names=("$@")
[ ${#names[@]} -eq 0 ] && names=(lowest gpu-image)
status=0
for name in "${names[@]}"; do
  pins=${rows[$name]:-}
  [ -z "$pins" ] && { echo "!! unknown row: $name (rows: ${!rows[*]})"; status=1; continue; }
  venv=$(mktemp -d)/venv
  constraints=$(mktemp)
  printf '%s\n' torch==2.13.0 $pins > "$constraints"
  echo "== $name: $pins"
  python -m venv "$venv" &&
    "$venv/bin/pip" install -q torch==2.13.0 &&
    "$venv/bin/pip" install -q -c "$constraints" -e ".[dev]" &&
    "$venv/bin/python" -m pytest -q -p no:cacheprovider || { echo "!! $name failed"; status=1; }
  rm -rf "$(dirname "$venv")" "$constraints"
done
exit $status
