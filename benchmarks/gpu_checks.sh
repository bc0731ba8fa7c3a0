#!/usr/bin/env bash
# Every check that needs an NVIDIA GPU, in one call, in order of value, inside one time budget (a lent GPU
# comes with ~15 minutes in all, start-up included). Each check's log and result files go to a work folder
# that is packed into OUT/results.tar.gz after every check (so a time-out still returns what finished);
# OUT/summary.txt says each check's exit code and seconds. Exits 1 if any check failed or was cut short.
#
#   bash benchmarks/gpu_checks.sh OUT                   # on the GPU machine (the device tool: OUT=$OUT)
#   bash benchmarks/gpu_checks.sh OUT --stand-in-cpu    # here, without a GPU: the same steps, small shapes
# Every result file goes to the work folder (each script's --out), never into benchmarks/results/: results
# files are committed from a clean commit by hand (benchmarks/provenance.py refuses a dirty tree there).
#
# Checks: device (nvidia-smi, versions), poll_cost (telemetry read cost), lora_ab (the experiment end to end
# with its report), cuda_tests (tests/test_cuda.py: Ctrl-C resume, a real CUDA OOM), throughput (job vs bare
# loop vs the speed switches, MFU, one profiled step of each), packed_rows (packed vs padded micro-batches,
# long-tailed lengths), fused (8 GPT-2-small variants fused vs 8 processes sharing the GPU: benchmarks/fused_job.py),
# packing (4 variants on one GPU vs one after another).
# Seen on an H200 (2026-11-26, benchmarks/results/gpu_checks/): lora_ab needed more than 150 s (base 300 steps,
# r8 done, r32 cut), tests/test_cuda.py more than 171 s (six runs of the command, ~30 s of start-up each);
# poll_cost took 4 s, throughput --only b,c --profile 82 s, packing 90 s. The next lease: GPU_CHECKS_ONLY=
# "device cuda_tests lora_ab throughput packed_rows fused" with GPU_CHECKS_THROUGHPUT_ARGS="--repeats 1 --only b,d,e".
# Budget: GPU_CHECKS_BUDGET_S (default 540 s); each check gets min(its own limit, what is left).
# GPU_CHECKS_ONLY="throughput cuda_tests" runs only those (in this file's order); GPU_CHECKS_THROUGHPUT_ARGS
# replaces throughput.py's arguments (default --repeats 2; --stand-in-cpu: --quick --repeats 1).
# Python packages the GPU machine lacks travel as wheels in .whl/ (the device tool's README) and are
# installed first; the commit of the tree comes in SLURM_ROUTER_COMMIT (no .git travels).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: gpu_checks.sh OUT [--stand-in-cpu]}
standin=0
[ "${2:-}" = "--stand-in-cpu" ] && standin=1
mkdir -p "$out"
out=$(cd "$out" && pwd)
work=$(mktemp -d /tmp/gpu-checks.XXXXXX)
runs=$work/runs
budget=${GPU_CHECKS_BUDGET_S:-540}
failed=0
export PYTHONUNBUFFERED=1
: >"$work/summary.txt"

pack() { tar -czf "$out/.results.tar.gz" -C "$work" --exclude=runs . && mv "$out/.results.tar.gz" "$out/results.tar.gz"
  cp "$work/summary.txt" "$out/summary.txt"; }
note() { echo "$*" | tee -a "$work/summary.txt"; }
# step NAME LIMIT_S CMD...: runs CMD with its output in NAME.log, under min(LIMIT_S, budget left)
step() {
  local name=$1 limit=$2; shift 2
  if [ -n "${GPU_CHECKS_ONLY:-}" ] && [[ " $GPU_CHECKS_ONLY " != *" $name "* ]]; then return 0; fi
  local left=$((budget - SECONDS))
  if [ "$left" -lt 20 ]; then note "$name: SKIPPED (budget spent: ${SECONDS}s of ${budget}s)"; failed=1; return 1; fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "== $name (limit ${limit}s, ${SECONDS}s used)"
  local t0=$SECONDS rc
  if declare -F "$1" >/dev/null; then     # a function of this script: timeout runs it in a bash of its own
    set -- bash -c "$(declare -f "$1"); $(declare -p standin work runs lora_ab_args tp_args); $*"
  fi
  timeout --kill-after=10 "$limit" "$@" >"$work/$name.log" 2>&1; rc=$?
  tail -25 "$work/$name.log"
  if [ "$rc" = 0 ]; then note "$name: ok ($((SECONDS - t0))s)"
  else note "$name: FAILED rc=$rc ($((SECONDS - t0))s$([ "$rc" = 124 ] && echo ', timed out'))"; failed=1; fi
  pack
  return "$rc"
}

# ---- install what the GPU machine's python3 lacks (hydra-core, omegaconf, antlr4, submitit; this package)
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl \
    || { note "install: FAILED (wheels)"; pack; exit 1; }
