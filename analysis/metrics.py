"""The report's figures for one task, from its cleaned events (see load.py). Pure functions of a Task.

Definitions (they are repeated in the report's own "Definitions" section):
- tokens/s (and samples/s) and warm-up: one definition, shared with `status`, in slurm_router/rundir/throughput.py
  (real tokens of the steps after warm-up over the summed step time of those same steps); the step-time figures
  leave the same warm-up out.
- balance ratio of a step: max / mean over devices of busy_s (time from step start to the gradient sync).
  1.0 means every device finished its share together; the run's figure is the mean (and p95) over steps.
- cost balance ratio: the router's own view, max / mean of the planned cost per device (mean over steps).
- useful-token fraction: sum over steps of real tokens / sum over steps of (devices x the most padded
  tokens any one device computed in that step). Of the token slots the job paid for (every device is held
  as long as the most loaded one), the share that held real tokens; padding and imbalance both lower it.
- MFU: tokens/s x FLOPs per token / (devices x peak FLOP/s). FLOPs per token = 2N forward + 2N backward
  through the activations + 2N' for the weight gradients of the N' trainable parameters (6N for full
  training, about 4N for LoRA) + 12 x layers x width x the mean attended context (causal attention's two
  matmuls, forward and backward; analysis/matmul_peak.py). The peak: a GPU's data-sheet bf16 peak, a CPU's
  float32 matmul peak measured on the machine (matmul_peak.py).
"""

from __future__ import annotations

import math
from typing import Any, cast

import numpy as np
import pandas as pd

from slurm_router.analysis import matmul_peak
from slurm_router.analysis.load import Task, of_kind
from slurm_router.rundir import throughput as rates
from slurm_router.rundir.events import StartRow

# Dense bf16 peak FLOP/s from the vendors' data sheets (SXM parts); matched as substrings of the device name.
# Dense bf16 tensor-core peaks (FLOP/s) from the vendors' data sheets. Matched in this order against the device
# name the worker records (torch.cuda.get_device_name), so the more specific names come first.
PEAK_FLOPS = {
    "H200": 989e12,
    "H100 PCIE": 756e12,
    "H100 NVL": 835e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 70e12,
    "L4": 121e12,
    "V100": 125e12,
}
GIB = 2**30


def warmup_steps(steps: pd.DataFrame) -> int:
    return rates.warmup_steps(int(steps["step"].max()) + 1 if len(steps) else 0)


def warm(steps: pd.DataFrame) -> pd.DataFrame:
    return steps[steps["step"] >= warmup_steps(steps)] if len(steps) else steps


