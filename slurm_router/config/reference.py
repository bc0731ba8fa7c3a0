"""Every config key and group, from one source (issue 41, 6): the schema's dataclasses (config/schema.py: each key's
type, its declaration's choices or bounds (config/settings.py), and the comment beside or above it) and the composed defaults (conf/, as a run gets
them). `--help` prints them as text (keys_text, groups_text); `--help-reference` prints docs/reference.md
(reference_markdown), which tests/test_help.py holds equal to the generator's output."""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import re
import sys
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurm_router.config import schema


@dataclass
class Key:
    key: str  # dotted, e.g. train.lr
    type: str  # int, float >0, one of auto | fp32 | bf16, ...
    default: str  # as typed on the command line
    what: str  # the schema's comment (the block above the key, and the one beside it)
    launchers: tuple[str, ...] = ()  # launcher.* keys: the launchers that have it
    line: str = ""  # --help's one line: the comment beside the key, else the block above it


@functools.cache
def _comments(module: str) -> dict[str, dict[str, tuple[str, str]]]:
    """class name -> field -> (the comment block just above it, the comment on its line) in that module's source."""
    source = inspect.getsource(sys.modules[module])
    lines = source.splitlines()
    found: dict[str, dict[str, tuple[str, str]]] = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        fields = found.setdefault(node.name, {})
        for item in node.body:
            if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
                continue
            line = lines[(item.end_lineno or item.lineno) - 1]  # a declaration over lines: the comment ends it
            text = line.split("  # ", 1)[1].strip() if "  # " in line else ""
            above: list[str] = []
            i = item.lineno - 2
            while i >= 0 and lines[i].strip().startswith("#"):
                above.insert(0, lines[i].strip().lstrip("#").strip())
                i -= 1
            fields[item.target.id] = (" ".join(above), text)
    return found


def _note(cls: type, name: str) -> tuple[str, str]:
    """The comments of field `name` where it is written: cls or the first base class that declares it."""
    for c in cls.__mro__:
        found = _comments(c.__module__).get(c.__name__, {}) if c.__module__ in sys.modules else {}
        if name in found:
            return found[name]
    return "", ""


def _type_name(hint: Any, key: str) -> str:
    found = schema.declared().get(key)
    declared = found[0] if found else None
    choices = schema.choices(key)
    if choices:
        return "|".join(choices)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union and type(None) in args:
        inner = [a for a in args if a is not type(None)]
        return f"{_type_name(inner[0], key)} or null"
    if origin in (list, typing.List):
        return f"list of {_type_name(args[0], key)}" if args and args[0] is not Any else "list"
    if origin in (dict, typing.Dict):
        return "mapping"
    if hint is Any:
        return (declared.takes if declared else "") or "any"
    name = getattr(hint, "__name__", str(hint))
    limits = declared.bounds if declared else None
    if limits and name in ("int", "float"):
        low, high, inclusive = limits
        if high is not None:
            return f"{name} {low}-{high}" if inclusive else f"{name} >{low}, <={high}"
        return f"{name} >={low}" if inclusive else f"{name} >{low}"
    return name


def _shown(value: Any) -> str:
    from omegaconf import OmegaConf

    if OmegaConf.is_config(value):
        value = OmegaConf.to_container(value)
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return repr(value) if value == "" or value != value.strip() or "\n" in value else value
    if isinstance(value, (list, dict)) and not value:
        return "[]" if isinstance(value, list) else "{}"
    return str(value).replace("'", "")


def _walk(cls: type, prefix: str, composed: Any, out: list[Key]) -> None:
    from omegaconf import OmegaConf

    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key, hint = prefix + f.name, hints[f.name]
        if dataclasses.is_dataclass(hint):
            _walk(typing.cast(type, hint), key + ".", composed, out)
            continue
        if key in ("launcher", "variants"):
            continue  # launcher.*: per launcher (launcher_keys); variants: their own section
        above, beside = _note(cls, f.name)
        what = " ".join(t for t in (above, beside) if t)
        out.append(Key(key, _type_name(hint, key), _shown(OmegaConf.select(composed, key)), what, line=beside or above))


def config_keys() -> list[Key]:
    """Every key but launcher.*, with the default a run gets (conf/ composed over the schema)."""
    from slurm_router.config.compose import compose

    out: list[Key] = []
    _walk(schema.Config, "", compose([]), out)
    return out


def launcher_keys() -> list[Key]:
    """launcher.*: each key once, the launchers that have it, its default (the same for all that have it)."""
    from slurm_router.config.compose import compose

    rows: dict[str, Key] = {}
    for kind_schema in schema.LAUNCHER_SCHEMAS:
        out: list[Key] = []
        _walk(kind_schema, "launcher.", compose([f"launcher={kind_schema.kind}"]), out)
        for k in out:
            if k.key in rows:
                rows[k.key].launchers += (kind_schema.kind,)
            else:
                rows[k.key] = dataclasses.replace(k, launchers=(kind_schema.kind,))
    return [k for k in rows.values() if k.key != "launcher.kind"]


