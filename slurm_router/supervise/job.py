"""The submitted callable: runs one task spec (one variant, D devices) by starting one worker per device.

    python -m slurm_router.supervise.job runs/lora_ab/<timestamp>/tasks/r8/task.json
    python -m slurm_router.supervise.job --run-dir RUN_DIR --stage variants      # in an sbatch array task
    python -m slurm_router.supervise.job --run-dir RUN_DIR --stage variants --colocate 4   # 4 tasks share its GPUs

Locally the launcher runs this as a subprocess with CUDA_VISIBLE_DEVICES pinned to the task's GPUs; a backend whose
runner is a callable (launcher=slurm's, in its backend's package) calls run_task in its job instead.
With launcher.srun_workers each srun task is one worker (slurm_router.supervise.srun_worker).

Never lose work. A stop signal (USR2: Slurm's time-limit warning or a preemption; TERM; INT) makes every
worker finish its current step, rank 0 save a checkpoint, and the job end as requeue.after_stop decides (the
one after-stop policy): requeued under Slurm on USR2 within the budget, else interrupted (exit 75) and
`python -m slurm_router resume=RUN_DIR` continues from the newest valid checkpoint. A worker that dies
(SIGKILL, segfault, an exception) stops the whole task at once: the supervisor kills the other workers (they
would wait on the dead one in their next collective), an `end` row says exit_state=failed and the job exits 1
with one line naming the rank and the signal (under Slurm, a worker killed by a signal requeues the task instead
while launcher.max_failures allows: slurm_router.supervise.retry). Retrying on the surviving devices instead would change the
device count mid-run and the task's memory plan; a clean stop is simpler and loses at most checkpoint_every
steps. How signals are never lost: slurm_router.supervise.supervisor.

A local job holds its run's lock (slurm_router.rundir.lock: inherited from the launcher, or taken when started by
hand) and ends with its launcher: if that dies, the job stops like on SIGTERM, kills workers that have not
stopped within supervisor.ORPHAN_GRACE_S, and records its own end in the manifest (nobody else will).

A fused task (resources.fuse_variants: a leader's spec names its members) trains every variant of its group in
one process (the worker's member group); it is done only when each of them has its result.json, its checkpoints (every
variant's state in one file) are in the leader's folder, and a failure's `end` row reaches every unfinished one.

Exit codes (slurm_router.rundir.lifecycle): 0 done, 75 stopped after a checkpoint, 76 a co-located task asks for a
requeue, 1 failed, 2 bad arguments or unusable checkpoints.
"""

from __future__ import annotations

import os
import signal
import sys
import time

if __name__ == "__main__":  # the job process: take stop signals before the slower imports below
    from slurm_router.supervise.supervisor import LAUNCHER_PID_ENV, TaskSupervisor

    _ENTRY_SUPERVISOR = TaskSupervisor().install()
    if os.environ.get(LAUNCHER_PID_ENV):  # a local job ends with its launcher (supervisor.py)
        _ENTRY_SUPERVISOR.watch_launcher(int(os.environ.pop(LAUNCHER_PID_ENV)))

import argparse
import json
from pathlib import Path

from slurm_router.rundir.layout import RESULT_FILE, TaskPaths  # noqa: F401  (RESULT_FILE: imported from here)
from slurm_router.rundir.lifecycle import EXIT_FAILED, EXIT_OK, EXIT_USAGE, STOP_SIGNALS, TaskOutcome, finished
from slurm_router.scheduler.registry import job_environment
from slurm_router.supervise.supervisor import TaskFailed, TaskStopped, TaskSupervisor


def _newest_checkpoint(spec, quiet: bool = False) -> str | None:
    """The newest valid checkpoint of this task, or None for a fresh start. Loud (warnings about damaged newer
    ones, CheckpointError when none is valid) before a start; quiet when only reporting."""
    from slurm_router.worker.checkpoint import CheckpointError, latest_valid_checkpoint

    try:
        path, warnings = latest_valid_checkpoint(TaskPaths(spec.task_dir).checkpoints)
    except CheckpointError:
        if quiet:
            return None
        raise
    if not quiet:
        for w in warnings:
            print(f"warning: {spec.name}: {w}", file=sys.stderr, flush=True)
        if path is not None:
            print(f"{spec.name}: resuming from {path}", flush=True)
    return None if path is None else str(path)


