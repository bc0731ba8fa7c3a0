"""Correctness on a real NVIDIA GPU (skipped without one; CI has none, the device tool does):

- Ctrl-C mid-run checkpoints, and resume=RUN_DIR ends with the uninterrupted run's per-step losses: bitwise
  when two uninterrupted runs agree bitwise (the kernels are deterministic for this shape), else within the
  spread two uninterrupted runs show.
- A real torch.cuda.OutOfMemoryError (router.memory_headroom above 1, which SLURM_ROUTER_TEST_MEMORY_HEADROOM_MAX
  allows in tests: the router plans one micro-batch far
  larger than the GPU holds) is halved and retried: every sample of every step computed exactly once, the loss
  curve that of a run whose plan fitted from the start.

    python -m pytest tests/test_cuda.py -v -s        # on a machine with an NVIDIA GPU
"""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import run_cli, run_dir_of
from test_requeue_local import _rows, last_attempt_losses

from slurm_router.config.testing_aids import MEMORY_HEADROOM_MAX_ENV

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA)"),
]

STEPS = 120
RESUME = [
    "base.enabled=false",
    "model=gpt2_small",
    "data=synthetic",
    "data.mean_len=200",
    "data.max_len=512",
    f"train.steps={STEPS}",
    "train.checkpoint_every=25",
    "train.global_batch_size=16",
    "train.eval_batches=2",
    "train.lr=1e-3",
]


def _start(tmp_path: Path, *args: str) -> subprocess.Popen:
    tmp_path.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        [sys.executable, "-m", "slurm_router", *args, f"run_root={tmp_path}"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(tmp_path: Path, *args: str, env: dict | None = None) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    out = run_cli(*args, f"run_root={tmp_path}", cwd=tmp_path, env=env, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return run_dir_of(out)


def _max_rel_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max(abs(a[s] - b[s]) / abs(b[s]) for s in a)


def test_ctrl_c_on_cuda_checkpoints_and_resume_matches_the_uninterrupted_run(tmp_path):
    ref1 = last_attempt_losses(_finish(tmp_path / "a", *RESUME) / "tasks" / "main")
    ref2 = last_attempt_losses(_finish(tmp_path / "b", *RESUME) / "tasks" / "main")
    assert sorted(ref1) == list(range(STEPS))
    start = next(r for r in _rows(next((tmp_path / "a").glob("default/*/tasks/main"))) if r["event"] == "start")
    assert start["device_type"] == "cuda" and "NVIDIA" in start["device_name"]
    noise = _max_rel_diff(ref1, ref2)

    proc = _start(tmp_path / "c", *RESUME)
    deadline, task_dir = time.time() + 300, None
    while time.time() < deadline and task_dir is None:
        for d in (tmp_path / "c").glob("default/*/tasks/main"):
            if any(r["event"] == "step" and r["step"] >= 40 for r in _rows(d)):
                task_dir = d
        time.sleep(0.05)
    assert task_dir is not None, "no step 40 within 300 s"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, out[-2000:] + err[-2000:]
    saved = [r for r in _rows(task_dir) if r["event"] == "checkpoint_saved"]
    assert saved[-1]["reason"] == "signal" and 40 < saved[-1]["step"] < STEPS
    run_dir = task_dir.parents[1]
    resumed = run_cli(f"resume={run_dir}", cwd=tmp_path / "c", timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    got = last_attempt_losses(task_dir)
    diff = _max_rel_diff(got, ref1)
    print(
        f"\nCUDA resume: stopped at step {saved[-1]['step']}; max relative loss difference resumed vs "
        f"uninterrupted {diff:.3g}; uninterrupted vs uninterrupted {noise:.3g}"
    )
    if noise == 0:
        assert got == ref1, "deterministic kernels: a resumed run must match bitwise"
    else:
        assert diff <= 2 * noise, (diff, noise)


OOM = [
    "base.enabled=false",
    "model=gpt2_small",
    "data=synthetic",
    "data.length_dist=fixed",
    "data.mean_len=1024",
    "data.max_len=1024",
    "data.n_samples=2048",
    "train.global_batch_size=192",
    "train.steps=4",
    "train.eval_batches=1",
    "train.eval_batch_size=8",
    "train.lr=1e-3",
]


def _step_rows(run_dir: Path) -> tuple[list[dict], list[dict]]:
    rows = _rows(run_dir / "tasks" / "main")
    return [r for r in rows if r["event"] == "step"], [r for r in rows if r["event"] == "micro"]


def test_a_real_cuda_oom_is_halved_and_retried_without_losing_or_repeating_a_sample(tmp_path):
    fitted = _finish(tmp_path / "fit", *OOM)
    forced = _finish(tmp_path / "oom", *OOM, "router.memory_headroom=4", env={MEMORY_HEADROOM_MAX_ENV: "4"})
    steps_fit, _ = _step_rows(fitted)
    steps, micro = _step_rows(forced)
    assert sum(r["oom_retries"] for r in steps) >= 1, "headroom 4 should have planned a micro-batch that OOMs"
    from slurm_router.train.data import GlobalBatchSampler

    sampler = GlobalBatchSampler(
        int(
            json.loads((forced / "tasks" / "main" / "events-rank0.jsonl").read_text().splitlines()[0])[
                "n_train_samples"
            ]
        ),
        192,
        0,
    )
    for r in steps:
        ids = [i for m in micro if m["step"] == r["step"] for i in m["sample_ids"]]
        assert sorted(ids) == sorted(sampler.batch(r["step"])), f"step {r['step']}: a sample lost or repeated"
    fit = {r["step"]: r["loss"] for r in steps_fit}
    got = {r["step"]: r["loss"] for r in steps}
    diff = _max_rel_diff(got, fit)
    print(
        f"\nCUDA OOM: {sum(r['oom_retries'] for r in steps)} OOM retries, micro-batches per step "
        f"{[r['n_micro'] for r in steps]}, max relative loss difference vs a fitting plan {diff:.3g}"
    )
    # bf16 autocast: a different micro-batch split changes GEMM shapes and so float rounding, not the math
    assert diff < 2e-3
