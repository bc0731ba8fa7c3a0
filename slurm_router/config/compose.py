"""The one Hydra composition of a command's config (conf/ over the schema in config/schema.py) and, with -m, the grid
of the sweep overrides as its variants (config/sweep.py); Hydra's and OmegaConf's errors as one line each
(docs/design/data-flow.md, "Data flow")."""

from __future__ import annotations

import contextlib
import re
from pathlib import Path
from typing import cast

from slurm_router.errors import UserError

# The user's own config folders (--config-dir DIR, hydra.searchpath=[...]; config/user_dirs.py), after the built-in
# conf/ in Hydra's search path, set once per command by set_config_dirs.
_USER_DIRS: list[Path] = []


def set_config_dirs(entries: list[tuple[str, str]]) -> list[Path]:
    """(entry, as the user gave it) for each folder: each checked (config/user_dirs.py), then used by compose()."""
    from slurm_router.config.user_dirs import check_dir, resolve

    dirs = []
    for entry, given_as in entries:
        path = resolve(entry, given_as)
        check_dir(path, given_as)
        dirs.append(path)
    _USER_DIRS[:] = dirs
    return dirs


def compose(overrides: list[str], multirun: bool = False, hydra: dict | None = None):
    """The command's config: Hydra's compose API (not @hydra.main: no cwd change, no outputs/ folder, our own error
    lines), and with -m (multirun) the grid of the sweep overrides as its variants (config/sweep.py). `hydra`, when
    given, gets what Hydra decided for this command (--cfg hydra, --info, --help): the search path (the built-in
    conf/, then --config-dir's folders) and each group's choice."""
    from slurm_router.config.checks import check_launcher_keys
    from slurm_router.config.schema import register_schema
    from slurm_router.config.sweep import expand_grid, split_sweeps

    fixed, sweeps = split_sweeps(overrides, multirun)
    register_schema()
    try:
        with _one_line_errors():
            cfg = _hydra_compose(_free_form_overrides(fixed), hydra_config=hydra is not None)
    except UserError:
        _blame_user_file(fixed)  # a file of the user's that fails alone: its error, naming it
        raise
    if hydra is not None:
        hydra.update(_hydra_settings(cfg))
    check_launcher_keys(cfg)
    if _USER_DIRS:
        _blame_values(cfg, fixed)
    if sweeps:
        cfg.variants = expand_grid(cfg, sweeps, fixed, compose)
    if _USER_DIRS and not cfg.variants:
        _refuse_empty_variants(fixed)
    return cfg


def _hydra_settings(cfg) -> dict:
    """cfg's `hydra` node taken off (as Hydra's compose does unasked), as the search path and each group's choice.
    Hydra's output dirs, logging and launcher settings are left out: this command reads none of them (it makes no
    outputs/ or multirun/ folder)."""
    from omegaconf import OmegaConf, open_dict

    runtime = cfg.hydra.runtime
    sources = [f"{s.schema}://{s.path}" for s in runtime.config_sources if s.provider not in ("hydra", "schema")]
    picked = cast(dict, OmegaConf.to_container(runtime.choices))
    with open_dict(cfg):
        del cfg["hydra"]
    return {"searchpath": sources, "choices": {str(k): v for k, v in picked.items() if not str(k).startswith("hydra/")}}


def _alone(override: str, f: Path) -> str:
    """The override that picks the user's file f alone (an experiment is added with '+')."""
    return override if override.startswith("+") or f.parent.name != "experiment" else f"+{override}"


def _blame_values(cfg, overrides: list[str]) -> None:
    """A value of the user's own file out of range or not a choice (train.lr=50 in DIR/experiment/x.yaml): the
    check's line naming the file, when the file alone fails the same way; otherwise the run's checks say it later,
    in their order (cli/checks.py)."""
    from slurm_router.config.user_dirs import user_file

    files = [(o, f) for o in overrides if (f := user_file(_USER_DIRS, o)) is not None]
    if not files:
        return
    try:
        _check_values_and_variants(cfg)
        return
    except UserError as e:
        problem = str(e)
    for o, f in files:
        try:
            _check_values_and_variants(_hydra_compose([_alone(o, f)]))
        except UserError as alone:
            if str(alone) == problem:
                raise UserError(f"{f}: {problem}") from None
        except Exception:  # the file alone does not compose: not its value's fault
            continue