def checkpoint_step(spec) -> int | None:
    from slurm_router.rundir.layout import checkpoint_step as step_of

    path = _newest_checkpoint(spec, quiet=True)
    return step_of(path) if path else None


def _repair_events(spec, srun_rank: int | None) -> None:
    """No worker of this task (or of any task fused into it) is running now (or, for an srun worker, no other
    process writes its file)."""
    from slurm_router.supervise.requeue import repair_torn_tail

    if srun_rank is not None:
        repair_torn_tail(TaskPaths(spec.task_dir).events(srun_rank))
        return
    for paths in _group_paths(spec):
        for events_file in paths.events_files():
            repair_torn_tail(events_file)


def _group_paths(spec) -> list[TaskPaths]:
    """The folders of the tasks this task trains: its own, then its fused members' (resources.fuse_variants)."""
    from slurm_router.rundir.layout import RunLayout

    return [RunLayout(spec.run_dir).task(name) for name in spec.group]


def _unfinished(spec) -> list[str]:
    """The tasks of this one's group without a result yet (or whose final adapter was deleted since: trained
    again, rundir/lifecycle.py finished): a fused task is done only when every variant is."""
    return [name for name, paths in zip(spec.group, _group_paths(spec)) if not finished(paths)]


def _end_failed(spec, error: str) -> None:
    """The failed `end` row, in this task's events and in each fused member's that has no result."""
    from slurm_router.supervise.requeue import task_event

    task_event(spec, "end", exit_state="failed", error=error)
    unfinished = set(_unfinished(spec))
    for member in spec.group_specs()[1:]:
        if member.name in unfinished:
            task_event(member, "end", exit_state="failed", error=error)


def run_task(task_file: str, supervisor: TaskSupervisor | None = None) -> dict | None:
    """Train one task to the end, resuming from its newest valid checkpoint; returns its result (held-out
    loss, ...). Raises TaskStopped after a stop signal (checkpoint saved), TaskFailed if a worker died,
    CheckpointError if checkpoints exist and none is valid."""
    from slurm_router.fileio import atomic_write_text
    from slurm_router.rundir.attempts import next_attempt
    from slurm_router.rundir.spec import TaskSpec
    from slurm_router.supervise.requeue import note_scheduler_restart, task_event
    from slurm_router.supervise.srun_worker import run_srun_worker, srun_rank
    from slurm_router.worker import auto_seeds

    supervisor = supervisor or TaskSupervisor()
    spec = TaskSpec.load(task_file)
    paths = TaskPaths(spec.task_dir)
    if not _unfinished(spec):  # a requeue or resume= after the task (every fused variant) had finished
        fused = f" and its {len(spec.members)} fused task(s)" if spec.members else ""
        print(f"{spec.name}: already completed ({paths.result}{fused})", flush=True)
        return json.loads(paths.result.read_text())
    # seeds=auto: a reserve runs only while the contest is undecided (worker/auto_seeds.py)
    waiting_since = time.time()
    unneeded = auto_seeds.wait_for_call(spec, stop=lambda: bool(supervisor.signum))
    waited_s = time.time() - waiting_since
    if waited_s >= auto_seeds.POLL_S and srun_rank() in (None, 0):  # it held its devices: the report shows it apart
        task_event(spec, "wait", waited_s=round(waited_s, 3), reason="seeds=auto reserve: waiting for its round's call")
    if supervisor.signum:
        raise TaskStopped(checkpoint_step(spec), supervisor.signum)
    if unneeded is not None:
        if srun_rank() in (None, 0):
            task_event(
                spec, "end", exit_state=auto_seeds.NOT_NEEDED, detail=unneeded["reason"], step=0, steps=spec.steps
            )
            atomic_write_text(paths.result, json.dumps(unneeded, indent=1))
        return unneeded
    resume = _newest_checkpoint(spec)  # a fused task's checkpoints hold every variant, in the leader's folder
    rank = srun_rank()
    _repair_events(spec, rank)
    if rank is not None:
        return run_srun_worker(spec, resume, supervisor)
    spec.attempt = next_attempt(spec.task_dir)
    note_scheduler_restart(spec)
    from slurm_router.supervise.retry import after_failure, count_node_failures

    refused = count_node_failures(spec)  # Slurm requeued it after NODE_FAIL: launcher.max_failures
    if refused:
        _end_failed(spec, refused)
        raise TaskFailed(refused)
    try:
        outcome = supervisor.run_workers(spec, resume)
    except TaskStopped as stopped:  # before any worker started: the newest checkpoint stands
        raise TaskStopped(checkpoint_step(spec), stopped.signum) from None
    except TaskFailed as e:
        if supervisor.orphaned_by is not None:  # its launcher is gone: the workers were killed on purpose
            raise TaskStopped(checkpoint_step(spec), supervisor.signum or signal.SIGTERM) from None
        ckpt = _newest_checkpoint(spec, quiet=True)
        msg = (
            f"{spec.name}: {e}; the task stopped (the other workers were killed); "
            f"{'resume continues from ' + ckpt if ckpt else 'no checkpoint yet: resume restarts it'}"
        )
        _end_failed(spec, msg)
        retried = after_failure(spec, str(e), checkpoint_step(spec))  # not its own error: launcher.max_failures
        if retried:
            raise retried from None
        raise TaskFailed(msg) from None
    if outcome is TaskOutcome.STOPPED:
        raise TaskStopped(checkpoint_step(spec), supervisor.signum or signal.SIGTERM)
    missing = _unfinished(spec)
    if missing:
        which = f" for {', '.join(missing)}" if spec.members else ""
        msg = f"{spec.name}: the workers ended without a result{which} (interrupted during start-up?)"
        _end_failed(spec, msg)
        raise TaskFailed(msg)
    return json.loads(paths.result.read_text())


