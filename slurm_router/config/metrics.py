"""Task metrics a run judges its variants by (docs/metrics.md): the `eval` config section, the contract a user's
metric function keeps, and its checks. Pure (no torch): the worker calls the functions (worker/metrics.py), the
submission imports each one and scores zero examples (cli/checks.py) before anything is written.

A metric is `eval.metrics.NAME=pkg.module:function` (or a local lm-evaluation-harness task file, NAME=PATH.yaml:
config/lm_eval_task.py). The function is called at every evaluation as

    function(model, tokenizer, device, examples) -> Scores

with the variant's model (its adapter alone active, in eval mode, under torch.no_grad), the run's tokenizer, the
device, and `examples`: the indices (0 .. n_examples - 1) this call scores, a worker's share of them. It returns
one score per index asked, in that order, plus how many examples it has in all (the same every call: every
variant and seed is scored on the same examples, so comparisons pair by example) and whether higher is better.
Called with no examples (at submission, with model None) it only says how many it has. `eval.primary` names the
metric the verdict, prune=true, the winner and `export` decide by: `loss` (held-out loss, always measured) by
default.
"""

from __future__ import annotations

import importlib
import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, Sequence

from slurm_router.config.lm_eval_task import is_task_file
from slurm_router.config.settings import setting
from slurm_router.errors import UserError

LOSS = "loss"  # the held-out loss: always measured, the default primary metric
SHOWN = 200  # characters of a prompt or an output kept in the events (the report shows them)
PATH_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,31}$")


@dataclass
class EvalConfig:
    """`eval`: the metrics every evaluation computes beside held-out loss, and the one decisions rest on."""

    primary: str = setting(LOSS, reader="config/metrics.py: str(ev.primary)")  # loss | a name in metrics
    metrics: Dict[str, str] = setting(
        factory=dict, reader="config/metrics.py: (ev.metrics or {})"
    )  # name -> pkg.module:function (docs/metrics.md)


@dataclass
class Scores:
    """What a metric function returns (docs/metrics.md).

    scores: one per example asked for, in the order asked (finite numbers, e.g. 1.0/0.0 for a correct answer).
    n_examples: how many examples the metric has in all; the same on every call.
    higher_is_better: True for accuracy-like scores, False for error-like ones.
    sources: optional, per example of ALL n_examples (not only those asked), what it comes from (a document, a
    task group): examples that share a source count as one cluster in the verdict's variance.
    prompts: optional, per example of ALL n_examples, its prompt; outputs: optional, per example asked, what the
    model answered (its text or choice). The report shows both where the leader and the runner-up differ most.
    """

    scores: Sequence[float]
    n_examples: int
    higher_is_better: bool = True
    sources: Sequence[Any] | None = None
    prompts: Sequence[str] | None = None
    outputs: Sequence[str] | None = None


def metric_names(cfg) -> list[str]:
    """The configured metric names, in order (held-out loss is not among them)."""
    ev = cfg.get("eval")
    return [str(n) for n in (ev.metrics or {})] if ev is not None else []


def primary(cfg) -> str:
    ev = cfg.get("eval")
    return str(ev.primary) if ev is not None else LOSS


def check_eval_config(cfg) -> None:
    """eval.* alone (no import yet): names, paths, the primary; set once, at the top level. UserError."""
    for name, overrides in (cfg.get("variants") or {}).items():
        if overrides is not None and hasattr(overrides, "keys") and "eval" in overrides:
            raise UserError(
                f"variants.{name}.eval: eval is set once, at the top level (every variant is scored on the same "
                "examples, so the verdict pairs them): set eval.* outside the variant"
            )
    names = metric_names(cfg)
    for name in names:
        path = str(cfg.eval.metrics[name])
        if name == LOSS or not NAME_RE.match(name):
            raise UserError(
                f"eval.metrics.{name}: a metric name is 1-32 letters, digits and '_', starting with a letter, and "
                f"not '{LOSS}' (held-out loss is always measured): rename it"
            )
        if not PATH_RE.match(path) and not is_task_file(path):
            raise UserError(
                f"eval.metrics.{name}={path!r} is not an import path: write it as package.module:function, or give "
                "a local lm-evaluation-harness task file (.yaml) (docs/metrics.md)"
            )
    if primary(cfg) not in (LOSS, *names):
        have = ", ".join([LOSS, *names])
        raise UserError(f"eval.primary={primary(cfg)!r} is not a metric of this run: choose one of {have}")


