"""Compose + check the config -> plan -> launch -> report -> print the run dir.

    python -m slurm_router +experiment=lora_ab                  # here, on the GPUs (or CPU) present
    python -m slurm_router +experiment=lora_ab launcher=slurm   # one Slurm array job per stage
    python -m slurm_router +experiment=lora_ab router=round_robin train.steps=20 resources.devices_per_task=2
    python -m slurm_router resume=runs/lora_ab/<timestamp>      # continue an interrupted run's unfinished tasks
"""
from __future__ import annotations

import re
import sys

from slurm_router.config import UserError

USAGE = """usage: python -m slurm_router [+experiment=NAME] [group=option ...] [key=value ...]
  groups: model data router launcher experiment (see conf/); e.g. +experiment=lora_ab router=round_robin
  values: train.steps=20 train.lr=1e-3 resources.devices_per_task=2 data=text_dir data.path=/my/texts
  resume: resume=RUN_DIR continues that run's unfinished tasks from their checkpoints with the run's own
          launcher (a Slurm run is submitted again); resume=RUN_DIR launcher=local continues them here"""


def compose(overrides: list[str]):
    """Hydra's compose API (not @hydra.main: no cwd change, no outputs/ folder, our own error lines)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException, MissingConfigException
    from omegaconf.errors import OmegaConfBaseException

    from slurm_router.config import EXPERIMENT_HINT, check_launcher_keys, conf_dir, explain, register_schema
    register_schema()
    # variants.<name>.* is free-form (each variant is a set of overrides): let users add keys there without
    # Hydra's '+' prefix; the merged variant is still checked against the schema.
    overrides = [f"++{o}" if o.startswith("variants.") else o for o in overrides]
    try:
        with initialize_config_dir(config_dir=conf_dir(), version_base=None, job_name="slurm_router"):
            cfg = hydra_compose(config_name="config", overrides=overrides)
    except MissingConfigException as e:
        raise _missing_option(e) from None
    except (HydraException, OmegaConfBaseException) as e:
        cause = e.__cause__ if isinstance(e.__cause__, OmegaConfBaseException) else e
        if isinstance(cause, OmegaConfBaseException):
            raise explain(cause) from None
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "Could not override 'experiment'" in first:         # experiment=NAME: Hydra takes it for the group
            raise UserError(f"experiment=...: {EXPERIMENT_HINT}") from None
        raise UserError(f"{first} (see: python -m slurm_router --help)") from None
    check_launcher_keys(cfg)
    return cfg


def _missing_option(e) -> UserError:
    text = str(e)
    m = re.search(r"Could not find '([^/']+)/([^']+)'", text)
    # the launcher schemas sit in the launcher group too (ConfigStore): they are not options to pick
    options = [o for o in re.findall(r"^\t(\S+)$", text, flags=re.M) if not o.endswith("_schema")]
    if m:
        group, option = m.groups()
        return UserError(f"{group}={option}: no such {group} in conf/{group}/; choose one of: "
                         f"{', '.join(options) or '(none)'}")
    return UserError(text.strip().splitlines()[0])


def _tokenizer(cfg):
    from slurm_router.train.data import make_tokenizer
    try:                        # a local checkpoint can be broken in many ways; each is the user's to fix
        return make_tokenizer(cfg.model)
    except UserError:
        raise
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise UserError(f"model.name_or_path={cfg.model.name_or_path!r}: cannot load its tokenizer ({first}): "
                        "give a complete local transformers checkpoint (config, weights, tokenizer files)") from None


def run(overrides: list[str]) -> int:
    resume = [o for o in overrides if o.split("=", 1)[0].lstrip("+") == "resume"]
    if resume:
        others = [o for o in overrides if o not in resume]
        if len(resume) > 1 or others not in ([], ["launcher=local"]):
            raise UserError("resume=RUN_DIR takes no other arguments but launcher=local: the run continues with "
                            "its own config.yaml")
        return resume_run(resume[0].split("=", 1)[1], here=bool(others))
    cfg = compose(overrides)
    from slurm_router.config import validate
    from slurm_router.launch.registry import launcher_class
    variants = validate(cfg)
    launcher = launcher_class(cfg.launcher.kind)
    launcher.check(cfg)
    from slurm_router.train.data import build_corpus
    corpus = build_corpus(cfg.data, _tokenizer(cfg))   # fail on bad data before any file is written
    print(f"experiment {cfg.experiment}: {len(variants)} variant(s) {', '.join(variants)}; "
          f"data {corpus.description}: {len(corpus.train)} train / {len(corpus.val)} held-out samples")

    from slurm_router.launch.base import launch
    from slurm_router.plan import make_plan
    from slurm_router.rundir import create_run_dir, new_run_dir
    run_id, run_dir = new_run_dir(cfg)
    stages = make_plan(cfg, variants, run_id, str(run_dir))
    manifest = create_run_dir(cfg, run_id, run_dir, stages, cfg.launcher.kind)
    return launch(launcher(cfg, manifest), stages)


def resume_run(arg: str, here: bool = False) -> int:
    """resume=RUN_DIR: the unfinished tasks of that run, each from its newest valid checkpoint, with the run's
    own launcher (a Slurm run is submitted again), or here with launcher=local."""
    if not arg:
        raise UserError("resume= needs a run directory: resume=runs/<experiment>/<timestamp>")
    from slurm_router.launch.base import launch
    from slurm_router.launch.registry import launcher_class
    from slurm_router.resume import plan_resume, renew_timeout_budget
    manifest, cfg, stages = plan_resume(arg)
    run_dir = manifest.layout.root
    kind = "local" if here else cfg.get("launcher", {}).get("kind", "local")
    todo = [t for s in stages if not s.cached for t in s.tasks]
    if not todo:
        print(f"resume: every task of {run_dir} has completed; nothing to do\nrun_dir: {run_dir}")
        return 0
    launcher = launcher_class(kind)(cfg, manifest)
    launcher.check_resume()
    # never run a task twice at once: whatever launched the run before must hold none of its tasks now
    launcher_class(manifest.data.get("launcher", "local"))(cfg, manifest).refuse_live_tasks()
    renew_timeout_budget(todo)        # the user chose to go on: launcher.max_requeues counts afresh
    manifest.set(state="running", resumed=manifest.data.get("resumed", 0) + 1, launcher=kind)
    return launch(launcher, stages)


def main(argv: list[str] | None = None) -> int:
    # Ctrl-C must always reach us: a process started in the background by a non-interactive shell inherits
    # SIGINT ignored, and Python then installs no handler (the Ctrl-C race of issue 11).
    import signal
    signal.signal(signal.SIGINT, signal.default_int_handler)
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip().splitlines()[0])
        print(USAGE)
        return 0
    bad = [a for a in argv if a.startswith("-")]
    if bad:
        print(f"error: unknown option {bad[0]}: arguments are Hydra overrides like train.steps=20 "
              "(see python -m slurm_router --help)", file=sys.stderr)
        return 2
    try:
        return run(argv)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
