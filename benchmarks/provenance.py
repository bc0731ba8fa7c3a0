"""The first lines of every results file: the exact command that regenerates it, the commit, the machine
and the date, so a figure can be traced to the code that printed it; and the one door into benchmarks/results/.

    from provenance import header, write
    lines = [f"# Title", "", *header("python benchmarks/x.py --repeats 3"), "", ...]
    write(out_dir / "x.md", "\n".join(lines), {"rows": rows})     # x.md, and x.json led by the same header

A results file names code that a commit holds: `write` refuses (one line, exit 2) to put anything into
benchmarks/results/ from a tree whose tracked files differ from their commit; an output folder the user names
(`--out`) takes it instead. The commit is SLURM_ROUTER_COMMIT where it is set (a device machine's copy of the
tree carries a stale .git: its first GPU results said the session's starting commit; gpu_checks.sh passes the
real one on), else `git rev-parse HEAD` plus "+dirty" when tracked files outside benchmarks/results/ differ.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
COMMIT_ENV = "SLURM_ROUTER_COMMIT"
HEADER_KEYS = {"Command": "command", "Commit": "commit", "Machine": "machine", "Date": "date"}


def commit() -> str:
    if os.environ.get(COMMIT_ENV):
        return os.environ[COMMIT_ENV]
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
        # results files are what a run writes, not code that measures: a batch of runs may follow one another
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)benchmarks/results"],
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


def check(*paths: Path) -> None:
    """Exit 2 with one line when a path lies in benchmarks/results/ and the commit is not a clean one.

    Call it before measuring too, so a long run is not spent on figures that cannot be kept."""
    inside = [p for p in paths if Path(p).resolve().is_relative_to(RESULTS.resolve())]
    sha = commit()
    if inside and ("+dirty" in sha or sha.startswith("unknown")):
        print(
            f"refusing to write {Path(inside[0]).name} into benchmarks/results/: the tree is at {sha} (tracked files "
            "differ from the commit, or no commit is known); commit first, or pass --out DIR",
            file=sys.stderr,
        )
        raise SystemExit(2)


def fields(text: str) -> dict[str, str]:
    """The header's four lines of a results file's text as {"command", "commit", "machine", "date"}."""
    found = {}
    for line in text.splitlines():
        key, sep, value = line.partition(": ")
        if sep and key in HEADER_KEYS and HEADER_KEYS[key] not in found:
            found[HEADER_KEYS[key]] = value.strip().strip("`")
    return found


def write(md_path: Path, text: str, data: dict[str, Any] | None = None) -> None:
    """Write md_path, and its .json beside it when data is given, the header's fields first."""
    md_path = Path(md_path)
    check(md_path)
    md_path.parent.mkdir(parents=True, exist_ok=True)
    md_path.write_text(text.rstrip("\n") + "\n")
    if data is not None:
        head = fields(text)
        assert set(head) == set(HEADER_KEYS.values()), f"{md_path.name}: the text carries no full header"
        rest = {k: v for k, v in data.items() if k not in ("header", "command")}  # the header's fields say these
        assert data.get("command", head["command"]) == head["command"], f"{md_path.name}: two commands"
        clash = set(head) & set(rest)
        assert not clash, f"{md_path.name}: data keys {sorted(clash)} would hide the header's"
        md_path.with_suffix(".json").write_text(json.dumps({**head, **rest}, indent=1) + "\n")
