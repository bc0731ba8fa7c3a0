"""Pure parts of the report: the paired bootstrap (the benchmark's baseline), sacct parsing and job facts (a stub
sacct), advice rules, markdown rendering. No run needed."""

import numpy as np
import pandas as pd
import pytest
from conftest import failed_base_manifest

from slurm_router.analysis import abtest, jobfacts
from slurm_router.analysis.load import Task
from slurm_router.analysis.render import to_markdown
from slurm_router.verdict import sentences


def batches(sums, tokens, step=10):
    return {"loss_sums": np.asarray(sums, float), "tokens": np.asarray(tokens, float), "step": step}


def test_paired_bootstrap_pairs_batches_and_its_point_estimate_is_the_plain_difference():
    rng = np.random.default_rng(1)
    tokens = rng.integers(200, 400, size=50)
    hardness = rng.uniform(2.0, 4.0, size=50)  # batch difficulty: shared by both, cancels when paired
    a = batches(hardness * tokens, tokens)
    b = batches((hardness + 0.05 + rng.normal(0, 0.01, 50)) * tokens, tokens)
    r = sentences.paired_bootstrap(a, b)
    assert r["diff"] == pytest.approx(a["loss_sums"].sum() / tokens.sum() - b["loss_sums"].sum() / tokens.sum())
    assert r["ci_low"] < r["diff"] < r["ci_high"] < 0 and r["se"] < 0.01  # paired: tight despite hardness
    assert sentences.paired_bootstrap(a, b) == r  # seeded: same report every time
    same = sentences.paired_bootstrap(a, a)
    assert same["diff"] == 0 and same["ci_low"] == same["ci_high"] == 0
    noisy = sentences.paired_bootstrap(a, batches((hardness + rng.normal(0, 0.3, 50)) * tokens, tokens))
    assert noisy["ci_low"] < 0 < noisy["ci_high"]
    with pytest.raises(ValueError, match="cannot be paired"):
        sentences.paired_bootstrap(a, batches([1.0], [1]))


def test_compare_all_covers_every_pair_and_the_base():
    def task(name, stage, evals):
        t = Task(name, {"stage": stage})
        t.evals = pd.DataFrame(
            [{"step": s, "val_loss": sum(v) / sum(k), "batch_loss_sums": v, "batch_tokens": k} for s, v, k in evals]
        )
        return t

    tok = [100, 100, 100]
    tasks = [
        task("base", "base", [(20, [300, 310, 290], tok)]),
        task("r8", "variants", [(0, [300, 310, 290], tok), (8, [280, 290, 270], tok)]),
        task("r32", "variants", [(0, [300, 310, 290], tok)]),
    ]  # not trained yet
    rows = {(r["a"], r["b"]): r for r in abtest.compare_all(tasks)}
    assert set(rows) == {("r8", "r32"), ("r8", "base"), ("r32", "base")}
    assert rows[("r8", "base")]["diff"] == pytest.approx(-0.2)
    assert "no verdict" in rows[("r8", "r32")]["sentence"] and "no verdict" in rows[("r32", "base")]["sentence"]
    base, source = abtest.base_batches(tasks[1:])  # cached base: a step-0 eval
    assert source == "r8 (step-0 eval)" and base["step"] == 0


SACCT = """15_0|16|COMPLETED|0:0|00:04:10|gpu01|2026-11-23T07:03:47|2026-11-23T07:07:57
15_1|17|REQUEUED|0:0|00:00:20|gpu02|2026-11-23T07:03:47|2026-11-23T07:04:07
15_1|17|TIMEOUT|0:0|01:00:00|gpu02|2026-11-23T07:04:07|2026-11-23T08:04:07
"""
RESOURCES = """15_0|01:00:00|billing=8,cpu=8,gres/gpu=2,gres/gpu:h100=2,mem=64G,node=1|8|00:50:00|||64G
15_0.batch|||8|00:50:00|3145728K||
15_0.0|||8|00:00:00|8G||
15_1|01:00:00|billing=8,cpu=8,gres/gpu=2,mem=64G,node=1|8|07:00:00|||64G
"""


