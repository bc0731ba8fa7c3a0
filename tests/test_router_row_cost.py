"""The packed row's cost fit from step times (RouterSettings.row_cost="fitted", slurm_router/router/cost_model.py).
Pure, fast: synthetic step times from known terms, no torch."""

from __future__ import annotations

import math
import random

import pytest
from workloads import lognormal_lengths, sample_batches

from slurm_router.router import DeviceState, Router, RouterSettings
from slurm_router.router.cost_model import RowCostModel
from slurm_router.router.partition import partition

PER_TOKEN_S = 32e-6
LONG_TAIL = tuple(lognormal_lengths(5000, seed=7, mean_len=96, sigma=1.0, max_len=1024))


def _true_s(rows, lengths_by_id, speed, per_len2_tokens, fixed_tokens):
    work = sum(
        mb.n_tokens + per_len2_tokens * sum(lengths_by_id[i] ** 2 for i in mb.sample_ids) + fixed_tokens for mb in rows
    )
    return PER_TOKEN_S * work / speed


def _train(router, speeds, batches, per_len2_tokens=1 / 2048, fixed_tokens=400.0, noise=0.0, seed=0):
    """Plan each batch, time it with the true terms (and lognormal noise), feed the times back; per step the
    noise-free slowest / fastest busy device, the step time and the micro-batches."""
    rng, out = random.Random(seed), []
    for lengths in batches:
        ids = list(range(len(lengths)))
        a = router.plan(ids, lengths)
        by_id = dict(zip(ids, lengths))
        true = [_true_s(r, by_id, s, per_len2_tokens, fixed_tokens) if r else 0.0 for r, s in zip(a.per_device, speeds)]
        for d, rows in enumerate(a.per_device):
            measured = true[d] * math.exp(rng.gauss(0.0, noise)) if rows else 0.0
            router.observe_step(d, sum(mb.cost for mb in rows), measured, None, rows)
        busy = [t for t in true if t > 0]
        out.append((max(busy) / min(busy), max(true), sum(len(r) for r in a.per_device)))
    return out


def test_the_fit_recovers_known_terms_from_step_times_on_unequal_devices():
    model = RowCostModel(3)
    rng = random.Random(1)
    slowness = (1.0, 2.0, 3.5)  # each device's own speed must not bend the shape
    for _ in range(24):
        for d, k in enumerate(slowness):
            lengths = [rng.choice(LONG_TAIL) for _ in range(rng.randint(4, 12))]
            n_rows = rng.randint(1, 3)
            t, q = sum(lengths), sum(n * n for n in lengths)
            seconds = k * PER_TOKEN_S * (t + q / 2048 + 400 * n_rows) * math.exp(rng.gauss(0.0, 0.01))
            model.observe(d, t, q, n_rows, seconds)
    fit = model.fit()
    assert fit is not None
    assert fit.per_len2_tokens == pytest.approx(1 / 2048, rel=0.05)
    assert fit.fixed_tokens == pytest.approx(400, rel=0.05)
    assert math.sqrt(fit.var_fixed) < 0.05 * 400, "clear data: a small standard error, the fit is used as is"


def test_the_router_fits_the_terms_from_its_own_plans_and_plans_with_them():
    router = Router(RouterSettings(packed=True), 2)
    assert router.planning_settings() is router.settings, "before any step the configured values hold"
    _train(router, (1.0, 0.5), sample_batches(LONG_TAIL, 16, 16, seed=3))
    used = router.planning_settings()
    assert used.cost == "tokens_attention"
    assert used.attention_weight / used.attention_ref_len == pytest.approx(1 / 2048, rel=0.01)
    assert used.microbatch_overhead_tokens == 400
    plan = router.plan(range(16), list(LONG_TAIL[:16]))
    assert all(mb.cost > mb.n_tokens + 400 for mbs in plan.per_device for mb in mbs), "a row pays its fixed cost"


