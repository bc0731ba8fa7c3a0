"""The Slurm launchers' keys (launcher=slurm, launcher=sbatch), declared as the config's own are
(config/settings.py): who reads each, its bounds, the condition it is read under; and their checks beyond that
(mail types, the container). `SlurmSettings` is the hook their schema (backends/slurm/config.py) takes: the
config check, the unread rules, --help and docs/reference.md read it through the launcher schema."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from slurm_router.config.schema import LauncherConfig, launcher_setting
from slurm_router.config.settings import Condition, Setting
from slurm_router.errors import UserError

SLURM, SBATCH = "backends/slurm/submitit_launcher.py", "backends/slurm/sbatch_launcher.py"
COMMON, CONTAINER = "backends/slurm/common.py", "backends/slurm/container.py"
TIME_LIMIT = "backends/slurm/time_limit.py"

# Slurm's --mail-type names (sbatch(1), 22.05 on); a list is comma-separated
MAIL_TYPES = (
    "NONE",
    "BEGIN",
    "END",
    "FAIL",
    "REQUEUE",
    "ALL",
    "INVALID_DEPEND",
    "STAGE_OUT",
    "TIME_LIMIT",
    "TIME_LIMIT_90",
    "TIME_LIMIT_80",
    "TIME_LIMIT_50",
    "ARRAY_TASKS",
)
CONTAINER_RUNTIMES = ("apptainer", "pyxis")

CPUS_PER_DEVICE = Condition(
    lambda c: c.launcher.get("cpus_per_task") is None,
    lambda c: f"with launcher.cpus_per_task={c.launcher.get('cpus_per_task')} (the CPUs per task, as given)",
    "drop one of the two",
    off=("launcher=sbatch", "launcher.cpus_per_task=2"),
    on=("launcher=sbatch",),
)
MAIL = Condition(
    lambda c: bool(c.launcher.get("mail_type")),
    lambda c: "without launcher.mail_type (Slurm sends no mail)",
    "set launcher.mail_type=END,FAIL, or drop it",
    off=("launcher=sbatch",),
    on=("launcher=sbatch", "launcher.mail_type=END"),
)


def _each(code_slurm: str, code_sbatch: str) -> dict[str, str]:
    """Each launcher reads the key in its own module."""
    return {"slurm": f"{SLURM}: {code_slurm}", "sbatch": f"{SBATCH}: {code_sbatch}"}


# launcher.NAME -> its declaration (the fields and their help lines: backends/slurm/config.py)
SETTINGS: dict[str, Setting] = {
    "partition": Setting(reader=_each('"partition", "account"', "partition=lc.partition")),
    "account": Setting(reader=_each('"partition", "account"', "account=lc.account")),
    "qos": Setting(reader=_each('"account", "qos"', "qos=lc.qos")),
    "constraint": Setting(reader=_each('"qos", "constraint"', "constraint=lc.constraint")),
    "timeout_min": Setting(bounds=(1, None, True), reader=f"{TIME_LIMIT}: int(cfg.launcher.timeout_min)"),
    "time_limit": Setting(reader=f'{TIME_LIMIT}: str(cfg.launcher.get("time_limit")) != AUTO', example="auto"),
    "mem_gb": Setting(bounds=(0, None, False), reader=_each('params["mem_gb"] = lc.mem_gb', "mem_gb=lc.mem_gb")),
    "cpus_per_task": Setting(bounds=(1, 4096, True), reader=f"{COMMON}: int(lc.cpus_per_task)"),
    "cpus_per_device": Setting(
        bounds=(1, 1024, True),
        reader=f'{COMMON}: launcher_setting(lc, "cpus_per_device")',
        read_if=CPUS_PER_DEVICE,
        example="2",
    ),
    "array_parallelism": Setting(
        bounds=(1, None, True),
        reader=_each("slurm_array_parallelism=lc.array_parallelism", "array_parallelism=lc.array_parallelism"),
    ),
    "additional_parameters": Setting(
        reader=_each("dict(lc.additional_parameters or {})", "(lc.additional_parameters or {}).items()")
    ),
    "srun_workers": Setting(reader=_each("if lc.srun_workers:", "if lc.srun_workers else")),
    "wait": Setting(reader=f"{COMMON}: self.cfg.launcher.wait"),
    "max_requeues": Setting(
        bounds=(0, 1000, True), reader='supervise/requeue.py: launcher_setting(launcher, "max_requeues")'
    ),
    "signal_delay_s": Setting(
        bounds=(0, 3600, True),
        reader=_each("slurm_signal_delay_s=lc.signal_delay_s", "signal_delay_s=lc.signal_delay_s"),
    ),
    "max_failures": Setting(bounds=(0, 1000, True), reader='supervise/retry.py: "max_failures")'),
    "setup": Setting(reader=_each('launcher_setting(cfg.launcher, "setup")', 'launcher_setting(lc, "setup")')),
    "python": Setting(reader=f'{CONTAINER}: cfg.launcher.get("python")'),
    "container.image": Setting(reader=f"{CONTAINER}: str(c.image)"),
    "container.runtime": Setting(reader=f"{CONTAINER}: runtime=str(c.runtime)"),
    "container.mounts": Setting(reader=f"{CONTAINER}: c.mounts or ()"),
    "container.runtime_cmd": Setting(reader=f"{CONTAINER}: str(c.runtime_cmd)"),
    "snapshot": Setting(reader=f'{COMMON}: self.cfg.launcher.get("snapshot", False)'),
    "mail_type": Setting(takes="str or list", reader=f'{COMMON}: launcher_setting(launcher, "mail_type")'),
    "mail_user": Setting(
        reader=f'{COMMON}: launcher_setting(launcher, "mail_user")', read_if=MAIL, example="someone@example.org"
    ),
    "dry_run": Setting(reader=f"{SBATCH}: cfg.launcher.dry_run"),
}


def mail_types(value: Any, where: str = "") -> list[str]:
    """launcher.mail_type as Slurm's names: 'END,FAIL', [END, FAIL] or None ([]). UserError for an unknown one."""
    if value is None:
        return []
    is_list = isinstance(value, (list, tuple)) or OmegaConf.is_list(value)
    names = [str(v).strip().upper() for v in value] if is_list else str(value).upper().split(",")
    bad = next((n for n in names if n.strip() not in MAIL_TYPES), None)
    if bad is not None:
        raise UserError(
            f"{where}launcher.mail_type={value!r}: {bad.strip()!r} is not a Slurm mail type: use "
            f"{', '.join(MAIL_TYPES)} (several: launcher.mail_type='END,FAIL')"
        )
    return [n.strip() for n in names]


