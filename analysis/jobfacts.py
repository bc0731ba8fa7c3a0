"""Job facts per task, in the manner of seff / jobstats: state, elapsed vs time limit, requeues, node,
allocated vs used devices, CPUs and memory; then plain advice where the numbers make it clear.

Every run: the manifest (state, elapsed_s, devices) and the events (peaks, utilisation); then what the run's
scheduler backend adds (a Slurm run's accounting: backends/slurm/jobfacts.py).
"""

from __future__ import annotations

from slurm_router.analysis.load import Task, of_kind
from slurm_router.errors import UserError
from slurm_router.rundir.events import StartRow
from slurm_router.rundir.progress import setup_failure
from slurm_router.scheduler.base import Runner
from slurm_router.scheduler.registry import run_backend
from slurm_router.scheduler.task_view import LOCAL_STATES, normalize_state


def _event_facts(task: Task) -> dict:
    """What the events tell about a task's devices: type, host, used devices, memory peak vs total, util."""
    ev, ds = task.events, task.dev_steps
    out: dict = {
        "device_type": (task.start or {}).get("device_type"),
        "node": (task.start or {}).get("host"),
        "requeues": max(0, task.attempts - 1),
    }
    if not task.micro.empty:
        used = task.micro.groupby("device")["n_samples"].sum() if "n_samples" in task.micro else None
        out["devices_used"] = int((used > 0).sum()) if used is not None else None
    if len(ds) and "mem_peak_bytes" in ds:
        out["device_mem_peak_bytes"] = float(ds["mem_peak_bytes"].max())
    starts = of_kind(ev, StartRow)
    if len(starts) and "mem_total_bytes" in starts:
        out["device_mem_total_bytes"] = float(starts["mem_total_bytes"].max())
    if len(ds) and "util" in ds and ds["util"].notna().any():
        out["util_mean"] = float(ds["util"].mean())
    return out


def job_facts(manifest: dict, tasks: list[Task], runner: Runner | None = None) -> dict[str, dict]:
    """Each task's facts from the run dir, then what the run's scheduler adds (scheduler/registry.py: its
    backend's job_facts; `runner` stands in for its commands in tests)."""
    facts = {t.name: {"source": "local", **_event_facts(t)} for t in tasks}
    f: dict | None
    for t in tasks:
        f, meta = facts[t.name], t.meta
        state = str(meta.get("state", ""))
        f["state"] = LOCAL_STATES.get(state.lower(), normalize_state(state))
        f["elapsed_s"] = meta.get("elapsed_s")
        f["exit_code"] = meta.get("exit_code")
        f["time_limit_s"] = None
        devices = meta.get("devices")
        f["devices_allocated"] = len(devices) if isinstance(devices, list) else devices
        f["node"] = f.get("node") or manifest.get("host")
        f["setup_failed"] = setup_failure(manifest.get("run_dir"), meta.get("job_id"))  # launcher.setup stopped it
        if f["state"] == "CACHED":
            f["source"] = "cache (an earlier run's result)"
    try:
        backend = run_backend(manifest)
    except UserError:  # a launcher no backend has now: what the run dir knows
        return facts
    backend.job_facts(manifest, facts, runner)
    return facts


