"""conf/ and analysis/ work from any directory after `pip install .` (not only from the repo), whichever
Python runs the suite: the system's, a venv's or a conda env's."""

import os
import site
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO


def _current_site_dirs() -> list[str]:
    """Where this interpreter finds its packages. In a venv, sys.executable's --system-site-packages would be
    the BASE interpreter's (without the project's dependencies): hand the new venv these dirs instead."""
    dirs = [*site.getsitepackages(), site.getusersitepackages(), *sys.path]
    out = []
    for d in dirs:
        p = Path(d).resolve() if d else None
        if p and p.name in ("site-packages", "dist-packages") and p.is_dir() and str(p) not in out:
            out.append(str(p))
    return out


@pytest.mark.integration
def test_non_editable_install_finds_conf_and_analysis(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    new_site = subprocess.run(
        [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # Plain path lines: appended after the venv's own site-packages (so its slurm_router wins), and the .pth
    # files in them (the editable install's finder) are not run.
    Path(new_site, "_outer_env.pth").write_text("\n".join(_current_site_dirs()) + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    subprocess.run(
        [py, "-m", "pip", "install", "-q", "--no-deps", str(REPO)], check=True, cwd=tmp_path, timeout=300, env=env
    )
    where = subprocess.run(
        [
            py,
            "-c",
            "import slurm_router.config.schema as c, slurm_router.analysis as a; "
            "print(c.conf_dir()); print(a.__file__)",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
        env=env,
    ).stdout.split()
    assert all(str(venv) in w for w in where), where
    proc = subprocess.run(
        [py, "-m", "slurm_router", "+experiment=nope"], cwd=tmp_path, capture_output=True, text=True, env=env
    )
    assert proc.returncode == 2 and "lora_ab" in proc.stderr, proc.stderr
