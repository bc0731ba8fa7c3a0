"""A Slurm run's job facts for the report (analysis/jobfacts.py asks through the run's backend): sacct's elapsed,
state, exit code and resources of each task (squeue too: a report job that starts as soon as the stage it waits on
has ended may ask before slurmdbd has recorded that end)."""

from __future__ import annotations

import re
import shutil
import sys

from slurm_router.backends.slurm.commands import run_command
from slurm_router.backends.slurm.lost_nodes import lost_nodes
from slurm_router.backends.slurm.parse import expected_jobs, merge_status, parse_duration
from slurm_router.backends.slurm.queries import in_slurm, job_ids, query_slurm
from slurm_router.errors import SchedulerUnavailable
from slurm_router.scheduler.base import Runner

RESOURCE_FIELDS = ("JobID", "Timelimit", "AllocTRES", "NCPUS", "TotalCPU", "MaxRSS", "ReqMem")
UNITS = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40, "P": 2**50}


def parse_size(text: str) -> float | None:
    """Slurm sizes ('1000M', '16G', '123456K', '4Gn', '0') -> bytes; '' -> None."""
    m = re.fullmatch(r"([\d.]+)([KMGTP]?)[nc]?", text.strip())
    return float(m.group(1)) * UNITS.get(m.group(2), 1) if m else None


def parse_cpu_time(text: str) -> float | None:
    """TotalCPU ('00:06.580', '01:02:03', '1-02:03:04.5') -> seconds."""
    whole, _, frac = text.strip().partition(".")
    seconds = parse_duration(whole)
    return None if seconds is None else seconds + (float(f"0.{frac}") if frac.isdigit() else 0.0)


def parse_tres(text: str) -> dict:
    """AllocTRES 'billing=1,cpu=4,gres/gpu=2,mem=16G,node=1' -> {cpu: 4, gpu: 2, mem_bytes: ..., node: 1}."""
    out: dict = {}
    typed = 0
    for item in text.split(","):
        key, _, value = item.partition("=")
        if key == "cpu" or key == "node":
            out[key] = int(value) if value.isdigit() else None
        elif key == "mem":
            out["mem_bytes"] = parse_size(value)
        elif key == "gres/gpu" and value.isdigit():
            out["gpu"] = int(value)
        elif key.startswith("gres/gpu:") and value.isdigit():  # typed: gres/gpu:h100=2 (beside gres/gpu=2)
            out["gpu_type"] = key.split(":", 1)[1]
            typed += int(value)
    if "gpu" not in out and typed:
        out["gpu"] = typed
    return out


def parse_sacct_resources(text: str) -> dict[str, dict]:
    """`sacct -n --parsable2 --format=JobID,Timelimit,AllocTRES,NCPUS,TotalCPU,MaxRSS,ReqMem` (with steps) ->
    per task id: time limit, allocation, CPU time; MaxRSS is the largest over the task's steps (.batch, .0)."""
    out: dict[str, dict] = {}
    for line in text.splitlines():
        cols = line.split("|")
        if len(cols) < len(RESOURCE_FIELDS):
            continue
        job, limit, tres, ncpus, total_cpu, max_rss, req_mem = (c.strip() for c in cols[: len(RESOURCE_FIELDS)])
        key, _, step = job.partition(".")
        row = out.setdefault(key, {})
        if not step:
            row.update(
                time_limit_s=parse_duration(limit),
                alloc=parse_tres(tres),
                req_mem_bytes=parse_size(req_mem),
                ncpus=int(ncpus) if ncpus.isdigit() else None,
                total_cpu_s=parse_cpu_time(total_cpu),
            )
        rss = parse_size(max_rss) if max_rss else None
        if rss is not None:
            row["max_rss_bytes"] = max(rss, row.get("max_rss_bytes") or 0)
    return out


def sacct_facts(manifest: dict, facts: dict[str, dict], runner: Runner | None = None) -> None:
    """Add sacct's (and squeue's) facts of each task to `facts` (task name -> the run dir's facts)."""
    ids = job_ids(manifest)
    if not ids or not in_slurm(manifest) or (runner is None and not shutil.which("sacct")):
        return
    runner = runner or run_command
    # squeue too: a report job that starts as soon as the stage it waits on has ended (afterany) may ask before
    # slurmdbd has recorded that end, or a cancelled stage at all; squeue holds them for MinJobAge
    try:
        states = merge_status(manifest, *query_slurm(",".join(ids), runner, expect=expected_jobs(manifest)))
        resources = parse_sacct_resources(
            runner(["sacct", "-n", "--parsable2", "-j", ",".join(ids), "--format=" + ",".join(RESOURCE_FIELDS)])
        )
    except SchedulerUnavailable as e:  # the controller never answered: the report says what the run dir knows
        print(f"warning: the report's job facts come from the run dir: {e.what}", file=sys.stderr)
        return
    for st in states:
        f = facts.get(st.variant)
        if f is None or st.state == "CACHED":  # a cached task was never submitted: nothing in sacct
            continue
        f.update(
            source="sacct",
            job_id=st.job_id,
            state=st.state,
            elapsed_s=st.elapsed_s,
            exit_code=st.exit_code,
            reason=st.reason or None,
            requeues=max(st.requeues, f.get("requeues") or 0),
            node=st.node or f.get("node"),
        )
        res = resources.get(st.job_id, {})
        alloc = res.get("alloc", {})
        f["time_limit_s"] = res.get("time_limit_s")
        f["cpus_allocated"] = alloc.get("cpu") or res.get("ncpus")
        f["mem_allocated_bytes"] = alloc.get("mem_bytes") or res.get("req_mem_bytes")
        f["mem_max_rss_bytes"] = res.get("max_rss_bytes")
        if alloc.get("gpu"):
            f["devices_allocated"] = alloc["gpu"]
        if res.get("total_cpu_s") is not None and st.elapsed_s and f["cpus_allocated"]:
            f["cpu_efficiency"] = res["total_cpu_s"] / (st.elapsed_s * f["cpus_allocated"])
    requeued = {st.job_id: st.variant for st in states if st.requeues and st.variant in facts}
    try:
        for job, lines in lost_nodes(sorted(requeued), runner).items():
            facts[requeued[job]]["lost_nodes"] = lines
    except SchedulerUnavailable as e:
        print(f"warning: the report cannot say which node a requeued task lost: {e.what}", file=sys.stderr)
