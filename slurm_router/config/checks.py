"""The checks that turn a bad config value into one line saying what to do (no torch, no files written)."""

from __future__ import annotations

import dataclasses
import difflib
import errno
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError

from slurm_router.config import data_sources, model_families
from slurm_router.config.lora_targets import check_target_modules, target_module_names
from slurm_router.config.schema import (
    CHOICES,
    FUSE_AUTO,
    LAUNCHER_SCHEMAS,
    declared,
    launcher_schema,
    valid_keys,
)
from slurm_router.config.testing_aids import FORMER_KEYS, testing_aids
from slurm_router.errors import UserError
from slurm_router.router.types import RouterSettings, not_a_choice, out_of_range


def nearest_existing(path: Path) -> Path:
    """The nearest part of `path` that exists (itself, or the closest parent; a dangling link counts)."""
    while not os.path.lexists(path):
        path = path.parent
    return path


def check_writable_dir(path: str | os.PathLike, setting: str, fix: str | None = None) -> Path:
    """The folder `path` (made later, parents and all) can be written: probed by making and removing a folder in
    its nearest existing part, before anything else is written. `setting` ("run_root='runs'") leads the one
    line a UserError gives, naming the path and the cause; `fix` ends it (default: set the setting to a folder
    you can write). Returns the absolute path."""
    target = Path(os.path.expanduser(str(path))).absolute()
    probe = nearest_existing(target)
    fix = fix or f"set {setting.split('=', 1)[0]}= to a folder you can write"
    if not probe.is_dir():
        what = "a dangling symbolic link" if probe.is_symlink() and not probe.exists() else "a file, not a folder"
        raise UserError(f"{setting}: {probe} is {what}: {fix}")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".slurm_router-write-test-", dir=probe))
    except OSError as e:
        cause = "it takes no new folders" if e.errno == errno.ENOENT else e.strerror or type(e).__name__
        raise UserError(f"{setting}: cannot write in {probe} ({cause}): {fix}") from None
    return target


def launcher_key_error(key: str, kind: str, where: str = "") -> UserError:
    """launcher.<name> that launcher=<kind> does not have: say which launchers have it, or which keys it has."""
    name = key.split(".", 1)[1].split(".")[0]
    have = [f"launcher={s.kind}" for s in LAUNCHER_SCHEMAS if name in {f.name for f in dataclasses.fields(s)}]
    if have:
        return UserError(
            f"{where}launcher.{name} does not apply to launcher={kind}: it is an option of "
            f"{', '.join(have)} only; choose one of those or drop launcher.{name}"
        )
    keys = sorted(f.name for f in dataclasses.fields(launcher_schema(kind)))
    hint = did_you_mean(f"launcher.{name}", keys)
    return UserError(
        f"{where}unknown key 'launcher.{name}': {hint}valid keys for launcher={kind} are {', '.join(keys)}"
    )


def check_launcher_keys(cfg: DictConfig) -> None:
    """Keys added under launcher with '+' pass Hydra (the group's node is not closed): refuse them here."""
    kind = cfg.launcher.kind
    allowed = {f.name for f in dataclasses.fields(launcher_schema(kind))} if kind in CHOICES["launcher.kind"] else set()
    extra = [k for k in cfg.launcher if k not in allowed]
    if allowed and extra:
        raise launcher_key_error(f"launcher.{extra[0]}", kind)


def explain(error: Exception, where: str = "") -> UserError:
    """One line for an OmegaConf/Hydra error about a key: unknown keys list the valid ones."""
    key = getattr(error, "full_key", None) or ""
    msg = str(error).splitlines()[0] if str(error) else type(error).__name__
    if isinstance(error, ConfigKeyError) or "not in struct" in msg or re.search(r"Key '.*' not in", msg):
        kind = getattr(getattr(error, "object_type", None), "kind", None)
        if key.rpartition(".")[::2] == ("router", name := key.rpartition(".")[2]) and name in FORMER_KEYS:
            return UserError(
                f"{where}{key} is no setting: it is a testing aid, set by the environment variable {FORMER_KEYS[name]}"
            )
        if key.startswith("launcher.") and kind in CHOICES["launcher.kind"]:
            return launcher_key_error(key, kind, where)
        parent = key.rsplit(".", 1)[0] if "." in key else ""
        keys = valid_keys(parent)
        under = f"under {parent}" if parent else "at the top level"
        if not keys:
            return UserError(
                f"{where}unknown key '{key}': {parent or 'the top level'} has no key {key.rsplit('.', 1)[-1]!r} ({msg})"
            )
        return UserError(
            f"{where}unknown key '{key}': {did_you_mean(key, keys)}valid keys {under} are {', '.join(keys)}"
        )
    if isinstance(error, ValidationError) and key and re.search(r"'dict'|'\{\}'", msg):
        return _not_a_group(key, msg, where)
    if isinstance(error, ValidationError) and key:
        return UserError(f"{where}{key}: {msg}{_example(key, msg)}")
    return UserError(f"{where}{msg}")


