"""The command line's options besides the overrides: Hydra's `--cfg job|hydra|all` (`-c`) and `--resolve`, and the
user's own config folders, `--config-dir DIR` (`-cd DIR`) and `hydra.searchpath=[DIR,...]` (config/user_dirs.py)."""

from __future__ import annotations

from slurm_router.errors import UserError

CFG_KINDS = ("job", "hydra", "all")
CONFIG_DIR = ("--config-dir", "-cd")
NOT_HERE = {  # Hydra's other config options: what to type instead
    "--config-path": "the root config is built in: add your own folder with --config-dir DIR",
    "-cp": "the root config is built in: add your own folder with --config-dir DIR",
    "--config-name": "the root config is built in: pick an experiment of yours with +experiment=NAME",
    "-cn": "the root config is built in: pick an experiment of yours with +experiment=NAME",
}


def _value(argv: list[str], i: int, flag: str) -> tuple[str, int]:
    """The value of `flag VALUE` or `flag=VALUE` at argv[i], and the index after it."""
    a = argv[i]
    if "=" in a:
        return a.split("=", 1)[1], i + 1
    import os

    after = argv[i + 1] if i + 1 < len(argv) else ""
    if not after or after.startswith("-") or ("=" in after and not os.path.exists(after)):  # an override, not DIR
        raise UserError(f"{flag} needs a folder: {flag} DIR +experiment=NAME ...")
    return argv[i + 1], i + 2


def cfg_options(argv: list[str]) -> tuple[list[str], str | None, bool]:
    """Hydra's `--cfg job|hydra|all` (`-c`) and `--resolve`: (the other arguments, the kind shown, resolve)."""
    rest, shown, resolve, i = [], None, False, 0
    while i < len(argv):
        a = argv[i]
        if a == "--resolve":
            resolve, i = True, i + 1
        elif a in ("--cfg", "-c") or a.startswith("--cfg="):
            value = a.split("=", 1)[1] if "=" in a else (argv[i + 1] if i + 1 < len(argv) else "")
            i += 1 if "=" in a else 2
            if value not in CFG_KINDS:
                raise UserError(f"--cfg {value or '(nothing)'}: show one of {', '.join(CFG_KINDS)} (--cfg job)")
            shown = value
        else:
            rest.append(a)
            i += 1
    if resolve and not shown:
        raise UserError("--resolve goes with --cfg job|all: it resolves the interpolations of the config shown")
    return rest, shown, resolve


def config_dir_options(argv: list[str]) -> tuple[list[str], list[tuple[str, str]]]:
    """(the other arguments, [(folder entry, as the user typed it)]) for --config-dir/-cd and hydra.searchpath=."""
    rest: list[str] = []
    entries: list[tuple[str, str]] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        flag = a.split("=", 1)[0]
        if flag in CONFIG_DIR:
            value, i = _value(argv, i, flag)
            entries.append((value, f"{flag} {value}"))
            continue
        if flag in NOT_HERE:
            raise UserError(f"{flag}: {NOT_HERE[flag]} (python -m slurm_router init writes a starter experiment)")
        if flag.lstrip("+") == "hydra.searchpath":
            entries += [(e, f"hydra.searchpath entry {e}") for e in _searchpath(a)]
        else:
            _refuse_experiment_path(a)
            rest.append(a)
        i += 1
    return rest, entries


def _searchpath(override: str) -> list[str]:
    from slurm_router.config.sweep import parse_overrides

    try:
        value = parse_overrides([override.lstrip("+")])[0].value()
    except UserError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise UserError(
            f"{override}: hydra.searchpath is a list of folders, e.g. hydra.searchpath=[file://conf_mine] "
            "(or --config-dir conf_mine)"
        )
    return value


def _refuse_experiment_path(a: str) -> None:
    """+experiment=path/to/x.yaml: Hydra picks options by name, from a folder on the search path."""
    key, _, value = a.partition("=")
    if key.lstrip("+") == "experiment" and ("/" in value or value.endswith((".yaml", ".yml"))):
        from pathlib import Path

        p = Path(value)
        folder = p.parent.parent if p.parent.name == "experiment" else None
        fix = (
            f"--config-dir {folder} +experiment={p.stem}"
            if folder is not None
            else f"put it in DIR/experiment/{p.stem}.yaml, then --config-dir DIR +experiment={p.stem}"
        )
        raise UserError(f"{a}: +experiment= takes a name, not a path: {fix}")
