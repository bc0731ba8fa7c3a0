"""launcher.setup under both Slurm launchers: the user's own shell lines, run as written before the task (module
load, source a venv), and a line that fails stops the job naming itself (docs/design/jobs.md, "How a Slurm job
runs").

The lines stay exactly as written (a construct may span several: `if ...; then`, `fi`); between them the job notes
which one runs next, and an EXIT trap set around them says, if the shell ends during setup (a failing command under
`set -e`, or an `exit N`), which line and with what exit code, in the job's stdout and stderr logs and in
RUN_DIR/logs/setup-failed.<job id> (one line), which `status` and the report read: "setup failed: launcher.setup
line 1 (exit 3) failed with exit code 3" instead of a task "failed after 0 steps". A later attempt whose setup
passes removes that file. An EXIT trap the user's own lines set is left in place.
"""

from __future__ import annotations

import shlex

from slurm_router.rundir.layout import RunLayout

LINE_VAR = "_slurm_router_setup_line"  # the setup line running now (1-based); 0 once setup has passed
REPORT_FN = "_slurm_router_setup_failed"
TEXT_CHARS = 200  # a setup line quoted in a message: its first characters, on one line
# the job's own id: JOB_INDEX for an array task (as the manifest records it), else the job id
JOB_ID = "${SLURM_ARRAY_TASK_ID:+${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}}"
JOB_ID_FALLBACK = "${SLURM_JOB_ID:-nojob}"


def quoted_text(line: str) -> str:
    """A setup line as a message quotes it: on one line, at most TEXT_CHARS characters."""
    text = " ".join(line.split())
    return text if len(text) <= TEXT_CHARS else text[: TEXT_CHARS - 3] + "..."


def _continues(line: str) -> bool:
    """The line's text runs on into the next one (a trailing backslash, or a here-document it opens): nothing may
    be inserted after it."""
    return line.rstrip().endswith("\\") or "<<" in line.replace("<<<", "")


def guarded(lines, run_dir: str, around: tuple[str, str] = ("", "")) -> list[str]:
    """The bash that runs `lines` as written, naming the one that fails. `around`: shell options set before the
    lines and after them (the sbatch script runs with -u, which a venv's activate may trip: ("set +u", "set -u");
    submitit's script has no -e: ("set -e", "set +e"), so a failing line stops the job there too). [] for none."""
    lines = [str(line) for line in lines or ()]
    if not lines:
        return []
    marker = shlex.quote(str(RunLayout(run_dir).setup_failed(""))) + '"$_slurm_router_job"'
    texts = " ".join(shlex.quote(quoted_text(line)) for line in lines)
    out = [
        "# ---- launcher.setup: your own shell lines, run as written (trusted, like a hand-written sbatch",
        "# script); a line that fails stops the job, and the job's logs (and RUN_DIR/logs/setup-failed.<job id>)",
        "# say which line and with what exit code ----",
        f'_slurm_router_job="{JOB_ID}"; _slurm_router_job="${{_slurm_router_job:-{JOB_ID_FALLBACK}}}"',
        f"_slurm_router_setup_texts=({texts})",
        f"{REPORT_FN}() {{",
        f'    local rc="$1" n="${{{LINE_VAR}:-0}}"',
        '    [ "$n" -gt 0 ] || return 0',
        '    local what="launcher.setup line $n (${_slurm_router_setup_texts[$((n - 1))]}) failed with exit code $rc"',
        "    printf 'slurm_router: %s, before the task started\\n' \"$what\"",
        "    printf 'slurm_router: %s, before the task started\\n' \"$what\" >&2",
        f"    printf '%s\\n' \"$what\" > {marker} 2>/dev/null || :",
        "}",
        f"trap '{REPORT_FN} \"$?\"' EXIT",
        '_slurm_router_trap="$(trap -p EXIT)"',
    ]
    if around[0]:
        out.append(around[0])
    for i, line in enumerate(lines, 1):
        if i == 1 or not _continues(lines[i - 2]):
            out.append(f"{LINE_VAR}={i}")
        out.append(line)
    if around[1]:
        out.append(around[1])
    out += [
        f"{LINE_VAR}=0",
        '[ "$(trap -p EXIT)" != "$_slurm_router_trap" ] || trap - EXIT      # an EXIT trap of your own stays',
        f"rm -f {marker}",
        "# ---- end of launcher.setup ----",
    ]
    return out
