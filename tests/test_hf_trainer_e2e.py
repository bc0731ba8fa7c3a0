"""benchmarks/hf_trainer_e2e.py's pieces that decide its figures, without running it: the HF Trainer scripts'
decision (slurm_router's statistics on fixed numbers), the user's rule between rounds (drop what is decided worse,
stop when one variant is left or at the cap) and the scripts' model (the weights slurm_router trains)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from hf_trainer_e2e import decide, user_rule  # noqa: E402
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
    assert clear["winner"] == "a" and clear["decided"] and clear["worse"] == ["b", "c", "d"]
    close = decide({"a": side(4.0), "b": side(4.001), "c": side(4.6), "d": side(5.0)})
    assert close["winner"] in ("a", "b") and not close["decided"]
    assert close["worse"] == ["c", "d"]  # the pair within noise stays in the contest
    assert abs(close["val_loss"]["c"] - np.mean([sum(r["loss_sums"]) / 800 for r in side(4.6).values()])) < 1e-12


def test_one_seed_never_decides():
    one = decide({v: side(b, seeds=1) for v, b in (("a", 4.0), ("b", 4.5), ("c", 4.6), ("d", 5.0))})
    assert one["winner"] == "a" and not one["decided"]


def test_the_user_drops_what_is_decided_worse_and_stops_when_one_is_left_or_at_the_cap():
    keep, verdict, stop = user_rule({"a": side(4.0), "b": side(4.5), "c": side(4.6), "d": side(5.0)}, cap=4)
    assert keep == ["a"] and verdict["decided"] and stop == "decided"
    close = {"a": side(4.0), "b": side(4.001), "c": side(4.6), "d": side(5.0)}
    keep, verdict, stop = user_rule(close, cap=4)  # 3 seeds each: one more round for a and b
    assert sorted(keep) == ["a", "b"] and not verdict["decided"] and stop is None
    keep, verdict, stop = user_rule({v: close[v] for v in ("a", "b")}, cap=3)
    assert sorted(keep) == ["a", "b"] and not verdict["decided"] and stop == "cap"


def test_the_scripts_model_is_the_one_slurm_router_trains():
    from slurm_router.config.compose import compose
    from slurm_router.train.model import build_model

    cfg = compose(OVERRIDES)
    ours = build_model(cfg.model, cfg.model.vocab_size, cfg.seed, lora=True, lora_seed=2).state_dict()
    theirs = gpt2_lora(cfg.model, cfg.seed, 2, cfg.model.lora.r, cfg.model.lora.alpha).state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