def losses(task: Task) -> dict:
    """The held-out losses: val_loss is the last evaluation after training began (step > 0); the step-0
    evaluation is the model before any step (the base's loss), so a task that ended before its second
    evaluation (failed, stopped) has none, only val_loss_start."""
    out: dict = {}
    trained = task.evals[task.evals["step"] > 0] if len(task.evals) else task.evals
    if len(trained):
        out["val_loss"] = float(trained["val_loss"].iloc[-1])
        out["val_loss_step"] = int(trained["step"].iloc[-1])
        out["best_val_loss"] = float(task.evals["val_loss"].min())
        out["best_val_loss_step"] = int(task.evals.loc[task.evals["val_loss"].idxmin(), "step"])
    if len(task.evals) and int(task.evals["step"].iloc[0]) == 0:
        out["val_loss_start"] = float(task.evals["val_loss"].iloc[0])
    if len(task.steps):
        tail = task.steps["loss"].iloc[-max(1, len(task.steps) // 10) :]
        out["train_loss"] = float(tail.mean())
    return out


def throughput(task: Task) -> dict:
    """tokens/s and samples/s as rundir/throughput.py defines them (status shows the same tokens/s)."""
    rows = task.steps.to_dict("records")
    return {
        "warmup_steps": warmup_steps(task.steps),
        "tokens_per_s": rates.tokens_per_s(rows),
        "samples_per_s": rates.per_s(rows, "n_samples") if "n_samples" in task.steps else None,
    }


def step_balance(busy: list[float]) -> float:
    mean = sum(busy) / len(busy)
    return max(busy) / mean if mean > 0 else 1.0


def token_slots(task: Task) -> tuple[pd.Series, pd.Series]:
    """Per step: real tokens, and devices x the most padded tokens one device computed (see the docstring)."""
    m = task.micro
    if m.empty or task.steps.empty:
        return pd.Series(dtype=float), pd.Series(dtype=float)
    per_dev = (
        pd.DataFrame(
            {
                "real": m["n_tokens"],
                "padded": m["n_tokens"] + m["n_pad_tokens"],
                "step": m["step"],
                "device": m["device"],
            }
        )
        .groupby(["step", "device"])
        .sum()
    )
    real = per_dev["real"].groupby(level="step").sum()
    return real, per_dev["padded"].groupby(level="step").max() * task.n_devices


def balance(task: Task) -> dict:
    s = task.steps
    out: dict[str, Any] = {
        "balance_ratio": None,
        "balance_ratio_p95": None,
        "cost_balance_ratio": None,
        "useful_token_fraction": None,
    }
    if s.empty:
        return out
    ratios = s["busy_s_all"].map(step_balance)
    out["balance_ratio"] = float(ratios.mean())
    out["balance_ratio_p95"] = float(np.percentile(ratios, 95))
    if "cost_balance_ratio" in s and s["cost_balance_ratio"].notna().any():
        out["cost_balance_ratio"] = float(s["cost_balance_ratio"].mean())
    real, slots = token_slots(task)
    if slots.sum() > 0:
        out["useful_token_fraction"] = float(real.sum() / slots.sum())
    return out


def per_step_table(task: Task) -> pd.DataFrame:
    """One row per step (rank 0's view, last attempt) with the per-step balance figures."""
    s = task.steps
    if s.empty:
        return pd.DataFrame()
    out = pd.DataFrame(
        {
            "task": task.name,
            "step": s["step"].astype(int),
            "attempt": s["attempt"],
            "loss": s["loss"],
            "n_tokens": s["n_tokens"],
            "t_step_s": s["t_step_s"],
            "balance_ratio": s["busy_s_all"].map(step_balance),
        }
    )
    for col in ("n_samples", "t_sync_wait_s", "cost_balance_ratio", "oom_retries", "lr"):
        if col in s:
            out[col] = s[col].to_numpy()
    out["warmup"] = out["step"] < warmup_steps(s)
    real, slots = token_slots(task)
    out["useful_token_fraction"] = out["step"].map(real / slots)
    return out.reset_index(drop=True)


def oom_retries(task: Task) -> int:
    if "oom_retries" in task.dev_steps:
        return int(task.dev_steps["oom_retries"].fillna(0).sum())
    if "oom_retries" in task.micro:
        return int(task.micro.groupby(["step", "device"])["oom_retries"].max().sum())
    return 0


def device_table(task: Task) -> pd.DataFrame:
    """Per device: its share of samples, tokens and cost, busy %, sync wait, micro-batches, OOMs, memory."""
    D = task.n_devices or 0
    if task.steps.empty or not D:
        return pd.DataFrame()
    s, ds, m = task.steps, task.dev_steps, task.micro
    step_s = float(s["t_step_s"].sum())
    busy = np.array(s["busy_s_all"].tolist(), dtype=float).sum(axis=0)
    rows = []
    for d in range(D):
        mine_m = m[m["device"] == d] if len(m) else m
        mine_s = ds[ds["device"] == d]
        row: dict[str, Any] = {"device": d}
        for col in ("n_samples", "n_tokens", "cost"):
            total = float(m[col].sum()) if col in m else 0.0
            row[f"{col.removeprefix('n_')}_share"] = float(mine_m[col].sum()) / total if total else None
        row["busy_pct"] = 100 * busy[d] / step_s if step_s and d < len(busy) else None
        if "t_sync_wait_s" in mine_s:
            row["sync_wait_s"] = float(mine_s["t_sync_wait_s"].sum())
            own = float(mine_s["t_step_s"].sum())
            row["sync_wait_pct"] = 100 * row["sync_wait_s"] / own if own else None
        if "n_micro" in s:
            row["micro_per_step"] = float(
                np.mean([nm[d] for nm in s["n_micro"] if isinstance(nm, list) and d < len(nm)] or [np.nan])
            )
        row["oom_retries"] = int(mine_s["oom_retries"].fillna(0).sum()) if "oom_retries" in mine_s else 0
        for col in ("mem_peak_bytes", "mem_predicted_bytes"):
            row[col] = float(mine_m[col].max()) if col in mine_m and mine_m[col].notna().any() else None
        budgets = (task.start or {}).get("mem_budget_bytes") or []
        row["mem_budget_bytes"] = float(budgets[d]) if d < len(budgets) else None
        row["mem_total_bytes"] = device_total_bytes(task, d)
        rows.append(row)
    return pd.DataFrame(rows)


def device_total_bytes(task: Task, device: int) -> float | None:
    ev = task.events
    starts = of_kind(ev, StartRow, device=device)
    if len(starts) and "mem_total_bytes" in starts and starts["mem_total_bytes"].notna().any():
        return float(starts["mem_total_bytes"].dropna().iloc[-1])
    return None


def step_times(task: Task) -> dict:
    if task.steps.empty:
        return {"p50": None, "p95": None, "max": None}
    w = warm(task.steps)["t_step_s"]
    return {"p50": float(w.median()), "p95": float(np.percentile(w, 95)), "max": float(w.max())}


def time_split(task: Task) -> dict:
    """Shares of all devices' step time: loading/collating data, forward+backward, waiting at the gradient
    sync (includes waiting for the slowest device), and the rest (router plan, optimizer step, telemetry)."""
    ds, m = task.dev_steps, task.micro
    total = float(ds["t_step_s"].sum()) if len(ds) else 0.0
    if not total:
        return {}
    data = float(m["t_data_s"].sum()) if "t_data_s" in m else 0.0
    compute = float(m["t_compute_s"].sum()) if "t_compute_s" in m else 0.0
    sync = float(ds["t_sync_wait_s"].sum()) if "t_sync_wait_s" in ds else 0.0
    return {
        "data": data / total,
        "compute": compute / total,
        "sync": sync / total,
        "other": max(0.0, 1 - (data + compute + sync) / total),
    }


def memory(task: Task) -> dict:
    """Predicted (router's memory model) vs observed peak, per micro-batch."""
    m = task.micro
    if m.empty or "mem_predicted_bytes" not in m or "mem_peak_bytes" not in m:
        return {}
    both = m[(m["mem_predicted_bytes"] > 0) & m["mem_peak_bytes"].notna()]
    if both.empty:
        return {}
    ratio = both["mem_peak_bytes"] / both["mem_predicted_bytes"]
    on_cpu = (task.start or {}).get("device_type") == "cpu"
    return {
        "observed_over_predicted_p50": float(ratio.median()),
        "observed_over_predicted_max": float(ratio.max()),
        "under_predicted_share": float((ratio > 1).mean()),
        "peak_bytes": float(both["mem_peak_bytes"].max()),
        "predicted_bytes_max": float(both["mem_predicted_bytes"].max()),
        "observed_is": "process RSS (CPU worker)" if on_cpu else "torch peak allocated",
    }


def device_peak(start: dict, peak_tflops: float | None = None) -> tuple[str | None, float | None, str]:
    """(device name, peak FLOP/s, how it was found): from the `device_name` the worker records in its start
    row; events written before that field existed get a model inferred from the memory size, and say so."""
    if peak_tflops:
        return "given", peak_tflops * 1e12, "--peak-tflops"
    name = start.get("device_name") or start.get("gpu_name")
    if name:
        hit = next((k for k in PEAK_FLOPS if k in str(name).upper()), None)
        return str(name), PEAK_FLOPS.get(hit) if hit else None, "start event"
    gib = (start.get("mem_total_bytes") or 0) / GIB
    if gib >= 130:
        return "H200", PEAK_FLOPS["H200"], f"assumed from {gib:.0f} GiB of device memory"
    if 75 <= gib <= 82:
        return "H100 80GB", PEAK_FLOPS["H100"], f"assumed from {gib:.0f} GiB (an A100 80GB would be 312 TFLOP/s)"
    if 38 <= gib <= 42:
        return "A100 40GB", PEAK_FLOPS["A100"], f"assumed from {gib:.0f} GiB of device memory"
    return None, None, f"unknown GPU model ({gib:.0f} GiB)"


def mfu(task: Task, tokens_per_s: float | None, peak_tflops: float | None = None) -> dict:
    """Model FLOP utilisation: tokens/s x FLOPs per token (matmul_peak.train_flops_per_token, attention included when
    the start row gives the model's shape) over devices x the peak: a GPU's data-sheet bf16 peak, a CPU's matmul
    peak measured on this machine at the worker's threads (only when the run ran here: another machine's is
    unknown), or --peak-tflops."""
    start = task.start or {}
    if not start:
        return {"mfu": None, "text": "n/a (no events)"}
    n, n_train = start.get("n_params"), start.get("n_trainable_params", start.get("n_params"))
    if not (n and tokens_per_s and task.n_devices):
        return {"mfu": None, "text": "n/a (no parameter count or throughput)"}
    mean_len = _mean_sample_tokens(task)
    flops_per_token = matmul_peak.train_flops_per_token(
        int(n),
        int(cast(int, n_train)),
        start.get("n_layer"),
        start.get("d_model"),
        (mean_len + 1) / 2 if mean_len else 0,
    )
    if start.get("device_type") == "cpu" and not peak_tflops:
        name, peak, how = _cpu_peak(start)
    else:
        name, peak, how = device_peak(start, peak_tflops)
    if not peak:
        return {"mfu": None, "flops_per_token": flops_per_token, "text": f"n/a ({how}; give --peak-tflops)"}
    value = tokens_per_s * flops_per_token / (task.n_devices * peak)
    kind = "full training, 6N" if n_train == n else "LoRA, 4N + 2N_trainable"
    kind += " + attention" if start.get("n_layer") and mean_len else ""
    return {
        "mfu": value,
        "flops_per_token": flops_per_token,
        "device": name,
        "peak_flops": peak,
        "text": f"{100 * value:.1f}% of {name} peak ({kind}; {how})",
    }


def _mean_sample_tokens(task: Task) -> float | None:
    """Real tokens per sample over the task's steps (the step rows' n_tokens / n_samples)."""
    s = task.steps
    if not len(s) or "n_tokens" not in s or "n_samples" not in s:
        return None
    samples = float(s["n_samples"].sum())
    return float(s["n_tokens"].sum()) / samples if samples > 0 else None


def _cpu_peak(start: dict) -> tuple[str | None, float | None, str]:
    """A CPU run's peak: the float32 matmul FLOP/s measured on this machine at the worker's threads, when the run
    ran on this machine (its start row's host); else unknown."""
    import platform

    if start.get("host") and start["host"] != platform.node():
        return None, None, f"CPU: its matmul peak is {start['host']}'s, not measured here"
    threads = start.get("threads")
    peak = matmul_peak.peak_flops("cpu", "float32", threads)
    where = f"{threads} thread(s)" if threads else "torch's default threads"
    return "this CPU's float32 matmul", peak, f"torch.mm measured on this machine at {where}"


def finite(x):
    """NaN and infinities become None (json.dumps would write NaN, which is not JSON and != itself)."""
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite(v) for v in x]
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x
