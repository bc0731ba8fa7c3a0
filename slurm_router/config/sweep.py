"""Hydra's sweep syntax: `python -m slurm_router -m model.lora.r=4,8 train.lr=1e-3,3e-3` runs the grid of the
sweep overrides as the variants of ONE run (one array job per stage), not as separate runs.

The overrides are read by Hydra's own parser (hydra.core.override_parser), so `a,b`, `choice(a,b)`,
`range(start,stop[,step])`, `glob(*)` for a config group, quoting, `shuffle()` and `sort()` behave as in Hydra;
each value goes through the parser again as `key=value` (what Hydra's basic sweeper hands each job). An override
with one value applies to every variant. With `+experiment=NAME` each of its variants runs once per grid point.

A config group can be swept (`router=round_robin,balanced`, `model=...`, `data=...`): the variant takes the keys
the option changes. `launcher`, `experiment`, `base.*`, `run_root`, `seed`, `seeds`, `prune`, `tracker`,
`resources.fuse_variants` and `variants.*` are one per run and cannot be swept (training-seed replicates are `seeds=N`).

Names (`variant_name`): one part per swept key, in command order, joined with `_`. A part is the key's last
dotted component (more components when two swept keys share it) followed by the value: directly when the value
starts with a digit, a sign or a dot (`r4`, `lr1e-3`, `lr-1`), after a `-` otherwise (`policy-balanced`,
`router-round_robin`, `use_dora-true`). Numbers are written in their shortest exact form (1e-3, 3e-4, 0.5, 100);
a list joins its items with `+`; any character outside letters, digits and `_ . + -` becomes `-`. With an
experiment the name is `<experiment variant>_<grid name>` (r8_lr1e-3). A name longer than 64 characters keeps
its first 55 and ends with `-` and 8 hex digits of its hash. Two grid points that would share a name are an
error naming the override.
"""

from __future__ import annotations

import hashlib
import itertools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, cast

import numpy as np
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from slurm_router.config.checks import explain
from slurm_router.config.schema import conf_dir
from slurm_router.errors import UserError


def one_per_run() -> dict[str, str]:
    """Swept keys (or their first component) that are one per run, and why: each declaration's `sweep`."""
    from slurm_router.config.schema import declared

    return {key: found.sweep for key, (found, _) in declared().items() if found.sweep}


MAX_NAME = 64  # config.NAME_RE
HINT = "write KEY=a,b, KEY=choice(a,b) or KEY=range(start,stop,step)"


