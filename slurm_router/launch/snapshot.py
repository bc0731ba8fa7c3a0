"""launcher.snapshot (on by default for the Slurm launchers): a job runs the code that was submitted
(docs/design/jobs.md, "How a job runs"). The same idea as submitit's RsyncSnapshot, without rsync.

At submission the project's source is copied to RUN_DIR/code/: the files of the checkout the slurm_router
package is imported from that git tracks, or would (`git ls-files --cached --others --exclude-standard`: a new
module not yet `git add`ed is code the run needs too; ignored files never), as they are in the working tree, or,
for an installed package, the package folder. Every job of the run (array tasks, requeues, resume=, the report job)
starts in RUN_DIR with RUN_DIR/code first on PYTHONPATH, so a task that starts hours later, or is requeued or
resumed after the checkout was edited, imports what was submitted. resume= keeps the run's snapshot.

The manifest's `snapshot` says where it came from: the git commit, whether the tree was dirty (then the
`git diff HEAD` of tracked files is in RUN_DIR/code.diff and the untracked files copied are listed), the
number of files, and RUN_DIR/pip-freeze.txt (the submitting interpreter's `pip freeze`). An untracked file over
UNTRACKED_MAX_BYTES is left out, with a warning naming it (data, not code).

That record is the run's provenance, so it is never rewritten. A resume whose snapshot folder is gone is refused in
one line (the jobs would silently import whatever the checkout holds now); `resume=RUN_DIR new_snapshot=true` takes
the current code as a new snapshot instead, into RUN_DIR/code-resume<N>/ (N: the resume's number), recorded in the
manifest's `resume_snapshots` list beside the untouched `snapshot`; the jobs then import the newest one.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import slurm_router
from slurm_router.errors import UserError
from slurm_router.fileio import WriteError, atomic_write_text
from slurm_router.rundir.layout import RunLayout

GIT_TIMEOUT_S = 30
PIP_TIMEOUT_S = 120
UNTRACKED_MAX_BYTES = 16 << 20
RESUME_SNAPSHOTS = "resume_snapshots"  # the manifest's list of the snapshots resume= new_snapshot=true took
NEW_SNAPSHOT = "new_snapshot"  # resume=RUN_DIR new_snapshot=true: the current code, as a new snapshot


def _git(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=GIT_TIMEOUT_S)


def package_dir() -> Path:
    return Path(slurm_router.__file__).resolve().parent


def git_root(package: Path) -> Path | None:
    """The checkout that tracks the package (None: not a git checkout, or git is not installed)."""
    try:
        top = _git(package, "rev-parse", "--show-toplevel")
        if top.returncode != 0:
            return None
        root = Path(top.stdout.strip()).resolve()
        tracked = _git(root, "ls-files", "--error-unmatch", str(package / "__init__.py"))
    except (OSError, subprocess.SubprocessError):
        return None
    return root if tracked.returncode == 0 else None


def _copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    if src.is_symlink():
        os.symlink(os.readlink(src), dst)
    else:
        shutil.copy2(src, dst)


def _ls_files(root: Path, *args: str) -> list[str]:
    out = subprocess.run(
        ["git", "-C", str(root), "ls-files", "-z", *args], capture_output=True, timeout=GIT_TIMEOUT_S, check=True
    ).stdout
    return [
        f
        for f in out.decode(errors="surrogateescape").split("\0")
        if f and os.path.lexists(root / f) and not (root / f).is_dir()
    ]


def _source_files(root: Path) -> tuple[list[str], list[str]]:
    """(tracked files, untracked files that are not ignored) of the checkout, as they exist now."""
    tracked = _ls_files(root)
    untracked: list[str]
    too_big: list[str]
    untracked, too_big = [], []
    for f in _ls_files(root, "--others", "--exclude-standard"):
        (too_big if (root / f).lstat().st_size > UNTRACKED_MAX_BYTES else untracked).append(f)
    if too_big:
        print(
            f"warning: snapshot: left out {len(too_big)} untracked file(s) over {UNTRACKED_MAX_BYTES >> 20} MiB "
            f"({', '.join(too_big[:3])}{', ...' if len(too_big) > 3 else ''}): data, not code",
            file=sys.stderr,
        )
    return tracked, untracked


def _link_mapped_subpackages(root: Path, package: Path, code: Path) -> list[str]:
    """Subpackages installed from folders outside the package (pyproject's package-dir: slurm_router.analysis
    from analysis/, ...): a relative link inside code/<package>/ makes them import from the snapshot too. A
    top-level folder D of the checkout is one when slurm_router.D imports from a folder named D (this checkout's,
    or the installed copy's when the checkout is only on PYTHONPATH)."""
    linked = []
    for d in sorted(p for p in root.iterdir() if p.is_dir() and (p / "__init__.py").is_file() and p != package):
        spec = importlib.util.find_spec(f"{package.name}.{d.name}")
        locations = list(spec.submodule_search_locations or []) if spec else []
        if locations and Path(locations[0]).name == d.name:
            link = code / package.relative_to(root) / d.name
            if not os.path.lexists(link):
                os.symlink(os.path.relpath(code / d.name, link.parent), link)
                linked.append(d.name)
    return linked


def _git_record(root: Path, diff_path: Path, untracked: list[str]) -> dict:
    head = _git(root, "rev-parse", "HEAD")
    changed = bool(_git(root, "status", "--porcelain", "--untracked-files=no").stdout.strip())
    record = {
        "git_commit": head.stdout.strip() if head.returncode == 0 else None,
        "git_dirty": changed or bool(untracked),
        "diff": None,
        "untracked": untracked,
    }
    if changed:
        diff = _git(root, "diff", "HEAD", "--binary")
        atomic_write_text(diff_path, diff.stdout)
        record["diff"] = str(diff_path)
    return record


def _pip_freeze(path: Path) -> str | None:
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "freeze"], capture_output=True, text=True, timeout=PIP_TIMEOUT_S
        )
    except (OSError, subprocess.SubprocessError) as e:
        print(f"warning: pip freeze did not run ({e}): the manifest records no package list", file=sys.stderr)
        return None
    if proc.returncode != 0:
        print(f"warning: pip freeze failed: {proc.stderr.strip()[:200]}", file=sys.stderr)
        return None
    atomic_write_text(path, proc.stdout)
    return str(path)


