"""Render an sbatch array script from a resource spec: a pure function, golden-file tested.

    python -c "from slurm_router.backends.slurm.sbatch_render import SbatchSpec, render_sbatch; \
print(render_sbatch(SbatchSpec(job_name='demo', run_dir='/tmp/run', array_size=4, task_argv=('-c', 'print(1)'))))"

Two parsers read the result, and every config-derived value must survive both without injection:
- `#SBATCH` lines are read by sbatch itself, not by a shell. sbatch splits on whitespace, honours '...'
  and "..." quotes, treats a backslash as an escape (even inside quotes) and an unquoted `#` as a comment.
  shlex.quote output ('a'"'"'b') means the same thing to sbatch as to bash (checked on Slurm 22.05), so it
  is used there too. What sbatch cannot represent is rejected: newlines and control characters (a line
  ends the directive), backslashes (sbatch eats them; in --output they also turn off %-patterns).
- Below the directives bash runs the script: every word is shlex.quote'd, so spaces, quotes, $(...),
  backticks and newlines in a path, variant or env value reach the program as literal argv.
Output paths are also Slurm filename patterns: a literal `%` in RUN_DIR is written as `%%`.
The one exception is launcher.setup: its lines are the user's own shell, run as written (module load, source a
venv), trusted like a hand-written sbatch script. A container (backends/slurm/container.py) keeps the batch shell
outside it: the task is its child, and the shell requeues when the task asks (REQUEUE_REQUEST_ENV).
"""

from __future__ import annotations

import importlib.resources
import math
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from string import Template
from typing import Any, cast

from slurm_router.backends.slurm.commands import sbatch
from slurm_router.backends.slurm.common import afterok, user_gpu_request
from slurm_router.backends.slurm.config import SlurmLauncherConfig
from slurm_router.backends.slurm.container import ContainerSpec
from slurm_router.backends.slurm.job import outside_exports
from slurm_router.backends.slurm.settings import MAIL_TYPES
from slurm_router.backends.slurm.setup_lines import guarded
from slurm_router.rundir.layout import RunLayout
from slurm_router.rundir.lifecycle import EXIT_REQUEUE, EXIT_STOPPED
from slurm_router.supervise.requeue import REQUEUE_REQUEST_ENV

TEMPLATE_NAME = "array.sbatch"

# sbatch stores `"` in job names as a backtick in accounting and `|` breaks sacct --parsable2 rows:
# keep job names to characters that read back the same everywhere.
_BAD_JOB_NAME = re.compile(r'[\x00-\x1f\x7f\\"|]')
_BAD_SBATCH_VALUE = re.compile(r"[\x00-\x1f\x7f\\]")
_SBATCH_KEY = re.compile(r"^[a-z][a-z0-9-]*$")
_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_JOB_ID = re.compile(r"^[0-9]+(_[0-9]+)?$")


@dataclass(frozen=True)
class SbatchSpec:
    """Everything one sbatch array submission needs. Units are in the names."""

    job_name: str
    run_dir: str  # absolute; logs go to run_dir/logs/%A_%a.{out,err}
    array_size: int
    array_parallelism: int | None = None  # at most this many tasks at once (%P); None: no cap
    array_indices: tuple[int, ...] | None = None  # only these of 0..array_size-1 (resume=); None: all
    gpus_per_task: int = 1
    cpus_per_task: int = 1
    mem_gb: float | None = None  # per node; None: the partition default
    timeout_min: int = 60
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    signal_delay_s: int = SlurmLauncherConfig.signal_delay_s  # USR2 this long before the time limit
    requeue: bool = True
    dependency_job_id: str | None = None  # afterok on this job (all its array tasks); cancelled if it fails
    after_round_job_id: str | None = None  # seeds=auto: afterany on the round before (launch/base.py reserve_rounds)
    ntasks: int = 1  # >1: srun starts one task per GPU set (D devices -> D tasks)
    nodes: int = 1  # with ntasks > 1: spread over this many nodes, ntasks/nodes on each
    extra_sbatch: tuple[tuple[str, str], ...] = ()  # passed through as --key=value
    python: str = field(default_factory=lambda: sys.executable)
    task_argv: tuple[str, ...] = ()  # argv after the interpreter, run once per array task
    env: tuple[tuple[str, str], ...] = ()  # exported before the task runs
    setup: tuple[str, ...] = ()  # launcher.setup: the user's shell lines, run as written before the task
    pythonpath: str | None = None  # launcher.snapshot: put first on PYTHONPATH (RUN_DIR/code)
    container: ContainerSpec | None = None  # launcher.container: the task runs in this image
    mail_type: str | None = None  # --mail-type, Slurm's names comma-separated (END,FAIL)
    mail_user: str | None = None


