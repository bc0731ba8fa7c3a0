"""The submitted callable: runs one task spec (one variant, D devices) by starting one worker per device.

    python -m slurm_router.job runs/lora_ab/<timestamp>/tasks/r8/task.json
    python -m slurm_router.job --run-dir RUN_DIR --stage variants      # in an sbatch array task
    python -m slurm_router.job --run-dir RUN_DIR --stage variants --pack 4   # 4 tasks share this array task's GPUs

Locally the launcher runs this as a subprocess with CUDA_VISIBLE_DEVICES pinned to the task's GPUs; under
Slurm submitit calls run_task() in the array task, where Slurm has already set CUDA_VISIBLE_DEVICES. With
launcher.srun_workers each of the D srun tasks is one worker (rank = SLURM_PROCID) and they meet at
MASTER_ADDR:MASTER_PORT (default: the job's first node, a port derived from the job id), so a task can
span nodes.

Never lose work. A stop signal (USR2: Slurm's time-limit warning or a preemption; TERM; INT) makes every
worker finish its current step, rank 0 save a checkpoint, and the job exit 75; under Slurm a USR2 also
requeues the job (`scontrol requeue` here for launcher=sbatch, submitit's checkpoint() for launcher=slurm),
and the next attempt resumes from the newest valid checkpoint in the same run dir. A worker that dies
(SIGKILL, segfault, an exception) stops the whole task at once: the job process kills the other workers
(they would wait on the dead one in their next collective), writes an `end` row with exit_state=failed and
exits 1 with one line naming the rank and the signal; `python -m slurm_router resume=RUN_DIR` (or a requeue)
continues from the last checkpoint. Retrying on the surviving devices instead would change the device count
mid-run and the running task's memory plan; a clean stop is simpler and loses at most checkpoint_every steps.
"""
from __future__ import annotations

import json
import multiprocessing.connection
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from submitit.helpers import Checkpointable

from slurm_router.train.state import EXIT_STOPPED, STOP_SIGNALS

RESULT_FILE = "result.json"
# After one worker has ended normally, the others get this long to end too (rank 0 still writes results).
WORKER_GRACE_S = 300.0


class TaskFailed(RuntimeError):
    """A worker died or raised: one line saying which and why."""


class TaskStopped(Exception):
    """The task stopped on a signal after saving a checkpoint at `step`."""

    def __init__(self, step: int | None, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name if signum else 'a signal'} at step {step}")
        self.step, self.signum = step, signum


# The job process's view of its task: the workers it watches and the first stop signal it got.
_JOB: dict = {"signum": 0, "workers": None}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_entry(rank: int, spec_json: str, world: int, master: str, resume: str | None = None):
    from slurm_router.checkpoint import atomic_write_text
    from slurm_router.plan import TaskSpec
    from slurm_router.worker import train
    spec = TaskSpec(**json.loads(spec_json))
    result = train(spec, rank, world, master, resume)
    if rank == 0 and isinstance(result, dict):
        atomic_write_text(spec.task_dir / RESULT_FILE, json.dumps(result, indent=1))
    return result


def _spawned_worker(rank: int, spec_json: str, world: int, master: str, resume: str | None) -> None:
    from slurm_router.train.state import Stopped
    if isinstance(_worker_entry(rank, spec_json, world, master, resume), Stopped):
        sys.exit(EXIT_STOPPED)


