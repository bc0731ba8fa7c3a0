"""The submitted callable: runs one task spec (one variant, D devices) by starting one worker per device.

    python -m slurm_router.job runs/lora_ab/<timestamp>/tasks/r8/task.json

Locally the launcher runs this as a subprocess with CUDA_VISIBLE_DEVICES pinned to the task's GPUs; under
Slurm submitit calls run_task() in the array task, where Slurm has already set CUDA_VISIBLE_DEVICES.
"""
from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

RESULT_FILE = "result.json"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_entry(rank: int, spec_json: str, world: int, master: str) -> None:
    from slurm_router.checkpoint import atomic_write_text
    from slurm_router.plan import TaskSpec
    from slurm_router.worker import train
    spec = TaskSpec(**json.loads(spec_json))
    result = train(spec, rank, world, master)
    if rank == 0 and result is not None:
        atomic_write_text(spec.task_dir / RESULT_FILE, json.dumps(result, indent=1))


def run_task(task_file: str) -> dict:
    """Train one task to the end; returns its result (held-out loss, ...). Raises if a worker failed."""
    import torch.multiprocessing as mp
    from slurm_router.plan import TaskSpec
    spec = TaskSpec.load(task_file)
    (spec.task_dir / RESULT_FILE).unlink(missing_ok=True)
    master = f"127.0.0.1:{free_port()}"
    mp.start_processes(_worker_entry, args=(spec.to_json(), spec.devices, master), nprocs=spec.devices,
                       join=True, start_method="spawn")
    return json.loads((spec.task_dir / RESULT_FILE).read_text())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or not Path(argv[0]).is_file():
        print("usage: python -m slurm_router.job RUN_DIR/tasks/NAME/task.json", file=sys.stderr)
        return 2
    result = run_task(argv[0])
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