def parse_overrides(lines: list[str]) -> list:
    """Hydra's Override for each line; a line Hydra cannot read is one UserError naming it."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser, parsed = OverridesParser.create(), []
    for line in lines:
        try:
            parsed.append(parser.parse_overrides([line])[0])
        except OverrideParseException as e:
            quoted = _quoted(parser, line)
            if quoted is not None:
                parsed.append(quoted)
                continue
            first = str(e).strip().splitlines()[0]
            raise UserError(
                f"cannot read the override {line!r} ({first}): write key=value, e.g. train.lr=1e-3 "
                f"(with -m, a sweep: {HINT}); names are letters, digits, '_' and '-'"
            ) from None
    return parsed


# what makes a value a sweep, a list or a dict, or a function call: never quoted on the user's behalf
STRUCTURE = set(",[]{}()")


def _quoted(parser, line: str):
    """A plain value Hydra's grammar cannot read unquoted, as users type paths (data.path=~/my_texts, a '#', '&',
    '=', an accented letter): read as the one string it is, quoted as Hydra wants it (data.path='~/my_texts').
    None when the key cannot be read either; a value with a sweep's, list's or call's characters is one
    UserError naming the key and how to quote it."""
    from hydra.errors import OverrideParseException

    key, sep, value = line.partition("=")
    try:
        parser.parse_overrides([f"{key}=x"])
    except OverrideParseException:
        return None  # the key itself: the caller's message
    if not sep or not value or value.endswith("\\") or ("'" in value and '"' in value):
        return None
    bad = next((c for c in value if c not in STRUCTURE and _unreadable(parser, c)), None)
    if bad is None:
        return None  # a typo in a sweep, list or call (model.lora.target_modules=[a,b): the caller's message
    if STRUCTURE & set(value):
        each = ",".join(f"'{v}'" for v in value.split(",")) if STRUCTURE & set(value) == {","} else f"'{value}'"
        raise UserError(
            f"{line}: {key} holds {bad!r}, which Hydra reads only inside quotes: quote each value, inside the "
            f'shell\'s quotes: "{key}={each}"'
        )
    mark = '"' if "'" in value else "'"
    try:
        return parser.parse_overrides([f"{key}={mark}{value}{mark}"])[0]
    except OverrideParseException:
        return None


def _unreadable(parser, char: str) -> bool:
    from hydra.errors import OverrideParseException

    try:
        parser.parse_overrides([f"k=a{char}a"])
        return False
    except OverrideParseException:
        return True


def split_sweeps(lines: list[str], multirun: bool) -> tuple[list[str], list]:
    """(the overrides every variant gets, the sweep overrides). A sweep without -m, and -m without a sweep, are
    one UserError each."""
    parsed = parse_overrides(lines)
    sweeps = [o for o in parsed if o.is_sweep_override()]
    if sweeps and not multirun:
        line = sweeps[0].input_line
        raise UserError(
            f"{line} is a sweep (several values): add -m to run one variant per value "
            f"(python -m slurm_router -m {line} ...); for a list write {sweeps[0].key_or_group}=[...], "
            "for a string with commas quote it"
        )
    if multirun and not sweeps:
        raise UserError(
            f"-m (--multirun) needs at least one sweep override to expand, e.g. train.lr=1e-3,3e-3 or "
            f"model.lora.r=range(4,17,4); none of the {len(lines)} override(s) has several values: "
            "drop -m, or give a sweep"
        )
    return [o.input_line for o in parsed if not o.is_sweep_override()], sweeps


@dataclass
class Axis:
    """One swept key (or config group): its values as Hydra reads each `key=value`, and each value's name part."""

    line: str
    key: str
    values: list
    group: bool = False
    parts: list[str] | None = None


def groups() -> list[str]:
    return sorted(p.name for p in Path(conf_dir()).iterdir() if p.is_dir() and not p.name.startswith(("_", ".")))


def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (Path(conf_dir()) / group).glob("*.yaml"))


def _axis(o, fixed_keys: list[str]) -> Axis:
    from hydra.core.override_parser.types import Glob
    from hydra.errors import HydraException

    line, key = o.input_line, o.key_or_group
    if o.is_delete() or o.package or o.is_interval_sweep():
        why = (
            "interval() draws from a continuous range, which needs a sampling sweeper: list the values instead"
            if o.is_interval_sweep()
            else "only KEY=... sweeps are supported"
        )
        raise UserError(f"{line}: {why}: {HINT}")
    per_run = one_per_run()
    top = next((k for k in (key, key.split(".")[0]) if k in per_run), None)
    if top:
        raise UserError(f"{line}: {key} cannot be swept: {per_run[top]}")
    if key in fixed_keys:
        raise UserError(f"{line}: {key} is also set to one value in the same command: give it once")
    group = key in groups()
    try:
        if isinstance(o.value(), Glob):
            if not group:
                raise UserError(
                    f"{line}: glob() picks options of a config group ({', '.join(groups())}); {key} is not one: {HINT}"
                )
            strings = o.value().filter(group_options(key))
        else:
            strings = list(o.sweep_string_iterator())
    except (HydraException, ValueError, TypeError) as e:
        raise UserError(
            f"{line}: {str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}: {HINT}"
        ) from None
    if not strings:
        raise UserError(f"{line}: the sweep has no values: {HINT}")
    values = [v.value() for v in parse_overrides([f"{key}={s}" for s in strings])]
    return Axis(line, key, values, group)