fi
editable() { python3 -m pip install -q --no-index --no-deps --no-build-isolation -e .; }
if ! python3 -c "import slurm_router.conf" 2>/dev/null; then
  # an older setuptools there may not build it: the carried one (.whl/build/) then, and again
  editable || { python3 -m pip install -q --no-index --no-deps .whl/build/*.whl && editable; } \
    || { note "install: FAILED (pip install -e .)"; pack; exit 1; }
fi
python3 -c "import slurm_router.conf, hydra, submitit" || { note "install: FAILED (imports)"; pack; exit 1; }

if [ "$standin" = 1 ]; then
  python3 -c "import torch, sys; sys.exit(0 if not torch.cuda.is_available() else 1)" \
    || { note "--stand-in-cpu on a machine with a GPU: drop the flag"; exit 2; }
  export CUDA_VISIBLE_DEVICES=""
  lora_ab_args=(base.steps=20 train.steps=10 train.eval_every=5 train.eval_batches=2)
  tp_args=(--quick --repeats 1)
else
  lora_ab_args=()
  tp_args=(--repeats 2)
fi
[ -n "${GPU_CHECKS_THROUGHPUT_ARGS:-}" ] && read -r -a tp_args <<<"$GPU_CHECKS_THROUGHPUT_ARGS"

# ---- device: what ran (nvidia-smi, versions)
devinfo() {
  if [ "$standin" = 0 ]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv || return 1
  fi
  python3 -c "import torch, transformers, peft; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__, 'peft', peft.__version__, 'gpu', \
torch.cuda.get_device_name() if torch.cuda.is_available() else None)"
  echo "commit ${SLURM_ROUTER_COMMIT:-unknown}"
}
step device 30 devinfo

# ---- poll_cost: what a telemetry read costs on this device (seconds)
step poll_cost 40 python3 benchmarks/poll_cost.py --out "$work"

# ---- (a) the experiment end to end, with its report
lora_ab() {
  python3 -m slurm_router +experiment=lora_ab run_root="$runs" base.cache_dir="$runs/cache" "${lora_ab_args[@]}" \
    || return 1
  local run_dir
  run_dir=$(grep '^run_dir: ' "$work/lora_ab.log" | tail -1 | cut -d' ' -f2)
  [ -n "$run_dir" ] || { echo "no run_dir line"; return 1; }
  mkdir -p "$work/lora_ab"
  cp "$run_dir/report/report.md" "$run_dir/report/summary.json" "$run_dir/manifest.json" "$work/lora_ab/"
  cp "$run_dir"/report/*.csv "$work/lora_ab/" 2>/dev/null
  python3 - "$run_dir" <<'EOF'
import json, sys
from pathlib import Path
run = Path(sys.argv[1])
for f in sorted(run.glob("tasks/*/events-rank0.jsonl")):
    rows = [json.loads(line) for line in f.read_text().splitlines()]
    start = next(r for r in rows if r["event"] == "start")
    assert start["device_type"] == "cuda" or start["device_type"] == "cpu" and not __import__("torch").cuda.is_available(), start
    end = [r for r in rows if r["event"] == "end"]
    assert end and end[-1]["exit_state"] == "completed", (f, end)
    print(f.parent.name, start["device_type"], start.get("device_name"), "steps", sum(r["event"] == "step" for r in rows))
EOF
}
step lora_ab 200 lora_ab

# ---- (b) tests/test_cuda.py: on a GPU both must pass (a skip there is a failure)
cuda_tests() {
  python3 -m pytest -q -s -rs -p no:cacheprovider --junitxml="$work/cuda_tests.xml" tests/test_cuda.py || return 1
  if [ "$standin" = 0 ]; then
    python3 -c "import sys, xml.etree.ElementTree as E; s = E.parse(sys.argv[1]).getroot().iter('testsuite'); \
t = next(s); sys.exit(0 if int(t.get('skipped')) == 0 and int(t.get('tests')) >= 2 else 1)" "$work/cuda_tests.xml" \
      || { echo "tests/test_cuda.py skipped on a GPU machine"; return 1; }
  fi
}
step cuda_tests 330 cuda_tests

# ---- (c) throughput: the job vs the bare loop vs the speed switches; MFU; one profiled step of each
step throughput 230 python3 benchmarks/throughput.py "${tp_args[@]}" --profile --out "$work"

# ---- (d) packed rows vs padded micro-batches on a long-tailed corpus (issue 27)
step packed_rows 150 python3 benchmarks/packed_rows.py --repeats "$([ "$standin" = 1 ] && echo 1 || echo 2)" \
  --steps "$([ "$standin" = 1 ] && echo 6 || echo 30)" --out "$work"


# ---- (f) fused variants (issue 28): 8 GPT-2-small variants in one task against 8 processes sharing the GPU
# (a stand-in's numbers are CPU numbers: never under a -cuda name)
if [ "$standin" = 1 ]; then fused_args=(--ks 2 --steps 6 --warmup 2 --small-k 0); else fused_args=(--gpu --ks "" --small-k 8 --small-steps 20 --warmup 5); fi
step fused 200 python3 benchmarks/fused_job.py "${fused_args[@]}" \
  --out "$work/fused-job-$([ "$standin" = 1 ] && echo cpu || echo cuda).md"

# ---- (e) 4 variants packed on one GPU vs one after another
step packing 120 python3 benchmarks/packing.py --shapes 8x512 --steps 60 --out "$work"

note "total: ${SECONDS}s of ${budget}s; $([ "$failed" = 0 ] && echo 'all checks passed' || echo 'SOME CHECKS FAILED')"
pack
cat "$work/summary.txt"
exit "$failed"