def advice(f: dict, s: dict) -> list[str]:
    """Plain advice where the figures make it clear. f: job facts, s: the task's summary entry."""
    out = []
    on_gpu = f.get("device_type") == "cuda"
    peak, total = f.get("device_mem_peak_bytes"), f.get("device_mem_total_bytes")
    if on_gpu and peak and total and peak / total < 0.5:
        out.append(
            f"GPU memory peak {peak / total:.0%} of the allocation: "
            "co-locate variants (resources.tasks_per_gpu) or ask for a smaller GPU"
        )
    if on_gpu and f.get("util_mean") is not None and f["util_mean"] < 50:
        out.append(
            f"GPU utilisation {f['util_mean']:.0f}% on average: the steps are data-, sync- or "
            "launch-bound; a larger global batch per device keeps the GPU busier"
        )
    alloc, used = f.get("devices_allocated"), f.get("devices_used")
    if alloc and used is not None and used < alloc:
        out.append(f"{alloc - used} of {alloc} allocated devices computed no sample: ask for fewer")
    limit, elapsed = f.get("time_limit_s"), f.get("elapsed_s")
    if f.get("state") == "TIMEOUT" or (limit and elapsed and elapsed >= 0.95 * limit):
        out.append("the task hit its time limit: raise launcher.timeout_min (a requeue resumes from checkpoints)")
    elif limit and elapsed is not None and limit >= 600 and elapsed < 0.25 * limit:
        out.append(
            f"used {elapsed / limit:.0%} of the {limit // 60} min time limit: a shorter limit "
            "(launcher.timeout_min) usually starts sooner"
        )
    if f.get("cpu_efficiency") is not None and f["cpu_efficiency"] < 0.5 and (f.get("cpus_allocated") or 0) > 1:
        out.append(f"CPU efficiency {f['cpu_efficiency']:.0%} of {f['cpus_allocated']} CPUs: ask for fewer")
    rss, mem = f.get("mem_max_rss_bytes"), f.get("mem_allocated_bytes")
    if rss and mem and rss / mem < 0.25:
        out.append(f"host memory peak {rss / mem:.0%} of the {mem / 2**30:.0f} GiB asked: ask for less")
    if f.get("requeues"):
        out.append(f"requeued {f['requeues']} time(s): steps redone after a requeue are counted once (last attempt)")
    for lost in f.get("lost_nodes") or []:
        out.append(f"lost node {lost}; the task was requeued")
    if (s.get("balance_ratio") or 1) > 1.15 and (s.get("devices") or 1) > 1:
        hint = "try router=balanced" if s.get("policy") != "balanced" else "check for a slow or shared device"
        out.append(f"devices wait for the slowest (balance ratio {s['balance_ratio']:.2f}): {hint}")
    sync = (s.get("time_split") or {}).get("sync")
    if sync is not None and sync > 0.3 and (s.get("devices") or 1) > 1:
        out.append(
            f"{sync:.0%} of device time waits at the gradient sync: fewer devices or a larger global batch per step"
        )
    if s.get("oom_retries"):
        out.append(
            f"{s['oom_retries']} out-of-memory retries: the memory model under-predicted; each retry "
            "costs a forward pass (a lower router.memory_headroom avoids them)"
        )
    out += memory_advice(s.get("memory") or {}, f.get("device_type"))
    if s.get("useful_token_fraction") is not None and s["useful_token_fraction"] < 0.7:
        out.append(
            f"only {s['useful_token_fraction']:.0%} of the token slots paid for held real tokens "
            "(padding and imbalance): router=affinity or balanced groups similar lengths"
        )
    return out


MEMORY_OFF = 2.0  # the memory model is flagged when observed / predicted is beyond this factor either way


def memory_advice(mem: dict, device_type: str | None) -> list[str]:
    """A memory model off by more than MEMORY_OFF x (metrics.memory: observed / predicted peak per micro-batch),
    and why. On a CPU worker the observed figure is the whole process's resident set (the interpreter, torch's
    libraries, the corpus, allocator caches), most of it there before the first micro-batch; a prior counting
    only tensors under-predicted the first micro-batches ~7x until the online refit, so a CPU worker seeds the
    model's fixed term with its RSS at start-up (worker/setup.py). On CUDA the observed figure is torch's peak
    allocated, the quantity the model predicts: an error there is the model's."""
    if not mem:
        return []
    p50, top = mem["observed_over_predicted_p50"], mem["observed_over_predicted_max"]
    if max(top, p50) <= MEMORY_OFF and p50 >= 1 / MEMORY_OFF:
        return []
    off = f"{p50:.1f}x" + (f" (up to {top:.0f}x)" if top > MEMORY_OFF else "")
    under = f"under-predicted in {mem['under_predicted_share']:.0%} of micro-batches"
    if device_type == "cpu":
        return [
            f"memory model off by more than {MEMORY_OFF:g}x: observed / predicted peak {off}, {under}; on CPU the "
            f"observed peak is the worker's whole RSS ({mem['peak_bytes'] / 2**30:.2f} GiB: interpreter, torch, "
            f"corpus, allocator caches) and the prediction its tensors plus the RSS at start-up "
            f"({mem['predicted_bytes_max'] / 2**30:.2f} GiB at most): RSS that grew after start-up, or events "
            "from a version whose prior counted tensors only; no budget is at risk on CPU unless "
            "a test sets one (SLURM_ROUTER_TEST_CPU_MEMORY_CAP_BYTES)"
        ]
    return [
        f"memory model off by more than {MEMORY_OFF:g}x: observed / predicted peak {off}, {under}: "
        + (
            "it refits online; if OOM retries follow, lower router.memory_headroom"
            if p50 > 1
            else "it over-predicts, so micro-batches are smaller than they could be (raise router.memory_headroom)"
        )
    ]