def _check_values_and_variants(cfg) -> None:
    """The values, then each variant's keys and values (variants.NAME: ...), as cli/checks.py checks them."""
    from slurm_router.config.checks import check_values
    from slurm_router.config.variants import variant_configs

    check_values(cfg)
    for name, vcfg in variant_configs(cfg).items():
        check_values(vcfg, where=f"variants.{name}: ")


def _refuse_empty_variants(overrides: list[str]) -> None:
    """An experiment file of the user's with `variants: {}` (or a bare `variants:`): almost surely a mistake (the
    run would train the experiment's own settings as one task, `main`, without a word): one line naming it."""
    import yaml

    from slurm_router.config.user_dirs import user_file

    for o in overrides:
        f = user_file(_USER_DIRS, o)
        if f is None or f.parent.name != "experiment":
            continue
        try:
            data = yaml.safe_load(f.read_text())
        except (OSError, yaml.YAMLError):  # composed already: not for this check to say
            continue
        if isinstance(data, dict) and "variants" in data and not data["variants"]:
            raise UserError(
                f"{f}: variants: {{}} names no variant: add at least one, e.g. variants: {{r8: {{model: {{lora: "
                "{r: 8}}}}, or remove the variants key to train the experiment's own settings as one task (main)"
            )


def _blame_user_file(overrides: list[str]) -> None:
    from hydra.errors import HydraException

    from slurm_router.config.user_dirs import file_error, user_file

    for o in overrides:
        f = user_file(_USER_DIRS, o)
        if f is None:
            continue
        try:
            _hydra_compose([_alone(o, f)])
        except HydraException as e:
            raise file_error(f, str(e)) from None
        except Exception:  # a file that is no YAML: the first error names it already
            return


def _hydra_compose(overrides: list[str], hydra_config: bool = False):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from slurm_router.config.schema import conf_dir
    from slurm_router.config.user_dirs import searchpath_override

    if _USER_DIRS:
        overrides = [*overrides, searchpath_override(_USER_DIRS)]
    with initialize_config_dir(config_dir=conf_dir(), version_base=None, job_name="slurm_router"):
        return hydra_compose(config_name="config", overrides=overrides, return_hydra_config=hydra_config)


def _free_form_overrides(overrides: list[str]) -> list[str]:
    """The free-form mappings (config.schema.free_form_keys) take new keys as Hydra users write them, without '+':
    `launcher.additional_parameters={nice: 10}`, `...additional_parameters.nice=10`. A variant's own overrides
    (`variants.r8.train.lr=1e-3`) need no '+' either, but only for a variant the experiment has: a typo must not
    add a variant; a new one is added on purpose with `+variants.NAME...`. The merged variant is still checked
    against the schema (config.variant_configs)."""
    from slurm_router.config.schema import free_form_keys
    from slurm_router.config.sweep import parse_overrides

    parsed, free_keys = parse_overrides(overrides), free_form_keys()
    free = [
        o
        for o in parsed
        if not (o.is_add() or o.is_force_add() or o.is_delete())
        and any(o.key_or_group == k or o.key_or_group.startswith(k + ".") for k in free_keys)
    ]
    variant_edits = [o for o in free if o.key_or_group.split(".")[0] == "variants"]
    lines = [f"++{o.input_line}" if o in free else o.input_line for o in parsed]
    if variant_edits:  # the variants the experiment has: composed with the same free-form rule as the command
        have = [
            str(k)
            for k in _hydra_compose([ln for o, ln in zip(parsed, lines) if o not in variant_edits]).variants or {}
        ]
        for o in variant_edits:
            new = [n for n in _variant_names(o) if n not in have]
            if new:
                listed = f"its variants: {', '.join(map(str, have))}" if have else "it has none"
                add = "+" if "." in o.key_or_group else "++"  # + cannot add to the existing variants={}
                raise UserError(
                    f"{o.input_line}: the experiment has no variant {new[0]!r} ({listed}): fix the "
                    f"name, or add a new variant on purpose with {add}{o.input_line}"
                )
    return lines