def take(run_dir: str | os.PathLike, package: Path | None = None, resume: int = 0) -> dict:
    """Copy the source of `package` (default: the slurm_router being run) into RUN_DIR/code/ (through code.tmp/,
    renamed when whole) and write code.diff and pip-freeze.txt; the manifest's `snapshot` record. resume=N: into
    code-resume<N>/ and its own diff and pip freeze instead (new_snapshot=true), never over the first. WriteError
    (one line) if the run dir cannot take it."""
    layout, package = RunLayout(run_dir), (package or package_dir()).resolve()
    code, diff_path, pip_path = layout.snapshot_files(resume)
    root = git_root(package)
    tmp = layout.root / f"{code.name}.tmp"
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        if root is not None:
            tracked, untracked = _source_files(root)
            files = tracked + untracked
            for f in files:
                _copy(root / f, tmp / f)
            _link_mapped_subpackages(root, package, tmp)
            import_root = code / package.parent.relative_to(root)
            record = {"kind": "git", "source": str(root), **_git_record(root, diff_path, untracked)}
        else:  # an installed package: the folder itself (subpackages included), without caches
            shutil.copytree(
                package, tmp / package.name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
            )
            files = [str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file()]
            import_root = code
            record = {
                "kind": "package",
                "source": str(package),
                "git_commit": None,
                "git_dirty": None,
                "diff": None,
                "untracked": [],
            }
        os.replace(tmp, code)
        pip = _pip_freeze(pip_path)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise WriteError.of(e.filename or code, e) from None
    return {"code": str(code), "pythonpath": str(import_root), "files": len(files), **record, "pip_freeze": pip}


def current_record(manifest_data: dict) -> dict | None:
    """The snapshot the run's jobs import: the newest one new_snapshot=true took, else the submission's (None: the
    run has none, launcher.snapshot=false)."""
    later = manifest_data.get(RESUME_SNAPSHOTS) or []
    return later[-1] if later else manifest_data.get("snapshot")


