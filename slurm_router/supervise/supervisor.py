"""The job side of a task's lifecycle (docs/ARCHITECTURE.md): a TaskSupervisor starts the processes that do
the work (the D workers of one task, or the K job processes of co-located tasks), watches them, forwards every stop
signal to them and, after a stop, asks the one after-stop policy (requeue.after_stop) what comes next.

No stop signal is ever lost (the Ctrl-C race of issue 11: a signal handled while the workers were being
spawned was remembered but forwarded to nobody, so the workers trained to the end). The supervisor's
handlers are installed before anything slow happens; the children are spawned with stop signals blocked
and, once the supervisor knows them, it forwards any signal that came meanwhile (blocked in this thread it
is handled right after; another thread of the process may take it earlier, while the children are not yet
known: the check after the spawn covers both). The children inherit the blocked mask through fork and exec
and unblock it once their own handlers are in place (train.state.install_stop_handlers for a worker,
TaskSupervisor.install for a job process), so a signal during their start-up waits for them instead of
killing them. Whoever spawns a job process should do the same (`stop_signals_blocked`). CPython's
multiprocessing undoes part of that: starting its resource tracker (on the first spawn) ends with
SIG_UNBLOCK of SIGINT and SIGTERM instead of restoring the mask it found, so workers used to start with only
USR2 blocked and a TERM during their start-up killed them (issue 12). Workers therefore start the tracker
first and block the stop signals again before they spawn.

Nothing of a local run outlives its launcher (issue 12): a local job process watches its launcher
(`watch_launcher`; the launcher's pid comes in LAUNCHER_PID_ENV) and each worker its job process
(`watch_parent_process`), and the forkserver that forks several workers dies with its job process (forkserver_tie.py).
When the parent is gone, the child stops as on a stop signal (the step in flight ends, rank 0 saves) and is killed
ORPHAN_GRACE_S later if it has not ended: nothing of the run lives 10 s after the launcher died.

Deliberately light imports (no torch): a job process installs its handlers within milliseconds of starting.
"""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import sys
import threading
import time
from contextlib import contextmanager
from typing import cast

from slurm_router.rundir.layout import TaskPaths
from slurm_router.rundir.lifecycle import EXIT_OK, EXIT_STOPPED, STOP_SIGNALS, TaskOutcome

# After one worker has ended normally, the others get this long to end too (rank 0 still writes results).
WORKER_GRACE_S = 300.0
# A job process whose launcher died, or a worker whose job process died, stops at its step end if that comes
# within this long, and is killed then (job: its workers, then itself ORPHAN_EXIT_S later).
ORPHAN_GRACE_S = 5.0
ORPHAN_EXIT_S = 3.0
LAUNCHER_PID_ENV = "SLURM_ROUTER_LAUNCHER_PID"  # set by the local launcher for its job processes
# Tests only: "window=seconds,..." pauses there, to widen a window a signal must be able to land in.
TEST_PAUSE_ENV = "SLURM_ROUTER_TEST_PAUSE"


class TaskFailed(RuntimeError):
    """A worker died or raised: one line saying which and why."""


class TaskStopped(Exception):
    """The task stopped on a signal after saving a checkpoint at `step` (None: before its first step)."""

    def __init__(self, step: int | None, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name if signum else 'a signal'} at step {step}")
        self.step, self.signum = step, signum


