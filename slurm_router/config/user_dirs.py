"""The user's own config folders (issue 41, 1): `--config-dir DIR` (`-cd DIR`) and `hydra.searchpath=[...]` add DIR's
group folders (experiment/, model/, data/, ...) beside the built-in conf/, as Hydra's own --config-dir does. A folder
is checked before anything is composed, each mistake one line naming the file and the fix: it exists, it holds
group folders the command knows, no file shadows a built-in option (Hydra's search order would pick the built-in
one without a word), an experiment file says `# @package _global_`. A selected file that fails to compose is
composed alone, so its error names the file (errors.UserError)."""

from __future__ import annotations

import difflib
import os
import re
from importlib import resources
from pathlib import Path

from slurm_router.errors import UserError

SEARCHPATH = "hydra.searchpath"
GLOBAL_PACKAGE = "# @package _global_"
FIX = "python -m slurm_router init DIR writes a starter DIR/experiment/NAME.yaml"


def builtin_groups() -> dict[str, set[str]]:
    """group -> its built-in options (conf/<group>/*.yaml)."""
    from slurm_router.config.schema import conf_dir

    root = Path(conf_dir())
    return {
        g.name: {p.stem for p in g.glob("*.yaml")} for g in sorted(root.iterdir()) if g.is_dir() and g.name[0] != "_"
    }


def resolve(entry: str, given_as: str) -> Path:
    """A search path entry (DIR, file://DIR, pkg://module.path) as an absolute folder; UserError if there is none."""
    if entry.startswith("pkg://"):
        module = entry[len("pkg://") :].replace("/", ".").strip(".")
        try:
            return Path(str(resources.files(module)))
        except (ModuleNotFoundError, TypeError):
            raise UserError(
                f"{given_as}: no importable package {module!r}: give a folder (file://DIR or DIR) or an installed "
                "package that holds the config groups"
            ) from None
    path = Path(os.path.expanduser(entry.removeprefix("file://"))).absolute()
    if not path.exists():
        raise UserError(f"{given_as}: no folder {path}: give the folder that holds experiment/NAME.yaml ({FIX})")
    if not path.is_dir():
        hint = (
            f"; for one experiment file put it in a folder as experiment/{path.stem}.yaml and pass that folder"
            if path.suffix in (".yaml", ".yml")
            else ""
        )
        raise UserError(f"{given_as}: {path} is a file, not a folder{hint}")
    return path


def check_dir(path: Path, given_as: str) -> None:
    """The folder holds group folders this command knows, shadows no built-in option, and its experiments are global."""
    groups = builtin_groups()
    if (path / "config.yaml").is_file():
        raise UserError(
            f"{path / 'config.yaml'}: the root config is built in and this file would be ignored: put your settings "
            f"in {path}/experiment/NAME.yaml and pick it with +experiment=NAME"
        )
    found = [d for d in sorted(path.iterdir()) if d.is_dir() and any(d.glob("*.y*ml"))]
    for d in found:
        if d.name not in groups:
            close = difflib.get_close_matches(d.name, list(groups), n=1)
            hint = f"did you mean {close[0]}/? " if close else ""
            raise UserError(
                f"{given_as}: {d}/ is not a config group: {hint}the groups are {', '.join(f'{g}/' for g in groups)}"
            )
    if not found:
        raise UserError(
            f"{given_as}: {path} holds no config group folder with a .yaml file "
            f"({', '.join(f'{g}/' for g in groups)}): {FIX}"
        )
    for d in found:
        for f in sorted(d.glob("*.y*ml")):
            if f.suffix == ".yml":
                raise UserError(f"{f}: Hydra reads .yaml files only: rename it to {f.with_suffix('.yaml').name}")
            if f.stem in groups[d.name]:
                raise UserError(
                    f"{f}: a built-in {d.name} is called {f.stem!r} and would be picked instead of yours: rename "
                    f"the file (and pick it with {'+' if d.name == 'experiment' else ''}{d.name}=NEW_NAME)"
                )
            if d.name == "experiment" and not _is_global(f):
                raise UserError(
                    f"{f}: an experiment file starts with the line '{GLOBAL_PACKAGE}' (its keys are the run's "
                    "top-level keys: train:, model:, variants: ...): add it as the first line"
                )


def _is_global(f: Path) -> bool:
    for line in f.read_text(errors="replace").splitlines():
        if re.fullmatch(r"#\s*@package\s+_global_\s*", line.strip()):
            return True
        if line.strip() and not line.lstrip().startswith("#"):
            return False  # Hydra reads the header before the first key only
    return False


def searchpath_override(dirs: list[Path]) -> str:
    return f"{SEARCHPATH}=[{','.join(f'file://{d}' for d in dirs)}]"


def user_file(dirs: list[Path], override: str) -> Path | None:
    """The user's file an override like +experiment=NAME (or model=NAME) picks, or None."""
    key, _, value = override.partition("=")
    group = key.lstrip("+~")
    if "." in group or not value or "/" in group:
        return None
    for d in dirs:
        f = d / group / f"{value}.yaml"
        if f.is_file():
            return f
    return None


def file_error(f: Path, text: str) -> UserError:
    """Hydra's 'In experiment/x: ...' composition message, as one line naming the user's file."""
    from omegaconf.errors import ConfigKeyError, ValidationError

    from slurm_router.config.checks import explain

    lines = [l.strip() for l in text.strip().splitlines()]
    key = next((l.split(":", 1)[1].strip() for l in lines if l.startswith("full_key:")), "")
    msg = lines[1] if len(lines) > 1 else lines[0] if lines else "it does not compose"
    kind = (
        ConfigKeyError if "ConfigKeyError" in lines[0] else ValidationError if "ValidationError" in lines[0] else None
    )
    if kind is not None and key:
        error = kind(msg)
        error.full_key = key
        return UserError(f"{f}: {explain(error)}")
    return UserError(f"{f}: {msg}")
