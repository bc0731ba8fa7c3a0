"""Compose + check the config -> plan -> launch -> report -> print the run dir.

python -m slurm_router +experiment=lora_ab                  # here, on the GPUs (or CPU) present
python -m slurm_router +experiment=lora_ab launcher=slurm   # one Slurm array job per stage
python -m slurm_router +experiment=lora_ab router=round_robin train.steps=20 resources.devices_per_task=2
python -m slurm_router +experiment=lora_ab seeds=3                 # every variant once per training seed
python -m slurm_router -m model.lora.r=4,8 train.lr=1e-3,3e-3      # a sweep: the grid's 4 variants, one run
python -m slurm_router resume=runs/lora_ab/<timestamp>      # continue an interrupted run's unfinished tasks
"""

from __future__ import annotations

import sys

if __name__ == "__main__":  # a Ctrl-C while the imports below load: one line and 130, as main() does later
    import signal

    def _interrupted_early(signum, frame):  # os._exit: nothing to clean up yet, and an exception raised
        print("\ninterrupted: nothing was written", file=sys.stderr, flush=True)  # in importlib's lock
        import os  # callbacks would be dropped ("Exception ignored")

        os._exit(130)

    signal.signal(signal.SIGINT, _interrupted_early)
    signal.signal(signal.SIGTERM, _interrupted_early)

from slurm_router.config.compose import compose_grid
from slurm_router.errors import UserError

USAGE = """usage: python -m slurm_router [-m] [+experiment=NAME] [group=option ...] [key=value ...]
  groups: model data router launcher tracker experiment (see conf/); e.g. +experiment=lora_ab router=round_robin
  values: train.steps=20 train.lr=1e-3 resources.devices_per_task=2 data=text_dir data.path=/my/texts
  seeds:  seeds=3 runs every variant with 3 training seeds (seed, seed+1, seed+2), or seeds=[0,5,9];
          prune=true (with seeds >= 2 and train.eval_every) stops clear losers at an evaluation
  sweep:  -m (--multirun) model.lora.r=4,8 train.lr=range(1,4) router=round_robin,balanced: Hydra's sweep syntax,
          the grid's variants in one run (named from their overrides, e.g. r4_lr1e-3)
  resume: resume=RUN_DIR continues that run's unfinished tasks from their checkpoints with the run's own
          launcher (a Slurm run is submitted again); resume=RUN_DIR launcher=local continues them here;
          a Slurm run's jobs import its code snapshot (RUN_DIR/code): if it is gone, resume=RUN_DIR
          new_snapshot=true records the current code as a new snapshot beside it"""


def run(overrides: list[str], multirun: bool = False) -> int:
    from slurm_router.config.checks import refuse_hydra_overrides

    refuse_hydra_overrides(overrides)  # hydra.run.dir=..., hydra/launcher=...: not read here, never ignored
    resume = [o for o in overrides if o.split("=", 1)[0].lstrip("+") == "resume"]
    if resume:
        from slurm_router.launch.snapshot import NEW_SNAPSHOT

        flags = [o for o in overrides if o.split("=", 1)[0] == NEW_SNAPSHOT]
        others = [o for o in overrides if o not in resume and o not in flags]
        if len(resume) > 1 or others not in ([], ["launcher=local"]) or multirun or len(flags) > 1:
            raise UserError(
                f"resume=RUN_DIR takes no other arguments but launcher=local and {NEW_SNAPSHOT}=true: "
                "the run continues with its own config.yaml"
            )
        new = _new_snapshot_flag(flags[0]) if flags else False
        if new and others:
            raise UserError(
                f"{NEW_SNAPSHOT}=true renews the code snapshot a Slurm run's jobs import; with "
                "launcher=local the tasks run this checkout as it is: drop one of the two"
            )
        return resume_run(resume[0].split("=", 1)[1], here=bool(others), new_snapshot=new)
    if any(o.split("=", 1)[0].lstrip("+") == "new_snapshot" for o in overrides):
        raise UserError(
            "new_snapshot=true goes with resume=RUN_DIR (a resumed Slurm run's jobs then import the "
            "current code, recorded as a new snapshot); a new Slurm run snapshots the current code anyway"
        )
    cfg = compose_grid(overrides, multirun)
    from slurm_router.cli.checks import check_new_run
    from slurm_router.config.unread import set_keys
    from slurm_router.rundir.manifest import create_run_dir

    checked = check_new_run(cfg, set_keys(overrides))  # every check, in order, before any file is written
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
    if cfg.dry_run or cfg.launcher.get("dry_run"):  # the plan, the Slurm scripts, their submit commands
        from slurm_router.launch.preview import write_preview

        return write_preview(cfg, variants, stages, run_id, run_dir)
    manifest = create_run_dir(cfg, run_id, run_dir, stages, cfg.launcher.kind)  # and its lock (rundir/lock.py)
    return launch(launcher(cfg, manifest), stages)


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


