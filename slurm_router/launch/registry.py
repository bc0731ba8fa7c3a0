"""The launchers by name: the one place a launcher kind (launcher=local|slurm|sbatch) is looked up."""

from __future__ import annotations

from slurm_router.errors import UserError
from slurm_router.launch.base import Launcher
from slurm_router.launch.local import LocalLauncher
from slurm_router.launch.slurm.sbatch_launcher import SbatchLauncher
from slurm_router.launch.slurm.submitit_launcher import SubmititLauncher

LAUNCHERS: dict[str, type[Launcher]] = {
    cls.schema.kind: cls for cls in (LocalLauncher, SubmititLauncher, SbatchLauncher)
}


def launcher_class(kind: str) -> type[Launcher]:
    try:
        return LAUNCHERS[kind]
    except KeyError:
        raise UserError(f"launcher={kind}: no such launcher; choose one of: {', '.join(LAUNCHERS)}") from None
