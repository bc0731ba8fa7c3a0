"""The one event schema: JSONL, one file per worker, append-only, one line per event.

Every row carries the identity fields (run_id, task, variant, stage, attempt, device, host, policy) and an
`event` kind. Kinds and their own fields:
  micro    one per (step, device, micro-batch): step, micro, n_samples, n_tokens, n_pad_tokens, cost,
           t_start, t_data_s, t_compute_s, t_sync_wait_s, t_step_s, mem_peak_bytes, mem_total_bytes,
           mem_predicted_bytes, util, loss (this micro-batch's mean token loss), lr, oom_retries
  step     one per optimizer step (written by every worker; rank 0's is the global view): step, loss
           (global token-weighted), n_tokens, n_samples, t_step_s, lr, busy_s (this device),
           busy_s_all (every device), planned_cost (every device), speed (router's estimate, every device)
  eval     held-out loss: step, val_loss, val_tokens, batch_loss_sums, batch_tokens (per eval batch)
  start    world, device_type, device_name (the GPU model, for MFU), n_params, n_trainable_params,
           mem_total_bytes, mem_budget_bytes, pid, cuda_visible_devices, resume_from
  end / checkpoint_saved / checkpoint_loaded / requeue: task-level rows (end has exit_state)
A crash leaves at most one partial last line, which readers skip. Units are in the names (_s, _bytes).
"""
from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any, Iterator

IDENTITY = ("run_id", "task", "variant", "stage", "attempt", "device", "host", "policy")


class EventWriter:
    def __init__(self, path: str | os.PathLike, **identity: Any):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.identity = {"host": socket.gethostname(), **identity}
        self._f = open(self.path, "a", encoding="utf-8", buffering=1)   # line-buffered: a crash loses <= 1 line

    def write(self, event: str, **fields: Any) -> None:
        row = {"event": event, "time": time.time(), **self.identity, **fields}
        self._f.write(json.dumps(row, separators=(",", ":"), default=_jsonable) + "\n")

    def close(self) -> None:
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()


def _jsonable(x: Any) -> Any:
    if hasattr(x, "item"):
        return x.item()
    if hasattr(x, "tolist"):
        return x.tolist()
    raise TypeError(f"cannot write {type(x).__name__} to an event")


def read_events(path: str | os.PathLike) -> Iterator[dict]:
    """Rows of one events file; a torn last line (crash mid-write) is skipped, garbage elsewhere raises."""
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.readlines()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if n == len(lines) and not line.endswith("\n"):
                return
            raise ValueError(f"{path}:{n}: not a JSON event line") from None
        if not isinstance(row, dict) or "event" not in row:
            raise ValueError(f"{path}:{n}: not an event row (no 'event' field)")
        yield row
