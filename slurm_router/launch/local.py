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
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from slurm_router.config import LocalLauncherConfig, UserError
from slurm_router.cpu import THREADS_ENV, threads_per_worker
from slurm_router.launch.base import Launcher, RunJobs, StageJobs
from slurm_router.launch.progress import Progress
from slurm_router.layout import RunLayout
from slurm_router.lifecycle import EXIT_INTERRUPTED, TaskOutcome, TaskState
from slurm_router.plan import Stage, TaskSpec
from slurm_router.supervisor import stop_signals_blocked


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
    # resume=RUN_DIR launcher=local of a Slurm run: its config has no cpu_slots (the schema's default then)
    slots = cfg.launcher.get("cpu_slots") or os.cpu_count() or 1
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


class LocalLauncher(Launcher):
    """Runs each stage's queue here, to the end, inside submit_stage; writes the report itself."""
    schema = LocalLauncherConfig
    synchronous = True

    def __init__(self, cfg, manifest):
        super().__init__(cfg, manifest)
        self._pool: tuple[list[str], bool] | None = None

    @classmethod
    def check(cls, cfg) -> None:
        check_devices(cfg)

    def submit_stage(self, stage: Stage, after: str | None) -> StageJobs:
        if self._pool is None:                  # GPUs are probed once per run, when the first stage starts
            self._pool = device_pool(self.cfg)
        pool, on_gpu = self._pool
        # The workers of this stage that run side by side share the cores: decided once, here (slurm_router.cpu).
        threads = threads_per_worker(min(len(pool), sum(t.devices for t in stage.tasks)))
        return StageJobs(states=_run_queue(stage.tasks, pool, on_gpu, self.layout, self.manifest, threads))

    def report_job(self, after: str | None) -> str | None:
        from slurm_router.analysis.report import print_table, write_report
        try:
            print_table(write_report(self.layout.root))
        except Exception as e:                 # a failed run still prints where its files are
            print(f"report: not written ({e})", file=sys.stderr)
        return None

    def finish(self, run: RunJobs) -> int:
        failed = [n for n, s in run.states.items() if not s.done]
        if failed:
            print(f"failed tasks: {', '.join(failed)}; logs in {self.layout.logs}", file=sys.stderr)
        print(f"run_dir: {self.layout.root}")
        return 0 if run.ok else 1

    def interrupted(self) -> int:
        self.manifest.set(state="interrupted")
        print(f"\ninterrupted: running tasks saved a checkpoint at their last step\n"
              f"continue with: python -m slurm_router resume={self.layout.root}\nrun_dir: {self.layout.root}")
        return EXIT_INTERRUPTED


def check_devices(cfg) -> None:
    """No more devices per task than this machine has (GPUs), or a warning when CPU workers share cores."""
    gpus = detect_gpus()
    need = max([cfg.resources.devices_per_task] + [int(v.get("resources", {}).get("devices_per_task", 0) or 0)
                                                     for v in cfg.variants.values() if v])
    if gpus and need > len(gpus):
        raise UserError(f"resources.devices_per_task={need} but this machine has {len(gpus)} GPU(s): "
                        f"ask for at most {len(gpus)}, or use launcher=slurm")
    if not gpus and need > (os.cpu_count() or 1):
        warnings.warn(f"resources.devices_per_task={need} CPU worker processes on {os.cpu_count()} cores: "
                      "they will share cores (fine for tests, slow for training)", stacklevel=1)


def _run_queue(tasks: list[TaskSpec], pool: list[str], on_gpu: bool, layout: RunLayout, manifest,
               threads: int) -> dict[str, TaskState]:
    """Start tasks while free devices exist; record each as it starts and ends; returns the final states."""
    waiting, running, states = list(tasks), [], {}
    free = list(pool)
    progress = Progress(tasks)
    try:
        while waiting or running:
            while waiting and (devices := _take(free, waiting[0].devices)):
                spec = waiting.pop(0)
                for d in devices:
                    free.remove(d)
                # A Ctrl-C while the job process starts waits until it is in `running` (and so is stopped
                # below), and the job process itself starts with stop signals blocked until its handlers exist.
                with stop_signals_blocked():
                    running.append(_start(spec, devices, on_gpu, layout, threads))
                manifest.set_task(spec.name, state=TaskState.RUNNING.value, devices=devices,
                                  log_path=str(running[-1].log))
            for r in [r for r in running if r.proc.poll() is not None]:
                running.remove(r)
                free = sorted(free + r.devices, key=pool.index)
                state = TaskOutcome.from_exit_code(r.proc.returncode).state
                states[r.spec.name] = state
                manifest.set_task(r.spec.name, state=state.value, exit_code=r.proc.returncode,
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
            # a task that was in its last step finishes instead (quicker than a checkpoint): completed
            state = TaskOutcome.from_exit_code(r.proc.returncode).state
            manifest.set_task(r.spec.name, state=state.value, exit_code=r.proc.returncode)
        raise
    finally:
        progress.close()
    return states


def _start(spec: TaskSpec, devices: list[str], on_gpu: bool, layout: RunLayout, threads: int) -> Running:
    log = layout.log(spec.name)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env[THREADS_ENV] = str(threads)
    # CPU workers: never touch a GPU by accident
    env["CUDA_VISIBLE_DEVICES"] = ",".join(devices) if on_gpu else ""
    with open(log, "ab") as f:
        proc = subprocess.Popen([sys.executable, "-m", "slurm_router.job", str(layout.task(spec.name).task_file)],
                                stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return Running(spec, proc, devices, log)
