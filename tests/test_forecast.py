"""The run's forecast (issue 50, "A forecast"): its arithmetic (launch/eta.py, pure), the Slurm time limit it sets
(launcher.time_limit=auto), and through the real command: the dry run prints it, the run saves forecast.json and
the report sets the forecast beside what happened."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from conftest import run_cli, run_dir_of
from omegaconf import OmegaConf

from slurm_router.analysis import forecast as report_forecast
from slurm_router.backends.slurm import time_limit
from slurm_router.errors import UserError
from slurm_router.launch import eta
from slurm_router.launch.forecast import OFF_ENV, lines, run_eta


def test_evaluations_and_the_first_look():
    assert eta.n_evaluations(100, 25) == 5  # 0, 25, 50, 75, 100
    assert eta.n_evaluations(10, 0) == 2  # the start and the end
    assert eta.n_evaluations(20, 20) == 2
    assert eta.first_look(100, 25, 0.5) == 50
    assert eta.first_look(20, 5, 0.5) == 10
    assert eta.first_look(20, 0, 0.5) is None


def test_a_task_is_its_start_up_steps_and_evaluations():
    t = eta.task_time("r8", "variants", 1, startup_s=10, step_s=0.5, eval_s=2, steps=100, eval_every=25)
    assert (t.startup_s, t.train_s, t.eval_s, t.total_s) == (10, 50, 10, 70)
    pruned = eta.task_time("r8", "variants", 1, 10, 0.5, 2, 100, 25, stop_at=50)
    assert (pruned.train_s, pruned.eval_s) == (25, 6)  # evaluations at 0, 25 and 50 (its last)


def test_the_queue_fills_free_slots_in_order():
    assert eta.makespan([], 2) == 0
    assert eta.makespan([10, 10, 10], 2) == 20
    assert eta.makespan([30, 10, 10, 10], 2) == 30
    assert eta.makespan([5, 5], 8) == 5
    assert eta.makespan([4, 4, 4], 1) == 12


def test_stages_rounds_device_hours_and_the_range():
    first = [eta.TaskTime(f"v{i}", "variants", 1, 10, 60, 20) for i in range(4)]
    reserves = [eta.TaskTime(f"r{i}", "variants", 1, 10, 60, 20, group="reserve-1") for i in range(2)]
    base = [eta.TaskTime("base", "base", 1, 10, 200, 30)]
    fc = eta.forecast([("base", base), ("variants", first + reserves)], slots=2, report_s=15, low=None)
    names = [p.name for p in fc.parts]
    assert names == ["base", "variants", "variants reserve-1"]
    assert [p.wall_s for p in fc.parts] == [240, 180, 90]
    assert fc.wall_s == 240 + 180 + 90 + 15
    assert fc.device_hours == pytest.approx((240 + 6 * 90) / 3600)
    assert fc.split()["train"] == pytest.approx((200 + 6 * 60) / 3600)
    low = eta.low_part([("base", base), ("variants", first + reserves)], slots=2)
    assert low.wall_s == 240 + 180 and low.device_hours == pytest.approx((240 + 4 * 90) / 3600)
    wide = [eta.TaskTime("w", "variants", 2, 0, 100, 0), eta.TaskTime("x", "variants", 2, 0, 100, 0)]
    assert eta.part("variants", wide, slots=2).wall_s == 200  # a 2-device task takes both slots
    d = eta.forecast([("base", base)], 2, 0, low).to_dict()
    assert d["low"]["wall_s"] == low.wall_s and d["stages"][0]["name"] == "base"


def test_the_run_eta_from_what_is_left():
    assert eta.remaining_s(100, 10, None, 20, None) == 100  # not started: its whole forecast
    assert eta.remaining_s(100, 10, 10, 20, None) == 45  # half its steps: half of what follows its start-up
    assert eta.remaining_s(100, 10, 10, 20, 7.5) == 7.5  # its own pace says
    # two running (30 s and 10 s left), two queued of 20 s on 2 slots: the 10 s one frees a slot first
    assert eta.run_eta([[(30, True), (10, True), (20, False), (20, False)]], 2) == 50
    assert eta.run_eta([[(10, True)], [(5, False)]], 2, report_s=15) == 30
    assert eta.run_eta([], 2, report_s=15) == 0


def _fc(tmp_path, **extra):
    fc = {
        "wall_s": 115.0,
        "report_s": 15.0,
        "device_hours": 0.05,
        "split_device_hours": {"startup": 0.01, "train": 0.03, "eval": 0.01},
        "slots": 2,
        "device": "cpu",
        "source": "calibration",
        "reserves": False,
        "prune": False,
        "rates": {"startup_s": 5.0},
        "stages": [{"name": "variants", "tasks": 2, "wall_s": 100.0, "device_hours": 0.05, "split": {}}],
        "low": None,
        "tasks": {
            "a": {"stage": "variants", "total_s": 100.0, "group": "first"},
            "b": {"stage": "variants", "total_s": 100.0, "group": "first"},
        },
        **extra,
    }
    (tmp_path / report_forecast.FILE).write_text(json.dumps(fc))
    return fc


def test_the_report_compares_and_status_counts_down(tmp_path):
    fc = _fc(tmp_path)
    summary = {
        "header": {"wall_s": 120.0, "device_hours": 0.06},
        "cost": {"train_device_hours": 0.036, "eval_device_hours": 0.01, "tasks": {}},
    }
    got = report_forecast.compare(tmp_path, summary, {"tasks": {}, "state": "completed"})
    rows = {r["what"]: r for r in got["rows"]}
    assert rows["wall time (s)"]["forecast"] == 100.0 and rows["wall time (s)"]["ratio"] == pytest.approx(1.2)
    assert rows["device-hours"]["ratio"] == pytest.approx(1.2)
    section = report_forecast.section({"forecast": got})
    assert section[0] == ("h", 2, "Forecast and what happened")
    assert list(section[1][1]["actual / forecast"]) == ["1.20", "1.20", "1.20", "1.00"]
    assert lines(fc)[0].startswith("forecast: 1m55s wall, 0.0500 device-hours on 2 cpu slot(s)")

    def row(name, state, step=None, eta_s=None, elapsed=None):
        p = SimpleNamespace(step=step, steps=20, eta_s=eta_s)
        return SimpleNamespace(variant=name, state=state, terminal=state == "COMPLETED", elapsed_s=elapsed, progress=p)

    left, whole = run_eta(tmp_path, [row("a", "RUNNING", 10, 40.0), row("b", "PENDING")])
    assert whole == 115.0 and left == pytest.approx(100 + 15)  # b starts on the free slot while a ends
    left, _ = run_eta(tmp_path, [row("a", "COMPLETED", elapsed=200.0), row("b", "PENDING")])
    assert left == pytest.approx(200 + 15)  # a took twice its forecast: b's is scaled by that
    assert run_eta(tmp_path, [row("a", "COMPLETED", elapsed=1.0), row("b", "COMPLETED", elapsed=1.0)]) is None


def test_time_limit_auto_sets_each_stage_from_the_forecast(tmp_path):
    cfg = OmegaConf.create({"launcher": {"timeout_min": 60, "time_limit": None}})
    assert time_limit.stage_minutes(cfg, "variants", str(tmp_path)) == 60
    cfg.launcher.time_limit = "auto"
    assert time_limit.stage_minutes(cfg, "variants", str(tmp_path)) == 60  # no forecast yet: the fixed limit
    _fc(tmp_path, tasks={"a": {"stage": "variants", "total_s": 1200.0}})
    assert time_limit.stage_minutes(cfg, "variants", str(tmp_path)) == 35  # 1200 s x 1.5 + 5 min
    assert time_limit.stage_minutes(cfg, "base", str(tmp_path)) == 60
    cfg.launcher.time_limit = "2h"
    with pytest.raises(UserError, match="launcher.time_limit=2h: set launcher.time_limit=auto"):
        time_limit.check(cfg)


SMALL = (
    "+experiment=lora_ab",
    "base.enabled=false",
    "train.steps=6",
    "train.eval_every=3",
    "train.eval_batches=2",
    "launcher.cpu_slots=2",
)


@pytest.mark.integration
def test_the_dry_run_prints_the_forecast_the_run_saves_it_and_the_report_sets_it_beside_what_happened(tmp_path):
    env = {OFF_ENV: "", "SLURM_ROUTER_CACHE": str(tmp_path / "cache")}
    common = (*SMALL, f"run_root={tmp_path / 'runs'}")
    dry = run_cli(*common, "dry_run=true", cwd=tmp_path, env=env)
    assert dry.returncode == 0, dry.stdout[-3000:] + dry.stderr[-3000:]
    line = next(ln for ln in dry.stdout.splitlines() if ln.startswith("forecast: "))
    assert " wall, " in line and "device-hours on 2 cpu slot(s)" in line and "measured here: calibration" in line
    assert "by stage: variants: 2 task(s)" in dry.stdout
    assert (tmp_path / "cache" / "calibration.json").is_file()
    preview = run_dir_of(dry)
    assert json.loads((preview / "forecast.json").read_text())["tasks"].keys() == {"r8", "r32"}
    assert "forecast: " in (preview / "preview.txt").read_text()

    proc = run_cli(*common, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "measured here: calibration (cached)" in proc.stdout  # the dry run's probe serves the run
    run_dir = run_dir_of(proc)
    fc = json.loads((run_dir / "forecast.json").read_text())
    assert fc["wall_s"] > 0 and fc["device_hours"] > 0 and set(fc["split_device_hours"]) == {"startup", "train", "eval"}
    summary = json.loads((run_dir / "report" / "summary.json").read_text())
    rows = {r["what"]: r for r in summary["forecast"]["rows"]}
    assert rows["device-hours"]["actual"] == pytest.approx(summary["header"]["device_hours"])
    assert rows["wall time (s)"]["ratio"] > 0 and rows["device-hours"]["ratio"] > 0
    report = (run_dir / "report" / "report.md").read_text()
    assert "## Forecast and what happened" in report and "| device-hours |" in report
    status = run_cli(str(run_dir), "--json", module="slurm_router.status", cwd=tmp_path, env=env)
    assert status.returncode == 0 and json.loads(status.stdout)["run_eta_s"] is None  # nothing left to run
    cache = json.loads((tmp_path / "cache" / "calibration.json").read_text())
    assert any(e.get("source") == "a measured run" for e in cache.values())  # the run's rates, for the next forecast


def test_a_runs_own_rates_go_back_into_the_cache(tmp_path):
    from slurm_router.artifacts import calibration

    fc = {
        "threads": {"variants": 1},
        "rates": {"1": {"lora_step_s": 0.5, "eval_batch_s": 0.1}},
        "tasks": {
            "a": {"stage": "variants", "train_s": 10.0, "steps": 20, "eval_s": 2.0, "evals": 2},
            "f": {"stage": "variants"},
        },
        "cache_file": str(tmp_path / "calibration.json"),
        "calibration_key": "k",
    }
    cost = {
        "a": {"steps_per_s": 1.0, "share": 1.0, "state": "completed", "devices": 1, "device_hours": 30 / 3600}
        | {"train_device_hours": 20 / 3600, "eval_device_hours": 5 / 3600, "evaluations": 2},
        "f": {"steps_per_s": 9.0, "share": 0.5, "state": "completed"},  # a fused variant: not a task alone
    }
    summary = {"cost": {"tasks": cost}}
    got = report_forecast.measured_rates(summary, fc)
    # a step took 1 s (0.5 forecast), an evaluation 2.5 s (1 s forecast), the rest of the task 5 s
    assert got == {
        "variants": {
            "lora_step_s": pytest.approx(1.0),
            "startup_s": pytest.approx(5.0),
            "eval_batch_s": pytest.approx(0.25),
        }
    }
    report_forecast.remember(fc, summary)
    entry = json.loads((tmp_path / "calibration.json").read_text())["k"]
    assert entry["source"] == "a measured run" and entry["startup_s"] == pytest.approx(5.0)
    assert entry["by_threads"]["1"]["lora_step_s"] == pytest.approx(1.0)
    calibration.record_measured(tmp_path / "calibration.json", "k", 2, {"step_s": 2.0, "bad": -1})
    entry = json.loads((tmp_path / "calibration.json").read_text())["k"]
    assert entry["by_threads"]["2"] == {"step_s": 2.0} and "1" in entry["by_threads"]
