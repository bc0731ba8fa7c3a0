"""What a variant task leaves for the user: its trained adapter, in peft's own format, beside the base it was
trained on (docs/run-directory.md, "The run directory").

    tasks/<variant>/adapter/        adapter_config.json, adapter_model.safetensors (model.save_pretrained) and
                                    held_out.json (its step and held-out loss); the final weights
    tasks/<variant>/adapter-best/   the same for the evaluation with the lowest held-out loss (train.eval_every)
    tasks/<variant>/model/          instead of adapter/ for a variant without LoRA: the whole model + tokenizer

adapter_config.json's base_model_name_or_path is the base the adapter was trained on: model=hf's checkpoint
folder, the base stage's cache entry (base_cache.py), or, with no base stage, the seed-built base saved once in
RUN_DIR/base-init/<key>/; so `PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter)`
loads it with transformers and peft alone (python -m slurm_router.export merges it).

Every folder is written whole or not at all (write_folder: a temp folder, fsynced, renamed into place), by
rank 0 only. A resumed or requeued task ends with the same files: the best so far is read back from
adapter-best/held_out.json, and the evaluations it repeats give the same losses (routing and resuming never
change the math), so only a strictly lower loss replaces it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import re
import shutil
from pathlib import Path
from typing import Any, cast

from slurm_router.config.model_families import from_checkpoint
from slurm_router.fileio import WriteError, sidecar_path, sign_file, verify_file
from slurm_router.rundir.layout import BASE_WEIGHTS, HELD_OUT, RunLayout, TaskPaths


# ---- a folder written whole or not at all -----------------------------------------------------------------
def _os_error(e: BaseException) -> OSError | None:
    """The OSError behind a failed write; safetensors' own error only names it: '... (os error 28)'."""
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, OSError):
            return seen
        seen = seen.__cause__ or seen.__context__
    code = re.search(r"\(os error (\d+)\)", str(e))
    return OSError(int(code.group(1)), os.strerror(int(code.group(1)))) if code else None


