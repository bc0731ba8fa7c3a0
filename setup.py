"""The packages, found rather than listed: every package under slurm_router/ (setuptools' discovery), and the
top-level folders pyproject.toml's package-dir ships inside it (conf/, analysis/, sbatch_templates/). The rest of
the build is pyproject.toml's."""

import tomllib
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).resolve().parent
SHIPPED = tomllib.loads((HERE / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
setup(packages=sorted({*find_packages(where=str(HERE), include=["slurm_router", "slurm_router.*"]), *SHIPPED}))
