"""conf/ and analysis/ work from any directory after `pip install .` (not only from the repo)."""
import subprocess
import sys

import pytest

from conftest import REPO


@pytest.mark.integration
def test_non_editable_install_finds_conf_and_analysis(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", str(REPO)], check=True,
                   cwd=tmp_path, timeout=300)
    where = subprocess.run([py, "-c", "import slurm_router.config as c, slurm_router.analysis as a; "
                            "print(c.conf_dir()); print(a.__file__)"], cwd=tmp_path, capture_output=True,
                           text=True, check=True).stdout.split()
    assert all(str(venv) in w for w in where), where
    proc = subprocess.run([py, "-m", "slurm_router", "+experiment=nope"], cwd=tmp_path, capture_output=True,
                          text=True)
    assert proc.returncode == 2 and "lora_ab" in proc.stderr, proc.stderr
