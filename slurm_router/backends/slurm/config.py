"""The Slurm launchers' config schemas (launcher=slurm: submitit; launcher=sbatch), each a `config.schema.
LauncherConfig`; backends/slurm/__init__.py adds them to the `launcher` group when the backend loads."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from slurm_router.backends.slurm.settings import SlurmSettings


@dataclass
class ContainerConfig:
    """launcher.container: each task runs inside this image (slurm_router/backends/slurm/container.py); the job's own
    shell (sbatch) or submitit's process stays outside, and requeues from there. image=None: no container."""

    image: Optional[str] = None  # apptainer: a .sif file (or docker://..., library://...); pyxis: a name
    runtime: str = "apptainer"  # apptainer (apptainer exec --nv) | pyxis (srun --container-image)
    # more binds, SRC[:DST]; the run dir, data.path, model.name_or_path and the base cache are bound already
    mounts: List[str] = field(default_factory=list)
    runtime_cmd: str = "apptainer"  # apptainer: the program (a path, or a name on the compute node's PATH)


@dataclass
class SlurmLauncherConfig(SlurmSettings):  # its keys' declarations: backends/slurm/settings.py
    """Shared by both Slurm launchers (submitit and sbatch)."""

    partition: Optional[str] = None  # Slurm's --partition
    account: Optional[str] = None  # Slurm's --account
    qos: Optional[str] = None  # Slurm's --qos
    constraint: Optional[str] = None  # Slurm's --constraint (node features)
    timeout_min: int = 60  # each job's time limit in minutes; a task near it checkpoints and requeues
    time_limit: Optional[str] = None  # auto: each stage's --time from the run's forecast, with a margin (time_limit.py)
    mem_gb: Optional[float] = None  # memory per node in GB (null: the partition's default)
    # CPUs per Slurm task: None = cpus_per_device x the worker processes the task runs (devices_per_task x
    # tasks_per_gpu, or 1 per srun task with srun_workers: backends/slurm/common.py job_cpus); a number: as given
    cpus_per_task: Optional[int] = None
    cpus_per_device: int = 1  # CPUs per worker process (cpus_per_task=null)
    array_parallelism: int = 64  # the most array tasks running at once (Slurm's %N)
    additional_parameters: Dict[str, Any] = field(default_factory=dict)  # more #SBATCH options, e.g. {nice: 10}
    srun_workers: bool = False  # run a task's D workers as D srun tasks, one GPU each
    wait: bool = False  # return once every task AND the report job have ended
    max_requeues: int = 3  # time-limit requeues per task (slurm_router.supervise.requeue)
    signal_delay_s: int = 120  # USR2 this long before the time limit: checkpoint, then requeue
    # a task that failed for a reason not its own (a worker killed by a signal, NODE_FAIL) runs again from its
    # checkpoint, away from that node, up to this many times (slurm_router.supervise.retry)
    max_failures: int = 0
    # How the job runs (backends/slurm/container.py, launch/snapshot.py). setup: shell lines the job runs before the
    # task (module load, source a venv, export), as written: shell by design, trusted like your own sbatch
    # script, in the directory the run was submitted from; every other value here is quoted for the shell.
    setup: List[str] = field(default_factory=list)
    python: Optional[str] = None  # the task's interpreter; None: the submitter's (python3 in a container)
    container: ContainerConfig = field(default_factory=ContainerConfig)
    snapshot: bool = True  # copy the checkout's source to RUN_DIR/code/ at submission; jobs import it
    mail_type: Any = None  # Slurm's --mail-type: END,FAIL or [END, FAIL] (MAIL_TYPES)
    mail_user: Optional[str] = None  # Slurm's --mail-user (unset: Slurm mails the submitting user)


@dataclass
class SubmititLauncherConfig(SlurmLauncherConfig):
    kind: str = "slurm"


@dataclass
class SbatchLauncherConfig(SlurmLauncherConfig):
    kind: str = "sbatch"
    dry_run: bool = False  # render RUN_DIR/submit*.sbatch, submit nothing
