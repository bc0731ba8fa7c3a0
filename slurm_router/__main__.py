"""Compose + check the config -> plan -> launch -> report -> print the run dir.

    python -m slurm_router +experiment=lora_ab                  # here, on the GPUs (or CPU) present
    python -m slurm_router +experiment=lora_ab launcher=slurm   # one Slurm array job per stage
    python -m slurm_router +experiment=lora_ab router=round_robin train.steps=20 resources.devices_per_task=2
    python -m slurm_router resume=runs/lora_ab/<timestamp>      # continue an interrupted run's unfinished tasks
"""
from __future__ import annotations

import json
import re
import shutil
import sys
import warnings

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

    from slurm_router.config import conf_dir, explain, register_schema
    register_schema()
    # variants.<name>.* is free-form (each variant is a set of overrides): let users add keys there without
    # Hydra's '+' prefix; the merged variant is still checked against the schema.
    overrides = [f"++{o}" if o.startswith("variants.") else o for o in overrides]
    try:
        with initialize_config_dir(config_dir=conf_dir(), version_base=None, job_name="slurm_router"):
            return hydra_compose(config_name="config", overrides=overrides)
    except MissingConfigException as e:
        raise _missing_option(e) from None
    except (HydraException, OmegaConfBaseException) as e:
        cause = e.__cause__ if isinstance(e.__cause__, OmegaConfBaseException) else e
        if isinstance(cause, OmegaConfBaseException):
            raise explain(cause) from None
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"{first} (see: python -m slurm_router --help)") from None


def _missing_option(e) -> UserError:
    text = str(e)
    m = re.search(r"Could not find '([^/']+)/([^']+)'", text)
    options = re.findall(r"^\t(\S+)$", text, flags=re.M)
    if m:
        group, option = m.groups()
        return UserError(f"{group}={option}: no such {group} in conf/{group}/; choose one of: "
                         f"{', '.join(options) or '(none)'}")
    return UserError(text.strip().splitlines()[0])


def check_devices(cfg) -> None:
    from slurm_router.launch.local import detect_gpus
    import os
    if cfg.launcher.kind != "local":
        return
    gpus = detect_gpus()
    need = max([cfg.resources.devices_per_task] + [int(v.get("resources", {}).get("devices_per_task", 0) or 0)
                                                     for v in cfg.variants.values() if v])
    if gpus and need > len(gpus):
        raise UserError(f"resources.devices_per_task={need} but this machine has {len(gpus)} GPU(s): "
                        f"ask for at most {len(gpus)}, or use launcher=slurm")
    if not gpus and need > (os.cpu_count() or 1):
        warnings.warn(f"resources.devices_per_task={need} CPU worker processes on {os.cpu_count()} cores: "
                      "they will share cores (fine for tests, slow for training)", stacklevel=1)


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
    variants = validate(cfg)
    check_devices(cfg)
    if cfg.launcher.kind in ("slurm", "sbatch") and not (cfg.launcher.kind == "sbatch" and cfg.launcher.dry_run):
        from slurm_router.launch.slurm import check_slurm
        check_slurm()
    if cfg.launcher.kind in ("slurm", "sbatch"):
        from slurm_router.launch.slurm import check_packing
        check_packing(cfg)
    if cfg.launcher.kind == "sbatch":
        from slurm_router.launch.slurm import check_sbatch
        check_sbatch(cfg)
    from slurm_router.train.data import build_corpus
    corpus = build_corpus(cfg.data, _tokenizer(cfg))   # fail on bad data before any file is written
    print(f"experiment {cfg.experiment}: {len(variants)} variant(s) {', '.join(variants)}; "
          f"data {corpus.description}: {len(corpus.train)} train / {len(corpus.val)} held-out samples")

    from slurm_router.plan import base_cache_dir, base_hash, make_plan
    from slurm_router.rundir import create_run_dir, new_run_dir
    run_id, run_dir = new_run_dir(cfg)
    stages = make_plan(cfg, variants, run_id, str(run_dir))
    manifest = create_run_dir(cfg, run_id, run_dir, stages, cfg.launcher.kind)
    for stage in stages:
        if stage.cached:
            cache = base_cache_dir(cfg) / base_hash(cfg)
            shutil.copy(cache / "meta.json", stage.tasks[0].task_dir / "result.json")
            print(f"base stage: reusing the cached base model {cache}")

    if cfg.launcher.kind in ("slurm", "sbatch"):
        return submit_to_slurm(cfg, stages, run_dir, manifest)

    return run_local(stages, cfg, run_dir, manifest)


