"""Entry point: python -m slurm_router.status [RUN_DIR] [--wait] [--follow] [--cancel] [--json] [--run-root DIR]
(see slurm_status; without RUN_DIR the recent runs: run_list)."""
import sys

from slurm_router.slurm_status import main

if __name__ == "__main__":
    sys.exit(main())