@contextmanager
def stop_signals_blocked():
    """Stop signals wait (pending, not lost) while inside; children spawned here start with them blocked."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def pause_for_tests(window: str) -> None:
    """Tests only: sleep in `window` if SLURM_ROUTER_TEST_PAUSE names it (tests/test_signal_windows.py makes
    the windows around training wide enough to hit every time). Unset in real runs: nothing happens."""
    spec = os.environ.get(TEST_PAUSE_ENV)
    if not spec:
        return
    for item in spec.split(","):
        name, _, seconds = item.partition("=")
        if name.strip() == window:
            print(f"test pause: {window} {float(seconds)} s", file=sys.stderr, flush=True)
            time.sleep(float(seconds))


def watch_parent_process(grace_s: float = ORPHAN_GRACE_S) -> None:
    """A spawned worker's tie to its job process: when that is gone (its sentinel pipe closes, however it died,
    even before this call), SIGINT to this worker (as a parent-death signal would; blocked until the
    worker's handlers exist), then SIGKILL grace_s later: a worker never outlives its job process for long."""
    parent = multiprocessing.parent_process()
    if parent is None:  # not spawned by multiprocessing (srun workers)
        return

    def watch() -> None:
        parent.join()
        signal.pthread_kill(cast(int, threading.main_thread().ident), signal.SIGINT)
        time.sleep(grace_s)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="watch-job-process", daemon=True).start()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_entry(rank: int, spec_json: str, world: int, master: str, resume: str | None = None):
    """One worker's whole life: train, and rank 0 writes the task's result."""
    from slurm_router.fileio import atomic_write_text
    from slurm_router.rundir.spec import TaskSpec
    from slurm_router.worker.worker import train

    spec = TaskSpec(**json.loads(spec_json))
    result = train(spec, rank, world, master, resume)  # a fused task: its members in one process group
    if rank == 0 and isinstance(result, dict):
        atomic_write_text(TaskPaths(spec.task_dir).result, json.dumps(result, indent=1))
        pause_for_tests("after_result")
    return result


def _spawned_worker(rank: int, spec_json: str, world: int, master: str, resume: str | None) -> None:
    watch_parent_process()
    pause_for_tests("worker_startup")  # stop signals are blocked here, until train_state installs handlers
    from slurm_router.worker.state import Stopped

    if isinstance(worker_entry(rank, spec_json, world, master, resume), Stopped):
        sys.exit(EXIT_STOPPED)


