"""Post-run analysis: `python -m slurm_router.analysis RUN_DIR` reads events + manifest and writes report/."""
