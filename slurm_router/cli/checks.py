"""The one ordered validation of a run, called by every entry point that starts tasks (python -m slurm_router,
resume=RUN_DIR): each check raises UserError (one line, exit 2) before any file of the run is written.

A new run, in this order: the config alone (values, seeds, variants, prune: config.variants.validate), the
settings the user set that nothing in the run reads (config.unread), the trackers of every variant (a known
mode, its package, a writable store), every variant fits the one base stage (launch.plan), the run root can be
written, model=hf checkpoints (config, whole weights, a causal LM with the LoRA target layers, built on the
meta device), the launcher's own checks (Slurm on PATH, the partition, the container image...), then the data
(the corpus is built once, so a bad file is named now).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from slurm_router.config.model_families import from_checkpoint
from slurm_router.config.unread import refuse_unread
from slurm_router.config.variants import training_seeds, validate
from slurm_router.errors import UserError
from slurm_router.launch.base import Launcher
from slurm_router.launch.plan import check_fits_base
from slurm_router.rundir.manifest import new_run_dir
from slurm_router.scheduler.registry import launcher_class
from slurm_router.tracking.trackers import check_tracker


@dataclass
class CheckedRun:
    variants: dict[str, DictConfig]  # each variant's merged config ({"main": cfg} without variants)
    launcher: type[Launcher]  # the launcher class of launcher.kind
    corpus: Any  # the data, built once (train.data.Corpus)
    run_id: str
    run_dir: Path  # not created yet


def check_new_run(cfg: DictConfig, user_keys: Iterable[str] = ()) -> CheckedRun:
    """A new run whose every check passed, in order. user_keys: the keys the user's overrides set
    (config.unread.set_keys), refused when nothing in the run reads them."""
    variants = validate(cfg)
    refuse_unread(cfg, variants if cfg.variants else {}, user_keys)
    for where, c in _each_config(cfg, variants):
        check_tracker(c.get("tracker"), where)
    check_fits_base(cfg, variants)
    run_id, run_dir = new_run_dir(cfg)  # in a run_root that can be written, or one line now
    check_models(cfg, variants)
    units = check_metrics(cfg)
    if cfg.get("prune"):
        prune_reach(variants, units)
    launcher = launcher_class(cfg.launcher.kind)
    launcher.check(cfg)
    from slurm_router.train.data import build_corpus

    corpus = None
    for name, c in _data_configs(cfg, variants):  # fail on bad data before any file is written
        try:
            built = build_corpus(c.data, tokenizer(c))
        except UserError as e:
            if name is None:
                raise
            raise UserError(
                f"variants.{name} (its data set by the -m sweep or the experiment's variants): {e}"
            ) from None
        corpus = corpus or built
    return CheckedRun(variants, launcher, corpus, run_id, run_dir)


def prune_reach(variants: dict[str, DictConfig], units: int | None = None) -> None:
    """prune=true that can never fire with these seeds, eval batches and evaluations: one line (the run goes on).
    units: eval.primary's example clusters, what its comparisons rest on instead of eval batches (a task metric)."""
    from slurm_router.verdict.pruning import reach_note

    tasks = [(int(v.train.steps), int(v.train.eval_every)) for v in variants.values()]  # the run's looks (Schedule)
    for note in dict.fromkeys(
        reach_note(
            len(training_seeds(v)),
            units or v.train.eval_batches,
            v.train.steps,
            v.train.eval_every,
            len(variants),
            auto_cap=len(training_seeds(v)) if v.seeds == "auto" else None,
            tasks=tasks,
        )
        for v in variants.values()
    ):
        if note and units:
            note = note.replace("eval batches", "example clusters").replace(
                "raise train.eval_batches to", "give eval.primary"
            )
        if note:
            print(note, file=sys.stderr, flush=True)


def _data_configs(cfg: DictConfig, variants: dict[str, DictConfig]) -> list[tuple[str | None, DictConfig]]:
    """The configs whose data the run reads, each data setting (and tokenizer) once: the run's own when every
    variant reads it, else each variant whose data differs (a -m sweep over data.path: the run's own data is
    nobody's). Variants that differ in LoRA, learning rate or anything else but the tokenizer share one corpus."""
    from omegaconf import OmegaConf

    def key_of(c: DictConfig) -> str:  # the data settings and what make_tokenizer reads
        return OmegaConf.to_yaml(c.data) + repr((c.model.get("kind"), c.model.get("name_or_path")))

    if not cfg.variants:
        return [(None, cfg)]
    own = key_of(cfg)
    seen, out = set(), []
    for name, c in variants.items():
        key = key_of(c)
        if key not in seen:
            seen.add(key)
            out.append((None if key == own else name, c))
    return out


def check_metrics(cfg: DictConfig) -> int | None:
    """eval.metrics: each function imported and asked for zero examples, twice (config/metrics.py probe), with the
    run's tokenizer on the CPU: a path that does not import, a wrong result, a changing count is one line now.
    Returns eval.primary's number of example clusters (None: the primary is held-out loss)."""
    from slurm_router.config.metrics import metric_names, primary, probe

    names = metric_names(cfg)
    if not names:
        return None
    import torch

    tok, units = tokenizer(cfg), None
    for name in names:
        scores = probe(name, str(cfg.eval.metrics[name]), tok, torch.device("cpu"))
        if name == primary(cfg):
            units = len(set(map(str, scores.sources))) if scores.sources is not None else scores.n_examples
    return units


def check_resumed_run(cfg: DictConfig, launcher: Any) -> None:
    """resume=RUN_DIR: the run's own config passed when it started; what can have changed since is checked again
    (a tracker store made unwritable, the launcher's code snapshot)."""
    check_tracker(cfg.get("tracker"))
    launcher.check_resume()


def _each_config(cfg: DictConfig, variants: dict[str, DictConfig]) -> list[tuple[str, DictConfig]]:
    """("", the experiment's config), then ("variants.NAME: ", each variant's) when there are variants."""
    return [("", cfg), *((f"variants.{n}: ", c) for n, c in variants.items() if cfg.variants)]


def check_models(cfg, variants: dict) -> None:
    """model=hf checkpoints, before anything is written (workers read them later): config and whole weights,
    then a causal LM whose layers include each variant's model.lora.target_modules (built on the meta device)."""
    named = [("", cfg), *((f"variants.{n}: " if cfg.variants else "", c) for n, c in variants.items())]
    named = [(where, c) for where, c in named if from_checkpoint(c.model)]
    if not named:
        return
    from slurm_router.train.logits import check_chunked_loss
    from slurm_router.train.model import check_architecture, check_checkpoint

    for c in {(c.model.name_or_path, c.data.max_len): c for _, c in named}.values():
        check_checkpoint(c.model, c.data.max_len)
    seen = set()
    for where, c in named:
        key = (c.model.name_or_path, c.model.lora.enabled, repr(c.model.lora.target_modules))
        if key not in seen:
            seen.add(key)
            check_architecture(c.model, where)
    for where, c in named:  # the chunked loss must compute the model's own logits (train/logits.py)
        if c.train.loss_chunk_tokens > 0:
            check_chunked_loss(c, where)


def tokenizer(cfg):
    from slurm_router.train.tokenizer import make_tokenizer

    try:  # a local checkpoint can be broken in many ways; each is the user's to fix
        return make_tokenizer(cfg.model)
    except UserError:
        raise
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise UserError(
            f"model.name_or_path={cfg.model.name_or_path!r}: cannot load its tokenizer ({first}): "
            "give a complete local transformers checkpoint (config, weights, tokenizer files)"
        ) from None
