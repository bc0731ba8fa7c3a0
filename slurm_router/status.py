"""Entry point: python -m slurm_router.status [RUN_DIR] [--wait] [--follow] [--cancel] [--json] [--run-root DIR]
(slurm_router.cli.status)."""

import sys

from slurm_router.cli.status import main

if __name__ == "__main__":
    sys.exit(main())