def parse_args(argv: list[str]) -> argparse.Namespace:
    """TASK_FILE, or --run-dir RUN_DIR --stage NAME [--colocate K] (an sbatch array task: SLURM_ARRAY_TASK_ID picks
    the task(s)). Bad arguments: argparse's usage line and SystemExit(2)."""
    p = argparse.ArgumentParser(
        prog="python -m slurm_router.supervise.job", description="Run one task (or K co-located ones)."
    )
    p.add_argument("task_file", nargs="?", help="RUN_DIR/tasks/NAME/task.json")
    p.add_argument("--run-dir", help="the run directory (with --stage)")
    p.add_argument("--stage", help="the stage whose array task this is (with --run-dir)")
    p.add_argument("--colocate", type=int, default=1, metavar="K", help="K tasks share this array task's GPUs")
    args = p.parse_args(argv)
    if args.task_file is not None:
        if args.run_dir or args.stage or args.colocate != 1:
            p.error("give either TASK_FILE or --run-dir/--stage/--colocate, not both")
        if not Path(args.task_file).is_file():
            p.error(f"no such task file: {args.task_file}")
    elif not (args.run_dir and args.stage) or args.colocate < 1:
        p.error("give TASK_FILE, or --run-dir RUN_DIR --stage NAME [--colocate K>=1]")
    return args


def main(argv: list[str] | None = None, supervisor: TaskSupervisor | None = None) -> int:
    """Exit codes: 0 done, 75 stopped on a signal after a checkpoint (requeued under Slurm on USR2), 76 a co-located
    task asks its runner for a requeue, 1 a worker failed, 2 unusable checkpoints or bad arguments."""
    supervisor = supervisor or TaskSupervisor().install()  # from here on a stop signal is a clean stop
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as e:
        return EXIT_USAGE if e.code else EXIT_OK
    task_file = args.task_file
    if task_file is None:
        from slurm_router.supervise.colocate import colocated_task_files, run_colocated

        index = job_environment().array_index()
        files = colocated_task_files(args.run_dir, args.stage, index, args.colocate)
        if args.colocate > 1:
            return run_colocated(files, supervisor)
        task_file = files[0]
    from slurm_router.errors import UserError
    from slurm_router.rundir.lock import release_all

    try:
        _hold_run_dir(task_file)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    code = _run(task_file, supervisor)
    if supervisor.orphaned_by is not None:
        _record_own_end(task_file, code, supervisor.orphaned_by)
    release_all()
    return code