def _fsync_tree(folder: Path) -> None:
    for f in sorted(folder.rglob("*")):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_folder(path: str | os.PathLike, write, replace: bool = True) -> bool:
    """write(tmp) fills a temp folder beside `path`; its files are fsynced and it is renamed to `path`, so a
    reader sees the old folder, or none, or the new one whole. An existing `path` is swapped out (replace), or
    stands and the new one is dropped (replace=False: identical content another process wrote first; returns
    False). WriteError (one line) when the disk refuses; the temp folder is removed either way."""
    path = Path(path)
    tmp, old = path.with_name(f".{path.name}.tmp-{os.getpid()}"), path.with_name(f".{path.name}.old-{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if replace:  # one writer: what a killed earlier attempt left is stale
            for stale in [*path.parent.glob(f".{path.name}.tmp-*"), *path.parent.glob(f".{path.name}.old-*")]:
                shutil.rmtree(stale, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        write(tmp)
        _fsync_tree(tmp)
        if path.exists() and not replace:
            shutil.rmtree(tmp, ignore_errors=True)
            return False
        if path.exists():
            os.rename(path, old)
        try:
            os.rename(tmp, path)
        except OSError as e:
            if replace or e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process renamed its copy in first
            return False
        _fsync_dir(path.parent)
        shutil.rmtree(old, ignore_errors=True)
        return True
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not path.exists():
            os.rename(old, path)  # the previous folder stands
        cause = None if isinstance(e, (KeyboardInterrupt, SystemExit)) else _os_error(e)
        if cause is not None:
            raise WriteError.of(path, cause) from None
        raise


# ---- the base an adapter sits on ----------------------------------------------------------------------------


def init_key(cfg) -> str:
    """What shapes a seed-built base: the model (not its LoRA) and the seed."""
    from omegaconf import OmegaConf

    model = cast(dict, OmegaConf.to_container(cfg.model, resolve=True))
    model.pop("lora", None)
    return hashlib.sha256(json.dumps({"model": model, "seed": cfg.seed}, sort_keys=True).encode()).hexdigest()[:12]


def save_init_base(run_dir: str, cfg, tokenizer) -> Path:
    """RUN_DIR/base-init/<key>/: the base a variant built from its seed (no base stage), built again the same way
    and saved once with its tokenizer (every variant of that model and seed shares it)."""
    folder = RunLayout(run_dir).init_base(init_key(cfg))
    if (folder / "config.json").is_file():
        return folder
    import torch

    from slurm_router.train.byte_tokenizer import to_transformers
    from slurm_router.train.model import build_model

    with torch.random.fork_rng(devices=[]):  # the training's RNG streams are not disturbed
        model: Any = build_model(cfg.model, cfg.model.vocab_size, cfg.seed, lora=False)  # transformers quieted
    hf_tok = to_transformers(tokenizer, cfg.model.get("n_positions"))

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp, max_shard_size="1000GB")
        hf_tok.save_pretrained(tmp)
        sign_file(Path(tmp) / BASE_WEIGHTS, kind="seed-built base weights")  # verified as the base cache is

    write_folder(folder, write, replace=False)
    return folder


def init_base_check(folder: str | os.PathLike) -> str | None:
    """None if RUN_DIR/base-init/<key>/ is whole; else why not, in words (verified as the base cache is: the
    weights' size and sha256 against their sidecar). A folder saved before sidecars existed is not checked."""
    weights = Path(folder) / BASE_WEIGHTS
    if not weights.is_file():
        return f"{weights.name} is missing"
    if not sidecar_path(weights).is_file() and (Path(folder) / "config.json").is_file():
        return None  # an older run's base-init/: nothing to verify against
    why = verify_file(weights)
    return None if why is None else f"{weights.name}: {why}"


def base_model_path(spec, cfg, tokenizer) -> str:
    """The base this task's model was trained on, as a folder transformers loads: the base stage's cache entry,
    model=hf's checkpoint, or the seed-built base saved in the run dir."""
    if spec.base_weights:
        return os.path.abspath(spec.base_weights)
    if from_checkpoint(cfg.model):
        return os.path.abspath(os.path.expanduser(cfg.model.name_or_path))
    return os.path.abspath(save_init_base(spec.run_dir, cfg, tokenizer))


def held_out(folder: str | os.PathLike) -> dict | None:
    """A saved folder's held_out.json ({step, val_loss, ...}), or None when it has none (or is not whole)."""
    try:
        data = json.loads((Path(folder) / HELD_OUT).read_text())
        return data if isinstance(data, dict) and isinstance(data.get("val_loss"), (int, float)) else None
    except (OSError, ValueError):
        return None


# ---- what rank 0 of a variant task saves ----------------------------------------------------------------------
class AdapterSaver:
    """Rank 0 of a variant task: the best adapter after each evaluation that improves it (train.eval_every),
    and the final one (or the whole model, without LoRA) when the task finishes."""

    def __init__(self, spec, cfg, tokenizer):
        self.spec, self.cfg, self.tokenizer = spec, cfg, tokenizer
        self.paths = TaskPaths(spec.task_dir)
        self.keep_best = bool(cfg.train.eval_every) and spec.lora
        self.best = held_out(self.paths.adapter_best) if self.keep_best else None
        self._base: str | None = None

    @property
    def base(self) -> str:
        if self._base is None:
            self._base = base_model_path(self.spec, self.cfg, self.tokenizer)
        return self._base

    def after_eval(self, model, step: int, val_loss: float, judged: tuple[str, float] | None = None) -> None:
        """adapter-best/ when this evaluation's held-out loss is strictly lower than every earlier one (the
        step-0 evaluation is the base's, not an adapter's); judged: (eval.primary, its mean score signed so that
        lower is better), what decides instead when the run judges by a task metric (config/metrics.py)."""
        value = val_loss if judged is None else judged[1]
        if not self.keep_best or step <= 0 or not math.isfinite(value):
            return
        if self.best is not None and not value < self.best.get("judged", self.best["val_loss"]):
            return
        self._save(model, self.paths.adapter_best, step, val_loss, judged)
        self.best = {"step": step, "val_loss": val_loss, **({"judged": value} if judged else {})}

    def final(self, model, step: int, val_loss: float, judged: tuple[str, float] | None = None) -> dict:
        """adapter/ (and adapter-best/ if the final one is the best); the result's fields naming them."""
        if not self.spec.lora:
            self._save(model, self.paths.full_model, step, val_loss)
            return {"model": str(self.paths.full_model)}
        self._save(model, self.paths.adapter, step, val_loss, judged)
        self.after_eval(model, step, val_loss, judged)
        out = {"adapter": str(self.paths.adapter), "base_model": self.base}
        if self.best is not None:
            out.update(
                adapter_best=str(self.paths.adapter_best),
                adapter_best_step=self.best["step"],
                adapter_best_val_loss=self.best["val_loss"],
            )
        return out

    def _save(self, model, folder: Path, step: int, val_loss: float, judged: tuple[str, float] | None = None) -> None:
        from slurm_router.train.model import quiet_transformers

        quiet_transformers()
        base = self.base if self.spec.lora else None
        record = json.dumps(
            {
                "task": self.spec.name,
                "step": step,
                "val_loss": val_loss,
                **({"judged_by": judged[0], "judged": judged[1]} if judged else {}),
                **({"base_model": base} if base else {}),
            },
            indent=1,
        )

        def write(tmp: Path) -> None:
            if self.spec.lora:
                # peft records the base it was given; a model built from a config has none, so name it here
                for peft_cfg in model.peft_config.values():
                    peft_cfg.base_model_name_or_path = base
                model.save_pretrained(tmp)
            else:
                from slurm_router.train.byte_tokenizer import to_transformers

                model.save_pretrained(tmp)
                to_transformers(self.tokenizer, self.cfg.model.get("n_positions")).save_pretrained(tmp)
            (tmp / HELD_OUT).write_text(record)

        write_folder(folder, write)
