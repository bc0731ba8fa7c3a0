"""Every Slurm command the toolkit runs (sbatch, squeue, sacct, scontrol, scancel) goes through `run_slurm`: on a
busy cluster the controller answers "Socket timed out on send/recv operation" or "Unable to contact slurm
controller" (exit 1) for a while, and a user's command must ride that out rather than fail or, worse, be read as
a refusal. Such an answer is retried with bounded, jittered backoff, each retry said in one line on stderr; past
the limit, SchedulerUnavailable names the command, its error and what to do (exit 75, EX_TEMPFAIL: not exit 2,
which says the user made a mistake).

A submission is never doubled by a retry: each sbatch carries a unique --comment, and before sbatch is run again
after a transient error, squeue is asked whether a job with that comment exists (the controller may have queued
it and timed out on the reply). submitit's own sbatch call comes here too (`python -m
slurm_router.backends.slurm.commands sbatch FILE`, backends/slurm/submitit_launcher.py).

The limits are a site's to set, for every user at once (a module file): SLURM_ROUTER_SLURM_TRIES (default 5 tries),
SLURM_ROUTER_SLURM_RETRY_S (the first wait, doubled each retry up to MAX_RETRY_WAIT_S; default 2), and the floor on
the interval between two polls of a run's jobs, SLURM_ROUTER_POLL_MIN_S (default 2).
"""

from __future__ import annotations

import getpass
import os
import random
import re
import shlex
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from slurm_router.errors import SchedulerUnavailable

# What a loaded or restarting controller answers (Slurm 22.05's slurm_strerror texts); anything else is an answer.
TRANSIENT = re.compile(
    r"Socket timed out on send/recv operation|Unable to contact slurm controller|"
    r"Slurm backup controller in standby mode|Zero Bytes were transmitted or received|"
    r"Transport endpoint is not connected|Connection refused|Communication connection failure|"
    r"no answer in \d+ s",
    re.IGNORECASE,
)
COMMAND_TIMEOUT_S = 120.0  # a command that hangs this long is a controller that does not answer: retried too
MAX_RETRY_WAIT_S = 60.0
EXIT_UNAVAILABLE = 75  # EX_TEMPFAIL: try again later
TRIES_ENV, RETRY_S_ENV = "SLURM_ROUTER_SLURM_TRIES", "SLURM_ROUTER_SLURM_RETRY_S"
# The shortest wait between two polls of a run's jobs (status --wait/--follow, launcher.wait, the report job's
# wait): each poll is one squeue and at most one sacct for all of them (backends/slurm/queries.py)
POLL_MIN_ENV, POLL_MIN_S = "SLURM_ROUTER_POLL_MIN_S", 2.0
# submitit's sbatch runs in a child process (below): its retry lines are appended here for the parent to print
SAY_FILE_ENV = "SLURM_ROUTER_SLURM_SAY_FILE"
COMMENT_PREFIX = "slurm_router:"
CONTROLLER_UP = "`scontrol ping` says UP"  # how a user sees the controller is back (SchedulerUnavailable.back)


@dataclass(frozen=True)
class Retry:
    tries: int = 5
    first_s: float = 2.0

    @classmethod
    def from_env(cls) -> Retry:
        try:
            tries = max(1, int(os.environ.get(TRIES_ENV, cls.tries)))
            first_s = max(0.0, float(os.environ.get(RETRY_S_ENV, cls.first_s)))
        except ValueError:
            return cls()
        return cls(tries, first_s)

    def wait_s(self, retry: int) -> float:
        """The wait before retry number `retry` (1, 2, ...): doubled each time, capped, with jitter so that the
        many clients of one slow controller do not all come back at the same instant."""
        return min(MAX_RETRY_WAIT_S, self.first_s * 2 ** (retry - 1)) * random.uniform(0.5, 1.0)