def _run(task_file: str, supervisor: TaskSupervisor) -> int:
    from slurm_router.fileio import WriteError
    from slurm_router.supervise.retry import TaskRetried
    from slurm_router.worker.checkpoint import CheckpointError

    try:
        result = run_task(task_file, supervisor)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except TaskRetried as e:  # requeued itself (launcher.max_failures): not an error
        print(f"warning: {e}", file=sys.stderr)
        return e.exit_code
    except (TaskFailed, WriteError) as e:  # WriteError: disk full or no permission, one line
        print(f"error: {e}", file=sys.stderr)
        return EXIT_FAILED
    except TaskStopped as stopped:
        return _after_stop(task_file, stopped)
    for each in _results(task_file, result):
        print(json.dumps(each))
    return EXIT_OK


def _results(task_file: str, result: dict | None) -> list:
    """The task's result; a fused task's, one per variant (each member's from its result.json), so a log
    followed by `status --follow` shows every variant's end."""
    from slurm_router.rundir.layout import RunLayout
    from slurm_router.rundir.spec import TaskSpec

    spec = TaskSpec.load(task_file)
    paths = [RunLayout(spec.run_dir).task(m).result for m in spec.members]
    return [result, *(json.loads(p.read_text()) for p in paths if p.is_file())]


def _hold_run_dir(task_file: str) -> None:
    """A local job holds its run's lock: the launcher's, inherited (rundir.lock.LOCK_FD_ENV), or taken here when the
    job was started by hand (UserError naming the holder if the run is in use). Under Slurm, Slurm owns it."""
    from slurm_router.rundir.lock import LOCK_FD_ENV, acquire

    if os.environ.get(LOCK_FD_ENV) or job_environment().job_id():
        return
    from slurm_router.rundir.spec import TaskSpec

    acquire(TaskSpec.load(task_file).run_dir)


def _record_own_end(task_file: str, code: int, launcher_pid: int) -> None:
    """The launcher is gone, so nobody else will record how this task ended: the manifest gets it from here
    (read-modify-write: the other tasks of the run may be doing the same)."""
    from slurm_router.errors import UserError
    from slurm_router.rundir.manifest import Manifest
    from slurm_router.rundir.spec import TaskSpec

    spec = TaskSpec.load(task_file)
    note = f"interrupted: launcher pid {launcher_pid} gone"

    def record(data: dict) -> None:
        data["tasks"][spec.name].update(state=TaskOutcome.from_exit_code(code).state.value, exit_code=code, note=note)
        data["state"] = "interrupted"

    try:
        Manifest.load(spec.run_dir).update(record)
    except (UserError, OSError) as e:
        print(f"warning: {spec.name}: could not record its end in the manifest ({e})", file=sys.stderr)


def _after_stop(task_file: str, stopped: TaskStopped) -> int:
    """Checkpointed after a signal: requeue.after_stop decides (the co-location runner requeues a co-located task's
    allocation, once; this process does otherwise)."""
    from slurm_router.rundir.spec import TaskSpec
    from slurm_router.supervise.colocate import COLOCATED_ENV
    from slurm_router.supervise.requeue import after_stop
    from slurm_router.supervise.srun_worker import srun_rank

    if (srun_rank() or 0) != 0:
        return EXIT_OK  # srun_workers: rank 0 speaks for the task; exit 0 so srun does not kill it
    requeue_by = "colocated" if os.environ.get(COLOCATED_ENV) else "self"
    return after_stop(TaskSpec.load(task_file), stopped.signum, stopped.step, requeue_by).exit_code


if __name__ == "__main__":
    _code = main(supervisor=_ENTRY_SUPERVISOR)
    # The outcome is decided: the interpreter's exit resets the handlers, and a stop signal then (the launcher's
    # TERM after a Ctrl-C) would end a finished task as killed (-15). Ignored from here on.
    for _sig in STOP_SIGNALS:
        signal.signal(_sig, signal.SIG_IGN)
    sys.exit(_code)
