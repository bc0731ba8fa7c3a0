"""A backend owns everything about itself (issue 49, 3): its runners, requeue, containers, scripts and words live in
its package; the rest of the code speaks the backends' shared words and asks the backend (scheduler/base.py) where
it needs one. tests/test_backend_boundary.py keeps Slurm's commands and variables in backends/slurm/; the import
contract in pyproject.toml keeps submitit there; this file keeps the rest of Slurm's vocabulary there, and counts
what a new backend needs outside its folder.

The rule, precisely. Each module of `slurm_router/` (and `analysis/`) outside `backends/slurm/` is parsed; comments
and docstrings may name anything (prose says what a concept is, or where to look). No other string literal, and no
import, may hold:
- a state or reason only Slurm has: the words every backend shares (PENDING, RUNNING, COMPLETED, FAILED, CANCELLED,
  TIMEOUT, PREEMPTED, UNKNOWN; CACHED and INTERRUPTED, the run's) are the interface's (scheduler/task_view.py),
  Slurm's others (NODE_FAIL, REQUEUE_HOLD, DependencyNeverSatisfied...) are the backend's (backends/slurm/states.py);
  matched as capitals, whole words (a "deadline" variable is not Slurm's DEADLINE);
- a Slurm dependency type (afterok, afterany, afternotok, aftercorr);
- a container runtime (apptainer, singularity, pyxis, enroot);
- an sbatch script's file name (`*.sbatch`); the launcher kind `sbatch` (launcher=sbatch in a message) is a name
  the user types, and a command `sbatch ...` is test_backend_boundary.py's;
- an import of submitit.
"""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

from test_backend_boundary import code_strings, modules

REPO = Path(__file__).resolve().parents[1]
STATES = (
    "COMPLETING CONFIGURING NODE_FAIL BOOT_FAIL OUT_OF_MEMORY DEADLINE REVOKED REQUEUED REQUEUE_FED REQUEUE_HOLD "
    "SPECIAL_EXIT SUSPENDED RESIZING SIGNALING STAGE_OUT DependencyNeverSatisfied"
).split()
SLURM_STATE = re.compile(rf"\b(?:{'|'.join(STATES)})\b")  # case-sensitive: Slurm spells them so
SLURM_WORD = re.compile(
    r"\b(?:after(?:ok|any|notok|corr)|apptainer|singularity|pyxis|enroot)\b|(?<=\S)\.sbatch\b", re.I
)

# Before issue 49: 8 modules outside backends/slurm/ broke this rule (analysis/report.py, launch/container.py,
# launch/preview.py, rundir/layout.py, scheduler/task_view.py, supervise/colocate.py, supervise/job.py,
# supervise/retry.py), and config/checks.py held Slurm's mail types and container runtimes. Now none.


def violations(source: str) -> list[str]:
    """Each piece of Slurm's vocabulary the rule above finds in this module's code: 'line N: what'."""
    tree = ast.parse(source)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "submitit" for a in node.names):
            found.append(f"line {node.lineno}: import submitit")
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "submitit":
            found.append(f"line {node.lineno}: from {node.module} import")
    for node, text in code_strings(tree):  # the strings test_backend_boundary.py reads
        for m in (*SLURM_STATE.finditer(text), *SLURM_WORD.finditer(text)):
            found.append(f"line {getattr(node, 'lineno', 0)}: {m.group(0)!r} in {text[:60]!r}")
    return found


def test_the_rule_finds_what_it_says_and_leaves_prose_alone():
    code = '''
"""A docstring may say NODE_FAIL, afterok, apptainer and submit.sbatch."""
from submitit.helpers import Checkpointable
# a comment may too: REQUEUE_HOLD
kinds = ("apptainer", "pyxis")
state = "NODE_FAIL"
dep = f"afterok:{job}"
script = "submit-base.sbatch"
deadline = time.monotonic() + 5
kind = "sbatch"
hint = "pick launcher=sbatch"
shared = ("PENDING", "RUNNING", "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "PREEMPTED", "UNKNOWN")
'''
    found = violations(code)
    assert sorted(f.split(":")[0] for f in found) == ["line 3", "line 5", "line 5", "line 6", "line 7", "line 8"], found


def _knowing() -> dict[str, list[str]]:
    out = {}
    for path in modules():
        found = violations(path.read_text())
        if found:
            out[str(path.relative_to(REPO))] = found
    return out


def test_no_module_outside_the_slurm_backend_speaks_slurm():
    outside = _knowing()
    assert not outside, "Slurm's words outside backends/slurm/ (ask the backend: scheduler/base.py):\n" + "\n".join(
        f"{k}: {'; '.join(v)}" for k, v in outside.items()
    )


def test_what_a_new_backend_needs_outside_its_folder():
    """A backend is its folder, its conf/launcher/<kind>.yaml and its registration line. The stub scheduler
    (tests/stub_backend/, run end to end by tests/test_stub_backend.py) is named by no file of the package, its
    configs or pyproject.toml; its registration is SLURM_ROUTER_BACKENDS there (in the package, one line of
    scheduler/registry.py BACKENDS). The Slurm backend's knowledge outside its folder is counted the same way: the
    modules the rule above finds: none."""
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    outside = [
        f
        for f in tracked
        if (f.startswith(("slurm_router/", "conf/", "sbatch_templates/", "analysis/")) or f == "pyproject.toml")
        and (REPO / f).is_file()
    ]
    naming_stub = [
        f for f in outside if re.search(r"stub_backend|launcher=stub\b", (REPO / f).read_text(errors="ignore"))
    ]
    assert naming_stub == [], naming_stub
    assert (REPO / "tests" / "stub_backend" / "conf" / "launcher" / "stub.yaml").is_file()

    slurm_outside = sorted(_knowing())
    print(f"files outside backends/slurm/ that hold Slurm's knowledge: {len(slurm_outside)}: {slurm_outside}")
    assert slurm_outside == [], slurm_outside