def groups() -> list[tuple[str, list[tuple[str, bool, str]]]]:
    """(group, [(option, is the default, its file's first comment line)]) over conf/ and --config-dir's folders."""
    from slurm_router.config.compose import _USER_DIRS, compose
    from slurm_router.config.user_dirs import builtin_groups

    settings: dict = {}
    compose([], hydra=settings)
    chosen = settings["choices"]
    out = []
    for group in builtin_groups():
        options: dict[str, str] = {}
        for folder in [Path(schema.conf_dir()), *_USER_DIRS]:
            for f in sorted((folder / group).glob("*.yaml")):
                options.setdefault(f.stem, _first_comment(f))
        out.append((group, [(o, chosen.get(group) == o, what) for o, what in sorted(options.items())]))
    return out


def _first_comment(f: Path) -> str:
    """The first sentence of the comment block a config file starts with (after Hydra's package line)."""
    block = []
    for line in f.read_text().splitlines():
        text = line.strip().lstrip("#").strip()
        if not line.strip().startswith("#"):
            break
        if text and not text.startswith("@package"):
            block.append(text)
    text = re.sub(r"\s+", " ", " ".join(block))
    end = text.find(". ")
    return text if end < 0 else text[: end + 1]  # its first sentence


def short(text: str, width: int = 96) -> str:
    """The comment's first clause that fits: never a sentence cut in the middle of a word."""
    text = re.sub(r"\s+", " ", text).strip()
    if len(text) <= width:
        return text
    for sep in (". ", "; ", ": "):
        cut = text.find(sep, 20)
        if 0 < cut <= width:
            return text[:cut].rstrip(".")
    return text[: text.rfind(" ", 0, width - 3)] + " ..."


def groups_text() -> str:
    lines = ["config groups (GROUP=OPTION; +experiment=NAME adds an experiment; * the default):"]
    for group, options in groups():
        for i, (option, default, what) in enumerate(options):
            name = f"{option}{'*' if default else ''}"
            lines.append(f"  {group if i == 0 else '':11s}{name:14s}{short(what, 80)}".rstrip())
    return "\n".join(lines)


def keys_text(width: int = 60) -> str:
    """--help's keys: one line each (the key, its type, its default, the schema's comment that fits `width`)."""
    rows = [*config_keys(), *launcher_keys()]
    wide = max(len(k.key) for k in rows) + 2
    lines = ["keys (KEY=VALUE; the type, the default, what it does; launcher.* says which launchers have it):"]
    cells: list[tuple[str, str, str, str]] = []
    for k in rows:
        kind, what = k.type, k.line
        if "|" in kind:  # a choice: its values lead the line unless the comment lists them
            choices = kind.split("|")
            kind, what = "str", what if all(c in what for c in choices) else f"{' | '.join(choices)}; {what}"
        if k.launchers and len(k.launchers) < len(schema.LAUNCHER_SCHEMAS):
            what = f"[{', '.join(k.launchers)}] {what}"
        default = k.default if len(k.default) <= 12 else k.default[:9] + "..."
        cells.append((k.key, kind, default, short(what, width)))
    # each column as wide as its widest cell and two spaces: `int, list or auto` never runs into its default
    kinds, defaults = (max(len(c[i]) for c in cells) + 2 for i in (1, 2))
    lines += [
        f"  {key:{wide}s}{kind:{kinds}s}{default:{defaults}s}{what}".rstrip() for key, kind, default, what in cells
    ]
    return "\n".join(lines)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ") or " "


def reference_markdown() -> str:
    """docs/reference.md: every group and its options, every key with its type, default and line."""
    out = [
        "# Configuration reference",
        "",
        "Generated from the schema (`slurm_router/config/schema.py`) and the built-in `conf/` by",
        "`python -m slurm_router --help-reference > docs/reference.md`; `tests/test_help.py` fails when this page",
        "and the generator differ. `python -m slurm_router --help` prints the same keys in a terminal. Set a key",
        "with `KEY=VALUE`, pick a group's option with `GROUP=OPTION`, an experiment with `+experiment=NAME`",
        "(your own: [experiments.md](experiments.md)).",
        "",
        "## Config groups",
        "",
        "| group | option | what it is |",
        "|---|---|---|",
    ]
    for group, options in groups():
        for option, default, what in options:
            out.append(f"| {group} | `{option}`{' (default)' if default else ''} | {_cell(what)} |")
    sections: dict[str, list[Key]] = {}
    for k in config_keys():
        head = k.key.split(".")[0] if "." in k.key else "top level"
        sections.setdefault(head, []).append(k)
    for head, rows in sections.items():
        out += ["", f"## {head if head == 'top level' else head + '.*'}", "", "| key | type | default | what it does |"]
        out.append("|---|---|---|---|")
        out += [f"| `{k.key}` | {_cell(k.type)} | `{_cell(k.default)}` | {_cell(k.what)} |" for k in rows]
    out += ["", "## launcher.*", "", "| key | launchers | type | default | what it does |", "|---|---|---|---|---|"]
    for k in launcher_keys():
        which = ", ".join(k.launchers)
        out.append(f"| `{k.key}` | {which} | {_cell(k.type)} | `{_cell(k.default)}` | {_cell(k.what)} |")
    out += [
        "",
        "## variants",
        "",
        "`variants.NAME.KEY=VALUE` changes one variant's key (any key above); `+variants.NAME.KEY=VALUE` adds a",
        "variant. An experiment file lists them under `variants:`.",
        "",
    ]
    return "\n".join(out)
