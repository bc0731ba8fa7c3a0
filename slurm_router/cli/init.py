"""slurm-router init [DIR] [--name NAME]: a commented starter experiment of the user's own, DIR/experiment/NAME.yaml
(DIR: conf by default, in the current directory), then run with `--config-dir DIR +experiment=NAME` (issue 41, 1;
docs/experiments.md). An existing file is never overwritten; nothing is written on a mistake."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from slurm_router.errors import UserError

STARTER = """\
# @package _global_
# {name}: an experiment of your own, written by `init`. This first line must stay: the keys below are the run's
# top-level keys. Run it from the folder that holds {dir}/:
#   {prog} --config-dir {dir} +experiment={name} dry_run=true   # the plan only: nothing trains
#   {prog} --config-dir {dir} +experiment={name}                # train, then write the report
# Any key can still be set on the command line (train.steps=20). Every key, its type and default:
#   {prog} --help (and docs/reference.md); your own experiments: docs/experiments.md.

# Other options of the config groups (model, data, router, launcher, tracker) go in a defaults list:
# defaults:
#   - override /data: text_dir      # your own .txt files (data.path below)
#   - override /launcher: slurm     # one Slurm array job per stage (launcher.partition=...)

experiment: {name}                  # the run's name: runs/{name}/<time>/

# data:
#   path: ~/my_texts                # with data=text_dir: a folder of .txt files

# A small base model trained first (no LoRA), cached by its config hash: later runs reuse it. Without a base
# stage or a checkpoint (model=hf model.name_or_path=DIR) LoRA fine-tunes a randomly initialised model.
base:
  enabled: true
  steps: 100

train:
  steps: 50                         # optimiser steps per variant
  lr: 5.0e-3
  eval_every: 25                    # held-out loss every 25 steps (0: at the start and the end only)

# The variants: a name each, and the keys it changes from the config above. Each one is fine-tuned from the
# same base; the report compares their held-out losses (a variant of its own: add a name and its keys).
variants:
  r8:
    model: {{lora: {{r: 8, alpha: 16}}}}
  r32:
    model: {{lora: {{r: 32, alpha: 64}}}}
"""


def program() -> str:
    """How the user called the command: the console script or python -m."""
    return "slurm-router" if Path(sys.argv[0]).name == "slurm-router" else "python -m slurm_router"


def write_starter(folder: str, name: str) -> Path:
    """DIR/experiment/NAME.yaml, checked first: a valid name, no built-in experiment of that name, no file there."""
    from slurm_router.config.checks import check_writable_dir
    from slurm_router.config.schema import NAME_RE
    from slurm_router.config.user_dirs import builtin_groups

    if not NAME_RE.match(name) or "." in name:
        raise UserError(f"--name {name!r}: an experiment's name is letters, digits, '_', '-' (e.g. --name my_lora)")
    if name in builtin_groups().get("experiment", set()):
        raise UserError(f"--name {name}: a built-in experiment has that name and would be picked first: choose another")
    root = check_writable_dir(folder, f"init {folder}", fix="give a folder you can write")
    target = root / "experiment" / f"{name}.yaml"
    if target.exists():
        raise UserError(f"{target} exists: it is kept as it is; give another --name, or edit that file")
    if (root / "config.yaml").exists():
        raise UserError(f"{root / 'config.yaml'}: the root config is built in; give init a folder without config.yaml")
    target.parent.mkdir(parents=True, exist_ok=True)
    shown = os.path.relpath(root) if not os.path.relpath(root).startswith("..") else str(root)
    text = STARTER.format(name=name, dir=shown, prog=program())
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, target)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"{program()} init", description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", nargs="?", default="conf", metavar="DIR", help="your config folder (default: conf)")
    parser.add_argument("--name", default="my_experiment", help="the experiment's name (default: my_experiment)")
    args = parser.parse_args(argv)
    try:
        target = write_starter(args.dir, args.name)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rel = os.path.relpath(target)
    folder = os.path.relpath(target.parent.parent)
    prog = program()
    print(f"wrote {rel}: a commented starter experiment (a small base model, two LoRA variants)")
    print("next:")
    print(f"  {prog} --config-dir {folder} +experiment={args.name} dry_run=true   # the plan: nothing trains")
    print(f"  {prog} --config-dir {folder} +experiment={args.name}                # train, then the report")
    return 0
