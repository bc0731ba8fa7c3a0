"""Throughput measured here for one model shape: a short calibration, kept in a cache (the forecast's rates,
launch/forecast.py).

One probe process starts as a worker would (the interpreter, torch, the corpus, the model), then times a few
training steps of the base stage (every weight trains) and of a LoRA variant, and a few held-out batches, with the
threads a worker gets. What it measures is kept in <base.cache_dir | $SLURM_ROUTER_CACHE | ~/.cache/slurm_router>/
calibration.json by everything it depends on (model shape and LoRA, data, batch sizes, dtype, threads, device,
torch and Python), so a second plan of the same shape measures nothing. A run's own measured rates replace the
calibration's there once its report is written (record_measured).

    python -m slurm_router.artifacts.calibration < probe.json   # the probe itself: prints one JSON line
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

VERSION = 1
FILE = "calibration.json"
PROBE_STEPS = 5  # timed steps after one warm-up; the median is kept (other work makes single steps noisy)
PROBE_EVAL_BATCHES = 2


def cache_file(cfg: Any) -> Path:
    root = cfg.base.cache_dir or os.environ.get("SLURM_ROUTER_CACHE") or "~/.cache/slurm_router"
    return Path(os.path.expanduser(str(root))) / FILE


def probe_request(cfg: dict, batch: int, threads: list[int], device: str = "cpu") -> dict:
    """What the probe needs from a task's resolved config (its model, data and eval batch size): the rates at
    each of `threads` (the workers' threads in each stage) on `device` (cpu, or cuda: GPU 0 here)."""
    model = {k: v for k, v in cfg["model"].items() if k != "lora"}
    return {  # the rank (and so alpha) barely moves a step's time: every rank shares one entry
        "model": {**model, "lora": {**cfg["model"]["lora"], "r": 8, "alpha": 16}},
        "data": cfg["data"],
        "seed": cfg.get("seed", 0),
        "batch": int(batch),
        "eval_batch": int(cfg["train"]["eval_batch_size"]),
        "threads": sorted(set(int(t) for t in threads)),
        "device": device,
        "version": VERSION,
    }


def key(request: dict) -> str:
    import platform

    import torch

    ident = {
        **{k: v for k, v in request.items() if k != "threads"},
        "torch": torch.__version__,
        "python": sys.executable,
        "machine": platform.node(),
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _load(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _store(path: Path, k: str, entry: dict) -> None:
    from slurm_router.fileio import atomic_write_text

    data = _load(path)
    data[k] = entry
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(data, indent=1, sort_keys=True))
    except OSError:
        pass  # a cache that cannot be written only costs the next plan another probe


def rates(cfg: Any, request: dict, timeout_s: float = 300.0) -> dict:
    """The cached rates for this request, else measured now by a probe (and cached). Raises RuntimeError when
    the probe fails."""
    path, k = cache_file(cfg), key(request)
    found = cached(cfg, request)
    missing = [t for t in request["threads"] if found is None or str(t) not in found["by_threads"]]
    if found is not None and not missing:
        return {**found, "cached": True}
    request = {**request, "threads": missing}  # only the thread counts not measured yet
    env = dict(os.environ, **({"CUDA_VISIBLE_DEVICES": ""} if request["device"] == "cpu" else {}))
    started = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "slurm_router.artifacts.calibration"],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout_s,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError((proc.stderr.strip().splitlines() or ["the probe printed nothing"])[-1])
    out = json.loads(lines[-1])
    out["startup_s"] = out.pop("ready_at") - started
    out["measured"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    out["source"] = "calibration"
    if found is not None:  # the thread counts measured before stay (and a measured run's start-up)
        out["by_threads"] = {**found["by_threads"], **out["by_threads"]}
        out["startup_s"] = found.get("startup_s") or out["startup_s"]
    _store(path, k, out)
    return {**out, "cached": False}


def cached(cfg: Any, request: dict) -> dict | None:
    """The cached rates for this request, or None (nothing is measured)."""
    found = _load(cache_file(cfg)).get(key(request))
    return found if isinstance(found, dict) and "by_threads" in found else None


def record_measured(path: str | os.PathLike, k: str, threads: int, measured: dict) -> None:
    """A run's own rates at `threads` (step_s, lora_step_s, eval_batch_s; startup_s: whichever it measured) replace
    the calibration's under key k (forecast.json keeps it), so the next forecast of this shape starts from what a
    run did (a Slurm run's GPUs, which no probe here can measure, included)."""
    entry = _load(Path(path)).get(k)
    entry = entry if isinstance(entry, dict) and "by_threads" in entry else {"by_threads": {}}
    good = {n: float(v) for n, v in measured.items() if isinstance(v, (int, float)) and v > 0}
    if "startup_s" in good:
        entry["startup_s"] = good.pop("startup_s")
    entry["by_threads"][str(threads)] = {**entry["by_threads"].get(str(threads), {}), **good}
    entry["source"] = "a measured run"
    _store(Path(path), k, entry)


def _probe(request: dict) -> dict:
    """In the probe process: start as a worker, then time the steps and the held-out batches."""
    import statistics

    import torch
    from omegaconf import OmegaConf

    from slurm_router.train.data import build_corpus
    from slurm_router.train.model import build_model
    from slurm_router.train.tokenizer import make_tokenizer

    device = torch.device(request["device"])
    model_cfg, data_cfg = OmegaConf.create(request["model"]), OmegaConf.create(request["data"])
    corpus = build_corpus(data_cfg, make_tokenizer(model_cfg))
    lengths = corpus.train.lengths[:20000]
    mean_len = max(2, int(round(float(lengths.mean())))) if len(lengths) else int(data_cfg.max_len)
    vocab = int(model_cfg.vocab_size)
    full = build_model(model_cfg, vocab, int(request["seed"]), lora=False, device=device).to(device)
    adapted = build_model(model_cfg, vocab, int(request["seed"]), lora=True, device=device).to(device)
    models = {False: full, True: adapted if model_cfg.lora.enabled else full}
    out: dict[str, Any] = {"mean_len": mean_len, "ready_at": time.time(), "by_threads": {}}  # a worker's start-up

    def timed(fn, n: int) -> float:
        times = []
        for i in range(n + 1):
            t0 = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i:
                times.append(time.perf_counter() - t0)
        return statistics.median(times)

    x = torch.randint(0, min(vocab, 256), (request["batch"], mean_len), device=device)
    e = torch.randint(0, min(vocab, 256), (request["eval_batch"], mean_len), device=device)
    for threads in request["threads"]:
        torch.set_num_threads(max(1, threads))
        rates = {}
        for label, lora in (("step_s", False), ("lora_step_s", True)):
            model = models[lora]
            opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

            def step() -> None:
                model(input_ids=x, labels=x).loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

            rates[label] = timed(step, PROBE_STEPS)
        with torch.no_grad():
            rates["eval_batch_s"] = timed(lambda: models[True](input_ids=e, labels=e), PROBE_EVAL_BATCHES)
        out["by_threads"][str(threads)] = rates
    return out


if __name__ == "__main__":
    print(json.dumps(_probe(json.loads(sys.stdin.read()))), flush=True)
