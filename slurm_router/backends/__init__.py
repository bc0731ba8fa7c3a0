"""The scheduler backends, one package each (local, slurm), looked up by name in scheduler/registry.py."""
