"""launcher.snapshot (issue 15): the jobs of a Slurm run import the source as it was submitted (RUN_DIR/code/),
whatever happens to the checkout afterwards; the manifest says what was submitted (commit, dirty, diff, pip freeze).

The real test never edits this checkout: it makes a git repository of a copy of the current source, submits from
that copy (on PYTHONPATH, as a user's checkout would be), edits it after the submission, and resumes the run.

    sudo scripts/slurm_test_cluster.sh && pytest tests/test_snapshot.py
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, run_cli, run_dir_of, slowdown, wait_until

from slurm_router.launch import snapshot

GIT = ["git", "-c", "user.name=test", "-c", "user.email=test@example.org", "-c", "init.defaultBranch=main"]


def _git(repo: Path, *args: str) -> str:
    return subprocess.run([*GIT, "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout.strip()


def _repo(root: Path, files: dict[str, str]) -> Path:
    root.mkdir(parents=True)
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    subprocess.run([*GIT, "init", "-q", str(root)], check=True)
    _git(root, "add", "-A")
    _git(root, "commit", "-q", "-m", "submitted")
    return root


def test_snapshot_of_a_dirty_checkout(tmp_path):
    """Working-tree content (uncommitted edits and new modules) is copied; ignored files and caches are not; the
    record names the commit, the diff and the untracked files; the import root is RUN_DIR/code."""
    repo = _repo(
        tmp_path / "repo",
        {"pkg/__init__.py": "", "pkg/mod.py": "X = 1\n", ".gitignore": "*.log\n", "README.md": "hello\n"},
    )
    (repo / "pkg" / "mod.py").write_text("X = 2  # edited, not committed\n")
    (repo / "pkg" / "new.py").write_text("Y = 3\n")
    (repo / "pkg" / "debug.log").write_text("ignored\n")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    record = snapshot.take(run_dir, package=repo / "pkg")
    code = run_dir / "code"
    assert (code / "pkg" / "mod.py").read_text() == "X = 2  # edited, not committed\n"
    assert (code / "pkg" / "new.py").is_file() and (code / "README.md").is_file()
    assert not (code / "pkg" / "debug.log").exists() and not (run_dir / "code.tmp").exists()
    assert record["kind"] == "git" and record["source"] == str(repo.resolve())
    assert record["git_commit"] == _git(repo, "rev-parse", "HEAD") and record["git_dirty"] is True
    assert record["untracked"] == ["pkg/new.py"] and record["files"] == 5
    assert "+X = 2  # edited, not committed" in Path(record["diff"]).read_text()
    assert record["pythonpath"] == str(code)
    assert "==" in Path(record["pip_freeze"]).read_text()

    clean = _repo(tmp_path / "clean", {"pkg/__init__.py": ""})
    (tmp_path / "run2").mkdir()
    record = snapshot.take(tmp_path / "run2", package=clean / "pkg")
    assert record["git_dirty"] is False and record["diff"] is None and not (tmp_path / "run2" / "code.diff").exists()


def test_snapshot_of_an_installed_package(tmp_path):
    """Not a git checkout: the package folder itself, without __pycache__."""
    pkg = tmp_path / "site" / "pkg"
    (pkg / "sub" / "__pycache__").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "__pycache__" / "x.pyc").write_bytes(b"\0")
    (tmp_path / "run").mkdir()
    record = snapshot.take(tmp_path / "run", package=pkg)
    assert record["kind"] == "package" and record["git_commit"] is None and record["files"] == 2
    assert (tmp_path / "run" / "code" / "pkg" / "sub" / "__init__.py").is_file()
    assert not list((tmp_path / "run" / "code").rglob("__pycache__"))


def test_this_checkout_imports_whole_from_its_snapshot(tmp_path):
    """slurm_router's subpackages that live outside its folder (analysis/, conf/: pyproject's package-dir) import
    from the snapshot too, through links inside code/slurm_router/."""
    (tmp_path / "run").mkdir()
    record = snapshot.take(tmp_path / "run")
    probe = (
        "import slurm_router, slurm_router.analysis, slurm_router.conf, slurm_router.launch.snapshot as s; "
        "print(slurm_router.__file__, slurm_router.analysis.__file__, s.__file__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=tmp_path / "run",
        capture_output=True,
        text=True,
        env={"PYTHONPATH": record["pythonpath"], "PATH": "/usr/bin:/bin"},
        check=True,
    ).stdout
    code = str(tmp_path / "run" / "code")
    assert all(path.startswith(code + "/slurm_router/") for path in out.split()), out
    # launcher=slurm's jobs start in the submission directory, often the checkout: PYTHONSAFEPATH=1 (set with the
    # snapshot) keeps `python -m` from importing the package found there instead of the snapshot
    checkout = tmp_path / "checkout"
    (checkout / "slurm_router").mkdir(parents=True)
    (checkout / "slurm_router" / "__init__.py").write_text("raise ImportError('the checkout was imported')\n")
    probe = ["-m", "slurm_router.supervise.job", "--no-such-option"]  # imports the package, then a usage error
    env = {"PYTHONPATH": record["pythonpath"], "PATH": "/usr/bin:/bin"}
    unsafe = subprocess.run([sys.executable, *probe], cwd=checkout, env=env, capture_output=True, text=True)
    assert "the checkout was imported" in unsafe.stderr
    safe = subprocess.run(
        [sys.executable, *probe], cwd=checkout, env={**env, "PYTHONSAFEPATH": "1"}, capture_output=True, text=True
    )
    assert safe.returncode == 2 and "usage: python -m slurm_router.supervise.job" in safe.stderr, safe.stderr


# ---- the real cluster ------------------------------------------------------------------------------------

MARK = "job code from: "
TRAIN = [
    "train.steps=10",
    "train.checkpoint_every=2",
    "train.eval_batches=2",
    "data.max_documents=60",
    "launcher.timeout_min=10",
    "launcher=sbatch",
]


def _source_copy(root: Path) -> Path:
    """A git repository of this checkout's current source (tracked and new files), committed once; then made
    dirty: job.py prints where it was imported from (uncommitted), and an untracked module."""
    listed = subprocess.run(
        ["git", "-C", str(REPO), "ls-files", "-co", "--exclude-standard"], capture_output=True, text=True, check=True
    ).stdout.split("\n")
    for name in filter(None, listed):
        if (REPO / name).is_file():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, root / name)
    subprocess.run([*GIT, "init", "-q", str(root)], check=True)
    _git(root, "add", "-A")
    _git(root, "commit", "-q", "-m", "the source as submitted")
    job = root / "slurm_router" / "supervise" / "job.py"
    text = job.read_text()
    at = text.rindex('if __name__ == "__main__":')
    job.write_text(text[:at] + f"print({MARK!r} + __file__, flush=True)\n\n\n" + text[at:])
    (root / "slurm_router" / "snapshot_probe.py").write_text("PROBE = 1\n")
    return root


def _sacct(job_id: str) -> str:
    out = subprocess.run(
        ["sacct", "-X", "-n", "--parsable2", "-o", "JobID,State", "-j", job_id], capture_output=True, text=True
    ).stdout
    return next((l.split("|")[1] for l in out.splitlines() if l.split("|")[0] == job_id), "")


def _steps(run_dir: Path) -> set[int]:
    path = run_dir / "tasks" / "main" / "events-rank0.jsonl"
    rows = [json.loads(l) for l in path.read_text().splitlines() if l.endswith("}")] if path.is_file() else []
    return {r["step"] for r in rows if r["event"] == "step"}


@pytest.mark.slurm
@pytest.mark.skipif(
    shutil.which("sbatch") is None, reason="no sbatch on PATH: run scripts/slurm_test_cluster.sh (root + apt) first"
)
def test_resume_after_an_edit_runs_the_submitted_code(tmp_path):
    src = _source_copy(tmp_path / "src")
    env = {"PYTHONPATH": str(src), **slowdown("4")}  # the user's checkout: the submitter imports it
    proc = run_cli(*TRAIN, f"run_root={tmp_path / 'runs'}", cwd=tmp_path, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = run_dir_of(proc)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    record = manifest["snapshot"]
    assert record["source"] == str(src) and record["git_commit"] == _git(src, "rev-parse", "HEAD")
    assert record["git_dirty"] and record["untracked"] == ["slurm_router/snapshot_probe.py"]
    assert MARK in (run_dir / "code.diff").read_text()
    assert (run_dir / "code" / "slurm_router" / "snapshot_probe.py").is_file()
    assert "torch==" in (run_dir / "pip-freeze.txt").read_text()

    # the user edits the checkout while the task runs; then an operator cancels the task
    job = src / "slurm_router" / "supervise" / "job.py"
    job.write_text(job.read_text().replace(f"print({MARK!r} + __file__, flush=True)", 'print("EDITED AFTER SUBMIT")'))
    first = manifest["tasks"]["main"]["job_id"]
    wait_until(lambda: max(_steps(run_dir), default=-1) >= 3, "step 3", timeout=180, poll_s=0.3)
    subprocess.run(["scancel", first], check=True)
    gone = lambda: not subprocess.run(["squeue", "-h", "-j", first], capture_output=True, text=True).stdout.strip()
    wait_until(lambda: _sacct(first).startswith("CANCELLED") and gone(), "the task cancelled", timeout=120, poll_s=0.5)

    resumed = run_cli(f"resume={run_dir}", cwd=tmp_path, env=env, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "snapshot: the jobs run the code submitted with this run" in resumed.stdout, resumed.stdout
    again = json.loads((run_dir / "manifest.json").read_text())["tasks"]["main"]["job_id"]
    assert again != first
    wait_until(
        lambda: (run_dir / "tasks" / "main" / "result.json").is_file() and _sacct(again) == "COMPLETED",
        "the resumed task to complete",
        timeout=240,
        poll_s=0.5,
    )

    logs = {p.name: p.read_text() for p in (run_dir / "logs").glob("*.out")}
    for job_id in (first, again):
        assert f"{MARK}{run_dir / 'code' / 'slurm_router' / 'supervise' / 'job.py'}" in logs[f"{job_id}.out"], logs
    assert not any("EDITED AFTER SUBMIT" in text for text in logs.values()), "a job ran the edited checkout"
    assert "EDITED" not in (run_dir / "code" / "slurm_router" / "supervise" / "job.py").read_text()
    assert len(_steps(run_dir)) == 10
