"""Imported first in a job process's multiprocessing forkserver (supervisor.spawn_blocked puts it at the head of
the forkserver's preload list): the forkserver ends with the job process that started it, at once.

Left to itself the forkserver ends only when every holder of its "alive" pipe has closed it (the job process
and every worker forked from it), and then tears down the interpreter that imported torch, transformers and
peft: about 1 s of CPU, 2.5-3 s after the job process on a loaded 2-core machine, and later still when the job
process itself ended last (its workers killed ORPHAN_GRACE_S after the launcher died, itself ORPHAN_EXIT_S
after that). So a kill -9 of the launcher could leave the forkserver alive past the 10 s in which nothing of
the run may live (tests/test_run_ownership.py). Two ties, both Linux-only and skipped elsewhere:

- PR_SET_PDEATHSIG: SIGKILL when the job process (the thread that forked it: the job's main thread) ends,
  however it ends, even during the seconds of preload imports that follow this one; a job process that died
  before the call is caught by comparing the parent pid with the one the job process wrote in
  FORKSERVER_PARENT_ENV. Children forked from the forkserver (the workers) do not inherit the signal: they
  watch the job process themselves (supervisor.watch_parent_process).
- Its normal end (the alive pipe closed) skips the module teardown: an atexit handler that only the
  forkserver's own pid runs calls os._exit(0) (the forkserver writes nothing; the workers, which inherit the
  handler through fork, pass over it).

Does nothing unless FORKSERVER_PARENT_ENV is set (the job process sets it only while it starts the forkserver).
"""

import atexit
import os
import signal
import sys

FORKSERVER_PARENT_ENV = "SLURM_ROUTER_FORKSERVER_PARENT"
PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> None:
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:  # the job process ended before the prctl: nobody needs us
        os._exit(0)


def _exit_fast(pid: int) -> None:
    if os.getpid() == pid:
        os._exit(0)


_parent = os.environ.get(FORKSERVER_PARENT_ENV)
if _parent:
    _die_with_parent(int(_parent))
    atexit.register(_exit_fast, os.getpid())
