"""Router facade: speed model, memory model, OOM halving, checkpoints. No torch."""

import json
import pathlib

import pytest
from workloads import lognormal_lengths

from slurm_router.router import DeviceState, MemoryModel, MicroBatch, Router, RouterSettings, SpeedModel, split_for_oom


def test_speed_model_converges_and_fills_unseen():
    sm = SpeedModel(3, ema=0.3)
    assert sm.speeds() == [1.0, 1.0, 1.0]
    for _ in range(40):
        sm.observe(0, cost=1000.0, compute_s=1.0)
        sm.observe(1, cost=1000.0, compute_s=4.0)
    s = sm.speeds()
    assert s[0] == pytest.approx(1000.0) and s[1] == pytest.approx(250.0)
    assert s[2] == pytest.approx(625.0)  # unseen: mean of the seen
    sm.observe(2, cost=0.0, compute_s=0.0)  # an idle step carries no information
    assert sm.speeds()[2] == pytest.approx(625.0)


def test_router_learns_speed_and_gives_slow_device_less():
    r = Router(RouterSettings(), 2)
    lengths = lognormal_lengths(64, seed=2)
    for _ in range(20):
        a = r.plan(range(64), lengths)
        for d, cost in enumerate(a.planned_cost()):
            r.observe_step(
                d, cost, compute_s=cost / (100.0 if d == 0 else 50.0), peak_mem_bytes=None, microbatches=a.per_device[d]
            )
    cost = r.plan(range(64), lengths).planned_cost()
    assert cost[1] / sum(cost) == pytest.approx(1 / 3, abs=0.02)


def test_memory_model_seed_is_sane():
    # GPT-2 small, full fine-tune in fp32
    mm = MemoryModel.from_model_sizes(124_000_000, 124_000_000, 768, 12, 50257)
    fixed, per_token, per_len2 = mm.coef
    assert fixed == pytest.approx(1.95e9, abs=0.05e9)  # 124M x (4 + 4 + 8) bytes
    assert 0.5e6 < per_token < 2e6  # ~0.6 MB activations + ~0.6 MB logits per token
    assert per_len2 > 0
    assert mm.predict(8 * 512, 8, 512) > mm.predict(8 * 256, 8, 256) > fixed


def test_memory_model_refits_to_observations():
    truth = MemoryModel(3_000_000, 5_000, 2.0)
    mm = MemoryModel(1_000_000, 1_000, 0.0)  # a bad prior
    sizes = [(n, ln) for n in (1, 2, 4, 8) for ln in (64, 256, 512, 1024)]
    for n, ln in sizes:
        mm.observe(n * ln, n, ln, truth.predict(n * ln, n, ln))
    for n, ln in [(3, 700), (16, 128), (1, 2048)]:
        assert mm.predict(n * ln, n, ln) == pytest.approx(truth.predict(n * ln, n, ln), rel=0.01)
    assert all(c >= 0 for c in mm.coef)


def test_memory_model_few_points_scales_prior():
    mm = MemoryModel(1_000, 10, 0)
    mm.observe(100, 1, 100, 4_000)  # prior says 2_000: everything doubles
    assert mm.predict(200, 2, 100) == pytest.approx(6_000, rel=1e-6)


def test_oom_lifts_prediction_above_the_limit():
    r = Router(RouterSettings(), 2, MemoryModel(0, 10, 0))
    r.set_device_memory(0, total_bytes=10_000)
    mb = MicroBatch((1, 2, 3, 4), 800, 800, 800.0, 8_000)
    assert r.memory_model.predict_mb(mb) == 8_000
    r.observe_oom(0, mb)
    assert r.memory_model.predict_mb(mb) > 10_000
    assert r.memory_model.predict_mb(mb) > r.device_states()[0].mem_budget_bytes


def test_split_for_oom_halves_without_losing_samples():
    lengths = {10: 500, 11: 20, 12: 480, 13: 30, 14: 25}
    mb = MicroBatch((10, 11, 12, 13, 14), 1055, 2500, 1055.0, None)
    long_half, short_half = split_for_oom(mb, lengths)
    assert long_half.sample_ids == (10, 12) and short_half.sample_ids == (11, 13, 14)
    assert long_half.n_tokens + short_half.n_tokens == mb.n_tokens
    assert long_half.cost + short_half.cost == pytest.approx(mb.cost)
    assert short_half.n_padded_tokens == 90
    r = Router(RouterSettings(), 1, MemoryModel(0, 1, 0))
    a, b = r.split_for_oom(mb, lengths)
    assert a.predicted_mem_bytes == 1000 and b.predicted_mem_bytes == 90
    with pytest.raises(ValueError, match="cannot be halved"):
        split_for_oom(a.__class__((10,), 500, 500, 500.0, None), lengths)


def test_observe_step_feeds_memory_model():
    r = Router(RouterSettings(), 1, MemoryModel(0, 1, 0))
    mbs = [MicroBatch((1, 2), 300, 400, 300.0, 400), MicroBatch((3,), 100, 100, 100.0, 100)]
    r.observe_step(0, 400.0, 1.0, peak_mem_bytes=800, microbatches=mbs)
    assert r.memory_model.predict(400, 2, 200) == 800


def test_state_dict_round_trip(tmp_path: pathlib.Path):
    r = Router(RouterSettings(), 3, MemoryModel.from_model_sizes(1_000_000, 10_000, 64, 2, 1000))
    r.set_device_memory(1, total_bytes=80_000_000_000, free_bytes=70_000_000_000)
    lengths = lognormal_lengths(48, seed=5)
    a = r.plan(range(48), lengths)
    for d in range(3):
        r.observe_step(d, a.planned_cost()[d], 0.01 * (d + 1), 50_000_000 + d, a.per_device[d])
    r.observe_oom(1, a.per_device[1][0])
    path = tmp_path / "router.json"
    path.write_text(json.dumps(r.state_dict()))
    r2 = Router(RouterSettings(), 3, MemoryModel())
    r2.load_state_dict(json.loads(path.read_text()))
    assert r2.device_states() == r.device_states()
    assert r2.memory_model.coef == pytest.approx(r.memory_model.coef) and r2.memory_model.scale == r.memory_model.scale
    assert r2.plan(range(48), lengths) == r.plan(range(48), lengths)


def test_device_states_budget_uses_headroom():
    r = Router(RouterSettings(memory_headroom=0.5), 2)
    r.set_device_memory(0, total_bytes=1000, free_bytes=900)
    assert r.device_states() == [DeviceState(0, 1.0, 500, 900), DeviceState(1, 1.0, None, None)]


def test_no_torch_in_router():
    src = pathlib.Path(__file__).resolve().parents[1] / "slurm_router" / "router"
    for f in src.glob("*.py"):
        text = f.read_text()
        assert "import torch" not in text and "from torch" not in text, f