def _forward(pids: list[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


# What a worker imports before its first line runs (torch, transformers' GPT-2 and peft: about 6 s of CPU).
# With several workers, a forkserver imports them once and forks each worker from there (PRELOAD_MIN_WORKERS).
WORKER_PRELOAD = ("slurm_router.worker.worker", "transformers.models.gpt2.modeling_gpt2", "peft")
PRELOAD_MIN_WORKERS = 2


def _child(fn, rank: int, args: tuple, error_file: str) -> None:
    """A started worker's body, as torch.multiprocessing's spawn runs it (without importing torch here): an
    exception's traceback goes to error_file for the job process to quote, and the child exits 1."""
    code = 0
    try:
        fn(rank, *args)
    except KeyboardInterrupt:
        pass  # SIGINT before the worker's own handlers: the job process decides
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except Exception:
        import pickle
        import traceback

        with open(error_file, "wb") as f:
            pickle.dump(traceback.format_exc(), f)
        code = 1
    _exit_without_teardown(code)


def _exit_without_teardown(code: int) -> None:
    """Exit as the interpreter would, but for tearing down its modules: torch's and transformers' take about
    0.9 s of CPU per worker and write nothing. What an exit must still do is done first: non-daemon threads
    joined (thread pools told to end first), atexit handlers run (multiprocessing's finalizers and the
    trackers' among them), the standard streams flushed. A worker forked from the forkserver ended with
    os._exit before too (multiprocessing's fork start)."""
    import atexit

    threading._shutdown()  # type: ignore[attr-defined]  # private, not in typeshed; as multiprocessing's own bootstrap does: executors' threads told, then joined
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    os._exit(code)


class Started:
    """The processes spawn_blocked started, and the file each one's traceback would go to."""

    def __init__(self, processes: list, error_files: list[str]):
        self.processes, self.error_files = processes, error_files

    def join(self) -> None:
        for p in self.processes:
            p.join()


def spawn_blocked(fn, args: tuple, nprocs: int) -> Started:
    """fn(rank, *args) in nprocs fresh processes, each child starting with every stop signal blocked (call under
    stop_signals_blocked). The resource tracker's first start unblocks SIGINT and SIGTERM (see the module
    docstring): it is started first, and the signals blocked again, before any child.

    One worker is spawned (a new interpreter). Several are forked from a forkserver that this process starts
    here, blocked too, and that has imported WORKER_PRELOAD once: each worker skips those seconds of imports.
    The forkserver never touches CUDA or a thread pool, so each child starts as clean as a spawned one; it keeps
    the stop signals blocked all its life (Slurm signals every process of a step: it must not die of a USR2),
    and ends with this process, at once (slurm_router.supervise.forkserver_tie). This process never imports torch (1.5 s of
    CPU per task)."""
    import tempfile
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    method = "forkserver" if nprocs >= PRELOAD_MIN_WORKERS else "spawn"
    ctx = multiprocessing.get_context(method)
    if method == "forkserver":
        _start_forkserver(ctx)
    processes, error_files = [], []
    for rank in range(nprocs):
        fd, error_file = tempfile.mkstemp(prefix="slurm_router-worker-error-", suffix=".pickle")
        os.close(fd)
        os.unlink(error_file)  # written only if the worker raises; the job process removes it then
        p = ctx.Process(target=_child, args=(fn, rank, args, error_file), daemon=False)  # type: ignore[attr-defined]  # typeshed: BaseContext has no Process; each concrete context has
        p.start()
        processes.append(p)
        error_files.append(error_file)
    return Started(processes, error_files)


def _start_forkserver(ctx) -> None:
    """This process's forkserver, started now (in the calling thread: call from the main thread, which lives as
    long as the process) with slurm_router.supervise.forkserver_tie imported first, so that it dies with this process.
    The tie reads this process's pid from the environment, set only while the forkserver starts."""
    from multiprocessing import forkserver

    from slurm_router.supervise.forkserver_tie import FORKSERVER_PARENT_ENV

    ctx.set_forkserver_preload(["slurm_router.supervise.forkserver_tie", *WORKER_PRELOAD])
    os.environ[FORKSERVER_PARENT_ENV] = str(os.getpid())
    try:
        forkserver.ensure_running()
    finally:
        os.environ.pop(FORKSERVER_PARENT_ENV, None)


class Workers:
    """The D worker processes of one task (spawned; call under stop_signals_blocked)."""

    def __init__(self, spec, resume: str | None):
        master = f"127.0.0.1:{free_port()}"
        self.ctx = spawn_blocked(_spawned_worker, (spec.to_json(), spec.devices, master, resume), spec.devices)
        self.procs = self.ctx.processes

    def alive(self) -> bool:
        return any(p.exitcode is None for p in self.procs)

    def forward(self, signum: int) -> None:
        _forward([p.pid for p in self.procs if p.exitcode is None], signum)

    def kill(self) -> None:
        self.forward(signal.SIGKILL)
        for p in self.procs:
            p.join(5)

    def _describe(self, rank: int) -> str:
        p = self.procs[rank]
        code = p.exitcode
        how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        err = self.ctx.error_files[rank]
        if err and os.path.exists(err):  # a Python exception: its last line says what went wrong
            import pickle

            with open(err, "rb") as f:
                trace = pickle.load(f)
            os.unlink(err)
            print(f"worker rank {rank}:\n{trace}", file=sys.stderr, flush=True)  # the whole story, in the log
            how = f"raised {[l for l in trace.strip().splitlines() if l.strip()][-1].strip()}"
        return f"worker rank {rank} (pid {p.pid}) {how}"

    def wait(self, timeout: float | None = None) -> TaskOutcome:
        """Until every worker has ended: COMPLETED or STOPPED (checkpointed). A worker that dies or raises gets
        the others killed at once and raises TaskFailed. `timeout`: give up waiting (kill, TaskFailed)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        first_end = None
        while True:
            codes = [p.exitcode for p in self.procs]
            outcomes = [TaskOutcome.from_exit_code(c) for c in codes if c is not None]
            if TaskOutcome.FAILED in outcomes or TaskOutcome.REQUEUE in outcomes:  # a worker never asks that
                what = self._describe(next(r for r, c in enumerate(codes) if c not in (None, EXIT_OK, EXIT_STOPPED)))
                self.kill()
                raise TaskFailed(what)
            if len(outcomes) == len(codes):
                return TaskOutcome.combine(outcomes)
            now = time.monotonic()
            if first_end is None and outcomes:
                first_end = now
            if (deadline is not None and now > deadline) or (first_end and now - first_end > WORKER_GRACE_S):
                stuck = [r for r, c in enumerate(codes) if c is None]
                self.kill()
                raise TaskFailed(
                    f"worker rank(s) {stuck} did not end in time after a stop or after their peers ended; killed"
                )
            multiprocessing.connection.wait([p.sentinel for p in self.procs if p.exitcode is None], timeout=0.5)


class TaskSupervisor:
    """One job process's (or co-location runner's) supervision: the first stop signal and the children it goes to.

    Children are anything with forward(signum): Workers, or supervise.colocate.Colocated."""

    def __init__(self):
        self.signum = 0
        self.children = None
        self.orphaned_by: int | None = None  # the launcher's pid, once it is gone (watch_launcher)

    def install(self) -> "TaskSupervisor":
        """Handle the stop signals from now on (and take any that waited, blocked, for this moment)."""
        for sig in STOP_SIGNALS:
            signal.signal(sig, self.on_signal)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        return self

    def watch_launcher(self, launcher_pid: int) -> None:
        """A local job process ends with its launcher: once that is gone (this process's parent is no longer
        launcher_pid, which also catches a launcher that died before this call), stop as on SIGTERM; workers
        still running ORPHAN_GRACE_S later are killed, and this process exits ORPHAN_EXIT_S after that
        whatever its main thread is doing. A poll, not a parent-death signal: portable, and the same code
        covers the launcher that died first."""

        def watch() -> None:
            while os.getppid() == launcher_pid:
                time.sleep(0.2)
            self.orphaned_by = launcher_pid
            print(
                f"the launcher (pid {launcher_pid}) is gone: stopping at the step end (killed after "
                f"{ORPHAN_GRACE_S:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
            signal.pthread_kill(cast(int, threading.main_thread().ident), signal.SIGTERM)  # wakes it in a wait too
            time.sleep(ORPHAN_GRACE_S)
            children = self.children
            if children is not None:
                children.forward(signal.SIGKILL)
            time.sleep(ORPHAN_EXIT_S)
            os._exit(EXIT_STOPPED)

        threading.Thread(target=watch, name="watch-launcher", daemon=True).start()

    def on_signal(self, signum, frame=None) -> None:
        # Remember the first signal, pass every one on: workers stop at their next step end and checkpoint.
        self.signum = self.signum or signum
        if self.children is not None:
            self.children.forward(signum)

    def start(self, make_children, stop_early: bool = True):
        """Spawn the children with stop signals blocked and know them before any signal is handled again: a
        signal during the spawn is forwarded to them as soon as the spawn returns. A signal that came earlier
        stops the task before it starts (TaskStopped: nothing spawned), or with stop_early=False is forwarded
        to the new children at once (co-located tasks: each job process decides for itself)."""
        with stop_signals_blocked():
            if self.signum and stop_early:
                raise TaskStopped(None, self.signum)
            self.children = make_children()
            if self.signum:
                self.children.forward(self.signum)
        return self.children

    def run_workers(self, spec, resume: str | None) -> TaskOutcome:
        """Start the task's D workers and wait for them: COMPLETED or STOPPED; TaskFailed if one died."""
        workers = self.start(lambda: Workers(spec, resume))
        try:
            return workers.wait()
        finally:
            self.children = None

    def stop_children(self, signum: int, timeout: float) -> None:
        """A stop asked for by code (a backend runner's checkpoint hook): forward it and give the children `timeout` s
        to finish their step and save."""
        self.on_signal(signum)
        children = self.children
        if isinstance(children, Workers) and children.alive():
            children.wait(timeout=timeout)
