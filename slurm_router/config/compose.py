"""Hydra composition of a run's config (conf/ over the schema in config/schema.py) and, with -m, the grid of the
sweep overrides as its variants (config/sweep.py); Hydra's and OmegaConf's errors as one line each
(docs/ARCHITECTURE.md, "Data flow")."""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

from slurm_router.errors import UserError


def compose(overrides: list[str]):
    """Hydra's compose API (not @hydra.main: no cwd change, no outputs/ folder, our own error lines)."""
    from slurm_router.config.checks import check_launcher_keys
    from slurm_router.config.schema import register_schema

    register_schema()
    with _one_line_errors():
        cfg = _hydra_compose(_free_form_overrides(overrides))
    check_launcher_keys(cfg)
    return cfg


def _hydra_compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from slurm_router.config.schema import conf_dir

    with initialize_config_dir(config_dir=conf_dir(), version_base=None, job_name="slurm_router"):
        return hydra_compose(config_name="config", overrides=overrides)


def _free_form_overrides(overrides: list[str]) -> list[str]:
    """The free-form mappings (config.schema.FREE_FORM_KEYS) take new keys as Hydra users write them, without '+':
    `launcher.additional_parameters={nice: 10}`, `...additional_parameters.nice=10`. A variant's own overrides
    (`variants.r8.train.lr=1e-3`) need no '+' either, but only for a variant the experiment has: a typo must not
    add a variant; a new one is added on purpose with `+variants.NAME...`. The merged variant is still checked
    against the schema (config.variant_configs)."""
    from slurm_router.config.schema import FREE_FORM_KEYS
    from slurm_router.config.sweep import parse_overrides

    parsed = parse_overrides(overrides)
    free = [
        o
        for o in parsed
        if not (o.is_add() or o.is_force_add() or o.is_delete())
        and any(o.key_or_group == k or o.key_or_group.startswith(k + ".") for k in FREE_FORM_KEYS)
    ]
    variant_edits = [o for o in free if o.key_or_group.split(".")[0] == "variants"]
    if variant_edits:
        have = [str(k) for k in _hydra_compose([o.input_line for o in parsed if o not in variant_edits]).variants or {}]
        for o in variant_edits:
            new = [n for n in _variant_names(o) if n not in have]
            if new:
                listed = f"its variants: {', '.join(map(str, have))}" if have else "it has none"
                add = "+" if "." in o.key_or_group else "++"  # + cannot add to the existing variants={}
                raise UserError(
                    f"{o.input_line}: the experiment has no variant {new[0]!r} ({listed}): fix the "
                    f"name, or add a new variant on purpose with {add}{o.input_line}"
                )
    return [f"++{o.input_line}" if o in free else o.input_line for o in parsed]


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
    from hydra.errors import HydraException, MissingConfigException
    from omegaconf.errors import OmegaConfBaseException

    from slurm_router.config.checks import EXPERIMENT_HINT, explain

    try:
        yield
    except MissingConfigException as e:
        raise _missing_option(e) from None
    except (HydraException, OmegaConfBaseException) as e:
        cause = e.__cause__ if isinstance(e.__cause__, OmegaConfBaseException) else e
        if isinstance(cause, OmegaConfBaseException):
            raise explain(cause) from None
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "Could not override 'experiment'" in first:  # experiment=NAME: Hydra takes it for the group
            raise UserError(f"experiment=...: {EXPERIMENT_HINT}") from None
        raise UserError(f"{first} (see: python -m slurm_router --help)") from None


def _missing_option(e) -> UserError:
    text = str(e)
    m = re.search(r"Could not (?:find|load) '([^/']+)/([^']+)'", text)  # load: one of a list (tracker=[a,b])
    # the launcher schemas sit in the launcher group too (ConfigStore): they are not options to pick
    options = [o for o in re.findall(r"^\t(\S+)$", text, flags=re.M) if not o.endswith("_schema")]
    if m:
        group, option = m.groups()
        if not options:  # Hydra lists them only for a single option, not for one of a list
            from slurm_router.config.schema import conf_dir

            options = sorted(p.stem for p in (Path(conf_dir()) / group).glob("*.yaml"))
        return UserError(
            f"{group}={option}: no such {group} in conf/{group}/; choose one of: {', '.join(options) or '(none)'}"
        )
    return UserError(text.strip().splitlines()[0])


def compose_grid(overrides: list[str], multirun: bool = False):
    """compose(), and with -m the grid of the sweep overrides as the variants (slurm_router.config.sweep)."""
    from slurm_router.config.sweep import expand_grid, split_sweeps

    fixed, sweeps = split_sweeps(overrides, multirun)
    cfg = compose(fixed)
    if sweeps:
        cfg.variants = expand_grid(cfg, sweeps, fixed, compose)
    return cfg
