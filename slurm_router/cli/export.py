"""A run's trained adapter, merged into its base: one full checkpoint for serving (docs/ARCHITECTURE.md).

    python -m slurm_router.export RUN_DIR --merge OUT              # the report's winner
    python -m slurm_router.export RUN_DIR r32 --merge OUT --best   # r32's adapter with the lowest held-out loss

VARIANT defaults to the report's winner (report/summary.json; the report is computed now if none is written).
--best takes adapter-best/ (written with train.eval_every) instead of the final adapter/. OUT gets the base
(adapter_config.json's base_model_name_or_path) with the adapter merged in (peft: PeftModel.from_pretrained,
merge_and_unload; done in fp32, saved in the base's own dtype) and the base's tokenizer, all with
save_pretrained: `AutoModelForCausalLM.from_pretrained(OUT)` loads it. It is written to a temp folder beside OUT
and renamed, so OUT is whole or absent. Without --merge: where the adapter and its base are.

Errors are one line, exit 2: RUN_DIR not a run, VARIANT unknown (the variants listed), no adapter (the task has
not completed; or the variant diverged or was pruned: --best offered where it saved one), the adapter's base gone
or damaged (the base cache and RUN_DIR/base-init/ verified by sha256), OUT exists and is not empty.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import warnings
from pathlib import Path

from slurm_router.errors import UserError
from slurm_router.rundir.layout import ADAPTER_FILES, BASE_INIT, RunLayout, TaskPaths


def variants(manifest: dict) -> list[str]:
    return [n for n, t in manifest["tasks"].items() if isinstance(t, dict) and t.get("stage") != "base"]


def report_winner(run_dir: Path) -> dict | None:
    """The report's winner ({variant, sentence, ...}): from report/summary.json, else the report computed now."""
    try:
        return json.loads(RunLayout(run_dir).summary.read_text())["winner"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    from slurm_router.analysis.report import analyze

    return analyze(run_dir)[0]["winner"]


def choose(run_dir: Path, variant: str | None, best: bool) -> tuple[str, Path, str]:
    """(variant, the folder to export, why this variant). UserError, one line, when there is none to export."""
    from slurm_router.rundir.manifest import Manifest

    manifest = Manifest.load(run_dir).data
    names = variants(manifest)
    listed = ", ".join(names) or "none"
    if variant is None:
        won = report_winner(run_dir)
        if not won:
            raise UserError(
                f"{run_dir}: no variant has a final held-out loss yet, so the report names no winner: "
                f"name a VARIANT (its variants: {listed})"
            )
        if won.get("variant") is None:  # every variant scored the same: the report names no winner to export
            raise UserError(
                f"{run_dir}: the report names no winner ({won['sentence']}): name a VARIANT (its variants: {listed})"
            )
        # with seeds=N the winner is a variant of N replicates: its best seed's task holds the adapter named
        variant, why = won.get("task") or won["variant"], f"the report's winner ({won['sentence']})"
    elif variant not in names:
        replicates = [n for n in names if manifest["tasks"][n].get("variant") == variant]
        if replicates:
            raise UserError(
                f"{run_dir}: {variant} ran {len(replicates)} training seeds: name one of its replicates "
                f"({', '.join(replicates)}), or leave VARIANT out for the report's winner"
            )
        raise UserError(f"{run_dir}: no variant {variant!r}; its variants: {listed}")
    else:
        why = "as named"
    paths = TaskPaths(RunLayout(run_dir).task(variant).dir)
    if (paths.full_model / "config.json").is_file():  # trained without LoRA: the model itself
        return variant, paths.full_model, why
    folder = paths.adapter_best if best else paths.adapter
    if not all((folder / f).is_file() for f in ADAPTER_FILES):
        state = manifest["tasks"][variant].get("state", "?")
        if best and all((paths.adapter / f).is_file() for f in ADAPTER_FILES):
            raise UserError(
                f"{variant}: no {folder} (a run without train.eval_every keeps the final adapter only): "
                "leave out --best to export that one"
            )
        ended = _ended_early(paths.result)
        if ended:
            has_best = not best and all((paths.adapter_best / f).is_file() for f in ADAPTER_FILES)
            offer = (
                f"export its adapter with the lowest held-out loss before that with --best ({paths.adapter_best})"
                if has_best
                else "it saved no adapter before that"
            )
            raise UserError(
                f"{variant}: no adapter in {folder}: the variant {ended}: {offer}, or choose another variant ({listed})"
            )
        if paths.result.is_file() and not best:  # it had completed: its adapter was deleted since
            raise UserError(
                f"{variant}: no adapter in {folder}: it was deleted after the task completed: python -m "
                f"slurm_router resume={run_dir} trains the task again to rebuild it, or choose another variant "
                f"({listed})"
            )
        raise UserError(
            f"{variant}: no adapter in {folder} (the task has not completed: its state is {state}): "
            f"finish it with python -m slurm_router resume={run_dir}, or choose another variant "
            f"({listed})"
        )
    return variant, folder, why


def _ended_early(result: Path) -> str | None:
    """'diverged at step 12 (loss nan, lr 0.5)' or 'was pruned at step 4' from a task's result, else None."""
    try:
        r = json.loads(result.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(r, dict):
        return None
    if r.get("exit_state") == "diverged":
        return f"diverged at step {r.get('step', '?')} (loss {r.get('loss', '?')}, lr {r.get('lr', '?')})"
    if r.get("exit_state") == "pruned":
        return f"was pruned at step {r.get('step', '?')} (prune=true)"
    return None


def base_of(adapter: Path) -> Path:
    """The base an adapter was trained on (its adapter_config.json), checked to be a whole checkpoint."""
    from slurm_router.artifacts import base_cache
    from slurm_router.artifacts.adapters import init_base_check

    try:
        base = Path(json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(
            f"{adapter / 'adapter_config.json'} cannot be read ({type(e).__name__}): the adapter is damaged"
        ) from None
    if not (base / "config.json").is_file():
        raise UserError(
            f"the base model of {adapter}, {base}, is gone (no config.json there): put that checkpoint "
            "back (the base stage's cache: run the experiment again to rebuild it)"
        )
    if base_cache.meta_path(base).is_file():  # a base stage's cache entry: verified (sha256)
        why = base_cache.check(base)
        if why is not None:
            raise UserError(
                f"the base model of {adapter}, {base}, cannot be used ({why}): run the experiment "
                "again to rebuild the base stage's cache"
            )
    elif base.parent.name == BASE_INIT:  # a seed-built base saved in the run dir: verified (sha256) the same way
        why = init_base_check(base)
        if why is not None:
            raise UserError(
                f"the base model of {adapter}, {base}, cannot be used ({why}): the seed-built base this run's "
                "adapters sit on was damaged after it was saved; put it back from a copy, or train the variants "
                "again (a new run)"
            )
    return base


def _out_folder(out: Path) -> Path:
    out = Path(os.path.expanduser(str(out)))
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(
            f"--merge {out}: {'is a file' if not out.is_dir() else 'exists and is not empty'}: "
            "give a new folder (it is created) or an empty one"
        )
    return out


def merge(folder: Path, out: Path) -> Path:
    """The adapter in `folder` merged into its base, saved with its tokenizer in `out`, whole or not at all.
    A full model folder (a variant trained without LoRA) is copied as it is."""
    from slurm_router.artifacts.adapters import write_folder
    from slurm_router.train.model import quiet_transformers

    if not (folder / ADAPTER_FILES[0]).is_file():
        write_folder(out, lambda tmp: shutil.copytree(folder, tmp, dirs_exist_ok=True))
        return folder
    base = base_of(folder)
    import torch
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    quiet_transformers()
    try:
        config = AutoConfig.from_pretrained(base, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(base, local_files_only=True, dtype=torch.float32)
    except Exception as e:  # damage no sidecar could name (a base saved before sidecars): one line, not a traceback
        cause = (str(e).strip().splitlines() or [""])[0][:200]
        raise UserError(f"the base model {base} cannot be loaded ({type(e).__name__}: {cause})") from None
    saved_dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    with warnings.catch_warnings():  # peft's own deprecation notices, nothing the user can act on
        warnings.simplefilter("ignore", FutureWarning)
        model = PeftModel.from_pretrained(model, folder).merge_and_unload()
    if isinstance(saved_dtype, str):
        saved_dtype = getattr(torch, saved_dtype, None)
    if isinstance(saved_dtype, torch.dtype) and saved_dtype != torch.float32:
        model = model.to(saved_dtype)  # merged in fp32, saved as the base was
    tokenizer = AutoTokenizer.from_pretrained(base, local_files_only=True)
    write_folder(out, lambda tmp: (model.save_pretrained(tmp), tokenizer.save_pretrained(tmp)))
    return base


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m slurm_router.export", description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a run directory (printed as run_dir:)")
    parser.add_argument("variant", nargs="?", metavar="VARIANT", help="default: the report's winner")
    parser.add_argument("--merge", type=Path, metavar="OUT", help="write the merged full checkpoint to this folder")
    parser.add_argument("--best", action="store_true", help="adapter-best/ (train.eval_every), not the final one")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        variant, folder, why = choose(args.run_dir, args.variant, args.best)
        if args.merge is None:
            base = base_of(folder) if (folder / ADAPTER_FILES[0]).is_file() else None
            print(f"{variant}: {why}\nadapter: {folder}" + (f"\nbase: {base}" if base else " (the whole model)"))
            return 0
        out = _out_folder(args.merge)
        base = merge(folder, out)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{variant}: {why}")
    print(f"merged {folder} into its base {base}: {out}" if base != folder else f"copied {folder}: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