def _check_values(cfg: DictConfig, axis: Axis) -> None:
    """Each value of a key fits the schema (the key exists, the type converts): else one line naming the
    override, listing the valid keys as for any unknown key. Ranges are checked per variant (config.validate)."""
    trial = cfg.copy()
    for value in axis.values:
        try:
            OmegaConf.update(trial, axis.key, value, merge=True)
        except OmegaConfBaseException as e:
            raise UserError(f"{axis.line}: {explain(e)}") from None


_MISSING = object()


def _diff(base: Any, other: Any) -> Any:
    """The part of `other` that differs from `base` (nested dicts), or None when nothing does."""
    if isinstance(base, dict) and isinstance(other, dict):
        out = {k: d for k, v in other.items() if (d := _diff(base.get(k, _MISSING), v)) is not None}
        return out or None
    return None if base == other else other


def _group_changes(cfg: DictConfig, axis: Axis, fixed: list[str], compose: Callable) -> list[dict]:
    """For each option of a swept group: the keys of that group the option changes (composed with the command's
    other overrides, so `router.speed_ema=0.5 -m router=a,b` keeps 0.5 in both)."""
    base = OmegaConf.to_container(cfg[axis.key], resolve=False)
    changes = []
    for option in axis.values:
        try:
            other = compose([*fixed, f"{axis.key}={option}"])
        except UserError as e:
            raise UserError(f"{axis.line}: {e}") from None
        changes.append({axis.key: _diff(base, OmegaConf.to_container(other[axis.key], resolve=False)) or {}})
    return changes


def format_value(value: Any) -> str:
    """A value as a name part: numbers in their shortest exact form, lists joined with '+', only [A-Za-z0-9_.+-]."""
    if isinstance(value, bool) or value is None:
        text = {True: "true", False: "false", None: "null"}[value]
    elif isinstance(value, int):
        text = str(value)
    elif isinstance(value, float):
        if value.is_integer() and abs(value) < 1e6:
            text = str(int(value))
        else:
            pos = np.format_float_positional(value, trim="-")
            sci = np.format_float_scientific(value, trim="-", exp_digits=1)
            text = sci if len(sci) < len(pos) else pos
    elif isinstance(value, (list, tuple)):
        text = "+".join(format_value(v) for v in value) or "empty"
    elif isinstance(value, dict):
        text = "+".join(_part(str(k), v) for k, v in value.items()) or "empty"
    else:  # a string: separators and leading/trailing symbols dropped
        text = re.sub(r"[^A-Za-z0-9_.+-]+", "-", str(value)).strip("-")
    return text or "empty"


def _part(short: str, value: Any) -> str:
    text = format_value(value)
    return f"{short}{text}" if re.match(r"[0-9.+-]", text) else f"{short}-{text}"


def short_keys(keys: list[str]) -> list[str]:
    """Each key's last dotted component, or as many trailing components as make it unique among `keys`."""
    out = []
    for key in keys:
        parts = key.split(".")
        for n in range(1, len(parts) + 1):
            short = ".".join(parts[-n:])
            if sum(1 for k in keys if k == short or k.endswith("." + short)) == 1:
                break
        out.append(short)
    return out


def fit_name(name: str) -> str:
    """A name within config.NAME_RE's 64 characters: a longer one keeps 55 and adds 8 hex digits of its hash."""
    if len(name) <= MAX_NAME:
        return name
    return f"{name[:55].rstrip('_.+-')}-{hashlib.sha1(name.encode()).hexdigest()[:8]}"


def _nested(key: str, value: Any) -> dict:
    out: Any = value
    for part in reversed(key.split(".")):
        out = {part: out}
    return out


