"""Compose + check the config -> plan -> launch -> report -> print the run dir.

slurm-router +experiment=lora_ab                  # here, on the GPUs (or CPU) present
slurm-router +experiment=lora_ab launcher=slurm   # one Slurm array job per stage
slurm-router +experiment=lora_ab router=round_robin train.steps=20 resources.devices_per_task=2
slurm-router +experiment=lora_ab seeds=3          # every variant once per training seed
slurm-router -m model.lora.r=4,8 train.lr=1e-3,3e-3   # a sweep: the grid's 4 variants, one run
slurm-router resume=runs/lora_ab/<timestamp>      # continue an interrupted run's unfinished tasks (cli/resume.py)

--cfg job|hydra|all shows the composed config instead; nothing is written.
"""

from __future__ import annotations

from slurm_router.cli.resume import is_resume, resume
from slurm_router.config.compose import compose
from slurm_router.errors import UserError


def run(overrides: list[str], multirun: bool = False) -> int:
    """A new run (or resume=RUN_DIR): every check, in order, before any file is written; then the run dir, the
    launch and the report."""
    from slurm_router.config.checks import refuse_hydra_overrides

    refuse_hydra_overrides(overrides)  # hydra.run.dir=..., hydra/launcher=...: not read here, never ignored
    if any(is_resume(o) for o in overrides):
        return resume(overrides, multirun)
    if any(o.split("=", 1)[0].lstrip("+") == "new_snapshot" for o in overrides):
        raise UserError(
            "new_snapshot=true goes with resume=RUN_DIR (a resumed Slurm run's jobs then import the "
            "current code, recorded as a new snapshot); a new Slurm run snapshots the current code anyway"
        )
    cfg = compose(overrides, multirun)
    from slurm_router.cli.checks import check_new_run
    from slurm_router.config.unread import set_keys
    from slurm_router.rundir.manifest import create_run_dir

    checked = check_new_run(cfg, set_keys(overrides))
    variants, launcher, corpus, run_id, run_dir = (
        checked.variants,
        checked.launcher,
        checked.corpus,
        checked.run_id,
        checked.run_dir,
    )
    print(
        f"experiment {cfg.experiment}: {_variants_line(variants)}; "
        f"data {corpus.description}: {len(corpus.train)} train / {len(corpus.val)} held-out samples"
        f"{corpus.counts_note()}"
    )

    from slurm_router.launch.base import launch
    from slurm_router.launch.plan import make_plan

    stages = make_plan(cfg, variants, run_id, str(run_dir), lambda n: launcher.auto_fuse_variants(cfg, n))
    from slurm_router.launch import forecast

    predicted = forecast.plan_forecast(cfg, stages)  # before secrets are hidden: the probe reads the real data
    # what is written and printed shows credentials as ***; the launcher keeps the real config (config/secrets.py)
    shown, secrets = _hide_secrets(cfg, variants, stages)
    if cfg.dry_run or cfg.launcher.get("dry_run"):  # the plan, the Slurm scripts, their submit commands
        from slurm_router.launch.preview import write_preview

        shown_variants = {n: _hide_secrets(v)[0] for n, v in variants.items()}
        return write_preview(shown, shown_variants, stages, run_id, run_dir, predicted)
    from slurm_router.scheduler.registry import backend_of

    packages = backend_of(cfg.launcher.kind).packages  # the backend's own (submitit), beside the core's versions
    manifest = create_run_dir(shown, run_id, run_dir, stages, cfg.launcher.kind, secrets=secrets, packages=packages)
    forecast.save(predicted, manifest.layout.root)
    for line in forecast.lines(predicted):  # the run's forecast, before it starts
        print(line, flush=True)
    return launch(launcher(cfg, manifest), stages)


def show_config(overrides: list[str], multirun: bool, shown: str, resolve: bool) -> int:
    """--cfg job|hydra|all [--resolve]: the composed config (with -m, the sweep's grid as its variants) and each
    variant's overrides, checked as a run's would be; nothing is written."""
    from slurm_router.config.checks import refuse_hydra_overrides
    from slurm_router.config.variants import variant_configs
    from slurm_router.launch.preview import cfg_text

    refuse_hydra_overrides(overrides)
    hydra_node: dict | None = {} if shown in ("hydra", "all") else None
    cfg = compose(overrides, multirun, hydra=hydra_node)
    if shown == "hydra":
        from omegaconf import OmegaConf

        print(OmegaConf.to_yaml(OmegaConf.create({"hydra": hydra_node})).rstrip())
        return 0
    variants = {n: _hide_secrets(v)[0] for n, v in variant_configs(cfg).items()}  # a URI's password as ***
    print(cfg_text(_hide_secrets(cfg)[0], variants, resolve, hydra_node))
    return 0


def _hide_secrets(cfg, variants: dict | None = None, stages: list | None = None):
    """(the config with its secrets shown as ***, what RUN_DIR/secrets.json keeps: the real values of config.yaml's
    and of each task's); the task specs' configs are replaced by their shown copies."""
    from slurm_router.config.secrets import hide_config, hide_in_specs, marked_keys

    marked = set(marked_keys(cfg)).union(*(marked_keys(v) for v in (variants or {}).values()))
    shown, found = hide_config(cfg, marked)
    specs = [t for s in stages or [] for t in [*s.tasks, *s.fused]]
    tasks = hide_in_specs(specs, marked)
    return shown, ({"config": found, "tasks": tasks} if found or tasks else {})


def _variants_line(variants: dict) -> str:
    """'2 variant(s) r8, r32 x 3 training seeds (0, 1, 2) = 6 tasks' (a long list shows its ends)."""
    from slurm_router.config.variants import training_seeds

    names = list(variants)
    shown = ", ".join(names if len(names) <= 12 else [*names[:5], "...", *names[-5:]])
    seeds = training_seeds(next(iter(variants.values())))
    if len(seeds) == 1:
        return f"{len(names)} variant(s) {shown}"
    listed = ", ".join(map(str, seeds if len(seeds) <= 8 else [*seeds[:3], "...", *seeds[-3:]]))
    return f"{len(names)} variant(s) {shown} x {len(seeds)} training seeds ({listed}) = {len(names) * len(seeds)} tasks"
