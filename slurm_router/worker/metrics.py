"""eval.metrics in a worker (docs/metrics.md; the contract: config/metrics.py): each function loaded and asked for
its example count once, then at every evaluation each rank scores its share of the examples (rank r: r, r + D,
...) with the variant's model, and the shares are summed across ranks into the whole list, in order (each index
is scored by one rank: the sum is exact). A function that raises, or returns a wrong result, fails the task on
every rank with one line naming the metric and the example (the worker keeps a checkpoint first, and resume=
evaluates again: the worker's evaluate).

A fused task scores each member through the shared model with that member's adapter alone
active (train/fused_lora.py Segments.only).
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from slurm_router.config.metrics import Scores, checked, load, metric_names, probe


class MetricFailed(RuntimeError):
    """A metric function raised or returned a wrong result at an evaluation (every rank raises it)."""


class MetricSet:
    """The run's metric functions in one worker, probed once (their example counts, directions, sources)."""

    def __init__(self, cfg: Any, tokenizer: Any, device: torch.device, rank: int, world: int):
        self.rank, self.world, self.device, self.tokenizer = rank, world, device, tokenizer
        self.items: list[tuple[str, str, Callable, Scores]] = []
        for name in metric_names(cfg):
            path = str(cfg.eval.metrics[name])
            self.items.append((name, path, load(name, path), probe(name, path, tokenizer, device)))
        self.seconds = 0.0  # the last evaluation's time in the functions (the eval row's t_metrics_s)

    def __bool__(self) -> bool:
        return bool(self.items)

    def score(self, model: Any, step: int, gather: Callable[[list[float]], list[list[float]]]) -> dict[str, dict]:
        """{name: {scores (every example, in order), higher_is_better, sources?}} of `model` (collective)."""
        out: dict[str, dict] = {}
        t0 = time.time()
        was_training = getattr(model, "training", False)
        model.eval()
        try:
            for name, path, fn, meta in self.items:
                n = meta.n_examples
                mine = list(range(self.rank, n, self.world))
                buf = torch.zeros(n, dtype=torch.float64, device=self.device)
                failed, example, error, outputs = 0.0, -1.0, "", None
                try:
                    with torch.no_grad():
                        answer = fn(model, self.tokenizer, self.device, mine)
                        got = checked(name, path, answer, mine, n, meta.higher_is_better)
                    if mine:
                        buf[mine] = torch.tensor(got.scores, dtype=torch.float64, device=self.device)
                    outputs = got.outputs
                except Exception as e:
                    failed, error = 1.0, _one_line(e)
                    example = float(self._culprit(name, path, fn, model, mine, meta))
                flags = gather([failed, example])
                if any(f[0] for f in flags):
                    who = next(r for r, f in enumerate(flags) if f[0])
                    at = int(flags[who][1])
                    where = f"example {at}" if at >= 0 else f"rank {who}'s examples"
                    raise MetricFailed(
                        f"eval.metrics.{name}={path} failed at the evaluation of step {step} on {where}"
                        f"{': ' + error if error else ' (on another rank)'}; the checkpoint is kept: fix the "
                        "function, then resume=RUN_DIR evaluates again"
                    )
                dist.all_reduce(buf)
                entry: dict[str, Any] = {"scores": buf.cpu().tolist(), "higher_is_better": meta.higher_is_better}
                if meta.sources is not None:
                    entry["sources"] = [s if isinstance(s, (int, str)) else str(s) for s in meta.sources]
                if meta.prompts is not None:
                    entry["prompts"] = list(meta.prompts)
                if any(f[0] for f in gather([1.0 if outputs is not None else 0.0])):  # every rank's, in order
                    shares: list[Any] = [None] * self.world
                    dist.all_gather_object(shares, (mine, list(outputs or [])))
                    answers: list[str | None] = [None] * n
                    for idx, texts in shares:
                        for i, text in zip(idx, texts):
                            answers[i] = text
                    entry["outputs"] = answers
                out[name] = entry
        finally:
            if was_training:
                model.train()
            self.seconds = time.time() - t0
        return out

    def _culprit(self, name: str, path: str, fn: Callable, model: Any, mine: list[int], meta: Scores) -> int:
        """The first of `mine` that fails alone (-1 when each passes alone: the failure needs them together)."""
        for i in mine:
            try:
                with torch.no_grad():
                    checked(
                        name,
                        path,
                        fn(model, self.tokenizer, self.device, [i]),
                        [i],
                        meta.n_examples,
                        meta.higher_is_better,
                    )
            except Exception:
                return i
        return -1


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())[:300]
    return text if isinstance(e, ValueError) and text.startswith("eval.metrics.") else f"{type(e).__name__}: {text}"


def summary(metrics: dict[str, dict]) -> dict[str, float]:
    """{name: mean score} of an evaluation's metrics (the trackers' eval/<name>)."""
    return {n: float(sum(m["scores"]) / max(1, len(m["scores"]))) for n, m in metrics.items()}