def load(name: str, path: str) -> Callable:
    """The function at `pkg.module:function` (or a local lm-eval task file's, config/lm_eval_task.py); UserError
    naming it and the fix when it does not import."""
    if is_task_file(path):
        from slurm_router.config.lm_eval_task import task_metric

        return task_metric(name, path, Scores)
    module, _, attr = path.partition(":")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except ModuleNotFoundError as e:
        raise UserError(
            f"eval.metrics.{name}={path}: cannot import {e.name or module} ({e}): put the module on PYTHONPATH (the "
            "jobs import it too) or fix the path"
        ) from None
    except AttributeError:
        raise UserError(f"eval.metrics.{name}={path}: {module} has no function {attr!r}: fix the name") from None
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise UserError(
            f"eval.metrics.{name}={path}: importing {module} raised {type(e).__name__}: {first}: fix the module"
        ) from None
    if not callable(fn):
        raise UserError(f"eval.metrics.{name}={path}: {attr} is not a function: point it at one")
    return fn


def checked(
    name: str, path: str, result: Any, asked: Sequence[int], n_examples: int | None = None, higher: bool | None = None
) -> Scores:
    """The function's result, checked; ValueError with one line naming the function and the fix. n_examples and
    higher (higher_is_better): what earlier calls returned, the submission's check among them: each must stay."""
    who = f"eval.metrics.{name}={path}"
    if not isinstance(result, Scores):
        raise ValueError(
            f"{who} returned {type(result).__name__}, not slurm_router.config.metrics.Scores: return "
            "Scores(scores=[...], n_examples=N, higher_is_better=True)"
        )
    n = result.n_examples
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{who}: n_examples={n!r}: it must be the number of examples the metric has (1 or more)")
    if n_examples is not None and n != n_examples:
        raise ValueError(
            f"{who}: n_examples changed from {n_examples} to {n}: every call must score the same examples (the "
            "verdict pairs them across variants and seeds): fix the examples, e.g. read them once, in order"
        )
    if higher is not None and bool(result.higher_is_better) != higher:
        raise ValueError(
            f"{who}: higher_is_better changed from {higher} to {bool(result.higher_is_better)}: it says which way "
            "the verdict, prune=true and the winner read the scores, so every call (with no examples too, as at "
            "submission) must return the same value: fix the function"
        )
    scores = list(result.scores)
    if len(scores) != len(asked):
        raise ValueError(
            f"{who}: returned {len(scores)} scores for {len(asked)} examples: return one score per example asked, "
            "in the order asked"
        )
    for i, s in zip(asked, scores):
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s):
            raise ValueError(
                f"{who}: the score of example {i} is {s!r}, not a finite number: return a number for every "
                "example (e.g. 0.0 for a wrong answer)"
            )
    for what, given, want in (("sources", result.sources, n), ("prompts", result.prompts, n)):
        if given is not None and len(given) != want:
            raise ValueError(
                f"{who}: {what} has {len(given)} entries for {n} examples: give one per example of all of them "
                "(or none)"
            )
    if result.outputs is not None and len(result.outputs) != len(asked):
        raise ValueError(f"{who}: outputs has {len(result.outputs)} entries for {len(asked)} examples asked")
    short = lambda texts: [str(t)[:SHOWN] for t in texts] if texts is not None else None
    return Scores(
        [float(s) for s in scores],
        n,
        bool(result.higher_is_better),
        result.sources,
        short(result.prompts),
        short(result.outputs),
    )


def probe(name: str, path: str, tokenizer: Any, device: Any) -> Scores:
    """Import the function and score zero examples, twice (the count must not change): the submission's check,
    and what a worker knows of a metric before its first evaluation. UserError, one line."""
    fn = load(name, path)
    first: Scores | None = None
    for _ in range(2):
        try:
            result = fn(None, tokenizer, device, [])
        except Exception as e:
            first_line = (str(e).strip().splitlines() or [""])[0][:200]
            raise UserError(
                f"eval.metrics.{name}={path}: called with no examples (model None) it raised "
                f"{type(e).__name__}: {first_line}: with no examples return Scores([], n_examples=N) without "
                "touching the model"
            ) from None
        try:
            first = checked(
                name, path, result, [], *((first.n_examples, first.higher_is_better) if first else (None, None))
            )
        except ValueError as e:
            raise UserError(str(e)) from None
    assert first is not None
    return first