def safe_job_name(name: str) -> str:
    """Map any string to a job name render_sbatch accepts (bad characters become '_')."""
    cleaned = _BAD_JOB_NAME.sub("_", name).strip()
    return cleaned[:200] or "slurm_router"


def _check_sbatch_value(what: str, value: str) -> str:
    if not value:
        raise ValueError(f"sbatch {what} is empty: set it or leave it unset (None)")
    bad = _BAD_SBATCH_VALUE.search(value)
    if bad:
        raise ValueError(
            f"sbatch {what} {value!r} contains {bad.group()!r}: #SBATCH lines cannot carry newlines, "
            "control characters or backslashes; rename it"
        )
    return value


def _directive(key: str, value: str | int | None = None) -> str:
    if value is None:
        return f"#SBATCH --{key}"
    return f"#SBATCH --{key}={shlex.quote(str(value))}"


def _validate(spec: SbatchSpec) -> None:
    if not spec.job_name or _BAD_JOB_NAME.search(spec.job_name) or len(spec.job_name) > 200:
        raise ValueError(
            f"job_name {spec.job_name!r} must be 1-200 characters without newlines, control characters, "
            'backslashes, double quotes or "|"; slurm_router.backends.slurm.sbatch_render.safe_job_name() makes one'
        )
    if not Path(spec.run_dir).is_absolute():
        raise ValueError(f"run_dir {spec.run_dir!r} must be an absolute path")
    _check_sbatch_value("run_dir", spec.run_dir)
    value: Any
    for name, value, low in (
        ("array_size", spec.array_size, 1),
        ("gpus_per_task", spec.gpus_per_task, 0),
        ("cpus_per_task", spec.cpus_per_task, 1),
        ("timeout_min", spec.timeout_min, 1),
        ("signal_delay_s", spec.signal_delay_s, 0),
        ("ntasks", spec.ntasks, 1),
        ("nodes", spec.nodes, 1),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name}={value!r} must be an integer >= {low}")
    if spec.array_parallelism is not None and (
        not isinstance(spec.array_parallelism, int) or spec.array_parallelism < 1
    ):
        raise ValueError(f"array_parallelism={spec.array_parallelism!r} must be an integer >= 1 or None")
    if spec.ntasks % spec.nodes:
        raise ValueError(f"ntasks={spec.ntasks} does not split evenly over nodes={spec.nodes}")
    if spec.array_indices is not None and (
        not spec.array_indices
        or any(
            not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < spec.array_size for i in spec.array_indices
        )
    ):
        raise ValueError(f"array_indices={spec.array_indices!r} must be integers in 0..{spec.array_size - 1}")
    if spec.mem_gb is not None and not (isinstance(spec.mem_gb, (int, float)) and spec.mem_gb > 0):
        raise ValueError(f"mem_gb={spec.mem_gb!r} must be a number > 0 or None")
    for name in ("partition", "account", "qos", "constraint"):
        value = getattr(spec, name)
        if value is not None:
            _check_sbatch_value(name, value)
    for name in ("dependency_job_id", "after_round_job_id"):
        value = getattr(spec, name)
        if value is not None and not _JOB_ID.match(str(value)):
            raise ValueError(f"{name}={value!r} must be a Slurm job id like 123 or 123_4")
    for key, value in spec.extra_sbatch:
        if not _SBATCH_KEY.match(key):
            raise ValueError(f"extra_sbatch key {key!r} must look like an sbatch long option name, e.g. 'nice'")
        _check_sbatch_value(f"extra_sbatch {key}", str(value))
    for key, _ in spec.env:
        if not _ENV_KEY.match(key):
            raise ValueError(f"env name {key!r} is not a valid environment variable name")
    if not spec.python:
        raise ValueError("python (the interpreter path) is empty")
    if spec.mail_type is not None:
        bad = [t for t in spec.mail_type.split(",") if t not in MAIL_TYPES]
        if bad or not spec.mail_type:
            raise ValueError(
                f"mail_type {spec.mail_type!r}: {bad[0] if bad else 'empty'!r} is not a Slurm mail "
                f"type ({', '.join(MAIL_TYPES)})"
            )
    if spec.mail_user is not None:
        _check_sbatch_value("mail_user", spec.mail_user)
    if spec.container is not None:
        spec.container.check()