def did_you_mean(key: str, keys: list[str]) -> str:
    """'did you mean train.lr? ' for train.lrr among train's keys (difflib's nearest), or ''."""
    parent, _, name = key.rpartition(".")
    close = difflib.get_close_matches(name, keys, n=1, cutoff=0.6)
    return f"did you mean {parent + '.' if parent else ''}{close[0]}? " if close else ""


# OmegaConf's "could not be converted to T": what to give instead, and an example for when the default is none
_TYPE_HINTS = {"Float": ("a number", "1e-4"), "Integer": ("a whole number", "1"), "Boolean": ("true or false", "true")}


def _example(key: str, msg: str) -> str:
    """': give a number, e.g. train.lr=0.002' (the key's default as the example) for a value of the wrong type."""
    kind = (
        "Boolean" if "not a valid bool" in msg else next((k for k in _TYPE_HINTS if f"converted to {k}" in msg), None)
    )
    if kind is None:
        return ""
    what, fallback = _TYPE_HINTS[kind]
    from slurm_router.config.schema import Config, launcher_setting

    try:
        default = (
            launcher_setting(None, key.split(".", 1)[1])
            if key.startswith("launcher.")
            else OmegaConf.select(OmegaConf.structured(Config), key)
        )
    except Exception:  # a key no schema has (a variant's, a free-form one): the generic example
        default = None
    if isinstance(default, bool):
        example = str(default).lower()
    elif isinstance(default, (int, float)) and kind != "Boolean":
        example = str(default)
    else:
        example = fallback
    return f": give {what}, e.g. {key}={example}"


EXPERIMENT_HINT = (
    "experiment is a string, the experiment's name, set by conf/experiment/NAME.yaml: pick one "
    "with +experiment=NAME (its options live under train., data., model., ...; seeds= and prune= "
    "are set at the top level)"
)


def _not_a_group(key: str, msg: str, where: str = "") -> UserError:
    """`experiment.seeds=2`, `train.lr.x=1`: a dotted key under a plain value (the user guessed where it lives)."""
    if key == "experiment":
        return UserError(f"{where}experiment has no keys under it: {EXPERIMENT_HINT}")
    kinds = {"Float": "a number", "Integer": "a whole number", "Boolean": "true or false", "string": "a string"}
    what = next((v for k, v in kinds.items() if k in msg), "a single value")
    return UserError(f"{where}{key} is {what} and has no keys under it: set {key}=VALUE")


def _get(cfg: DictConfig, key: str) -> Any:
    return OmegaConf.select(cfg, key)


def check_values(cfg: DictConfig, where: str = "") -> None:
    """Choices and ranges as each key declares them (config/settings.py; launcher.*: the chosen launcher's), then
    the model family's and the launcher's own checks; raises UserError naming the key (prefixed with `where`,
    e.g. 'variants.r8.')."""
    kind = cfg.launcher.kind if cfg.launcher.kind in CHOICES["launcher.kind"] else None
    keys = declared(kind)
    for key, allowed in [("launcher.kind", CHOICES["launcher.kind"]), *((k, s.choices) for k, (s, _) in keys.items())]:
        if not allowed:
            continue
        value = _get(cfg, key)
        if value in ("True", "False") and value.lower() in allowed:  # a str key given true/false on the command line
            continue
        problem = not_a_choice(key, value, allowed)
        if problem:
            raise UserError(f"{where}{problem}")
    if problem := fuse_width_problem(_get(cfg, "resources.fuse_variants")):
        raise UserError(f"{where}{problem}")
    for key, (setting, _) in keys.items():
        if setting.bounds is None:
            continue
        limits = setting.bounds
        if key == "router.memory_headroom":  # above 1 only in tests: real out-of-memory errors on a GPU
            limits = (limits[0], testing_aids().memory_headroom_max, limits[2])
        value = _get(cfg, key)
        problem = None if value is None or value == FUSE_AUTO else out_of_range(key, value, *limits)
        if problem:
            raise UserError(f"{where}{problem}")
    try:  # the router's own settings: their one check is RouterSettings'
        RouterSettings.from_config(cfg.router)
    except ValueError as e:
        raise UserError(f"{where}{e}") from None
    family = model_families.of(cfg)
    names = target_module_names(cfg.model.lora.target_modules, where) if cfg.model.lora.enabled else None
    if names and family.lora_layers is not None:  # None: checked on its architecture (cli.checks.check_models)
        check_target_modules(names, *family.lora_layers(cfg), where)
    if cfg.model.n_embd % cfg.model.n_head:
        raise UserError(f"{where}model.n_embd={cfg.model.n_embd} must be a multiple of model.n_head={cfg.model.n_head}")
    family.check(cfg, where)
    if list(cfg.router.affinity_boundaries) != sorted(set(cfg.router.affinity_boundaries)):
        raise UserError(f"{where}router.affinity_boundaries must be strictly increasing token lengths")
    check_data_keys(cfg.data, where)
    if kind is not None:
        launcher_schema(kind).check(cfg.launcher, where)


