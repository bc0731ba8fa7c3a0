"""One writer of a run directory (docs/ARCHITECTURE.md): RUN_DIR/run.lock, an exclusive flock, and in the file
who holds it (host, pid, the pid's start time, since when, the command).

    lock = acquire(run_dir)       # create_run_dir, right after it made the directory
    lock = own_run(manifest)      # resume=, before it plans
    Popen(..., pass_fds=(lock.fd,), env={LOCK_FD_ENV: str(lock.fd)})   # a local job process shares it

Who holds it: the process that runs or resumes the run (for a Slurm run: while it submits, or waits with
launcher.wait=true), and every local job process of the run. A local job does not take a lock of its own: the
launcher passes its locked file descriptor down (pass_fds), and a flock belongs to the open file, not to a
process, so the lock stays held while any process of the run lives, the launcher's orphaned tasks included,
with no moment between two holders in which a `resume=` could slip in. (A job process started by hand takes
the lock itself; under Slurm, Slurm owns the job and its array tasks take none.) The kernel drops the lock
when the last of them exits, however it dies: a holder that is gone is recognised by the lock being free
while the file still names it without `released`, and the next writer takes it over and says so.

A second writer refuses with one line naming the holder (RunInUse, exit 2). Short writes to manifest.json go
through `short_lock` (manifest.lock), so a job process and the launcher never overwrite each other's fields.
"""

from __future__ import annotations

import fcntl
import json
import os
import platform
import shlex
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from slurm_router.errors import UserError
from slurm_router.rundir.layout import RunLayout

LOCK_FD_ENV = "SLURM_ROUTER_RUN_LOCK_FD"  # a local job process: the launcher's locked fd it inherited
# A holder that is gone but whose lock is still held: its orphaned tasks, which stop within seconds
# (supervisor.ORPHAN_GRACE_S and the kill after it); wait this long for them before refusing.
ORPHANS_WAIT_S = 15.0


class RunInUse(UserError):
    """Another process holds the run directory: one line naming it and what to do."""


@dataclass
class RunLock:
    """A held run.lock: its open file (kept open for as long as the lock is held) and the holder written into it."""

    root: Path
    fd: int
    info: dict


_HELD: dict[Path, RunLock] = {}


def _pid_started(pid: int) -> float | None:
    """When a process started (seconds since the epoch): with its pid, it names one process, never a reused pid."""
    try:
        import psutil

        return psutil.Process(pid).create_time()
    except Exception:
        return None


def holder_info() -> dict:
    return {
        "host": platform.node(),
        "pid": os.getpid(),
        "pid_started": _pid_started(os.getpid()),
        "since": time.time(),
        "command": _command(),
    }


def _command() -> str:
    """The command as typed: python3 -m slurm_router resume=... (sys.argv would show __main__.py's path)."""
    argv = list(getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv])
    from slurm_router.config.secrets import redact_text  # a URI's password typed on the command line

    return redact_text(shlex.join([Path(argv[0]).name, *argv[1:]]))


def owner_alive(info: dict | None) -> bool | None:
    """Is the process `info` names (a holder, or the manifest's owner) still running? None: it ran on another host,
    so this one cannot tell (or `info` names nobody)."""
    if not info or not info.get("pid"):
        return None
    if info.get("host") != platform.node():
        return None
    import psutil

    try:
        proc = psutil.Process(int(info["pid"]))
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        started = info.get("pid_started")
        return started is None or abs(proc.create_time() - float(started)) < 1.0
    except psutil.NoSuchProcess:
        return False


def describe(info: dict | None) -> str:
    """pid N on HOST since 2024-01-01 12:00:00 (python3 -m slurm_router ...)."""
    if not info:
        return "a process that has not said who it is yet"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(info.get("since") or 0)))
    command = " ".join(str(info.get("command") or "?").split())  # one line, whatever was typed
    command = command if len(command) <= 200 else command[:197] + "..."
    return f"pid {info.get('pid')} on {info.get('host')} since {since} ({command})"


def _read(fd: int) -> dict | None:
    try:
        data = json.loads(os.pread(fd, 1 << 16, 0).decode() or "null")
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _write(fd: int, info: dict) -> None:
    data = json.dumps(info).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _open(path: Path) -> int:
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise UserError(f"cannot open {path} ({e.strerror}): make the run directory writable") from None


