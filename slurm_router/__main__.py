"""Entry point: python -m slurm_router and the slurm-router console script (slurm_router.cli.command; the run's
workflow: slurm_router.cli.run). An error is one line: the user's mistake exits 2, a scheduler that does not
answer 75 (EX_TEMPFAIL)."""

from __future__ import annotations

import sys

if __name__ == "__main__":  # a Ctrl-C while the imports below load: one line and 130, as a run does later
    import signal

    def _interrupted_early(signum, frame):  # os._exit: nothing to clean up yet, and an exception raised
        print("\ninterrupted: nothing was written", file=sys.stderr, flush=True)  # in importlib's lock
        import os  # callbacks would be dropped ("Exception ignored")

        os._exit(130)

    signal.signal(signal.SIGINT, _interrupted_early)
    signal.signal(signal.SIGTERM, _interrupted_early)

from slurm_router.cli.command import run_command
from slurm_router.errors import SchedulerUnavailable, UserError


def main(argv: list[str] | None = None) -> int:
    try:
        return run_command(sys.argv[1:] if argv is None else argv)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except SchedulerUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 75


if __name__ == "__main__":
    sys.exit(main())
