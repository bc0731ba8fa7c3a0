"""The first lines of every results file: the exact command that regenerates it, the commit, the machine
and the date, so a figure can be traced to the code that printed it (issue: figures from their scripts).

    from provenance import header
    lines = [f"# Title", "", *header("python benchmarks/x.py --repeats 3"), "", ...]

The commit is SLURM_ROUTER_COMMIT where it is set (a device machine's copy of the tree carries a stale .git:
its first GPU results said the session's starting commit; gpu_checks.sh passes the real one on), else
`git rev-parse HEAD` plus "+dirty" when tracked files differ.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMMIT_ENV = "SLURM_ROUTER_COMMIT"


def commit() -> str:
    if os.environ.get(COMMIT_ENV):
        return os.environ[COMMIT_ENV]
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git checkout, SLURM_ROUTER_COMMIT unset)"


def machine() -> str:
    """CPU count and platform, the GPU's name when torch sees one, and torch's version when imported."""
    parts = [f"{os.cpu_count()} CPUs", platform.platform(), f"Python {platform.python_version()}"]
    import sys

    torch = sys.modules.get("torch")
    if torch is not None:
        parts.append(f"torch {torch.__version__}")
        if torch.cuda.is_available():
            parts.insert(0, torch.cuda.get_device_name())
    return ", ".join(parts)


def header(command: str) -> list[str]:
    """Markdown lines: command, commit, machine, date (UTC)."""
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return [f"Command: `{command}`  ", f"Commit: {commit()}  ", f"Machine: {machine()}  ", f"Date: {now}"]