def pythonpath(manifest_data: dict) -> str | None:
    """The folder a job puts first on PYTHONPATH: the run's snapshot (None: it has none, or it is gone)."""
    path = (current_record(manifest_data) or {}).get("pythonpath")
    return path if path and Path(path).is_dir() else None


def _describe(record: dict) -> str:
    """' at 1a2b3c4d5e6f + uncommitted changes (code.diff)': where a snapshot's code came from."""
    if record.get("git_dirty") is None:
        return ""
    changes = [
        *([f"uncommitted changes ({Path(record['diff']).name})"] if record.get("diff") else []),
        *([f"{len(record['untracked'])} untracked file(s)"] if record.get("untracked") else []),
    ]
    return f" at {(record.get('git_commit') or 'no commit')[:12]}" + (f" + {' + '.join(changes)}" if changes else "")


def check_resume(manifest, enabled: bool, new: bool) -> None:
    """resume= that submits jobs: the snapshot they would import must still be there, or the user asks for a new
    one (new_snapshot=true). Otherwise one line (UserError), before anything about the run changes: a job that
    silently imported the current checkout would lose the run's provenance."""
    record, root = current_record(manifest.data), manifest.layout.root
    if new and not enabled:
        raise UserError(
            f"{NEW_SNAPSHOT}=true: this run was submitted with launcher.snapshot=false, so its jobs import "
            f"the checkout as it is; there is no snapshot to renew: resume={root} without {NEW_SNAPSHOT}"
        )
    if new or not record or not enabled or pythonpath(manifest.data):
        return
    raise UserError(
        f"resume={root}: the run's code snapshot {record.get('code')} is missing (the code submitted "
        f"from {record.get('source')}{_describe(record)}): the jobs would run other code than was "
        f"submitted; restore that folder, or resume with the current code recorded as a new snapshot "
        f"beside the first: python -m slurm_router resume={root} {NEW_SNAPSHOT}=true"
    )


def ensure(manifest, enabled: bool, new: bool = False) -> str | None:
    """Once per submission, before the first stage: take the snapshot (a fresh run), keep the one the run has
    (resume=), take a new one beside it (resume= new_snapshot=true), or none (launcher.snapshot=false). Records it
    in the manifest; returns the PYTHONPATH folder. A resume whose snapshot is gone: UserError (check_resume)."""
    resumed = int(manifest.data.get("resumed") or 0)
    if resumed:
        check_resume(manifest, enabled, new)
    if new and resumed:
        return _renew(manifest, resumed)
    have = pythonpath(manifest.data)
    if have or not enabled:
        if have and resumed:
            record = current_record(manifest.data)
            assert record is not None
            print(
                f"snapshot: the jobs run the code recorded at resume {record['resume']} ({record['code']})"
                if record.get("resume")
                else f"snapshot: the jobs run the code submitted with this run ({record.get('code')})"
            )
        return have
    record = take(manifest.layout.root)
    manifest.set(snapshot=record)
    print(f"snapshot: {record['files']} files of {record['source']}{_describe(record)} -> {record['code']}")
    return record["pythonpath"]


def _renew(manifest, resume: int) -> str:
    """new_snapshot=true at the N-th resume: the current code into code-resume<N>/, appended to the manifest's
    resume_snapshots; the submission's `snapshot` record (and any folder it names) stays as it was."""
    import time

    first = manifest.data.get("snapshot")
    gone = bool(first) and not Path(first.get("pythonpath") or "").is_dir()
    record = {
        **take(manifest.layout.root, resume=resume),
        "resume": resume,
        "taken_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "why": f"{NEW_SNAPSHOT}=true" + (f" ({first.get('code')} was missing)" if gone else ""),
    }
    manifest.set(**{RESUME_SNAPSHOTS: [*(manifest.data.get(RESUME_SNAPSHOTS) or []), record]})
    kept = (
        (
            f"; the submission's snapshot stays recorded in the manifest ({first.get('code')}"
            f"{_describe(first)}{', its folder missing' if gone else ''})"
        )
        if first
        else ""
    )
    print(
        f"snapshot: {NEW_SNAPSHOT}=true: {record['files']} files of {record['source']}{_describe(record)} -> "
        f"{record['code']}{kept}"
    )
    return record["pythonpath"]