def _new_snapshot_flag(flag: str) -> bool:
    from slurm_router.launch.snapshot import NEW_SNAPSHOT

    value = flag.split("=", 1)[1].strip().lower()
    if value not in ("true", "false"):
        raise UserError(
            f"{flag}: {NEW_SNAPSHOT} is true or false (true: the jobs import the current code, recorded "
            "as a new snapshot beside the run's first)"
        )
    return value == "true"


def resume_run(arg: str, here: bool = False, new_snapshot: bool = False) -> int:
    """resume=RUN_DIR: the unfinished tasks of that run, each from its newest valid checkpoint, with the run's
    own launcher (a Slurm run is submitted again), or here with launcher=local. plan_resume takes the run's
    lock first (a second writer is refused, naming the holder) and plans from the manifest read under it.
    new_snapshot: the Slurm jobs import the current code, snapshotted anew beside the run's first snapshot (which
    is kept); without it a run whose snapshot is gone is refused (launch/snapshot.py)."""
    if not arg:
        raise UserError("resume= needs a run directory: resume=runs/<experiment>/<timestamp>")
    from slurm_router.launch.base import launch
    from slurm_router.launch.registry import launcher_class
    from slurm_router.launch.resume import plan_resume, renew_timeout_budget

    manifest, cfg, stages = plan_resume(arg)
    run_dir = manifest.layout.root
    kind = "local" if here else cfg.get("launcher", {}).get("kind", "local")
    todo = [t for s in stages if not s.cached for t in s.tasks]
    # never run a task twice at once: whatever launched the run before must hold none of its tasks now
    refuse_live_tasks = launcher_class(manifest.data.get("launcher", "local"))(cfg, manifest).refuse_live_tasks
    if not todo:
        if manifest.layout.summary.is_file():
            print(f"resume: every task of {run_dir} has completed; nothing to do\nrun_dir: {run_dir}")
            return 0
        refuse_live_tasks()  # interrupted during its report, or the report job failed: write it here
        print(f"resume: every task of {run_dir} has completed; writing the report")
        launcher_class("local")(cfg, manifest).report_job(after=None)
        manifest.set(state="completed")
        print(f"run_dir: {run_dir}")
        return 0
    if new_snapshot and launcher_class(kind).synchronous:
        raise UserError(
            f"new_snapshot=true: {run_dir} ran with launcher={kind}, whose tasks run this checkout as it "
            "is (no code snapshot): resume it without new_snapshot"
        )
    from slurm_router.cli.checks import check_resumed_run

    launcher = launcher_class(kind)(cfg, manifest)
    launcher.new_snapshot = new_snapshot
    check_resumed_run(cfg, launcher)
    refuse_live_tasks()
    renew_timeout_budget(todo)  # the user chose to go on: launcher.max_requeues counts afresh
    manifest.set(state="running", resumed=manifest.data.get("resumed", 0) + 1, launcher=kind)
    return launch(launcher, stages)


