"""docs/BENCHMARKS.md names every results file with the commit it was measured at (the one its header names) and
why it still holds at HEAD: a figure is never older than the index says."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
ROW = re.compile(r"^\| `([\w.-]+\.md)` \| ([0-9a-f]{12}(?:\+dirty)?) \| (.+) \|$")


def index() -> dict[str, tuple[str, str]]:
    rows = {}
    for line in (REPO / "docs" / "BENCHMARKS.md").read_text().splitlines():
        m = ROW.match(line)
        if m:
            rows[m.group(1)] = (m.group(2), m.group(3))
    return rows


def header_commit(path: Path) -> str:
    line = next(l for l in path.read_text().splitlines() if l.startswith("Commit: "))
    return line.removeprefix("Commit: ").strip()


def test_every_results_file_is_indexed_with_the_commit_its_header_names_and_a_reason():
    rows = index()
    files = sorted(p.name for p in RESULTS.glob("*.md"))
    assert sorted(rows) == files, {
        "not indexed": sorted(set(files) - set(rows)),
        "gone": sorted(set(rows) - set(files)),
    }
    for name, (commit, why) in rows.items():
        assert header_commit(RESULTS / name) == commit, f"{name}: measured at {header_commit(RESULTS / name)}"
        assert len(why.split()) >= 5, f"{name}: say why its figures still hold"


# ---- the commit each results file names: clean, and one HEAD descends from (issue 36) -------------------------------
IN_CI = os.environ.get("CI", "").lower() in ("true", "1")
COMMAND = re.compile(r"python benchmarks/[\w.]+\.py")


def git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)


def header_command(path: Path) -> str:
    line = next(l for l in path.read_text().splitlines() if l.startswith("Command: "))
    return line.removeprefix("Command: ").strip().strip("`")


def needs_history() -> None:
    """Ancestry needs the commits: outside CI a checkout without them skips; CI clones, so there it fails."""
    shallow = git("rev-parse", "--is-shallow-repository")
    why = "no git checkout" if shallow.returncode else "a shallow clone" if shallow.stdout.strip() == "true" else ""
    if why and IN_CI:
        pytest.fail(f"{why} in CI: the results files' commits cannot be checked; clone with the full history")
    if why:
        pytest.skip(f"{why}: the results files' commits cannot be checked against the history")


@pytest.mark.parametrize("name", sorted(p.name for p in RESULTS.glob("*.md")))
def test_each_results_file_names_a_clean_commit_that_head_descends_from(name):
    commit, command = header_commit(RESULTS / name), header_command(RESULTS / name)
    assert "+dirty" not in commit, f"{name}: measured at {commit}, code no commit holds: `{command}` at a clean commit"
    assert re.fullmatch(r"[0-9a-f]{12}", commit), f"{name}: Commit: {commit!r} is not a commit"
    needs_history()
    assert git("merge-base", "--is-ancestor", commit, "HEAD").returncode == 0, (
        f"{name}: measured at {commit}, which is not an ancestor of HEAD: rerun `{command}` at a commit on this branch"
    )


@pytest.mark.parametrize("name", sorted(p.name for p in RESULTS.glob("*.json")))
def test_each_json_result_carries_the_command_and_commit_of_its_md(name):
    data = json.loads((RESULTS / name).read_text())
    assert COMMAND.match(data.get("command", "")), f"{name}: no command that regenerates it"
    assert re.fullmatch(r"[0-9a-f]{12}", data.get("commit", "")), f"{name}: no clean commit: {data.get('commit')!r}"
    md = (RESULTS / name).with_suffix(".md")
    if md.exists():
        assert (data["command"], data["commit"]) == (header_command(md), header_commit(md)), f"{name} vs {md.name}"


# ---- a script refuses to write results from a dirty tree ------------------------------------------------------------
def benchmark_repo(tmp: Path) -> Path:
    """A git repository holding benchmarks/poll_cost.py and provenance.py, committed: a results file's world."""
    repo = tmp / "repo"
    (repo / "benchmarks" / "results").mkdir(parents=True)
    for f in ("poll_cost.py", "provenance.py", "gpu_checks.sh"):
        shutil.copy(REPO / "benchmarks" / f, repo / "benchmarks" / f)
    (repo / "benchmarks" / "results" / "poll_cost-cpu.md").write_text("# committed figures\n")
    ident = ["-c", "user.name=t", "-c", "user.email=t@example.com"]
    for cmd in (["init", "-q"], ["add", "."], [*ident, "commit", "-qm", "benchmarks"]):
        subprocess.run(["git", *cmd], cwd=repo, check=True, capture_output=True)
    return repo


def poll_cost(repo: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("SLURM_ROUTER_COMMIT", "CI")}
    return subprocess.run(
        [sys.executable, "benchmarks/poll_cost.py", *args], cwd=repo, env=env, capture_output=True, text=True
    )


def test_a_benchmark_on_a_dirty_tree_refuses_to_write_results_but_writes_into_a_folder_you_name(tmp_path):
    repo = benchmark_repo(tmp_path)
    committed = repo / "benchmarks" / "results" / "poll_cost-cpu.md"
    (repo / "benchmarks" / "provenance.py").write_text((repo / "benchmarks" / "provenance.py").read_text() + "\n")
    out = poll_cost(repo)
    assert out.returncode == 2, out.stdout + out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "refusing to write poll_cost-cpu.md" in out.stderr
    assert "+dirty" in out.stderr and "--out DIR" in out.stderr, out.stderr
    assert committed.read_text() == "# committed figures\n"
    assert sorted(p.name for p in committed.parent.iterdir()) == ["poll_cost-cpu.md"], "nothing else written"

    assert poll_cost(repo, "--out", str(tmp_path / "mine")).returncode == 0
    mine = json.loads((tmp_path / "mine" / "poll_cost-cpu.json").read_text())
    assert mine["command"] == "python benchmarks/poll_cost.py" and mine["commit"].endswith("+dirty")
    assert committed.read_text() == "# committed figures\n", "--out writes there only"

    subprocess.run(["git", "checkout", "-q", "--", "benchmarks/provenance.py"], cwd=repo, check=True)
    assert poll_cost(repo).returncode == 0
    head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=repo, capture_output=True, text=True)
    data = json.loads(committed.with_suffix(".json").read_text())
    assert (data["command"], data["commit"]) == ("python benchmarks/poll_cost.py", head.stdout.strip())
    assert f"Commit: {head.stdout.strip()}" in committed.read_text()


def test_the_gpu_checks_stand_in_writes_only_into_its_output_folder(tmp_path):
    repo = benchmark_repo(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "CI"} | {"GPU_CHECKS_ONLY": "poll_cost"}
    out = subprocess.run(
        ["bash", "benchmarks/gpu_checks.sh", str(tmp_path / "out"), "--stand-in-cpu"],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert (repo / "benchmarks" / "results" / "poll_cost-cpu.md").read_text() == "# committed figures\n"
    assert subprocess.run(["git", "status", "--porcelain"], cwd=repo, capture_output=True, text=True).stdout == ""
    packed = subprocess.run(["tar", "-tzf", str(tmp_path / "out" / "results.tar.gz")], capture_output=True, text=True)
    assert "./poll_cost-cpu.md" in packed.stdout.splitlines(), packed.stdout