def test_job_facts_from_sacct_and_plain_advice():
    manifest = {
        "launcher": "slurm",
        "host": "login",
        "jobs": [
            {
                "stage": "variants",
                "job_id": "15",
                "array": True,
                "tasks": [{"variant": "r8", "array_index": 0}, {"variant": "r32", "array_index": 1}],
            }
        ],
        "tasks": {
            "r8": {"stage": "variants", "state": "submitted", "devices": 2},
            "r32": {"stage": "variants", "state": "submitted", "devices": 2},
        },
    }
    calls = []

    def runner(argv):
        calls.append(argv)
        if argv[0] == "squeue":
            return ""  # both ended longer ago than MinJobAge: sacct alone knows them
        return RESOURCES if any("Timelimit" in a for a in argv) else SACCT

    tasks = [Task("r8", manifest["tasks"]["r8"]), Task("r32", manifest["tasks"]["r32"])]
    facts = jobfacts.job_facts(manifest, tasks, runner)
    r8, r32 = facts["r8"], facts["r32"]
    # every call names job 15 or a task of it (a requeued task's attempts: lost_nodes.py asks by its own id)
    assert {c[0] for c in calls} == {"squeue", "sacct"}
    assert all(any(a == "15" or a.startswith("15_") for a in ",".join(c).split(",")) for c in calls), calls
    assert (r8["source"], r8["state"], r8["elapsed_s"], r8["time_limit_s"], r8["node"]) == (
        "sacct",
        "COMPLETED",
        250,
        3600,
        "gpu01",
    )
    assert r8["devices_allocated"] == 2 and r8["cpus_allocated"] == 8 and r8["mem_allocated_bytes"] == 64 * 2**30
    assert r8["mem_max_rss_bytes"] == 8 * 2**30 and r8["cpu_efficiency"] == pytest.approx(3000 / (250 * 8))
    assert (r32["state"], r32["requeues"]) == ("TIMEOUT", 1)
    tips = jobfacts.advice(
        {**r8, "device_type": "cuda", "device_mem_peak_bytes": 17e9, "device_mem_total_bytes": 80e9, "devices_used": 1},
        {"balance_ratio": 1.4, "devices": 2, "policy": "round_robin"},
    )
    text = "\n".join(tips)
    assert (
        "GPU memory peak 21% of the allocation: co-locate variants (resources.tasks_per_gpu) or ask for a smaller GPU"
        in text
    )
    assert "1 of 2 allocated devices computed no sample" in text and "try router=balanced" in text
    assert "used 7% of the 60 min time limit" in text
    assert "hit its time limit" in "\n".join(jobfacts.advice(r32, {}))
    assert jobfacts.advice({"device_type": "cpu"}, {"balance_ratio": 1.01, "devices": 2}) == []


def test_a_report_job_that_starts_before_sacct_knows_the_stage_reads_squeue():
    """The report job (afterany) may start within a second of Slurm cancelling a stage whose dependency failed,
    before slurmdbd has recorded that stage at all (CI saw it: 'r8: no events yet (unknown)'). squeue holds the
    cancelled array for MinJobAge: the report says it never ran, and why."""
    manifest = {**failed_base_manifest("221"), "host": "login"}
    squeue = "221_[0-1]|CANCELLED|0:00|0||DependencyNeverSatisfied|0|\n220|FAILED|0:01|0|vm|NonZeroExitCode|256|\n"
    facts = jobfacts.job_facts(
        manifest,
        [Task(n, {"state": "submitted"}) for n in ("base", "r8", "r32")],
        lambda argv: squeue if argv[0] == "squeue" else "",  # sacct: nothing recorded yet
    )
    assert (facts["base"]["state"], facts["base"]["exit_code"]) == ("FAILED", "1:0")
    for name in ("r8", "r32"):
        assert facts[name]["state"] == "CANCELLED", facts[name]
        assert facts[name]["reason"] == "DependencyNeverSatisfied: stage base failed (base FAILED)", facts[name]


def test_local_runs_need_no_sacct():
    manifest = {
        "launcher": "local",
        "host": "box",
        "jobs": [],
        "tasks": {"r8": {"state": "completed", "elapsed_s": 7.5, "devices": ["0"]}},
    }
    f = jobfacts.job_facts(
        manifest, [Task("r8", manifest["tasks"]["r8"])], runner=lambda argv: pytest.fail("sacct called for a local run")
    )["r8"]
    assert (f["source"], f["state"], f["elapsed_s"], f["node"], f["devices_allocated"]) == (
        "local",
        "COMPLETED",
        7.5,
        "box",
        1,
    )


def test_markdown_tables_escape_and_align():
    md = to_markdown([("h", 2, "T"), ("table", pd.DataFrame({"task": ["a|b"], "tokens/s": ["1,234"]})), ("ul", ["x"])])
    assert "## T" in md and "| a\\|b | 1,234 |" in md and "|---|---:|" in md and "- x" in md


