"""Entry point: python -m slurm_router.export RUN_DIR [VARIANT] [--best] --merge OUT (slurm_router.cli.export)."""

import sys

from slurm_router.cli.export import main

if __name__ == "__main__":
    sys.exit(main())
