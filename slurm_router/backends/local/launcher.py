"""Local launcher: a GPU-pinned task queue.

Every task needing D devices gets D devices of its own (CUDA_VISIBLE_DEVICES), tasks run concurrently while
free devices exist and the rest wait. Never all tasks on GPU 0, never more concurrent tasks than devices: the
known failures of submitit's LocalExecutor and Hydra's local launcher. Without GPUs the devices are CPU worker
slots (launcher.cpu_slots, default the core count). Stages run in order; a failed stage stops later ones.

Ctrl-C (or SIGTERM to the launcher): every running task gets SIGTERM; its workers finish the current step,
save a checkpoint and exit (code 75), and `python -m slurm_router resume=RUN_DIR` continues from there. A task
that had finished is recorded as finished wherever the Ctrl-C lands; if every task had, the run is completed
and only the report is left to `python -m slurm_router.analysis RUN_DIR`.

The job processes share the launcher's run lock (slurm_router.rundir.lock, pass_fds) and watch the launcher's pid
(supervisor.LAUNCHER_PID_ENV): if the launcher dies, even by SIGKILL, they stop within seconds by themselves.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, cast

from slurm_router.backends.local.reserves import ReserveCalls
from slurm_router.config.schema import FUSE_AUTO, LocalLauncherConfig
from slurm_router.errors import UserError
from slurm_router.launch.base import Launcher, RunJobs, StageJobs
from slurm_router.launch.plan import prune_layout_note, queue_order, trained_variants
from slurm_router.launch.progress import Progress, note_killed
from slurm_router.rundir.layout import RunLayout
from slurm_router.rundir.lifecycle import EXIT_INTERRUPTED, TaskOutcome, TaskState, finished, raise_if_stop_dropped
from slurm_router.rundir.lock import LOCK_FD_ENV
from slurm_router.rundir.lock import held as held_lock
from slurm_router.rundir.spec import Stage, TaskSpec
from slurm_router.scheduler.task_view import TaskView, local_tasks
from slurm_router.supervise.supervisor import LAUNCHER_PID_ENV, pause_for_tests, stop_signals_blocked
from slurm_router.worker.cpu import THREADS_ENV, threads_per_worker


def detect_gpus() -> list[str]:
    """GPU ids this process may use: CUDA_VISIBLE_DEVICES if set, else every GPU NVML sees, else none."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [x.strip() for x in env.split(",") if x.strip() and x.strip() != "-1"]
    try:
        import pynvml

        pynvml.nvmlInit()
        return [str(i) for i in range(pynvml.nvmlDeviceGetCount())]
    except Exception:  # no NVIDIA driver: a CPU machine
        return []


@dataclass
class Running:
    spec: TaskSpec
    proc: subprocess.Popen
    devices: list[str]
    log: Path
    started: float = field(default_factory=time.time)


def device_pool(cfg) -> tuple[list[str], bool]:
    """Device slots: each GPU id appears once per task it may hold (co-located tasks), or CPU worker slots."""
    gpus = detect_gpus()
    if gpus:
        per_gpu = cfg.resources.tasks_per_gpu or packable_tasks(cfg, gpu_total_bytes(gpus[0]))
        if per_gpu > 1:
            print(f"co-location: up to {per_gpu} tasks per GPU")
        return [g for g in gpus for _ in range(per_gpu)], True
    # resume=RUN_DIR launcher=local of a Slurm run: its config has no cpu_slots (the schema's default then)
    slots = cfg.launcher.get("cpu_slots") or os.cpu_count() or 1
    return [f"cpu{i}" for i in range(max(slots, cfg.resources.devices_per_task))], False


def gpu_total_bytes(gpu_id: str) -> int:
    import pynvml

    pynvml.nvmlInit()
    return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(int(gpu_id))).total)


