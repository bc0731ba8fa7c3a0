"""The job side of Slurm (scheduler/base.py `JobEnvironment`): what a task's job process asks Slurm. Its job and
array task from SLURM_* variables; the time left from squeue; a requeue of itself (scontrol requeue); the
partition's usable nodes (sinfo), a node excluded (scontrol update), the attempts that ended NODE_FAIL (sacct);
the srun workers' ranks and their meeting point. Every command goes through the submit side's runner
(backends/slurm/commands.py): a busy controller's answers are retried there, bounded and jittered.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
from typing import Callable

from slurm_router.backends.slurm.commands import run_slurm
from slurm_router.errors import SchedulerUnavailable
from slurm_router.scheduler.base import JobEnvironment

NODE_FAIL = "NODE_FAIL"
# sinfo's node states that can take a job (a trailing * means not responding: not usable)
USABLE_STATES = frozenset(
    {"idle", "mix", "mixed", "alloc", "allocated", "comp", "completing", "resv", "reserved", "plnd", "planned"}
)
# The job's end time (epoch seconds), exported by the batch script outside a container (backends/slurm/container.py):
# inside one there is seldom a squeue to ask.
JOB_END_ENV = "SLURM_ROUTER_JOB_END_TIME"
JOB_TIMEOUT_S = 30.0  # one command from inside a job (then retried): a stop must not wait on a hung controller long


def _ignore_stop_signals() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def job_command(argv: list[str]) -> str:
    """stdout of a Slurm command run from inside a job, "" if it failed (after the retries of a busy controller).
    The command ignores SIGTERM: a requeue makes Slurm signal every process of this job, and the commands that
    follow the requeue must still end their work."""
    try:
        proc = run_slurm(argv, timeout_s=JOB_TIMEOUT_S, preexec_fn=_ignore_stop_signals)
    except (OSError, SchedulerUnavailable):
        return ""
    return proc.stdout if proc.returncode == 0 else ""


# ---------------------------------------------------------------- pure parsing


def usable(state: str) -> bool:
    """sinfo's short state (idle, mix, alloc*, drain, down*, ...) can run a job."""
    return not state.endswith("*") and state.rstrip("~#!%$@^-+").lower() in USABLE_STATES


def parse_sinfo(text: str) -> dict[str, str]:
    """`sinfo -h -N -o %N|%t` -> {node: state} (a node listed once per partition is one node)."""
    nodes = {}
    for line in text.splitlines():
        node, _, state = line.strip().partition("|")
        if node and state:
            nodes[node] = state.strip()
    return nodes


def node_fail_attempts(text: str) -> list[tuple[str, str, str, str]]:
    """`sacct -X -D -n --parsable2 --format=JOBID,State,NodeList,Start[,End]` -> (job id, node list, start, end) of
    each attempt that ended NODE_FAIL (end "" when not asked)."""
    out = []
    for line in text.splitlines():
        cols = [c.strip() for c in line.split("|")]
        if len(cols) >= 4 and cols[1].split(" ")[0] == NODE_FAIL:
            out.append((cols[0], cols[2], cols[3], cols[4] if len(cols) > 4 else ""))
    return out


def parse_node_failures(text: str) -> list[tuple[str, str]]:
    """`sacct -X -D -n --parsable2 --format=JobIDRaw,State,NodeList,Start` of one task -> (key, node) of each of
    its attempts that ended NODE_FAIL; the key (job id and start time) names the attempt once."""
    return [(f"{job}@{start}", nodes) for job, nodes, start, _ in node_fail_attempts(text)]


def parse_time_left(text: str) -> float | None:
    """squeue's %L (days-hours:minutes:seconds, parts omitted) in seconds; None for UNLIMITED or nothing."""
    m = re.fullmatch(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)", text.splitlines()[0] if text else "")
    if not m:
        return None
    d, h, mi, s = (int(x or 0) for x in m.groups())
    return ((d * 24 + h) * 60 + mi) * 60 + s


def parse_preempt_time(text: str) -> str | None:
    """PreemptTime=... of `scontrol show job -o`: the time Slurm chose the job for preemption, None if it has not."""
    m = re.search(r"\bPreemptTime=(\S+)", text)
    return m.group(1) if m and m.group(1) not in ("None", "Unknown", "(null)") else None


def tasks_per_node(text: str) -> list[int]:
    """SLURM_TASKS_PER_NODE ('2(x3),1') -> [2, 2, 2, 1]."""
    return [
        int(n)
        for part in text.split(",")
        for n in [part.split("(")[0]] * (int(part.split("(x")[1].rstrip(")")) if "(x" in part else 1)
    ]


# ---------------------------------------------------------------- the environment


