"""Credentials in a run's settings, kept out of everything the run writes where others can read it (a cluster's
shared file system, a run dir made 755): config.yaml, task.json, the manifest, the printed plan, logs, trackers' run
parameters. What is secret:
  - the password in the user-info of any URI-valued setting: `http://alice:s3cret@host:5000` is shown as
    `http://alice:***@host:5000`, `postgresql://user:pass@host/db` as `postgresql://user:***@host/db`; a user-info
    with no password is a token (`https://ghp_TOKEN@host`), shown as `https://***@host`;
  - a tracker setting the user takes from the environment, `tracker.mlflow_uri='${oc.env:MY_MLFLOW_URI}'`: its
    whole value is shown as `***` (the way to mark a tracker setting secret, README "Trackers").
The real values travel to the job in RUN_DIR/secrets.json (rundir/layout.py), made with mode 0600 before anything is written in it
(only its owner can read it; never printed); the job reads back what it needs (tracking/trackers.py Target.of)."""

from __future__ import annotations

import copy
import json
import os
import re
from pathlib import Path
from typing import Any, Iterable

MASK = "***"
MARKED_NODE = "tracker"  # where an ${oc.env:VAR} value is a secret as a whole (where credentials are read)
KeyPath = tuple[str, ...]  # a setting's keys from the config's root: a variant's name may hold a dot

# scheme://user:password@ : the password stops at '@', '/', whitespace or a quote ('/' ends the authority)
_URI_PASSWORD = re.compile(r"(\b[A-Za-z][A-Za-z0-9+.\-]*://[^\s/:@'\"]*:)[^\s/@'\"]+(?=@)")
# scheme://token@ : a user-info with no ':' is a token as often as a name (GitHub, Hugging Face URLs)
_URI_TOKEN = re.compile(r"(\b[A-Za-z][A-Za-z0-9+.\-]*://)[^\s/:@'\"]+(?=@)")


def redact_text(text: str) -> str:
    """Any text (a setting, a command line, an exception's message) with every URI's password as ***."""
    text = _URI_PASSWORD.sub(lambda m: m.group(1) + MASK, text)
    return _URI_TOKEN.sub(lambda m: m.group(1) + MASK, text)


def _flat(tree: Any, prefix: KeyPath = ()) -> dict[KeyPath, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree} if prefix else {}
    out: dict[KeyPath, Any] = {}
    for k, v in tree.items():
        out.update(_flat(v, (*prefix, str(k))))
    return out


def _set(tree: dict, key: KeyPath, value: Any) -> Any:
    """Put value at key in tree (a path that is there); returns the value it replaces (None: not there)."""
    node: Any = tree
    for p in key[:-1]:
        node = node.get(p) if isinstance(node, dict) else None
    if not isinstance(node, dict) or key[-1] not in node:
        return None
    old, node[key[-1]] = node[key[-1]], value
    return old


def marked_keys(cfg: Any) -> set[KeyPath]:
    """The tracker settings a composed config takes from the environment (`${oc.env:VAR}`), as key paths."""
    from omegaconf import OmegaConf

    raw = _flat(OmegaConf.to_container(cfg, resolve=False))
    return {k for k, v in raw.items() if k[0] == MARKED_NODE and isinstance(v, str) and "${oc.env:" in v}


def hide(tree: dict, marked: Iterable[KeyPath] = ()) -> tuple[dict, list]:
    """(a copy of a resolved config tree with its secrets shown as ***, [[key path, real value], ...])."""
    marked, found, shown = set(marked), [], copy.deepcopy(tree)
    for key, value in _flat(tree).items():
        if not isinstance(value, str) or value == MASK:
            continue
        masked = MASK if key in marked and value else redact_text(value)
        if masked != value:
            found.append([list(key), value])
            _set(shown, key, masked)
    return shown, found


def hide_config(cfg: Any, marked: Iterable[KeyPath] | None = None) -> tuple[Any, list]:
    """A composed DictConfig resolved, with its secrets shown as *** (what config.yaml and the plan show)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    marked = marked_keys(cfg) if marked is None else marked
    try:
        tree = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException:  # --cfg job with an ${oc.env:VAR} unset: the values as written
        tree = OmegaConf.to_container(cfg, resolve=False)
    found = hide(tree, marked)[1]  # type: ignore[arg-type]
    if not found:
        return cfg, found
    shown = copy.deepcopy(cfg)  # the schema's types and the other interpolations kept
    for key, value in found:
        node = shown
        for p in key[:-1]:
            node = node[p]
        node[key[-1]] = MASK if tuple(key) in marked else redact_text(value)
    return shown, found


def hide_in_specs(specs: Iterable[Any], marked: Iterable[KeyPath]) -> dict[str, list]:
    """Each task spec's config replaced by a copy with its secrets shown as *** (the specs are what task.json and
    the Slurm launchers' pickles hold); returns {task name: [[key path, real value], ...]} for those with any.
    A copy, never in place: the tasks of one variant's seeds share their config."""
    marked, secrets = set(marked), {}
    for spec in specs:
        spec.config, found = hide(spec.config, marked)
        if found:
            secrets[spec.name] = found
    return secrets


def write_secrets(path: str | os.PathLike, secrets: dict) -> None:
    """RUN_DIR/secrets.json, created with mode 0600 (never readable by others, not even for a moment):
    {"config": [[key path, real value], ...], "tasks": {task name: [[key path, real value], ...]}}."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(secrets, f)


def read_secrets(path: str | os.PathLike) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def reveal(tree: dict, path: str | os.PathLike, task: str | None = None) -> tuple[dict, dict[str, str]]:
    """(a copy of a task's config (task: its name) or of config.yaml (None) with the real values back from
    RUN_DIR/secrets.json (path), {real value: the value shown}): for the job's own use, never to be written."""
    data = read_secrets(path)
    found = (data.get("tasks") or {}).get(task) if task else data.get("config")
    out, shown = copy.deepcopy(tree), {}
    for key, value in found or []:
        old = _set(out, tuple(key), value)
        if old is not None:
            shown[value] = old
    return out, shown