def data_keys_read(data: DictConfig) -> set[str]:
    """The data.* keys the chosen source reads with these values (data.kind, a record format, a length
    distribution): every other key is ignored by it (check_data_keys refuses them when set)."""
    if data.kind not in data_sources.SOURCES:
        return set()
    found = data_sources.source(data.kind)
    return set(found.reads) - set(found.unread(data))


def check_data_keys(data: DictConfig, where: str = "") -> None:
    """A data.* key set (away from its schema default) that data.kind does not read: one line naming it, the
    sources that read it and the fix. Without this, data.path=/x without data=text_dir trained on stdlib."""
    from slurm_router.config.schema import DataConfig

    if data.kind not in data_sources.SOURCES:
        return  # an unknown kind: check_values' choice check names it first
    read, defaults = data_keys_read(data), DataConfig()
    unread = data_sources.source(data.kind).unread(data)
    for key in map(str, data):
        if key in read or data[key] == getattr(defaults, key, data[key]):
            continue
        shown = f"data.{key}={data[key]!r}"
        fix = unread.get(key)
        if fix is None:
            sources = [k for k in data_sources.SOURCES if key in data_sources.source(k).reads]
            fix = f"it is read by {', '.join(f'data={k}' for k in sources)}: add one of those, or drop data.{key}"
        raise UserError(f"{where}{shown} is not read by data={data.kind}, so it would be ignored: {fix}")


# Hydra's own settings: this command composes the config with Hydra's compose API (no @hydra.main), so no hydra.*
# key is read and no Hydra launcher or sweeper plugin runs.
def refuse_hydra_overrides(overrides: list[str]) -> None:
    """hydra.run.dir=X, hydra.job.chdir=true, hydra/launcher=submitit_slurm: one line naming the setting to use."""
    for o in overrides:
        key = o.split("=", 1)[0].lstrip("+~")
        if not (key == "hydra" or key.startswith(("hydra.", "hydra/"))):
            continue
        if key == "hydra/launcher":
            fix = "Hydra's launcher plugins are not used here: pick launcher=slurm (submitit), launcher=sbatch or launcher=local"
        elif key.startswith("hydra/sweeper"):
            fix = "sweeps are -m with Hydra's sweep syntax (model.lora.r=4,8), one run of the grid's variants"
        elif key.startswith("hydra/"):
            fix = "Hydra's config groups are not used here: drop it (see python -m slurm_router --help)"
        elif key in ("hydra.run.dir", "hydra.sweep.dir", "hydra.sweep.subdir", "hydra.runtime.output_dir"):
            value = o.split("=", 1)[1] if "=" in o else "DIR"
            fix = f"runs are written under run_root (runs/<experiment>/<timestamp>): set run_root={value} instead"
        elif key.startswith("hydra.job.chdir"):
            fix = "the command never changes directory; each run writes under run_root=: drop it"
        else:
            fix = "Hydra's own settings are not read here (it only composes the config): drop it; the run directory is set by run_root="
        raise UserError(f"{o}: {fix}")


def fuse_width_problem(width: Any) -> str | None:
    """Why resources.fuse_variants=width is neither K (an int; its range is RANGES') nor auto, or None."""
    if width == FUSE_AUTO or (isinstance(width, int) and not isinstance(width, bool)):
        return None
    return (
        f"resources.fuse_variants={width!r}: give K, the most variants fused into one task (e.g. "
        "resources.fuse_variants=4; 1: off), or auto (launcher=local: K chosen from its slots and memory)"
    )