def test_mfu_uses_6n_for_full_training_4n_plus_2n_trainable_for_lora_and_names_the_peak():
    from slurm_router.analysis.metrics import mfu

    t = Task("r8", {"stage": "variants"})
    t.steps = pd.DataFrame([{"step": 0, "busy_s_all": [1.0, 1.0]}])
    t.start = {"device_type": "cuda", "n_params": 100e6, "n_trainable_params": 100e6, "mem_total_bytes": 80 * 2**30}
    full = mfu(t, tokens_per_s=100_000)
    assert full["mfu"] == pytest.approx(100_000 * 6 * 100e6 / (2 * 989e12)) and "H100" in full["text"]
    t.start.update(n_trainable_params=1e6, device_name="NVIDIA A100-SXM4-80GB")
    lora = mfu(t, tokens_per_s=100_000)
    assert lora["mfu"] == pytest.approx(100_000 * (4 * 100e6 + 2 * 1e6) / (2 * 312e12)) and "LoRA" in lora["text"]
    t.start.update(n_trainable_params=100e6, device_name="NVIDIA H100 PCIe")  # not the SXM part's peak
    assert mfu(t, tokens_per_s=100_000)["mfu"] == pytest.approx(100_000 * 6 * 100e6 / (2 * 756e12))
    # attention's two matmuls when the start row gives the shape: 12 x layers x width x the mean attended context
    t.steps = pd.DataFrame([{"step": 0, "busy_s_all": [1.0, 1.0], "n_tokens": 990, "n_samples": 10}])  # 99 a sample
    t.start.update(n_layer=12, d_model=768)
    want = 6 * 100e6 + 12 * 12 * 768 * 50
    assert mfu(t, tokens_per_s=100_000)["mfu"] == pytest.approx(100_000 * want / (2 * 756e12))


def test_a_cpu_runs_mfu_is_against_this_machines_measured_matmul_peak(tmp_path, monkeypatch):
    """Issue 51, 1: a CPU run's MFU divides by the float32 torch.mm FLOP/s measured here at the worker's threads
    (kept in the user cache: measured once); a run from another host says its peak is unknown here."""
    import platform

    from slurm_router.analysis import matmul_peak
    from slurm_router.analysis.metrics import mfu

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    t = Task("r8", {"stage": "variants"})
    t.steps = pd.DataFrame([{"step": 0, "busy_s_all": [1.0]}])
    t.start = {"device_type": "cpu", "n_params": 1e6, "n_trainable_params": 1e4, "host": platform.node(), "threads": 1}
    got = mfu(t, tokens_per_s=1000)
    peak = matmul_peak.peak_flops("cpu", "float32", 1, measure=False)  # measured by mfu, kept in the cache
    assert peak and 1e8 < peak < 1e13, peak
    assert (
        got["mfu"] == pytest.approx(1000 * (4e6 + 2e4) / peak) and "measured on this machine at 1 thread" in got["text"]
    )
    assert (tmp_path / "slurm_router" / "matmul_peak.json").is_file()
    t.start["host"] = "another-node"
    assert mfu(t, tokens_per_s=1000)["mfu"] is None and "another-node" in mfu(t, tokens_per_s=1000)["text"]


def test_tokens_per_s_is_one_definition_after_warm_up_and_counts_a_rerun_step_once():
    from slurm_router.rundir.throughput import per_s, tokens_per_s, warmup_steps

    assert [warmup_steps(n) for n in (0, 1, 2, 19, 20, 35)] == [0, 0, 1, 1, 2, 3]
    rows = [{"step": s, "attempt": 0, "n_tokens": 100, "n_samples": 4, "t_step_s": 1.0} for s in range(6)]
    rows[0]["t_step_s"] = 50.0  # warm-up: left out
    rows += [{"step": 5, "attempt": 1, "n_tokens": 100, "n_samples": 4, "t_step_s": 3.0}]  # a requeue ran step 5 again
    rows += [{"step": 6, "attempt": 1, "n_tokens": 300, "t_step_s": None}]  # damaged: left out
    assert tokens_per_s(rows) == pytest.approx(500 / 7.0) and per_s(rows, "n_samples") == pytest.approx(20 / 7.0)
    assert tokens_per_s(rows[:1]) == pytest.approx(100 / 50.0)  # one step: no warm-up
    assert tokens_per_s([]) is None and tokens_per_s([{"step": 0, "n_tokens": 1, "t_step_s": 0.0}]) is None
