"""benchmarks/hf_trainer_e2e.py's pieces that decide its figures, without running it: the HF Trainer scripts'
decision (slurm_router's statistics on fixed numbers) and the scripts' model (the weights slurm_router trains)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from hf_trainer_e2e import decide  # noqa: E402
from hf_trainer_task import OVERRIDES, gpt2_lora  # noqa: E402


def side(base: float, seeds: int = 3, batches: int = 8, noise: float = 0.01) -> dict:
    """{seed: eval batches} whose held-out loss is about `base`, per-batch noise shared by every variant."""
    rng = np.random.default_rng(7)
    shared = rng.normal(0, 0.2, batches)  # eval-batch difficulty: the same batches for everyone
    out = {}
    for s in range(seeds):
        r = np.random.default_rng([s, int(base * 1000)])
        loss = base + shared + r.normal(0, noise, batches) + r.normal(0, noise)
        out[s] = {"loss_sums": list(loss * 100), "tokens": [100.0] * batches}
    return out


def test_a_clear_winner_is_decided_and_a_close_one_is_not():
    clear = decide({"a": side(4.0), "b": side(4.5), "c": side(4.6), "d": side(5.0)})
    assert clear["winner"] == "a" and clear["decided"]
    close = decide({"a": side(4.0), "b": side(4.001), "c": side(4.6), "d": side(5.0)})
    assert close["winner"] in ("a", "b") and not close["decided"]
    assert abs(close["val_loss"]["c"] - np.mean([sum(r["loss_sums"]) / 800 for r in side(4.6).values()])) < 1e-12


def test_one_seed_never_decides():
    one = decide({v: side(b, seeds=1) for v, b in (("a", 4.0), ("b", 4.5), ("c", 4.6), ("d", 5.0))})
    assert one["winner"] == "a" and not one["decided"]


def test_the_scripts_model_is_the_one_slurm_router_trains():
    from slurm_router.config.compose import compose
    from slurm_router.train.model import build_model

    cfg = compose(OVERRIDES)
    ours = build_model(cfg.model, cfg.model.vocab_size, cfg.seed, lora=True, lora_seed=2).state_dict()
    theirs = gpt2_lora(cfg.model, cfg.seed, 2, cfg.model.lora.r, cfg.model.lora.alpha).state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
