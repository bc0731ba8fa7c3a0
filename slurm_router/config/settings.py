"""One declaration per setting: what a key takes, who reads it, and where it may be set, written once beside its
schema field (`train.lr: float = setting(2e-3, bounds=(0, 10, False), reader=...)`) or, for a launcher's keys, by
the launcher schema's `declared()` hook. Everything else is derived from it: the value checks (config/checks.py),
the unread rules (config/unread.py), the sweep's and the variants' refusals, `--help` and docs/reference.md
(config/reference.py), and tests/test_every_setting.py. The help line is the comment beside the field."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

Bounds = tuple[float, "float | None", bool]  # (low, high, low inclusive); high None: unbounded


@dataclass(frozen=True)
class Condition:
    """A key read only under another setting: `reads(cfg)` says whether a config reads it; when not, the key set by
    the user is refused with `why(cfg)` (the setting that leaves it unread, in words) and `fix`. `off` and `on`:
    overrides that leave it unread and that make it read (tests/test_every_setting.py tries both)."""

    reads: Callable[[Any], bool]
    why: Callable[[Any], str]
    fix: Any  # str, or a function of the config
    off: tuple[str, ...] = ()
    on: tuple[str, ...] = ()

    def fix_for(self, cfg) -> str:
        return self.fix(cfg) if callable(self.fix) else self.fix


@dataclass(frozen=True)
class Setting:
    """A key's facts. reader: "module: code" under slurm_router/ that reads it (a mapping launcher kind -> that,
    where each launcher reads it in its own place); choices or bounds: what it takes (`takes`: for an Any field,
    in words); read_if: the condition it is read under; sweep / variant: why a -m sweep may not vary it or a variant
    may not set it ('' = they may); example: a value other than its default (a test sets it)."""

    reader: str | Mapping[str, str] = ""
    choices: tuple[str, ...] = ()
    bounds: Bounds | None = None
    takes: str = ""
    read_if: Condition | None = None
    sweep: str = ""
    variant: str = ""
    example: str = ""

    def reader_for(self, launcher: str) -> tuple[str, str] | None:
        """(module, code) that reads the key under launcher=kind, or None."""
        site = self.reader.get(launcher, "") if isinstance(self.reader, Mapping) else self.reader
        if not site:
            return None
        module, _, code = site.partition(": ")
        return module, code


NONE = Setting()


def setting(default: Any = dataclasses.MISSING, *, factory: Any = dataclasses.MISSING, **facts: Any) -> Any:
    """A dataclass field with its declaration (Setting's facts) as metadata."""
    meta = {"setting": Setting(**facts)}
    if factory is not dataclasses.MISSING:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def declaration(f: dataclasses.Field) -> Setting:
    return f.metadata.get("setting", NONE)


def _fields(schema: type, prefix: str) -> Iterator[tuple[str, Setting, Any]]:
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        key, hint = prefix + f.name, hints[f.name]
        yield key, declaration(f), hint
        if dataclasses.is_dataclass(hint):
            yield from _fields(typing.cast(type, hint), key + ".")


def walk(schema: type, prefix: str = "") -> Iterator[tuple[str, Setting, Any]]:
    """(dotted key, its declaration, its type hint) for every field of a schema dataclass and of the dataclasses
    in it (a nested dataclass's own field, then its keys). A schema's `declared()` hook (a launcher's: its
    backend's keys, by their names under it, e.g. "container.runtime") adds to the fields' own metadata."""
    hooked = getattr(schema, "declared", None)
    extra = {prefix + k: v for k, v in hooked().items()} if hooked else {}
    for key, found, hint in _fields(schema, prefix):
        yield key, extra.get(key, found), hint