def _merge(into: dict, extra: dict) -> dict:
    """extra merged into a copy of `into` (nested dicts merge; anything else replaces)."""
    out = dict(into)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _dotted(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{'model.lora.r': 8, ...}: the leaves of nested dicts by their dotted keys (an empty dict has none)."""
    if not isinstance(tree, dict):
        return {prefix: tree} if prefix else {}
    out: dict[str, Any] = {}
    for k, v in tree.items():
        out.update(_dotted(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def _overlap(a: str, b: str) -> bool:
    """Two dotted keys name the same value, or one holds the other (model.lora and model.lora.r)."""
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def _refuse_overriding(axes: list[Axis], edits: list[list[dict]], own: dict) -> None:
    """A swept key that an experiment's variant sets itself would silently replace that variant's own value (r32
    swept to r=8 keeps its alpha 64): one line naming the override, the variants and their values. (A swept
    config group is not checked: its options set every key of the group, the variant's among them.)"""
    for axis, axis_edits in zip(axes, edits):
        if axis.group:  # a config group's option brings its defaults too (model=...: its lora.r): not refused here
            continue
        swept = {k for e in axis_edits for k in _dotted(e)}
        setters = {
            str(name): {k: v for k, v in _dotted(overrides or {}).items() if any(_overlap(k, w) for w in swept)}
            for name, overrides in own.items()
            if name is not None
        }
        setters = {n: kv for n, kv in setters.items() if kv}
        if setters:
            values = "; ".join(f"{n}: {', '.join(f'{k}={v}' for k, v in kv.items())}" for n, kv in setters.items())
            raise UserError(
                f"{axis.line}: the sweep would override what the experiment's variants set themselves ({values}): "
                "sweep another key, or set these values in the variants (variants.NAME.KEY=...)"
            )


def expand_grid(cfg: DictConfig, sweeps: list, fixed: list[str], compose: Callable) -> dict[str, dict]:
    """The experiment's variants (or none) times the grid of `sweeps`: name -> that variant's overrides, for
    cfg.variants. Raises UserError (one line naming the override) for a sweep that cannot be run."""
    fixed_keys = [o.key_or_group for o in parse_overrides(fixed)]
    axes: list[Axis] = []
    for o in sweeps:
        if o.key_or_group in (a.key for a in axes):
            raise UserError(f"{o.input_line}: {o.key_or_group} is swept twice: give all its values in one sweep")
        axes.append(_axis(o, fixed_keys))
    edits = []
    for axis, short in zip(axes, short_keys([a.key for a in axes])):
        axis.parts = [_part(short, v) for v in axis.values]
        twice = next((p for i, p in enumerate(axis.parts) if p in axis.parts[:i]), None)
        if twice is not None:
            raise UserError(
                f"{axis.line}: two of its values give the variant name part {twice!r} (the grid would "
                "hold two variants of the same name): give each value once"
            )
        if axis.group:
            edits.append(_group_changes(cfg, axis, fixed, compose))
        else:
            _check_values(cfg, axis)
            edits.append([_nested(axis.key, v) for v in axis.values])
    own = cast(dict, OmegaConf.to_container(cfg.variants, resolve=False) or {None: {}})
    _refuse_overriding(axes, edits, own)
    variants: dict[str, dict] = {}
    for prefix, overrides in own.items():
        for point in itertools.product(*(range(len(a.values)) for a in axes)):
            name = "_".join(
                ([str(prefix)] if prefix is not None else [])
                + [cast("list[str]", a.parts)[i] for a, i in zip(axes, point)]
            )
            name = fit_name(name)
            if name in variants:
                raise UserError(
                    f"the grid of {' '.join(a.line for a in axes)} gives two variants named {name!r} "
                    f"(with the experiment's variants: {', '.join(map(str, own))}): rename a variant "
                    "or change the values"
                )
            merged = dict(overrides or {})
            for axis_edits, i in zip(edits, point):
                merged = _merge(merged, axis_edits[i])
            variants[name] = merged
    return variants