def _refusal(root: Path, info: dict | None) -> RunInUse:
    if not info:
        return RunInUse(
            f"{root} is in use by another process (not named in {RunLayout(root).run_lock} yet): wait for it"
        )
    if owner_alive(info) is False:
        return RunInUse(
            f"{root} is in use by the tasks of {describe(info)}, which is gone: they stop by "
            "themselves within seconds; try again then"
        )
    there = "" if info.get("host") == platform.node() else f" on {info.get('host')}"
    return RunInUse(
        f"{root} is in use by {describe(info)}: wait for it, or stop it with kill {info.get('pid')}"
        f"{there} (its tasks checkpoint at the step end; resume={root} continues them)"
    )


def acquire(run_dir: str | os.PathLike, orphans_wait_s: float = ORPHANS_WAIT_S) -> RunLock:
    """Take RUN_DIR/run.lock for this process (again: the lock it holds already), or raise RunInUse (one line).
    A holder that is gone (its lock free, its record not released) is taken over, said so in one line; one
    that is gone while its orphaned tasks still hold the lock is waited for, up to orphans_wait_s."""
    root = Path(run_dir).resolve()
    if root in _HELD:
        return _HELD[root]
    fd = _open(RunLayout(root).run_lock)
    try:
        if not _try_lock(fd):
            info = _holder(fd)
            # gone, while the lock is still held: by its orphaned tasks, which stop within seconds
            if owner_alive(info) is not False or not _wait_for_orphans(fd, info, orphans_wait_s):
                raise _refusal(root, _read(fd))
        previous = _read(fd)
        if previous and not previous.get("released"):
            print(
                f"note: {root}: its last holder, {describe(previous)}, is gone without releasing it: taking it over",
                file=sys.stderr,
                flush=True,
            )
        info = holder_info()
        _write(fd, info)
    except BaseException:
        os.close(fd)
        raise
    lock = RunLock(root, fd, info)
    _HELD[root] = lock
    return lock


def _holder(fd: int) -> dict | None:
    """Who holds the lock. A holder writes itself in just after it took the lock: what names nobody, or a
    process that is gone, is read again a moment later."""
    info = _read(fd)
    if owner_alive(info) is not True:
        time.sleep(0.3)
        info = _read(fd)
    return info


def _wait_for_orphans(fd: int, info: dict | None, wait_s: float) -> bool:
    """The holder is gone but its tasks still hold the lock while they stop: wait for them (True: the lock is
    ours); False at once if a live holder took it meanwhile, or after wait_s."""
    print(
        f"waiting up to {wait_s:.0f} s for the tasks of {describe(info)}, which is gone, to stop",
        file=sys.stderr,
        flush=True,
    )
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        time.sleep(0.2)
        if _try_lock(fd):
            return True
        if owner_alive(_read(fd)) is True:
            return False
    return False


def own_run(manifest) -> RunLock:
    """The run's lock for this process, and the manifest's `owner` record of it (what status checks for life)."""
    lock = acquire(manifest.layout.root)
    manifest.set(owner=lock.info)
    return lock


def held(run_dir: str | os.PathLike) -> RunLock | None:
    """The lock this process holds on RUN_DIR, if it does."""
    return _HELD.get(Path(run_dir).resolve())


def held_dirs() -> list[Path]:
    return list(_HELD)


def let_go(run_dir: str | os.PathLike) -> None:
    """Drop this process's lock on RUN_DIR without a record: the directory is being removed (never made whole)."""
    lock = _HELD.pop(Path(run_dir).resolve(), None)
    if lock is not None:
        os.close(lock.fd)


def release_all() -> None:
    """This process is done with its runs: mark each record released, then drop the lock (closing the file).
    Only when the run's processes have ended (local job processes share the lock until they exit)."""
    for root, lock in list(_HELD.items()):
        try:
            _write(lock.fd, {**lock.info, "released": time.time()})
        except OSError:
            pass
        os.close(lock.fd)
        del _HELD[root]


@contextmanager
def short_lock(path: str | os.PathLike):
    """An exclusive flock on `path` for the duration of a read-modify-write (the manifest's manifest.lock)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        from slurm_router.fileio import WriteError

        raise WriteError.of(path, e) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
