"""Local launcher: a GPU-pinned task queue.

Every task needing D devices gets D devices of its own (CUDA_VISIBLE_DEVICES), tasks run concurrently while
free devices exist and the rest wait. Never all tasks on GPU 0, never more concurrent tasks than devices: the
known failures of submitit's LocalExecutor and Hydra's local launcher. Without GPUs the devices are CPU worker
slots (launcher.cpu_slots, default the core count). Stages run in order; a failed stage stops later ones.

Ctrl-C: every running task gets SIGTERM; its workers finish the current step, save a checkpoint and exit
(code 75), and `python -m slurm_router resume=RUN_DIR` continues from there.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from slurm_router.launch.progress import Progress
from slurm_router.plan import Stage, TaskSpec
from slurm_router.train.state import EXIT_STOPPED


def detect_gpus() -> list[str]:
    """GPU ids this process may use: CUDA_VISIBLE_DEVICES if set, else every GPU NVML sees, else none."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [x.strip() for x in env.split(",") if x.strip() and x.strip() != "-1"]
    try:
        import pynvml
        pynvml.nvmlInit()
        return [str(i) for i in range(pynvml.nvmlDeviceGetCount())]
    except Exception:               # no NVIDIA driver: a CPU machine
        return []


@dataclass
class Running:
    spec: TaskSpec
    proc: subprocess.Popen
    devices: list[str]
    log: Path
    started: float = field(default_factory=time.time)


def device_pool(cfg) -> tuple[list[str], bool]:
    """Device slots: each GPU id appears once per task it may hold (variant packing), or CPU worker slots."""
    gpus = detect_gpus()
    if gpus:
        per_gpu = cfg.resources.tasks_per_gpu or packable_tasks(cfg, gpu_total_bytes(gpus[0]))
        if per_gpu > 1:
            print(f"variant packing: up to {per_gpu} tasks per GPU")
        return [g for g in gpus for _ in range(per_gpu)], True
    slots = cfg.launcher.cpu_slots or os.cpu_count() or 1
    return [f"cpu{i}" for i in range(max(slots, cfg.resources.devices_per_task))], False


def gpu_total_bytes(gpu_id: str) -> int:
    import pynvml
    pynvml.nvmlInit()
    return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(int(gpu_id))).total)


def packable_tasks(cfg, gpu_bytes: int, limit: int = 8) -> int:
    """How many tasks' predicted peaks fit in one GPU's budget (the router's memory model, seeded from the
    model's sizes, which are counted on the meta device: nothing is allocated)."""
    import torch
    from slurm_router.router import MemoryModel
    from slurm_router.train.model import build_model, count_parameters
    with torch.device("meta"):
        model = build_model(cfg.model, cfg.model.vocab_size, cfg.seed, lora=True)
    n_params, n_trainable = count_parameters(model)
    c = model.config
    mem = MemoryModel.from_model_sizes(n_params, n_trainable, c.n_embd, c.n_layer, c.vocab_size,
                                       bytes_per_param=2 if cfg.train.precision != "fp32" else 4)
    per_device = -(-cfg.train.global_batch_size // cfg.resources.devices_per_task)
    need = mem.predict(per_device * cfg.data.max_len, per_device, cfg.data.max_len)
    return max(1, min(limit, int(cfg.router.memory_headroom * gpu_bytes // max(1, need))))


def _take(free: list[str], n: int) -> list[str] | None:
    """n slots on n different devices, emptiest devices first (spread before packing); None if impossible."""
    order = sorted(dict.fromkeys(free), key=lambda d: -free.count(d))
    return order[:n] if len(order) >= n else None


def run_stages(stages: list[Stage], cfg, run_dir: Path, manifest) -> dict[str, str]:
    """Run every stage in order; returns task name -> final state (completed | failed | interrupted | skipped |
    cached)."""
    pool, on_gpu = device_pool(cfg)
    states: dict[str, str] = {}
    for stage in stages:
        if stage.cached:
            for t in stage.tasks:
                states[t.name] = "cached"
            continue
        if any(states.get(t.name) in ("failed", "skipped", "interrupted") for s in stages if s.name in stage.depends_on
               for t in s.tasks):
            for t in stage.tasks:
                states[t.name] = "skipped"
            continue
        states.update(_run_queue(stage.tasks, pool, on_gpu, run_dir, manifest))
    return states


def _run_queue(tasks: list[TaskSpec], pool: list[str], on_gpu: bool, run_dir: Path, manifest) -> dict[str, str]:
    waiting, running, states = list(tasks), [], {}
    free = list(pool)
    progress = Progress(tasks)
    try:
        while waiting or running:
            while waiting and (devices := _take(free, waiting[0].devices)):
                spec = waiting.pop(0)
                for d in devices:
                    free.remove(d)
                running.append(_start(spec, devices, on_gpu, run_dir, len(pool)))
                manifest.set_task(spec.name, state="running", devices=devices, log_path=str(running[-1].log))
            for r in list(running):
                if r.proc.poll() is not None:
                    running.remove(r)
                    free = sorted(free + r.devices, key=pool.index)
                    code = r.proc.returncode
                    state = "completed" if code == 0 else "interrupted" if code == EXIT_STOPPED else "failed"
                    states[r.spec.name] = state
                    manifest.set_task(r.spec.name, state=state, exit_code=r.proc.returncode,
                                      elapsed_s=round(time.time() - r.started, 3))
                    progress.finish(r.spec.name, state, r.log)
            progress.update()
            time.sleep(0.2)
    except KeyboardInterrupt:
        # SIGTERM, not SIGKILL: each task checkpoints at the end of its current step, then exits.
        print("\nstopping: running tasks checkpoint at the end of their current step...", file=sys.stderr,
              flush=True)
        for r in running:
            r.proc.terminate()
        for r in running:
            r.proc.wait()
            manifest.set_task(r.spec.name, state="interrupted", exit_code=r.proc.returncode)
        raise
    finally:
        progress.close()
    return states


def _start(spec: TaskSpec, devices: list[str], on_gpu: bool, run_dir: Path, pool_size: int) -> Running:
    task_file = spec.task_dir / "task.json"
    log = run_dir / "logs" / f"{spec.name}.log"
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    if on_gpu:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
    else:
        env["CUDA_VISIBLE_DEVICES"] = ""       # CPU workers: never touch a GPU by accident
        env["SLURM_ROUTER_THREADS"] = str(max(1, (os.cpu_count() or 1) // pool_size))
    with open(log, "ab") as f:
        proc = subprocess.Popen([sys.executable, "-m", "slurm_router.job", str(task_file)], stdout=f,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return Running(spec, proc, devices, log)
