#!/usr/bin/env bash
# The checks that need an NVIDIA GPU, by name (a lent GPU's time is scarce: run several in one go). Each
# check's output goes to DIR/<check>.log, the result files beside it.
#   bash benchmarks/gpu_checks.sh DIR lora_ab cuda_tests throughput packing     # or throughput_quick
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: gpu_checks.sh DIR CHECK...}; shift
mkdir -p "$out"
runs=/tmp/gpu-runs
step() { local name=$1 limit=$2; shift 2; echo "== $name (limit ${limit}s)"; local t0=$SECONDS
  PYTHONUNBUFFERED=1 timeout "$limit" "$@" >"$out/$name.log" 2>&1; local rc=$?
  echo "== $name rc=$rc $((SECONDS - t0))s"; tail -30 "$out/$name.log"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers, peft; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"
for check in "$@"; do
  case $check in
    lora_ab) step lora_ab 240 python3 -m slurm_router +experiment=lora_ab run_root=$runs base.cache_dir=$runs/cache
      run_dir=$(grep '^run_dir: ' "$out/lora_ab.log" | tail -1 | cut -d' ' -f2)
      [ -n "$run_dir" ] && cp "$run_dir/report/report.md" "$out/lora_ab-report.md" ;;
    cuda_tests) step cuda_tests 400 python3 -m pytest -q -s -p no:cacheprovider tests/test_cuda.py ;;
    throughput_quick) step throughput 240 python3 benchmarks/throughput.py --quick --repeats 1 ;;
    throughput) step throughput 560 python3 benchmarks/throughput.py --repeats 3 ;;
    packing) step packing 300 python3 benchmarks/packing.py ;;
    *) echo "unknown check $check"; exit 2 ;;
  esac
done
cp benchmarks/results/throughput-cuda.* benchmarks/results/packing.md "$out/" 2>/dev/null
exit 0