def _variant_names(override) -> list[str]:
    """The variants an override names: NAME of variants.NAME.key=..., or the keys of variants={NAME: ...}."""
    parts = override.key_or_group.split(".")
    if len(parts) > 1:
        return [parts[1]]
    value = override.value()
    return [str(k) for k in value] if isinstance(value, dict) else []


@contextlib.contextmanager
def _one_line_errors():
    """Hydra's and OmegaConf's errors about the overrides, as one UserError line."""
    import yaml
    from hydra.errors import HydraException, MissingConfigException
    from omegaconf.errors import OmegaConfBaseException

    from slurm_router.config.checks import EXPERIMENT_HINT, explain

    try:
        yield
    except yaml.YAMLError as e:  # a config file that is no YAML (the user's own, --config-dir)
        mark = getattr(e, "problem_mark", None)
        where = f"{mark.name}, line {mark.line + 1}" if mark else "a config file"
        raise UserError(f"{where}: not valid YAML ({getattr(e, 'problem', None) or e}): fix the file") from None
    except MissingConfigException as e:
        raise _missing_option(e) from None
    except (HydraException, OmegaConfBaseException) as e:
        cause = e.__cause__ if isinstance(e.__cause__, OmegaConfBaseException) else e
        if isinstance(cause, OmegaConfBaseException):
            raise _not_optional(cause) or explain(cause) from None
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "Could not override 'experiment'" in first:  # experiment=NAME: Hydra takes it for the group
            raise UserError(f"experiment=...: {EXPERIMENT_HINT}") from None
        taken = re.search(r"An item is already at '([^']+)'", first)
        if taken:  # +KEY=VALUE where the experiment (or a group) has KEY already
            key = taken.group(1)
            raise UserError(
                f"+{key}=...: {key} is set already (by the experiment or a config group): set it without the '+', "
                f"{key}=VALUE"
            ) from None
        raise UserError(f"{first} (see: python -m slurm_router --help)") from None


def _not_optional(e) -> UserError | None:
    """KEY=null for a key that takes a value (train.eval_every=null): what it takes instead, with its default."""
    key = getattr(e, "full_key", None)
    if not key or "is not Optional" not in str(e):
        return None
    from omegaconf import OmegaConf

    from slurm_router.config.schema import Config, launcher_setting

    try:
        if key.startswith("launcher."):
            default = launcher_setting(None, key.split(".", 1)[1])
        else:
            default = OmegaConf.select(OmegaConf.structured(Config), key)
    except Exception:  # no schema default to show
        default = None
    shown = str(default).lower() if isinstance(default, bool) else default
    example = f": give one, e.g. {key}={shown} (its default)" if default is not None else ""
    return UserError(f"{key}=null: {key} takes a value, not null{example}")


def _missing_option(e) -> UserError:
    text = str(e)
    m = re.search(r"Could not (?:find|load) '([^/']+)/([^']+)'", text)  # load: one of a list (tracker=[a,b])
    # the launcher schemas sit in the launcher group too (ConfigStore): they are not options to pick
    options = [o for o in re.findall(r"^\t(\S+)$", text, flags=re.M) if not o.endswith("_schema")]
    if m:
        group, option = m.groups()
        if not options:  # Hydra lists them only for a single option, not for one of a list
            from slurm_router.config.schema import conf_dir

            dirs = [Path(conf_dir()), *_USER_DIRS]
            options = sorted({p.stem for d in dirs for p in (d / group).glob("*.yaml")})
        where = " or ".join([f"conf/{group}/", *(f"{d}/{group}/" for d in _USER_DIRS)])
        fix = "" if _USER_DIRS or group != "experiment" else " (your own: --config-dir DIR, see init)"
        return UserError(
            f"{group}={option}: no such {group} in {where}; choose one of: {', '.join(options) or '(none)'}{fix}"
        )
    return UserError(text.strip().splitlines()[0])
