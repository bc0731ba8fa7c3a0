"""--help, resume --help, --info and --help-reference (issue 41, 6): the usage, the options, and the config groups and
keys generated from the schema (config/reference.py), the same source as docs/reference.md."""

from __future__ import annotations

import sys

USAGE = """usage: slurm-router [-m] [--config-dir DIR] [+experiment=NAME] [GROUP=OPTION ...] [KEY=VALUE ...]
       (python -m slurm_router is the same command)
  a run:    slurm-router +experiment=lora_ab                     a base stage, two LoRA variants, the report
  the plan: slurm-router +experiment=lora_ab dry_run=true        what would run, where; nothing trains
  the config: slurm-router +experiment=lora_ab --cfg job         the composed config; nothing is written
  yours:    slurm-router init; slurm-router --config-dir conf +experiment=my_experiment   (docs/experiments.md)
  values:   train.steps=20 train.lr=1e-3 resources.devices_per_task=2 data=text_dir data.path=~/my_texts
  seeds:    seeds=3 runs every variant with 3 training seeds (seed, seed+1, seed+2), or seeds=[0,5,9];
            prune=true (with seeds >= 2 and train.eval_every) stops clear losers at an evaluation;
            seeds=auto prune=true: 2 seeds each, one more at a time while undecided (auto_seeds.max;
            auto_seeds.min_effect=0.02 also stops once every variant is within 0.02 of the best)
  sweep:    -m (--multirun) model.lora.r=4,8 train.lr=range(1,4) router=round_robin,balanced: Hydra's sweep
            syntax, the grid's variants in one run (named from their overrides, e.g. r4_lr1e-3)
  resume:   slurm-router resume RUN_DIR (see slurm-router resume --help)"""

OPTIONS = """options:
  -h, --help            this help: the usage, the commands, the config groups and every key
  -m, --multirun        a sweep: the grid of the sweep overrides becomes the run's variants
  -cd, --config-dir DIR your own config folder (DIR/experiment/NAME.yaml ...), after the built-in conf/;
                        also hydra.searchpath=[file://DIR,...]
  -c, --cfg job|hydra|all  print the composed config (job), the search path and choices (hydra), or both
  --resolve             with --cfg: resolve the interpolations
  --info                the version, where the configs come from, each group's default
  --help-reference      the configuration reference as Markdown (docs/reference.md)
  -V, --version         the version"""

RESUME = """usage: slurm-router resume RUN_DIR [launcher=local] [new_snapshot=true]
       (the same: slurm-router resume=RUN_DIR ...)

Continue an interrupted or failed run: its unfinished tasks, each from its newest valid checkpoint, with the
run's own config.yaml and launcher (a Slurm run is submitted again). Finished tasks are kept; a run whose every
task completed gets its report written, if it has none.

  RUN_DIR             the run directory (the run printed it as run_dir:)
  launcher=local      continue the tasks here, on this machine, whatever launcher ran them
  new_snapshot=true   a Slurm run's jobs import the current code, recorded as a new snapshot beside the run's
                      first (RUN_DIR/code); without it a run whose snapshot is gone is refused

A task that is still running (its job, or the process that launched it) is never started twice: resume refuses
a live run in one line. No other override is taken: the run continues with the config it started with."""


def main_help(subcommands: dict[str, str], first_line: str) -> str:
    from slurm_router.config.reference import groups_text, keys_text

    lines = [first_line, USAGE, "commands (slurm-router WORD, or python -m slurm_router WORD; WORD --help):"]
    lines += [f"  {word:9s} {what}" for word, what in subcommands.items()]
    return "\n".join([*lines, OPTIONS, groups_text(), keys_text(), _see_also()])


def _see_also() -> str:
    return (
        "every key in full: docs/reference.md (slurm-router --help-reference); your own experiments: "
        "docs/experiments.md"
    )


def info_text(version: str) -> str:
    """--info: what this installation composes from, as Hydra's --info does."""
    import slurm_router
    from slurm_router.config.compose import compose
    from slurm_router.config.schema import conf_dir

    settings: dict = {}
    compose([], hydra=settings)
    lines = [
        f"slurm-router {version}",
        f"python {sys.version.split()[0]} ({sys.executable})",
        f"package: {slurm_router.__path__[0]}",
        f"built-in configs: {conf_dir()}",
        "search path (first wins): " + ", ".join(settings["searchpath"]),
        "defaults: " + " ".join(f"{group}={choice}" for group, choice in settings["choices"].items()),
        "runs are written under run_root (default: runs/, from the current directory)",
    ]
    return "\n".join(lines)