def _interrupted() -> int:
    """A Ctrl-C (or SIGTERM) outside the launcher's own handling (launch.base.launch): before a run dir was
    made, nothing was written; after, the run is marked interrupted and resume= continues it. One line each."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the bookkeeping short
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from slurm_router.rundir.lifecycle import EXIT_INTERRUPTED
    from slurm_router.rundir.lock import held_dirs

    dirs = held_dirs()
    if not dirs:
        print("\ninterrupted: nothing was written", file=sys.stderr)
    for root in dirs:
        from slurm_router.rundir.manifest import Manifest

        manifest = Manifest.load(root)
        state = manifest.data.get("state")
        if state in ("completed", "failed"):
            print(f"\ninterrupted after the run had ended ({state})\nrun_dir: {root}")
            continue
        if state == "running":
            manifest.set(state="interrupted")
        print(f"\ninterrupted: continue with: python -m slurm_router resume={root}\nrun_dir: {root}")
    return EXIT_INTERRUPTED


# `slurm-router WORD ...` (the console script, pyproject.toml) and `python -m slurm_router WORD ...`: a subcommand only
# when the first word is one of these (an override always has '='), so `slurm-router OVERRIDES...` still runs.
SUBCOMMANDS = {
    "run": "a new run: slurm-router run [-m] [OVERRIDES...] (the same as slurm-router OVERRIDES...)",
    "status": "the recent runs, or one run's tasks: slurm-router status [RUN_DIR] [--json] [--wait] [--follow] [--cancel]",
    "analysis": "the report, a comparison, or a tracker replay: slurm-router analysis RUN_DIR [RUN_B ...] [--to KIND]",
    "export": "a LoRA adapter merged into its base: slurm-router export RUN_DIR [VARIANT] [--best] --merge OUT",
    "resume": "an interrupted run's unfinished tasks: slurm-router resume RUN_DIR [launcher=local] [new_snapshot=true]",
}


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("slurm_router")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def _subcommand(word: str, rest: list[str]) -> int:
    """The commands that live in their own modules, under one name; `run` and `resume` are this module's own."""
    if word == "status":
        from slurm_router.cli.status import main as status_main

        return status_main(rest)
    if word == "export":
        from slurm_router.cli.export import main as export_main

        return export_main(rest)
    from slurm_router.analysis.__main__ import main as analysis_main

    return analysis_main(rest)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("status", "export", "analysis"):
        return _subcommand(argv[0], argv[1:])
    if argv and argv[0] == "run":
        argv = argv[1:]
    elif argv and argv[0] == "resume":
        if not argv[1:] or "=" in argv[1] or argv[1].startswith("-"):
            print(f"error: resume needs a run directory: {SUBCOMMANDS['resume']}", file=sys.stderr)
            return 2
        argv = [f"resume={argv[1]}", *argv[2:]]
    # Ctrl-C must always reach us: a process started in the background by a non-interactive shell inherits
    # SIGINT ignored, and Python then installs no handler (the Ctrl-C race of issue 11). `kill PID` (SIGTERM)
    # stops a run the same clean way: the tasks checkpoint, the run is marked interrupted, exit 130.
    # A KeyboardInterrupt the interpreter drops (raised in a callback) is raised again (lifecycle.raise_stop).
    import signal

    from slurm_router.rundir.lifecycle import forget_stops, raise_stop

    forget_stops()
    before = signal.signal(signal.SIGINT, raise_stop), signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, raise_stop)
    try:
        return _main(argv)
    finally:  # called in-process (tests): leave the caller's handlers as they were
        signal.signal(signal.SIGINT, before[0])
        signal.signal(signal.SIGTERM, signal.SIG_DFL if before[1] is None else before[1])
        forget_handled_interrupt()


def forget_handled_interrupt() -> None:
    """A stop we handled must not kill the process on its way out. CPython (3.11) notes a KeyboardInterrupt
    leaving any exec() of a source string (dataclasses and namedtuple build their methods that way: a Ctrl-C
    while a module defining one is imported) as unhandled, even when our code catches it later; under
    `python -m` the interpreter then ends by re-raising SIGINT at exit (rc -2 after our one line, not 130).
    Each exec() of a string resets that note first: this one clears it. A KeyboardInterrupt that does escape
    main() sets it again (the interpreter's own path), so an uncaught one still ends by SIGINT."""
    exec("")  # noqa: S102