def check_job_values(launcher: DictConfig, where: str = "") -> None:
    """The Slurm launchers' job options (setup, python, container, mail): what is wrong, found before any file is
    written. The apptainer image must exist here (the run dir holds its absolute path)."""
    if "mail_type" in launcher:
        mail_types(launcher.mail_type, where)
    if launcher.get("mail_user") is not None and not str(launcher.mail_user).strip():
        raise UserError(f"{where}launcher.mail_user is empty: give an address, or leave it unset")
    if launcher.get("python") is not None and not str(launcher.python).strip():
        raise UserError(f"{where}launcher.python is empty: give an interpreter, or leave it unset (the submitter's)")
    container = launcher.get("container")
    if container is None:
        return
    if container.runtime not in CONTAINER_RUNTIMES:
        raise UserError(
            f"{where}launcher.container.runtime={container.runtime!r} is not valid: choose one of "
            f"{', '.join(CONTAINER_RUNTIMES)}"
        )
    if container.get("image") is None:  # no container: its other settings would be ignored
        defaults = launcher_setting(None, "container")  # its launcher schema's (backends/slurm/config.py)
        for key in ("mounts", "runtime", "runtime_cmd"):
            value = OmegaConf.to_container(container[key]) if OmegaConf.is_list(container[key]) else container[key]
            if value != getattr(defaults, key):
                raise UserError(
                    f"{where}launcher.container.{key}={value!r} is not read without launcher.container.image "
                    "(no container): set the image, or drop it"
                )
        return
    image = container.image
    if image is not None and not str(image).strip():
        raise UserError(f"{where}launcher.container.image is empty: give an image, or leave it unset (no container)")
    if (
        image
        and container.runtime == "apptainer"
        and "://" not in image
        and not Path(os.path.expanduser(image)).is_file()
    ):
        raise UserError(
            f"{where}launcher.container.image={image!r}: no such image file "
            f"({Path(os.path.expanduser(image)).absolute()}): give the path of a .sif image, or a URI "
            "such as docker://... that apptainer pulls"
        )


class SlurmSettings(LauncherConfig):
    """The hook of the Slurm launchers' schema: their keys' declarations and their checks."""

    @classmethod
    def declared(cls) -> dict[str, Setting]:
        return {**super().declared(), **SETTINGS}

    @classmethod
    def check(cls, launcher: DictConfig, where: str = "") -> None:
        check_job_values(launcher, where)