def task_peak_bytes(cfg, device_type: str) -> Callable[[int], int]:
    """fused -> a task's predicted peak per device with `fused` variants' batches at once (1: a task alone): the
    router's memory model, seeded from the model's sizes counted on the meta device (nothing is allocated), as
    the worker seeds it (worker/setup.py): on a GPU bf16 activations under autocast; on a CPU the tensors only
    (a worker's RSS adds the interpreter and torch)."""
    import torch

    from slurm_router.router import MemoryModel
    from slurm_router.train.model import build_model, memory_shape

    with torch.device("meta"):
        model = build_model(cfg.model, cfg.model.vocab_size, cfg.seed, lora=True)
    mem = MemoryModel.from_model_bytes(
        **memory_shape(model, cfg, torch.device(device_type)), vocab_size=cast(Any, model).config.vocab_size
    )
    per_task = -(-cfg.train.global_batch_size // cfg.resources.devices_per_task)

    def peak(fused: int) -> int:
        per_device = per_task * fused
        return int(mem.predict(per_device * cfg.data.max_len, per_device, cfg.data.max_len))

    return peak


def packable_tasks(cfg, gpu_bytes: int, limit: int = 8) -> int:
    """How many tasks' predicted peaks fit in one GPU's budget (a fused task: every variant's batch at once)."""
    need = task_peak_bytes(cfg, "cuda")(max(1, int(cfg.resources.get("fuse_variants", 1))))
    return max(1, min(limit, int(cfg.router.memory_headroom * gpu_bytes // max(1, need))))


def auto_fuse_variants(cfg, n_tasks: int, limit: int = 64) -> tuple[int, str]:
    """resources.fuse_variants=auto: K = the variant tasks spread over the tasks this machine runs at once
    (ceil(n / slots): no slot idle for want of a group, no more groups than slots), lowered while a fused task's
    predicted peak (every variant's batch at once) exceeds the memory model's share of its device: a GPU's
    memory over resources.tasks_per_gpu, or this machine's memory over its CPU slots. Returns (K, why)."""
    pool, on_gpu = device_pool(cfg)
    slots = max(1, len(pool) // max(1, cfg.resources.devices_per_task))
    k = max(1, min(limit, -(-n_tasks // slots)))
    if on_gpu:
        total, share = gpu_total_bytes(pool[0]), max(1, cfg.resources.tasks_per_gpu)
        where, of = f"{slots} task slot(s) on {len(set(pool))} GPU(s)", f"GPU {pool[0]}'s"
        shared = f"resources.tasks_per_gpu={share}"
    else:
        total, share = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), slots
        where, of, shared = f"{slots} CPU task slot(s) (launcher.cpu_slots)", "this machine's RAM,", f"{slots} slot(s)"
    budget = total // share
    peak, allowed = task_peak_bytes(cfg, "cuda" if on_gpu else "cpu"), cfg.router.memory_headroom * budget
    while k > 1 and peak(k) > allowed:
        k -= 1
    return k, (
        f"resources.fuse_variants=auto: K={k} for {n_tasks} variant task(s) over {where}; a fused task of {k} "
        f"predicted at {peak(k) / 2**30:.2f} GiB per device of the {allowed / 2**30:.2f} GiB it may use "
        f"(router.memory_headroom={cfg.router.memory_headroom:g} x {of} {total / 2**30:.2f} GiB, over {shared})"
    )


def _take(free: list[str], n: int) -> list[str] | None:
    """n slots on n different devices, emptiest devices first (spread before co-locating); None if impossible."""
    order = sorted(dict.fromkeys(free), key=lambda d: -free.count(d))
    return order[:n] if len(order) >= n else None


class LocalLauncher(Launcher):
    """Runs each stage's queue here, to the end, inside submit_stage; writes the report itself."""

    schema = LocalLauncherConfig
    synchronous = True

    @classmethod
    def task_states(cls, manifest: dict) -> list[TaskView]:
        return local_tasks(manifest)

    @classmethod
    def cancel(cls, manifest: dict) -> str | None:
        return stop_local_run(manifest)

    def __init__(self, cfg, manifest):
        super().__init__(cfg, manifest)
        self._pool: tuple[list[str], bool] | None = None

    @classmethod
    def check(cls, cfg) -> None:
        check_devices(cfg)

    @classmethod
    def auto_fuse_variants(cls, cfg, n_tasks: int) -> tuple[int, str]:
        return auto_fuse_variants(cfg, n_tasks)

    def submit_stage(self, stage: Stage, after: str | None, after_round: str | None = None) -> StageJobs:
        if self._pool is None:  # GPUs are probed once per run, when the first stage starts
            self._pool = device_pool(self.cfg)
        pool, on_gpu = self._pool
        # The workers of this stage that run side by side share the cores: decided once, here (slurm_router.worker.cpu).
        threads = threads_per_worker(min(len(pool), sum(t.devices for t in stage.tasks)))
        order = queue_order(stage.tasks)  # replicates of different variants side by side (prune=true compares them)
        if self.cfg.get("prune") and len(order) > 1:
            at_once = len(pool) // max(t.devices for t in order)
            if note := prune_layout_note(order, at_once, trained_variants(stage)):
                print(note, file=sys.stderr, flush=True)
        return StageJobs(states=_run_queue(order, pool, on_gpu, self.layout, self.manifest, threads))

    def report_job(self, after: str | None) -> str | None:
        pause_for_tests("report")  # before the imports: a signal during them may land in importlib's
        from slurm_router.analysis.console import print_table
        from slurm_router.analysis.report import write_report  # lock callbacks, which drop it

        raise_if_stop_dropped()  # (one dropped there, or earlier: now)
        try:
            print_table(write_report(self.layout.root))
        except Exception as e:  # a failed run still prints where its files are
            print(f"report: not written ({e})", file=sys.stderr)
        return None

    def finish(self, run: RunJobs) -> int:
        stopped = [n for n, s in run.states.items() if s is TaskState.INTERRUPTED]
        failed = [n for n, s in run.states.items() if not s.done and n not in stopped]
        tasks = self.manifest.data["tasks"]
        with_members = lambda n: ", ".join([n, *tasks[n].get("members", [])])  # a fused task: every variant of it
        if failed:  # a fused task failed as a group: every variant of it, and the one log they share
            shown = [f"{with_members(n)} (log: {self.layout.log(n)})" for n in failed]
            print(f"failed tasks: {'; '.join(shown)}", file=sys.stderr)
        if stopped:  # a stop signal reached the job processes themselves (not through this launcher)
            if not [n for n, s in run.states.items() if s is TaskState.FAILED]:
                self.manifest.set(state="interrupted")
            print(
                f"interrupted tasks (stopped by a signal after a checkpoint): {', '.join(map(with_members, stopped))}; continue "
                f"with: python -m slurm_router resume={self.layout.root}",
                file=sys.stderr,
            )
        print(f"run_dir: {self.layout.root}")
        return 0 if run.ok else 1

    def interrupted(self) -> int:
        """Ctrl-C: the finished work stays recorded as finished. Every task done (the Ctrl-C came during the
        report, or just after the last task wrote its result): the run is completed (or failed) and only the
        report is left; else the run is interrupted and resume= continues it."""
        manifest, root = self.manifest.refresh(), self.layout.root
        ended = manifest.data.get("state") in ("completed", "failed")  # submit_stages got to the report
        done = (TaskState.COMPLETED.value, TaskState.CACHED.value)
        if not ended and all(t.get("state") in done for t in manifest.data["tasks"].values()):
            manifest.set(state="completed")
            ended = True
        if ended:
            print(
                f"\ninterrupted before the report was written: every task has ended; "
                f"python -m slurm_router.analysis {root} writes the report\nrun_dir: {root}"
            )
            return EXIT_INTERRUPTED
        manifest.set(state="interrupted")
        print(
            f"\ninterrupted: running tasks saved a checkpoint at their last step\n"
            f"continue with: python -m slurm_router resume={root}\nrun_dir: {root}"
        )
        return EXIT_INTERRUPTED


def check_devices(cfg) -> None:
    """No more devices per task than this machine has (GPUs), or a warning when CPU workers share cores."""
    if cfg.resources.nodes_per_task != 1:
        raise UserError(
            f"resources.nodes_per_task={cfg.resources.nodes_per_task}: launcher=local runs on this "
            "machine only; span nodes with launcher=slurm (or sbatch) launcher.srun_workers=true"
        )
    gpus = detect_gpus()
    need = max(
        [cfg.resources.devices_per_task]
        + [int(v.get("resources", {}).get("devices_per_task", 0) or 0) for v in cfg.variants.values() if v]
    )
    if gpus and cfg.resources.tasks_per_gpu == 0 and cfg.resources.get("fuse_variants") == FUSE_AUTO:
        raise UserError(
            "resources.fuse_variants=auto and resources.tasks_per_gpu=0 both size by predicted memory, each from "
            "the other: set one of them (e.g. resources.tasks_per_gpu=1)"
        )
    if gpus and need > len(gpus):
        raise UserError(
            f"resources.devices_per_task={need} but this machine has {len(gpus)} GPU(s): "
            f"ask for at most {len(gpus)}, or use launcher=slurm"
        )
    # settings that only one kind of machine reads: a warning, not a refusal (the same command runs on both)
    if gpus and cfg.launcher.get("cpu_slots"):
        _warn(
            f"launcher.cpu_slots={cfg.launcher.cpu_slots} is not read: this machine has {len(gpus)} GPU(s) and the "
            "tasks run on them (cpu_slots counts CPU workers where there is no GPU)"
        )
    if not gpus and cfg.resources.tasks_per_gpu != 1:
        _warn(
            f"resources.tasks_per_gpu={cfg.resources.tasks_per_gpu} is not read: there is no GPU here, the tasks "
            "run on CPU worker slots (launcher.cpu_slots)"
        )
    cores = os.cpu_count() or 1
    if not gpus and need > cores and (cfg.launcher.get("cpu_slots") or 0) < need:
        # a warning, not a refusal: CPU workers sharing cores are how a multi-device run is tested on a laptop;
        # launcher.cpu_slots=N (N >= the workers) says it is meant, and silences it
        _warn(
            f"resources.devices_per_task={need} starts {need} CPU worker processes per task on "
            f"{cores} cores: they share the cores (fine for tests, slow for training); use "
            f"resources.devices_per_task={cores}, or set launcher.cpu_slots={need} to mean it"
        )


def _warn(line: str) -> None:
    print(f"warning: {line}", file=sys.stderr, flush=True)


def _run_queue(
    tasks: list[TaskSpec], pool: list[str], on_gpu: bool, layout: RunLayout, manifest, threads: int
) -> dict[str, TaskState]:
    """Start tasks while free devices exist; record each as it starts and ends; returns the final states."""
    running: list[Any]
    waiting, running, started, states = list(tasks), [], [], {}
    free = list(pool)
    reserves = ReserveCalls()
    progress = Progress(tasks)
    try:
        while waiting or running:
            raise_if_stop_dropped()
            while (spec := reserves.startable(waiting)) is not None and (devices := _take(free, spec.devices)):
                waiting.remove(spec)
                for d in devices:
                    free.remove(d)
                # A Ctrl-C while the job process starts waits until it is in `started` (and so is stopped
                # below), and the job process itself starts with stop signals blocked until its handlers exist.
                with stop_signals_blocked():
                    r = _start(spec, devices, on_gpu, layout, threads)
                    running.append(r)
                    started.append(r)
                now_running = {"state": TaskState.RUNNING.value, "devices": devices, "log_path": str(r.log)}
                manifest.set_task(spec.name, **now_running, pid=r.proc.pid, started_at=round(r.started, 3))
            ended_now = [r for r in running if r.proc.poll() is not None]
            for r in ended_now:
                running.remove(r)
                free = sorted(free + r.devices, key=pool.index)  # the next waiting task takes them at once
                state = states[r.spec.name] = _record_end(r, layout, manifest)  # a Ctrl-C after: recorded below
                if r.proc.returncode < 0 and state is not TaskState.COMPLETED:  # killed from outside: unsaid
                    note_killed(r.log, [r.spec.name, *r.spec.members], r.proc.pid, r.proc.returncode, layout.root)
                progress.finish(r.spec.name, state, r.log)
            progress.update()
            if not ended_now:  # a device freed (a task pruned, or done) is given out at once, at the loop's top
                time.sleep(0.2)
    except KeyboardInterrupt:
        # SIGTERM, not SIGKILL: each task checkpoints at the end of its current step, then exits. Every task
        # started and not yet recorded, wherever the Ctrl-C landed (one that just ended is recorded as it ended).
        print("\nstopping: running tasks checkpoint at the end of their current step...", file=sys.stderr, flush=True)
        unrecorded = [r for r in started if r.spec.name not in states]
        for r in unrecorded:
            if r.proc.poll() is None:
                r.proc.terminate()
        for r in unrecorded:
            r.proc.wait()  # a task in its last step finishes instead (quicker than a checkpoint): completed
            states[r.spec.name] = _record_end(r, layout, manifest)
        raise
    finally:
        progress.close()
    return states


def _record_end(r: Running, layout: RunLayout, manifest) -> TaskState:
    """The ended task's state in the manifest, from its exit code; but a task whose result is written (each
    variant's, fused) is completed whatever its exit: the TERM of a Ctrl-C may land after the work, as it exits."""
    code, ended = r.proc.returncode, time.time()
    state, note = TaskOutcome.from_exit_code(code).state, {}
    if state is not TaskState.COMPLETED and all(finished(layout.task(n)) for n in r.spec.group):
        state, note = TaskState.COMPLETED, {"note": f"finished: its result was written before its exit ({code})"}
    elapsed = round(ended - r.started, 3)
    manifest.set_task(
        r.spec.name, state=state.value, exit_code=code, elapsed_s=elapsed, ended_at=round(ended, 3), **note
    )
    return state


def _start(spec: TaskSpec, devices: list[str], on_gpu: bool, layout: RunLayout, threads: int) -> Running:
    log = layout.log(spec.name)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env[THREADS_ENV] = str(threads)
    # CPU workers: never touch a GPU by accident
    env["CUDA_VISIBLE_DEVICES"] = ",".join(devices) if on_gpu else ""
    # The job ends with this launcher (it watches this pid) and holds the run's lock with it (the same open
    # file: the lock stays held while any process of the run lives). Its own session: a Ctrl-C in the
    # terminal reaches only the launcher, which stops the tasks with a checkpoint.
    env[LAUNCHER_PID_ENV] = str(os.getpid())
    lock = held_lock(layout.root)
    if lock is not None:
        env[LOCK_FD_ENV] = str(lock.fd)
    with open(log, "ab") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "slurm_router.supervise.job", str(layout.task(spec.name).task_file)],
            stdout=f,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            pass_fds=(lock.fd,) if lock is not None else (),
        )
    return Running(spec, proc, devices, log)


def stop_local_run(manifest: dict) -> str | None:
    """--cancel of a local run that is still going: SIGTERM to its launcher (its owner, checked by pid and start
    time), which stops it as Ctrl-C does (checkpoints at the step end, run interrupted). What was done, or None."""
    import signal

    from slurm_router.rundir.lock import describe, owner_alive

    owner = manifest.get("owner")
    if manifest.get("state") not in ("running", None) or owner_alive(owner) is not True:
        return None
    assert owner is not None
    try:
        os.kill(int(owner["pid"]), signal.SIGTERM)
    except ProcessLookupError:
        return None
    return (
        f"stopping the local run of {describe(owner)}: its tasks checkpoint at the step end; "
        f"resume={manifest.get('run_dir')} continues them"
    )