MULTIRUN = ("-m", "--multirun")  # Hydra's flag: the sweep overrides' grid becomes the run's variants


CFG_KINDS = ("job", "hydra", "all")


def _cfg_options(argv: list[str]) -> tuple[list[str], str | None, bool]:
    """Hydra's `--cfg job|hydra|all` (`-c`) and `--resolve`: (the other arguments, the kind shown, resolve)."""
    rest, shown, resolve, i = [], None, False, 0
    while i < len(argv):
        a = argv[i]
        if a == "--resolve":
            resolve = True
        elif a in ("--cfg", "-c") or a.startswith("--cfg="):
            value = a.split("=", 1)[1] if "=" in a else (argv[i + 1] if i + 1 < len(argv) else "")
            i += 0 if "=" in a else 1
            if value not in CFG_KINDS:
                raise UserError(f"--cfg {value or '(nothing)'}: show one of {', '.join(CFG_KINDS)} (--cfg job)")
            shown = value
        else:
            rest.append(a)
        i += 1
    if resolve and not shown:
        raise UserError("--resolve goes with --cfg job|all: it resolves the interpolations of the config shown")
    return rest, shown, resolve


def show_config(overrides: list[str], multirun: bool, shown: str, resolve: bool) -> int:
    """--cfg job|hydra|all [--resolve]: the composed config (with -m, the sweep's grid as its variants) and each
    variant's overrides, checked as a run's would be; nothing is written."""
    from slurm_router.config.checks import refuse_hydra_overrides
    from slurm_router.config.variants import variant_configs
    from slurm_router.launch.preview import cfg_text

    refuse_hydra_overrides(overrides)
    cfg = compose_grid(overrides, multirun)
    hydra_node = None
    if shown in ("hydra", "all"):
        from hydra.core.global_hydra import GlobalHydra
        from omegaconf import OmegaConf

        from slurm_router.config.schema import conf_dir

        GlobalHydra.instance().clear()
        from hydra import compose as hydra_compose
        from hydra import initialize_config_dir

        with initialize_config_dir(config_dir=conf_dir(), version_base=None, job_name="slurm_router"):
            full = hydra_compose(config_name="config", overrides=[], return_hydra_config=True)
        hydra_node = OmegaConf.to_container(full.hydra, resolve=False)
    if shown == "hydra":
        from omegaconf import OmegaConf

        print(OmegaConf.to_yaml(OmegaConf.create({"hydra": hydra_node})).rstrip())
        return 0
    print(cfg_text(cfg, dict(variant_configs(cfg)), resolve, hydra_node))
    return 0


def _main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip().splitlines()[0])
        print(USAGE)
        print("commands (slurm-router WORD, or python -m slurm_router WORD):")
        for word, what in SUBCOMMANDS.items():
            print(f"  {word:9s} {what}")
        return 0
    if argv and argv[0] in ("--version", "-V"):
        print(f"slurm-router {version()}")
        return 0
    multirun = any(a in MULTIRUN for a in argv)
    argv = [a for a in argv if a not in MULTIRUN]
    try:
        argv, shown, resolve = _cfg_options(argv)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    bad = [a for a in argv if a.startswith("-")]
    if bad:
        print(
            f"error: unknown option {bad[0]}: arguments are -m (a sweep) and Hydra overrides like train.steps=20 "
            "(see python -m slurm_router --help)",
            file=sys.stderr,
        )
        return 2
    from slurm_router.rundir.lifecycle import stops_raised

    try:
        code = show_config(argv, multirun, shown, resolve) if shown else run(argv, multirun)
    except KeyboardInterrupt:
        code = _interrupted()
    except Exception as e:
        if stops_raised():  # a stop that a library caught or dropped, surfacing as another error (a Ctrl-C
            code = _interrupted()  # inside Hydra's compose: "unknown key 'defaults'")
        elif isinstance(e, UserError):
            print(f"error: {e}", file=sys.stderr)
            code = 2
        else:
            raise
    from slurm_router.rundir.lock import release_all

    release_all()  # every process of the run has ended: the lock is free, said released
    return code


if __name__ == "__main__":
    sys.exit(main())