def resume_run(arg: str, here: bool = False) -> int:
    """resume=RUN_DIR: the unfinished tasks of that run, each from its newest valid checkpoint, with the run's
    own launcher (a Slurm run is submitted again), or here with launcher=local."""
    if not arg:
        raise UserError("resume= needs a run directory: resume=runs/<experiment>/<timestamp>")
    from slurm_router.resume import plan_resume, renew_timeout_budget
    from slurm_router.rundir import Manifest
    run_dir, cfg, _, stages = plan_resume(arg)
    manifest = Manifest.load(run_dir)
    kind = "local" if here else cfg.get("launcher", {}).get("kind", "local")
    todo = [t for s in stages for t in s.tasks]
    if not todo:
        print(f"resume: every task of {run_dir} has completed; nothing to do\nrun_dir: {run_dir}")
        return 0
    if kind in ("slurm", "sbatch"):
        from slurm_router.launch.slurm import check_slurm
        check_slurm()
    if manifest.data.get("launcher") in ("slurm", "sbatch"):     # never run a task twice at once
        from slurm_router.slurm_status import live_tasks
        live = live_tasks(manifest.data)
        if live:
            raise UserError(f"resume={arg}: {len(live)} task(s) of this run are still in Slurm "
                            f"({', '.join(f'{t.variant} {t.job_id} {t.state}' for t in live[:3])}): wait for them "
                            f"(python -m slurm_router.status {run_dir} --wait) or cancel them (--cancel) first")
    renew_timeout_budget(todo)        # the user chose to go on: launcher.max_requeues counts afresh
    manifest.set(state="running", resumed=manifest.data.get("resumed", 0) + 1, launcher=kind)
    if kind in ("slurm", "sbatch"):
        return submit_to_slurm(cfg, stages, run_dir, manifest)
    return run_local(stages, cfg, run_dir, manifest)


def run_local(stages, cfg, run_dir, manifest) -> int:
    from slurm_router.launch.local import run_stages
    try:
        states = run_stages(stages, cfg, run_dir, manifest)
    except KeyboardInterrupt:
        manifest.set(state="interrupted")
        print(f"\ninterrupted: running tasks saved a checkpoint at their last step\n"
              f"continue with: python -m slurm_router resume={run_dir}\nrun_dir: {run_dir}")
        return 130
    ok = all(s in ("completed", "cached") for s in states.values())
    manifest.set(state="completed" if ok else "failed")

    from slurm_router.analysis.report import print_table, write_report
    try:
        summary = write_report(run_dir)
        print_table(summary)
    except Exception as e:                 # a failed run still prints where its files are
        print(f"report: not written ({e})", file=sys.stderr)
    if not ok:
        failed = [n for n, s in states.items() if s not in ("completed", "cached")]
        print(f"failed tasks: {', '.join(failed)}; logs in {run_dir / 'logs'}", file=sys.stderr)
    print(f"run_dir: {run_dir}")
    return 0 if ok else 1


def submit_to_slurm(cfg, stages, run_dir, manifest) -> int:
    from slurm_router.launch import slurm
    submit = slurm.submit_submitit if cfg.launcher.kind == "slurm" else slurm.submit_sbatch
    try:
        job_ids = submit(stages, cfg, run_dir, manifest)
    except UserError:
        manifest.set(state="failed")
        raise
    if not job_ids:                      # launcher.dry_run: rendered only
        manifest.set(state="rendered")
        print(f"run_dir: {run_dir}")
        return 0
    manifest.set(state="submitted", job_ids=job_ids)
    print(f"submitted {len(job_ids)} array job(s): {' '.join(job_ids)} "
          f"(python -m slurm_router.status {run_dir} [--wait])")
    if not cfg.launcher.wait:
        print(f"run_dir: {run_dir}")
        return 0
    from slurm_router.slurm_status import wait_for_run
    tasks = wait_for_run(manifest.data, poll_s=2.0)
    from slurm_router.slurm_status import SUCCESS_STATES
    ok = all(t.state in SUCCESS_STATES for t in tasks)
    manifest.set(state="completed" if ok else "failed")
    from slurm_router.analysis.report import print_table, write_report
    print_table(write_report(run_dir))
    print(f"run_dir: {run_dir}")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
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
