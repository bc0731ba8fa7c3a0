"""The command line of `slurm-router` (and `python -m slurm_router`): the subcommand words, --help, --version,
the options (cli/options.py), Ctrl-C and SIGTERM, then a run (cli/run.py) or the config shown. The user's
mistakes are raised as UserError for the entry point (__main__.py) to print as one line, exit 2."""

from __future__ import annotations

import sys

from slurm_router.config.compose import set_config_dirs
from slurm_router.errors import SchedulerUnavailable, UserError

HELP_FLAGS = ("-h", "--help", "--info", "--help-reference")
MULTIRUN = ("-m", "--multirun")  # Hydra's flag: the sweep overrides' grid becomes the run's variants

# `slurm-router WORD ...` (the console script, pyproject.toml) and `python -m slurm_router WORD ...`: a subcommand only
# when the first word is one of these (an override always has '='), so `slurm-router OVERRIDES...` still runs.
SUBCOMMANDS = {
    "run": "a new run: slurm-router run [-m] [OVERRIDES...] (the same as slurm-router OVERRIDES...)",
    "status": "the recent runs, or one run's tasks: slurm-router status [RUN_DIR] [--json] [--wait] [--follow] [--cancel]",
    "analysis": "the report, a comparison, or a tracker replay: slurm-router analysis RUN_DIR [RUN_B ...] [--to KIND]",
    "export": "a LoRA adapter merged into its base: slurm-router export RUN_DIR [VARIANT] [--best] --merge OUT",
    "resume": "an interrupted run's unfinished tasks: slurm-router resume RUN_DIR [launcher=local] [new_snapshot=true]",
    "init": "a starter experiment of your own: slurm-router init [DIR] [--name NAME] (then --config-dir DIR)",
}


def run_command(argv: list[str]) -> int:
    """The exit code; UserError and SchedulerUnavailable are raised (after a stop, any error reads as the stop)."""
    if argv and argv[0] in ("status", "export", "analysis", "init"):
        return _subcommand(argv[0], argv[1:])
    if argv and argv[0] == "run":
        argv = argv[1:]
    elif argv and argv[0] == "resume":
        if any(a in ("-h", "--help") for a in argv[1:]):
            from slurm_router.cli.help import RESUME

            print(RESUME)
            return 0
        if not argv[1:] or "=" in argv[1] or argv[1].startswith("-"):
            raise UserError(f"resume needs a run directory: {SUBCOMMANDS['resume']}")
        argv = [f"resume={argv[1]}", *argv[2:]]
    # Ctrl-C must always reach us: a process started in the background by a non-interactive shell inherits
    # SIGINT ignored, and Python then installs no handler. `kill PID` (SIGTERM) stops a run the same clean way:
    # the tasks checkpoint, the run is marked interrupted, exit 130.
    # A KeyboardInterrupt the interpreter drops (raised in a callback) is raised again (lifecycle.raise_stop).
    import signal

    from slurm_router.rundir.lifecycle import forget_stops, raise_stop

    forget_stops()
    before = signal.signal(signal.SIGINT, raise_stop), signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, raise_stop)
    try:
        return _main(argv)
    except KeyboardInterrupt:  # before _main's own handling: its options, the backends' entry points (metadata)
        return _interrupted()
    finally:  # called in-process (tests): leave the caller's handlers as they were
        signal.signal(signal.SIGINT, before[0])
        signal.signal(signal.SIGTERM, signal.SIG_DFL if before[1] is None else before[1])
        forget_handled_interrupt()


def _subcommand(word: str, rest: list[str]) -> int:
    """The commands that live in their own modules, under one name."""
    if word == "status":
        from slurm_router.cli.status import main as status_main

        return status_main(rest)
    if word == "export":
        from slurm_router.cli.export import main as export_main

        return export_main(rest)
    if word == "init":
        from slurm_router.cli.init import main as init_main

        return init_main(rest)
    from slurm_router.analysis.__main__ import main as analysis_main

    return analysis_main(rest)


def _main(argv: list[str]) -> int:
    from slurm_router.scheduler.registry import backends

    backends()  # every scheduler backend loaded first: each adds its launchers' schemas (--help lists their keys)
    if any(a in HELP_FLAGS for a in argv):
        return _help(argv)
    if argv and argv[0] in ("--version", "-V"):
        print(f"slurm-router {version()}")
        return 0
    multirun = any(a in MULTIRUN for a in argv)
    argv = [a for a in argv if a not in MULTIRUN]
    from slurm_router.cli.options import cfg_options, config_dir_options

    set_config_dirs([])  # called again in one process (tests): no folder of an earlier call
    argv, shown, resolve = cfg_options(argv)
    argv, config_dirs = config_dir_options(argv)
    if config_dirs and any(a.split("=", 1)[0].lstrip("+") == "resume" for a in argv):
        raise UserError("resume=RUN_DIR continues with the run's own config.yaml: drop --config-dir")
    set_config_dirs(config_dirs)
    bad = [a for a in argv if a.startswith("-")]
    if bad:
        raise UserError(
            f"unknown option {bad[0]}: arguments are -m (a sweep) and Hydra overrides like train.steps=20 "
            "(see python -m slurm_router --help)"
        )
    from slurm_router.cli import run as workflow
    from slurm_router.rundir.lifecycle import stops_raised
    from slurm_router.rundir.lock import release_all

    try:
        code = workflow.show_config(argv, multirun, shown, resolve) if shown else workflow.run(argv, multirun)
    except KeyboardInterrupt:
        code = _interrupted()
    except Exception as e:
        if not stops_raised():
            if isinstance(e, (UserError, SchedulerUnavailable)):
                release_all()  # the entry point prints it
            raise
        # a stop that a library caught or dropped, surfacing as another error (a Ctrl-C inside Hydra's compose:
        code = _interrupted()  # "unknown key 'defaults'")
    release_all()  # every process of the run has ended: the lock is free, said released
    return code


def _help(argv: list[str]) -> int:
    """--help (with --config-dir's options too), --info, --help-reference: printed, nothing else done."""
    from slurm_router.cli import help as text
    from slurm_router.cli import run as workflow
    from slurm_router.cli.options import config_dir_options

    set_config_dirs(config_dir_options([a for a in argv if a not in HELP_FLAGS])[1])
    if "--help-reference" in argv:
        from slurm_router.config.reference import reference_markdown

        print(reference_markdown(), end="")
    elif "--info" in argv and not any(a in ("-h", "--help") for a in argv):
        print(text.info_text(version()))
    else:
        print(text.main_help(SUBCOMMANDS, (workflow.__doc__ or "").strip().splitlines()[0]))
    return 0


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("slurm_router")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


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


def forget_handled_interrupt() -> None:
    """A stop we handled must not kill the process on its way out. CPython (3.11) notes a KeyboardInterrupt
    leaving any exec() of a source string (dataclasses and namedtuple build their methods that way: a Ctrl-C
    while a module defining one is imported) as unhandled, even when our code catches it later; under
    `python -m` the interpreter then ends by re-raising SIGINT at exit (rc -2 after our one line, not 130).
    Each exec() of a string resets that note first: this one clears it. A KeyboardInterrupt that does escape
    run_command() sets it again (the interpreter's own path), so an uncaught one still ends by SIGINT."""
    exec("")  # noqa: S102