def _slurm_filename(path: str) -> str:
    return path.replace("%", "%%")  # Slurm expands %A, %a, %j...; %% is a literal %


def _own_gpu_request(spec: SbatchSpec) -> bool:
    """The built-in GPU request (--gres=gpu:D, --gpus-per-task), unless the user's extra_sbatch asks for GPUs
    itself (gres, gpus, gpus-per-node, ...): theirs replaces it, never two requests."""
    return not user_gpu_request(k for k, _ in spec.extra_sbatch)


def sbatch_directives(spec: SbatchSpec) -> list[str]:
    """The #SBATCH lines for spec, in a fixed order (validated; values quoted for sbatch's parser)."""
    _validate(spec)
    logs = _slurm_filename(str(RunLayout(spec.run_dir).logs))
    array = f"0-{spec.array_size - 1}"
    if spec.array_indices is not None:
        array = ",".join(str(i) for i in sorted(set(spec.array_indices)))
    if spec.array_parallelism is not None:
        array += f"%{spec.array_parallelism}"
    lines = [_directive("job-name", spec.job_name), _directive("array", array)]
    if spec.ntasks > 1:
        lines += [
            _directive("nodes", spec.nodes),
            _directive("ntasks", spec.ntasks),
            _directive("ntasks-per-node", spec.ntasks // spec.nodes),
        ]
        if spec.gpus_per_task and _own_gpu_request(spec):
            lines.append(_directive("gpus-per-task", spec.gpus_per_task))
    elif spec.gpus_per_task and _own_gpu_request(spec):
        lines.append(_directive("gres", f"gpu:{spec.gpus_per_task}"))
    lines.append(_directive("cpus-per-task", spec.cpus_per_task))
    if spec.mem_gb is not None:
        lines.append(_directive("mem", f"{math.ceil(spec.mem_gb * 1024)}M"))
    lines.append(_directive("time", spec.timeout_min))
    for name in ("partition", "account", "qos", "constraint", "mail_type", "mail_user"):
        value = getattr(spec, name)
        if value is not None:
            lines.append(_directive(name.replace("_", "-"), value))
    # With exec the batch shell *is* the task, so signal it (B:); with srun the steps get the signal.
    target = "B:" if spec.ntasks == 1 else ""
    lines.append(_directive("signal", f"{target}USR2@{spec.signal_delay_s}"))
    lines.append(_directive("requeue" if spec.requeue else "no-requeue"))
    lines.append(_directive("open-mode", "append"))  # a requeued task appends to its own log
    lines.append(_directive("output", f"{logs}/%A_%a.out"))
    lines.append(_directive("error", f"{logs}/%A_%a.err"))
    # afterok, and cancelled by Slurm if that job fails; afterany on seeds=auto's round before
    lines += [_directive(key, value) for key, value in afterok(spec.dependency_job_id, spec.after_round_job_id).items()]
    lines += [_directive(key, value) for key, value in spec.extra_sbatch]
    return lines


def _srun(spec: SbatchSpec) -> list[str]:
    # 22.05's srun does not inherit --cpus-per-task from sbatch: repeat the per-task resources.
    # --kill-on-bad-exit=0 (also over a cluster's KillOnBadExit=1): when one worker dies, the others must live
    # long enough to see it in their next collective and record the task's end (srun_worker._peer_lost); srun
    # killing them at once raced that write. They exit by themselves right after it.
    srun = ["srun", f"--ntasks={spec.ntasks}", f"--cpus-per-task={spec.cpus_per_task}"]
    if spec.ntasks > 1:
        srun += [f"--nodes={spec.nodes}", f"--ntasks-per-node={spec.ntasks // spec.nodes}", "--kill-on-bad-exit=0"]
        if spec.gpus_per_task and _own_gpu_request(spec):
            srun.append(f"--gpus-per-task={spec.gpus_per_task}")
    return srun  # one task: the step has the job's GPUs (--gres)


def task_argv(spec: SbatchSpec) -> list[str]:
    """The words that run one array task: [srun ...] [apptainer exec ... IMAGE] python ARGV."""
    argv, c = [spec.python, *spec.task_argv], spec.container
    if c is not None and c.runtime == "apptainer":
        argv = [*c.exec_argv(), *argv]
    if c is not None and c.runtime == "pyxis":
        return [*_srun(spec), *c.srun_args(), *argv]
    return [*_srun(spec), *argv] if spec.ntasks > 1 else argv


def _in_container(spec: SbatchSpec) -> str:
    """The task as this shell's child (it stays outside the image); it passes USR2 and TERM on, and requeues
    its own array task when the task asks with the request file (requeue.request_requeue_outside)."""
    request = shlex.quote(str(RunLayout(spec.run_dir).requeue_request(""))) + '"$SLURM_JOB_ID"'
    return "\n".join(
        [
            f"# ---- the task runs in {cast(ContainerSpec, spec.container).runtime}'s image; this shell stays outside it "
            "(launcher.container) ----",
            "# Images seldom carry Slurm's client, so the task never runs scontrol in there: when its verdict is a",
            f"# requeue it writes ${REQUEUE_REQUEST_ENV} and exits {EXIT_REQUEUE}, and this shell requeues its own array "
            "task.",
            f"export {REQUEUE_REQUEST_ENV}={request}",
            f'rm -f "${REQUEUE_REQUEST_ENV}"',
            *outside_exports(srun_workers=spec.ntasks > 1),
            shlex.join(task_argv(spec)) + " &",
            "task=$!",
            "trap 'kill -USR2 \"$task\" 2>/dev/null || :' USR2",
            "trap 'kill -TERM \"$task\" 2>/dev/null || :' TERM",
            'while kill -0 "$task" 2>/dev/null; do wait "$task" || :; done     # a trapped signal interrupts wait',
            'rc=0; wait "$task" || rc=$?',
            f'if [ -e "${REQUEUE_REQUEST_ENV}" ]; then',
            f'    rm -f "${REQUEUE_REQUEST_ENV}"',
            '    scontrol requeue "${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}"',
            f"    exit {EXIT_STOPPED}",
            "fi",
            'exit "$rc"',
        ]
    )


def task_command(spec: SbatchSpec) -> str:
    """The bash that runs one array task: exec python ..., srun python ..., or, in a container, the task as a
    child of this shell (which requeues from outside). Every config-derived word is quoted."""
    if spec.container is not None:
        return _in_container(spec)
    argv = task_argv(spec)
    return shlex.join(argv) if spec.ntasks > 1 else "exec " + shlex.join(argv)


def prologue(spec: SbatchSpec) -> str:
    """What runs before `cd RUN_DIR`: launcher.setup's lines as written (in the directory the run was submitted
    from; a failing line stops the job and names itself: setup_lines.py), then the exports, quoted. Empty, or
    lines ending in a newline."""
    lines = guarded(spec.setup, spec.run_dir, ("set +u", "set -u"))  # a venv's activate may read unset names
    lines += [f"export {key}={shlex.quote(value)}" for key, value in spec.env]
    if spec.pythonpath:  # launcher.snapshot: the submitted code first
        lines.append(f'export PYTHONPATH={shlex.quote(spec.pythonpath)}"${{PYTHONPATH:+:$PYTHONPATH}}"')
    return "".join(line + "\n" for line in lines)


def _read_template(template_dir: str | Path | None) -> str:
    if template_dir is not None:
        return (Path(template_dir) / TEMPLATE_NAME).read_text()
    try:  # installed: sbatch_templates/ ships as the package slurm_router.sbatch_templates
        resource = importlib.resources.files("slurm_router.sbatch_templates").joinpath(TEMPLATE_NAME)
        if resource.is_file():
            return resource.read_text()
    except ModuleNotFoundError:
        pass
    return (Path(__file__).resolve().parents[3] / "sbatch_templates" / TEMPLATE_NAME).read_text()


def render_sbatch(spec: SbatchSpec, template_dir: str | Path | None = None) -> str:
    """Render sbatch_templates/array.sbatch for spec. Raises ValueError on values sbatch cannot carry."""
    directives = sbatch_directives(spec)
    return Template(_read_template(template_dir)).substitute(
        sbatch_directives="\n".join(directives),
        prologue=prologue(spec),
        run_dir=shlex.quote(spec.run_dir),
        signal_delay_s=spec.signal_delay_s,
        signal_target="to the batch shell" if spec.ntasks == 1 else "to the srun tasks",
        command=task_command(spec),
    )


# ---- thin I/O helpers for the sbatch launcher (everything above is pure) ------------------------


def script_path(layout: RunLayout, stage: str, last: bool, resume: int = 0, round_: int = 0) -> Path:
    """launcher=sbatch's script in the run dir: submit.sbatch for the last stage, submit-<stage>.sbatch before it;
    -round<N> for seeds=auto's reserves of replicate N; -resume<N> for the N-th resume's partial arrays."""
    suffix = (f"-round{round_}" if round_ else "") + (f"-resume{resume}" if resume else "")
    return layout.root / (f"submit{suffix}.sbatch" if last else f"submit-{stage}{suffix}.sbatch")


def write_sbatch(spec: SbatchSpec, path: str | Path | None = None, template_dir: str | Path | None = None) -> Path:
    """Render to path (default RUN_DIR/submit.sbatch) and create RUN_DIR/logs, which Slurm needs first."""
    text = render_sbatch(spec, template_dir)
    target = Path(path) if path is not None else Path(spec.run_dir) / "submit.sbatch"
    RunLayout(spec.run_dir).logs.mkdir(parents=True, exist_ok=True)
    target.write_text(text)
    return target


def submit_sbatch(script: str | Path, *extra_args: str) -> str:
    """sbatch the script; return its job id. Raises RuntimeError with sbatch's message on failure."""
    return _sbatch([*extra_args, str(script)], what=str(script))


def submit_wrapped(argv: list[str], *options: str, what: str | None = None) -> str:
    """sbatch --wrap one command (argv, not a shell line: every word is shlex-quoted); its job id."""
    return _sbatch([*options, "--wrap", shlex.join(argv)], what=what or argv[-1])


def _sbatch(args: list[str], what: str) -> str:
    return sbatch(args, what)  # retried while the controller is busy, never submitted twice