def test_noisy_steps_without_evidence_keep_the_configured_terms():
    model = RowCostModel(2)
    rng = random.Random(5)
    for _ in range(10):  # the same share every step: nothing tells a fixed cost from a per-token one
        for d in range(2):
            model.observe(d, 1000, 100_000, 1, PER_TOKEN_S * 1400 * (1 + d) * math.exp(rng.gauss(0.0, 0.1)))
    settings = RouterSettings(packed=True, microbatch_overhead_tokens=16)
    used = model.settings_for(settings)
    assert used.microbatch_overhead_tokens == 16 and used.attention_weight == 0.0


def test_a_fitted_high_fixed_cost_packs_the_batch_into_fewer_micro_batches():
    fitted = Router(RouterSettings(packed=True), 2)
    _train(fitted, (1.0, 0.25), sample_batches(LONG_TAIL, 8, 16, seed=11), fixed_tokens=3000.0)
    assert fitted.planning_settings().microbatch_overhead_tokens == 3000
    devices = [DeviceState(0, 1.0), DeviceState(1, 0.25)]  # the same speeds for both: only the row cost differs
    default = Router(RouterSettings(packed=True, row_cost="fixed"), 2)
    for lengths in sample_batches(LONG_TAIL, 8, 8, seed=12):
        ids = list(range(8))
        few, many = fitted.plan(ids, lengths, devices), default.plan(ids, lengths, devices)
        assert [len(mbs) for mbs in many.per_device] == [1, 1], "16 tokens a row: the slow device gets a row"
        assert [len(mbs) for mbs in few.per_device] == [1, 0], "3000 tokens a row: the 4x slower one is not worth one"
        assert sorted(few.sample_ids(0)) == ids


def test_the_fitted_cost_balances_a_heterogeneous_pair_better_than_the_default():
    batches = sample_batches(LONG_TAIL, 16, 40, seed=13)
    results = {}
    for mode in ("fixed", "fitted"):
        steps = _train(Router(RouterSettings(packed=True, row_cost=mode), 2), (1.0, 0.5), batches, noise=0.02)
        kept = steps[16:]
        results[mode] = (sum(b for b, _, _ in kept) / len(kept), sum(t for _, t, _ in kept))
    assert results["fitted"][0] < results["fixed"][0] - 0.03, results
    assert results["fitted"][1] < 0.99 * results["fixed"][1], results


def test_partition_charges_a_fixed_cost_once_per_busy_device():
    costs = [100.0] * 4
    assert [len(b) for b in partition(range(4), costs, [1.0, 0.5])] == [3, 1]
    assert [len(b) for b in partition(range(4), costs, [1.0, 0.5], fixed=2000.0)] == [4, 0]
    assert [len(b) for b in partition(range(4), costs, [1.0, 0.5], fixed=50.0)] == [3, 1]
    equal = partition(range(8), costs * 2, [1.0, 1.0], fixed=2000.0)
    assert [len(b) for b in equal] == [4, 4], "equal devices: a fixed cost changes nothing"


def test_padded_plans_ignore_the_row_cost():
    lengths = list(LONG_TAIL[:32])
    devices = [DeviceState(0, 1.0), DeviceState(1, 0.5)]
    plain = Router(RouterSettings(), 2).plan(range(32), lengths, devices)
    high = Router(RouterSettings(microbatch_overhead_tokens=16), 2).plan(range(32), lengths, devices)
    assert plain == high and Router(RouterSettings(), 2).cost_model is None


def test_the_fit_survives_a_checkpoint_and_a_new_device_count():
    router = Router(RouterSettings(packed=True), 2)
    _train(router, (1.0, 0.5), sample_batches(LONG_TAIL, 16, 12, seed=17))
    state = router.state_dict()
    again = Router(RouterSettings(packed=True), 2)
    again.load_state_dict(state)
    assert again.planning_settings() == router.planning_settings()
    bigger = Router(RouterSettings(packed=True), 3)
    bigger.load_state_dict(state)
    assert (
        bigger.planning_settings().microbatch_overhead_tokens == router.planning_settings().microbatch_overhead_tokens
    )


def test_a_bad_row_cost_names_the_choices():
    with pytest.raises(ValueError, match="router.row_cost='learned' is not valid: choose one of fitted, fixed"):
        RouterSettings(row_cost="learned")
