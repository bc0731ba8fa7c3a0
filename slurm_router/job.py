"""The submitted callable: runs one task spec (one variant, D devices) by starting one worker per device.

    python -m slurm_router.job runs/lora_ab/<timestamp>/tasks/r8/task.json
    python -m slurm_router.job --run-dir RUN_DIR --stage variants      # in an sbatch array task

Locally the launcher runs this as a subprocess with CUDA_VISIBLE_DEVICES pinned to the task's GPUs; under
Slurm submitit calls run_task() in the array task, where Slurm has already set CUDA_VISIBLE_DEVICES. With
launcher.srun_workers each of the D srun tasks is one worker (rank = SLURM_PROCID) and they meet at
MASTER_ADDR:MASTER_PORT (default: the job's first node, a port derived from the job id), so a task can
span nodes.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
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


def _srun_master() -> str:
    if os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
        return f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    nodes = subprocess.run(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]],
                           capture_output=True, text=True, check=True).stdout.split()
    return f"{nodes[0]}:{20000 + int(os.environ['SLURM_JOB_ID']) % 20000}"


def run_task(task_file: str) -> dict | None:
    """Train one task to the end; returns its result (held-out loss, ...). Raises if a worker failed."""
    from slurm_router.plan import TaskSpec
    spec = TaskSpec.load(task_file)
    ntasks = int(os.environ.get("SLURM_NTASKS", "1"))
    if ntasks > 1 and "SLURM_PROCID" in os.environ:      # srun_workers: this process is one worker
        if ntasks != spec.devices:
            raise RuntimeError(f"{ntasks} srun tasks for a task of {spec.devices} devices")
        rank = int(os.environ["SLURM_PROCID"])
        _worker_entry(rank, spec.to_json(), ntasks, _srun_master())
        return json.loads((spec.task_dir / RESULT_FILE).read_text()) if rank == 0 else None
    import torch.multiprocessing as mp
    (spec.task_dir / RESULT_FILE).unlink(missing_ok=True)
    master = f"127.0.0.1:{free_port()}"
    mp.start_processes(_worker_entry, args=(spec.to_json(), spec.devices, master), nprocs=spec.devices,
                       join=True, start_method="spawn")
    return json.loads((spec.task_dir / RESULT_FILE).read_text())


def stage_task_file(run_dir: str, stage: str, index: int) -> str:
    manifest = json.loads((Path(run_dir) / "manifest.json").read_text())
    names = next(s["tasks"] for s in manifest["stages"] if s["name"] == stage)
    return str(Path(run_dir) / "tasks" / names[index] / "task.json")


def write_report_job(run_dir: str) -> dict:
    """The last job of a Slurm run: the report, once every stage has ended (afterany)."""
    from slurm_router.analysis.report import write_report
    return write_report(Path(run_dir))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 4 and argv[0] == "--run-dir" and argv[2] == "--stage":
        task_file = stage_task_file(argv[1], argv[3], int(os.environ.get("SLURM_ARRAY_TASK_ID", "0")))
    elif len(argv) == 1 and Path(argv[0]).is_file():
        task_file = argv[0]
    else:
        print("usage: python -m slurm_router.job RUN_DIR/tasks/NAME/task.json | --run-dir RUN_DIR --stage NAME",
              file=sys.stderr)
        return 2
    result = run_task(task_file)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