class SlurmJobEnvironment(JobEnvironment):
    name = "slurm"
    restart_detail = "requeued by Slurm (preemption, node failure or scontrol requeue)"
    scheduler = "Slurm"
    node_failure = "NODE_FAIL"  # sacct's state of a job whose node failed

    def __init__(self, runner: Callable[[list[str]], str] = job_command):
        self.runner = runner

    def job_id(self) -> str | None:
        return os.environ.get("SLURM_JOB_ID") or None

    def job_ref(self) -> str | None:
        """This job as scontrol and squeue must name it: JOB_TASK inside an array. The bare SLURM_JOB_ID of one
        array task can equal the array's own id, and `scontrol requeue <array id>` requeues every task of it."""
        array, index = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
        return f"{array}_{index}" if array and index else self.job_id()

    def restart_count(self) -> int:
        return int(os.environ.get("SLURM_RESTART_COUNT") or 0)

    def array_index(self) -> int:
        return int(os.environ.get("SLURM_ARRAY_TASK_ID", "0"))

    def node(self) -> str | None:
        return os.environ.get("SLURMD_NODENAME") or socket.gethostname() or None

    def partition(self) -> str | None:
        return os.environ.get("SLURM_JOB_PARTITION") or None

    def cpus(self) -> int | None:
        value = os.environ.get("SLURM_CPUS_PER_TASK", "")
        return int(value) if value.isdigit() else None

    def time_left_s(self) -> float | None:
        """squeue %L; in a container (no squeue there), JOB_END_ENV; None when unknown or unlimited."""
        left = parse_time_left(self.runner(["squeue", "-h", "-j", str(self.job_ref()), "-o", "%L"]).strip())
        if left is not None:
            return left
        end = os.environ.get(JOB_END_ENV, "")
        return float(end) - time.time() if end.isdigit() else None

    def preempted(self) -> str | None:
        """scontrol's PreemptTime: set once Slurm picked the job for preemption (its steps got SIGTERM, GraceTime
        before the kill), while the job still reads RUNNING."""
        return parse_preempt_time(self.runner(["scontrol", "show", "job", "-o", str(self.job_ref())]))

    def requeue(self) -> None:
        argv = ["scontrol", "requeue", str(self.job_ref())]
        try:
            proc = run_slurm(argv, timeout_s=JOB_TIMEOUT_S, preexec_fn=_ignore_stop_signals)
        except SchedulerUnavailable as e:
            raise OSError(str(e)) from None
        if proc.returncode != 0:
            raise subprocess.CalledProcessError(proc.returncode, argv, proc.stdout, proc.stderr)

    def usable_nodes(self) -> dict[str, bool]:
        partition = self.partition()
        nodes = parse_sinfo(
            self.runner(["sinfo", "-h", "-N", "-o", "%N|%t", *(["-p", partition] if partition else [])])
        )
        return {node: usable(state) for node, state in nodes.items()}

    def exclude_nodes(self, nodes: list[str]) -> str | None:
        job, listed = str(self.job_ref()), ",".join(nodes)
        self.runner(["scontrol", "update", f"jobid={job}", f"ExcNodeList={listed}"])
        # scontrol update prints nothing, done or refused (the task already started again): ask Slurm
        done = f"ExcNodeList={listed}" in self.runner(["scontrol", "show", "job", job])
        return None if done else "scontrol update refused"

    def node_failures(self) -> list[tuple[str, str]]:
        if self.restart_count() <= 0:
            return []
        fields = "--format=JobIDRaw,State,NodeList,Start"
        return parse_node_failures(
            self.runner(["sacct", "-X", "-D", "-n", "--parsable2", "-j", str(self.job_ref()), fields])
        )

    # ---- srun workers (launcher.srun_workers): each srun task of the job is one worker

    def worker_rank(self) -> int | None:
        ntasks = int(os.environ.get("SLURM_NTASKS", "1"))
        return int(os.environ["SLURM_PROCID"]) if ntasks > 1 and "SLURM_PROCID" in os.environ else None

    def worker_count(self) -> int:
        return int(os.environ.get("SLURM_NTASKS", "1"))

    def _hosts(self) -> list[str]:
        return self.runner(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]]).split()

    def rendezvous(self) -> str:
        hosts = self._hosts()
        if not hosts:
            raise OSError("scontrol show hostnames named no node of this job")
        return f"{hosts[0]}:{20000 + int(os.environ['SLURM_JOB_ID']) % 20000}"

    def ranks_on(self, node: str) -> list[int]:
        """Block distribution: the ranks before `node`'s, then its own count (SLURM_TASKS_PER_NODE)."""
        try:
            hosts, counts = self._hosts(), tasks_per_node(os.environ["SLURM_TASKS_PER_NODE"])
            first = sum(counts[: hosts.index(node)])
            return list(range(first, first + counts[hosts.index(node)]))
        except (KeyError, ValueError, IndexError):
            return []


# ---------------------------------------------------------------- a container's job (backends/slurm/container.py)


def outside_exports(srun_workers: bool) -> list[str]:
    """Bash lines run outside the image before the task starts in it, for what the task would otherwise ask
    Slurm's client (which the image lacks): the job's end time (requeue.decide tells a time limit from a
    preemption by it: SlurmJobEnvironment.time_left_s) and, with launcher.srun_workers, where the D workers meet (srun_worker.srun_master)."""
    lines = [
        'job_end="$(squeue -h -j "$SLURM_JOB_ID" -o %e 2>/dev/null || :)"',  # e.g. 2024-01-01T12:00:00
        f'export {JOB_END_ENV}="$([ -n "$job_end" ] && date -d "$job_end" +%s 2>/dev/null || :)"',
    ]
    if srun_workers:
        lines += [
            'export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
            "export MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))",
        ]
    return lines