def poll_floor_s() -> float:
    try:
        return max(0.0, float(os.environ.get(POLL_MIN_ENV, POLL_MIN_S)))
    except ValueError:
        return POLL_MIN_S


def say(line: str) -> None:
    path = os.environ.get(SAY_FILE_ENV)
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")
    print(line, file=sys.stderr, flush=True)


def transient(proc: subprocess.CompletedProcess) -> str | None:
    """The controller's busy answer in a failed command's output (its words), else None."""
    if proc.returncode == 0:
        return None
    found = TRANSIENT.search(f"{proc.stderr}\n{proc.stdout}")
    return found.group(0) if found else None


def _once(argv: list[str], timeout_s: float, preexec_fn=None) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout_s, check=False, preexec_fn=preexec_fn
        )
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(argv, 1, "", f"{argv[0]}: no answer in {timeout_s:.0f} s")


def run_slurm(
    argv: list[str],
    retry: Retry | None = None,
    timeout_s: float = COMMAND_TIMEOUT_S,
    before_retry=None,
    preexec_fn=None,
) -> subprocess.CompletedProcess:
    """Run a Slurm command; its result once it is not the controller's busy answer (the caller reads a refusal or
    an empty answer as before). before_retry(proc) runs before each retry and may return a result instead (an
    sbatch that did submit); preexec_fn runs in the child (the job side's: stop signals ignored). FileNotFoundError
    when the command is not installed."""
    retry = retry or Retry.from_env()
    start = time.monotonic()
    for attempt in range(1, retry.tries + 1):
        proc = _once(argv, timeout_s, preexec_fn)
        error = transient(proc)
        if error is None:
            return proc
        found = before_retry(proc) if before_retry is not None else None
        if found is not None:
            return found
        if attempt == retry.tries:
            break
        wait = retry.wait_s(attempt)
        say(f"{argv[0]}: {error}: the controller is busy; try {attempt + 1} of {retry.tries} in {wait:.1f} s")
        time.sleep(wait)
    raise SchedulerUnavailable(
        f"{argv[0]} failed {retry.tries} time(s) over {time.monotonic() - start:.0f} s ({error}): "
        "the Slurm controller is down or overloaded",
        back=CONTROLLER_UP,
    )


def run_command(argv: list[str]) -> str:
    """stdout of a Slurm query, "" when it fails or is not installed (a purged job makes squeue exit 1); the
    controller's busy answers are retried (SchedulerUnavailable past the limit)."""
    try:
        proc = run_slurm(argv)
    except FileNotFoundError:
        return ""
    return proc.stdout if proc.returncode == 0 else ""


def submitted_with(comment: str) -> str | None:
    """The job id of this user's job carrying `comment` (squeue -t all holds a job queued seconds ago), or None."""
    out = run_command(["squeue", "-h", "-t", "all", "-u", getpass.getuser(), "-o", "%F|%k"])
    for line in out.splitlines():
        job, _, text = line.partition("|")
        if text.strip() == comment:
            return job.strip()
    return None


def script_comment(script: str) -> str | None:
    """The user's own `#SBATCH --comment` in the script sbatch is given (launcher.additional_parameters), if any:
    the command line's --comment replaces it, so it is carried in ours."""
    found = re.search(r"^#SBATCH --comment[= ](.+)$", script, re.MULTILINE)
    if not found:
        return None
    try:
        return " ".join(shlex.split(found.group(1)))
    except ValueError:
        return found.group(1).strip()


def _script(args: list[str]) -> str:
    try:
        return Path(args[-1]).read_text() if args else ""
    except (OSError, ValueError):
        return ""


def _array_indices(spec: str) -> list[int]:
    """The indices of an --array spec: '0-2%3' -> [0, 1, 2], '1,4-8:2' -> [1, 4, 6, 8]."""
    out: list[int] = []
    for item in spec.split("%")[0].split(","):
        span, _, step = item.partition(":")
        first, _, last = span.partition("-")
        out += range(int(first), int(last or first) + 1, int(step or 1))
    return out


