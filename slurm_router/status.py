"""Entry point: python -m slurm_router.status RUN_DIR [--wait] [--cancel] [--json] (see slurm_status)."""
import sys

from slurm_router.slurm_status import main

if __name__ == "__main__":
    sys.exit(main())