class Workers:
    """The D worker processes of one task, watched by the job process."""

    def __init__(self, spec, resume: str | None):
        import torch.multiprocessing as mp
        master = f"127.0.0.1:{free_port()}"
        # Stop signals stay blocked from here until each worker has installed its handlers (train() unblocks
        # them; the mask is inherited through spawn): a signal during start-up is deferred, not fatal.
        old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            self.ctx = mp.start_processes(_spawned_worker, args=(spec.to_json(), spec.devices, master, resume),
                                          nprocs=spec.devices, join=False, start_method="spawn")
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
        self.procs = self.ctx.processes

    def alive(self) -> bool:
        return any(p.exitcode is None for p in self.procs)

    def forward(self, signum: int) -> None:
        for p in self.procs:
            if p.exitcode is None:
                try:
                    os.kill(p.pid, signum)
                except ProcessLookupError:
                    pass

    def kill(self) -> None:
        self.forward(signal.SIGKILL)
        for p in self.procs:
            p.join(5)

    def _describe(self, rank: int) -> str:
        p = self.procs[rank]
        code = p.exitcode
        how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        err = self.ctx.error_files[rank]
        if err and os.path.exists(err):          # a Python exception: its last line says what went wrong
            import pickle
            with open(err, "rb") as f:
                trace = pickle.load(f)
            print(f"worker rank {rank}:\n{trace}", file=sys.stderr, flush=True)      # the whole story, in the log
            how = f"raised {[l for l in trace.strip().splitlines() if l.strip()][-1].strip()}"
        return f"worker rank {rank} (pid {p.pid}) {how}"

    def wait(self, timeout: float | None = None) -> str:
        """Until every worker has ended: 'completed' or 'stopped' (checkpointed). A worker that dies or raises
        gets the others killed at once and raises TaskFailed. `timeout`: give up waiting (kill, TaskFailed)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        first_end = None
        while True:
            codes = [p.exitcode for p in self.procs]
            bad = [r for r, c in enumerate(codes) if c not in (None, 0, EXIT_STOPPED)]
            if bad:
                what = self._describe(bad[0])
                self.kill()
                raise TaskFailed(what)
            if all(c is not None for c in codes):
                return "stopped" if EXIT_STOPPED in codes else "completed"
            now = time.monotonic()
            if first_end is None and any(c is not None for c in codes):
                first_end = now
            if (deadline is not None and now > deadline) or (first_end and now - first_end > WORKER_GRACE_S):
                stuck = [r for r, c in enumerate(codes) if c is None]
                self.kill()
                raise TaskFailed(f"worker rank(s) {stuck} did not end in time after a stop or after their peers "
                                 "ended; killed")
            multiprocessing.connection.wait([p.sentinel for p in self.procs if p.exitcode is None], timeout=0.5)


def _pick_checkpoint(spec) -> str | None:
    """The newest valid checkpoint of this task (warnings for damaged newer ones), or None for a fresh start."""
    from slurm_router.checkpoint import latest_valid_checkpoint
    path, warnings = latest_valid_checkpoint(spec.task_dir / "checkpoints")
    for w in warnings:
        print(f"warning: {spec.name}: {w}", file=sys.stderr, flush=True)
    if path is not None:
        print(f"{spec.name}: resuming from {path}", flush=True)
    return None if path is None else str(path)


def _srun_master() -> str:
    if os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
        return f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    nodes = subprocess.run(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]],
                           capture_output=True, text=True, check=True).stdout.split()
    return f"{nodes[0]}:{20000 + int(os.environ['SLURM_JOB_ID']) % 20000}"


def run_task(task_file: str) -> dict | None:
    """Train one task to the end, resuming from its newest valid checkpoint; returns its result (held-out
    loss, ...). Raises TaskStopped after a stop signal (checkpoint saved), TaskFailed if a worker died,
    CheckpointError if checkpoints exist and none is valid."""
    from slurm_router.plan import TaskSpec
    from slurm_router.requeue import next_attempt, note_slurm_restart, repair_torn_tail, task_event
    spec = TaskSpec.load(task_file)
    done = spec.task_dir / RESULT_FILE
    if done.is_file():          # a requeue or resume= after the task had finished: nothing to redo
        print(f"{spec.name}: already completed ({done})", flush=True)
        return json.loads(done.read_text())
    resume = _pick_checkpoint(spec)
    ntasks = int(os.environ.get("SLURM_NTASKS", "1"))
    mine = f"events-rank{os.environ.get('SLURM_PROCID', '0')}.jsonl" if ntasks > 1 else "events-rank*.jsonl"
    for events_file in spec.task_dir.glob(mine):      # no worker of this task is running now
        repair_torn_tail(events_file)
    if ntasks > 1 and "SLURM_PROCID" in os.environ:      # srun_workers: this process is one worker
        if ntasks != spec.devices:
            raise RuntimeError(f"{ntasks} srun tasks for a task of {spec.devices} devices")
        from slurm_router.train.state import Stopped, install_stop_handlers, request_stop
        install_stop_handlers()
        if _JOB["signum"]:          # arrived before this process became a worker
            request_stop(_JOB["signum"])
        rank = int(os.environ["SLURM_PROCID"])
        spec.attempt = -1           # rank 0 counts the attempt once the workers have met
        result = _worker_entry(rank, spec.to_json(), ntasks, _srun_master(), resume)
        if isinstance(result, Stopped):
            raise TaskStopped(result.step, result.signum)
        return json.loads(done.read_text()) if rank == 0 else None
    spec.attempt = next_attempt(spec.task_dir)
    note_slurm_restart(spec)
    if _JOB["signum"]:          # stopped before any worker started: the newest checkpoint stands
        raise TaskStopped(None, _JOB["signum"])
    workers = _JOB["workers"] = Workers(spec, resume)
    try:
        outcome = workers.wait()
    except TaskFailed as e:
        ckpt = _pick_checkpoint_quietly(spec)
        msg = (f"{spec.name}: {e}; the task stopped (the other workers were killed); "
               f"{'resume continues from ' + ckpt if ckpt else 'no checkpoint yet: resume restarts it'}")
        task_event(spec, "end", exit_state="failed", error=msg)
        raise TaskFailed(msg) from None
    finally:
        _JOB["workers"] = None
    if outcome == "stopped":
        raise TaskStopped(_checkpoint_step(spec), _JOB["signum"] or signal.SIGTERM)
    if not done.is_file():
        msg = f"{spec.name}: the workers ended without a result (interrupted during start-up?)"
        task_event(spec, "end", exit_state="failed", error=msg)
        raise TaskFailed(msg)
    return json.loads(done.read_text())


def _pick_checkpoint_quietly(spec) -> str | None:
    from slurm_router.checkpoint import CheckpointError, latest_valid_checkpoint
    try:
        path, _ = latest_valid_checkpoint(spec.task_dir / "checkpoints")
    except CheckpointError:
        return None
    return None if path is None else str(path)


def _checkpoint_step(spec) -> int | None:
    path = _pick_checkpoint_quietly(spec)
    return int(Path(path).stem.split("-")[1]) if path else None


class TaskRunner(Checkpointable):
    """What launcher=slurm submits (submitit): run_task, plus checkpoint(), which submitit calls on USR2 (time
    limit or preemption): the workers stop at their step end and save, then submitit requeues this callable."""

    def __call__(self, task_file: str) -> dict | None:
        return run_task(task_file)

    def checkpoint(self, task_file: str):
        from slurm_router.plan import TaskSpec
        from slurm_router.requeue import decide, requeue_self, task_event
        spec = TaskSpec.load(task_file)
        workers = _JOB["workers"]
        _JOB["signum"] = _JOB["signum"] or signal.SIGUSR2
        if workers is not None and workers.alive():
            workers.forward(signal.SIGUSR2)
            delay = int((spec.config.get("launcher") or {}).get("signal_delay_s", 120))
            try:        # the step in flight finishes and rank 0 saves; Slurm kills everything at the limit
                workers.wait(timeout=max(5.0, delay - 15.0))
            except TaskFailed as e:
                print(f"error: {spec.name}: {e}; requeueing from the last checkpoint", file=sys.stderr, flush=True)
        spec.attempt = int(_attempt_now(spec))
        decision = decide(spec, signal.SIGUSR2)
        if not decision.requeue:
            task_event(spec, "end", exit_state="failed", error=decision.detail)
            print(f"error: {spec.name}: {decision.detail}", file=sys.stderr, flush=True)
            return None           # submitit: not requeued, the job fails
        requeue_self(spec, decision, _checkpoint_step(spec) or 0, scontrol=False)
        return super().checkpoint(task_file)


def _attempt_now(spec) -> int:
    from slurm_router.requeue import current_attempt
    return current_attempt(spec.task_dir)


def write_report_job(run_dir: str) -> dict:
    """The last job of a Slurm run: the report, once every stage has ended (afterany)."""
    from slurm_router.analysis.report import write_report
    return write_report(Path(run_dir))


def _on_stop_signal(signum, frame) -> None:
    # Remember the first signal, pass every one on: workers stop at their next step end and checkpoint.
    _JOB["signum"] = _JOB["signum"] or signum
    if _JOB["workers"] is not None:
        _JOB["workers"].forward(signum)


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 done, 75 stopped on a signal after a checkpoint (requeued under Slurm on USR2), 1 a worker
    failed, 2 unusable checkpoints or bad arguments."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) in (4, 6) and argv[0] == "--run-dir" and argv[2] == "--stage" and argv[4:5] in ([], ["--pack"]):
        from slurm_router.launch.pack import pack_task_files, run_pack
        per_pack = int(argv[5]) if len(argv) == 6 else 1
        files = pack_task_files(argv[1], argv[3], int(os.environ.get("SLURM_ARRAY_TASK_ID", "0")), per_pack)
        if per_pack > 1:
            return run_pack(files)
        task_file = files[0]
    elif len(argv) == 1 and Path(argv[0]).is_file():
        task_file = argv[0]
    else:
        print("usage: python -m slurm_router.job RUN_DIR/tasks/NAME/task.json | --run-dir RUN_DIR --stage NAME "
              "[--pack K]", file=sys.stderr)
        return 2
    from slurm_router.checkpoint import CheckpointError
    for sig in STOP_SIGNALS:
        signal.signal(sig, _on_stop_signal)
    try:
        result = run_task(task_file)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except TaskFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except TaskStopped as stopped:
        return _after_stop(task_file, stopped)
    print(json.dumps(result))
    return 0


def _after_stop(task_file: str, stopped: TaskStopped) -> int:
    """Checkpointed after a signal: requeue (USR2 under Slurm, within budget), or just end the attempt."""
    from slurm_router.plan import TaskSpec
    from slurm_router.requeue import decide, requeue_self, task_event
    spec = TaskSpec.load(task_file)
    if int(os.environ.get("SLURM_PROCID", "0")) != 0:
        return 0                    # srun_workers: rank 0 speaks for the task; exit 0 so srun does not kill it
    spec.attempt = _attempt_now(spec)
    decision = decide(spec, stopped.signum)
    where = f"checkpoint at step {stopped.step}" if stopped.step is not None else "no checkpoint yet"
    if decision.requeue:
        from slurm_router.launch.pack import EXIT_REQUEUE, PACKED_ENV
        packed = bool(os.environ.get(PACKED_ENV))       # the pack runner requeues the allocation, once
        requeue_self(spec, decision, stopped.step or 0, scontrol=not packed)
        print(f"{spec.name}: {decision.detail}; {where}; requeued", flush=True)
        return EXIT_REQUEUE if packed else EXIT_STOPPED
    if decision.reason == "timeout":
        task_event(spec, "end", exit_state="failed", error=decision.detail, step=stopped.step)
        print(f"error: {spec.name}: {decision.detail}", file=sys.stderr)
        return 1
    task_event(spec, "end", exit_state="interrupted", detail=decision.detail, step=stopped.step)
    print(f"{spec.name}: {decision.detail}; {where}; continue with: python -m slurm_router resume={spec.run_dir}",
          flush=True)
    return EXIT_STOPPED


if __name__ == "__main__":
    sys.exit(main())