def log_folders(script: str) -> list[str]:
    """The folders of a script's #SBATCH --output/--error paths that name the job (%j, %A, %a): submitit's
    logs/%j/ is made only after sbatch returns, and a job that starts first (an idle cluster starts it in
    milliseconds) cannot open its output and fails (signal 53). Such a job is submitted held, its folders made,
    then released (sbatch below). [] when the script holds itself or names no such folder."""
    if re.search(r"^#SBATCH\s+(--hold|-H)\b", script, re.MULTILINE):
        return []
    paths = re.findall(r"^#SBATCH\s+(?:--output|--error)[= ]\s*(\S+)", script, re.MULTILINE)
    return sorted({os.path.dirname(p.strip("'\"")) for p in paths if "%" in os.path.dirname(p)})


def expand_folders(folders: list[str], script: str, job: str) -> list[Path]:
    """log_folders' templates for job `job` (every array index; %j of an array task is unknown: left out)."""
    found = re.search(r"^#SBATCH\s+--array[= ]\s*(\S+)", script, re.MULTILINE)
    indices = _array_indices(found.group(1)) if found else []
    out = []
    for f in folders:
        if found and "%j" in f:
            continue
        names = [f.replace("%A", job).replace("%a", str(i)) for i in indices] if found else [f.replace("%j", job)]
        out += [Path(n) for n in names if "%" not in n]
    return out


def sbatch(args: list[str], what: str) -> str:
    """sbatch --parsable ARGS (once, however often the controller times out); the job id. RuntimeError with
    sbatch's message when Slurm refuses the job."""
    script = _script(args)
    theirs = script_comment(script)
    comment = f"{theirs + ' ' if theirs else ''}{COMMENT_PREFIX}{uuid.uuid4().hex[:16]}"
    folders = log_folders(script)
    argv = ["sbatch", "--parsable", f"--comment={comment}", *(["--hold"] if folders else []), *args]

    def already_queued(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess | None:
        job = submitted_with(comment)
        if job is None:
            return None
        say(f"sbatch: {transient(proc)}, but job {job} was queued (found by its comment): not submitting it again")
        return subprocess.CompletedProcess(argv, 0, f"{job}\n", "")

    proc = run_slurm(argv, before_retry=already_queued)
    if proc.returncode != 0:
        raise RuntimeError(f"sbatch {what} failed (exit {proc.returncode}): {proc.stderr.strip()}")
    job = proc.stdout.strip().split(";")[0]  # --parsable prints "jobid[;cluster]"
    if folders:
        for folder in expand_folders(folders, script, job):
            folder.mkdir(parents=True, exist_ok=True)
        released = run_slurm(["scontrol", "release", job])
        if released.returncode != 0:
            raise RuntimeError(
                f"sbatch {what}: job {job} was queued held and could not be released: {released.stderr.strip()} "
                f"(scontrol release {job} starts it)"
            )
    return job


def main(argv: list[str]) -> int:
    """`python -m slurm_router.backends.slurm.commands sbatch [OPTIONS] FILE`: submitit's sbatch (it reads
    'Submitted batch job N'); a refusal is sbatch's own stderr and exit code, an unreachable controller exit 75."""
    if not argv or argv[0] != "sbatch":
        print("usage: python -m slurm_router.backends.slurm.commands sbatch [OPTIONS] FILE", file=sys.stderr)
        return 2
    try:
        job = sbatch(argv[1:], what=argv[-1])
    except RuntimeError as e:
        print(str(e).split(": ", 1)[-1], file=sys.stderr)
        return 1
    except SchedulerUnavailable as e:
        print(f"{UNAVAILABLE_MARK}{e}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    print(f"Submitted batch job {job}")
    return 0


UNAVAILABLE_MARK = "slurm_router unavailable: "  # how the parent tells the controller's absence from a refusal


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
