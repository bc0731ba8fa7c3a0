"""Task metrics through the real command (issue 37): a tiny model trained here on a toy task (tests/toy_metric.py:
'c>' answered 'y' or 'z') by two variants, one that learns (lr 3e-2) and one that cannot (lr 1e-6), scored at
every evaluation by a user's function (eval.metrics.acc=toy_metric:next_letter). Every evaluation records one
score per example; fused variants and a 2-device task give the separate run's scores, in order; a function that
raises fails its task naming the example, keeps a checkpoint, and resume= evaluates again, once."""

import json
import os
import signal
from pathlib import Path

import pytest
import toy_metric
from conftest import event_rows, read_json, run_cli, run_dir_of, start_cli, wait_until

pytestmark = pytest.mark.integration

TESTS = Path(__file__).parent
VARIANTS = ["+variants.learns.train.lr=3e-2", "+variants.stuck.train.lr=1e-6"]


def common(data: Path) -> list[str]:
    return [
        "data=jsonl",
        f"data.path={data}",
        "data.prompt_field=prompt",
        "data.completion_field=completion",
        "data.max_len=16",
        "train.steps=20",
        "train.eval_every=10",
        "train.eval_batches=2",
        "train.eval_batch_size=8",
        "router.row_cost=fixed",  # the fitted row cost diverges on these 3-token samples (a router bug, reported)
        "launcher.cpu_slots=2",
        "eval.metrics.acc=toy_metric:next_letter",
    ]


def env(**extra: str) -> dict:
    """The jobs import the metric's module too: tests/ on PYTHONPATH."""
    return {"PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]), **extra}


def run(tmp: Path, *args: str, code: int = 0, **extra: str):
    tmp.mkdir(parents=True, exist_ok=True)
    data = toy_metric.write_data(tmp / "toy.jsonl")
    proc = run_cli(*common(data), *args, f"run_root={tmp / 'runs'}", cwd=tmp, env=env(**extra), timeout=900)
    assert proc.returncode == code, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def scores(run_dir: Path, task: str) -> dict[int, list[float]]:
    """step -> the per-example scores of `acc` in the task's eval rows (every eval row must have them)."""
    out = {}
    for r in event_rows(run_dir / "tasks" / task):
        if r["event"] == "eval" and r["device"] == 0:
            assert r["step"] not in out, f"{task}: step {r['step']} evaluated twice"
            m = r["metrics"]["acc"]
            assert m["higher_is_better"] is True and len(m["scores"]) == len(toy_metric.EXAMPLES)
            assert m["sources"] == toy_metric.SOURCES and r["t_metrics_s"] >= 0
            out[r["step"]] = m["scores"]
    return out


@pytest.fixture(scope="module")
def alone(tmp_path_factory) -> Path:
    return run_dir_of(run(tmp_path_factory.mktemp("alone"), *VARIANTS, "eval.primary=acc"))


def test_every_evaluation_scores_every_example(alone):
    learns, stuck = scores(alone, "learns"), scores(alone, "stuck")
    assert sorted(learns) == sorted(stuck) == [0, 10, 20]
    assert learns[0] == stuck[0]  # both start from the same base: the same model at step 0
    assert sum(learns[20]) > sum(stuck[20]) == 0  # the toy task separates them


def test_fused_variants_and_two_devices_give_the_separate_scores(alone, tmp_path):
    for extra in ("resources.fuse_variants=2", "resources.devices_per_task=2"):
        other = run_dir_of(run(tmp_path / extra.split("=")[0], *VARIANTS, "eval.primary=acc", extra))
        for task in ("learns", "stuck"):
            assert scores(other, task) == scores(alone, task), (extra, task)


def test_a_metric_that_raises_fails_its_task_naming_the_example_and_resume_evaluates_again(tmp_path):
    """The step-10 evaluation raises on example 5: the task fails with that line, keeps a checkpoint at step 10;
    resume= (the function fixed) evaluates step 10 again and finishes; every step is evaluated once."""
    proc = run(tmp_path, code=1, TOY_METRIC_FAIL_AT="5", TOY_METRIC_FAIL_CALL="2")
    run_dir = Path(next(line for line in proc.stdout.splitlines() if line.startswith("run_dir: "))[9:])
    task = run_dir / "tasks" / "main"
    end = [r for r in event_rows(task) if r["event"] == "end"][-1]
    assert end["exit_state"] == "failed"
    assert "eval.metrics.acc=toy_metric:next_letter failed at the evaluation of step 10 on example 5" in end["error"]
    assert "cannot score example 5" in end["error"]
    assert [p.name for p in (task / "checkpoints").glob("*.pt")] == ["step-00000010.pt"]
    resumed = run_cli(f"resume={run_dir}", cwd=tmp_path, env=env(), timeout=900)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert sorted(scores(run_dir, "main")) == [0, 10, 20]
    assert json.loads((task / "result.json").read_text())["steps"] == 20


def test_the_verdict_the_winner_and_export_follow_the_primary_metric(alone, tmp_path):
    """eval.primary=acc: the verdict's rows, the winner and `export` (no VARIANT) are about acc; the report has
    each variant's mean and interval of loss and acc; adapter-best/ is kept by acc."""
    summary = json.loads((alone / "report" / "summary.json").read_text())
    assert summary["primary"] == "acc" and summary["winner"]["variant"] == "learns"
    assert summary["winner"]["metric"] == "acc" and "acc" in summary["winner"]["sentence"]
    row = next(r for r in summary["ab"] if {r["a"], r["b"]} == {"learns", "stuck"})
    assert row["metric"] == "acc" and "in acc" in row["sentence"] and "example clusters" in row["sentence"]
    table = summary["metrics"]
    assert table["learns"]["acc"]["mean"] > table["stuck"]["acc"]["mean"] == 0
    assert table["learns"]["acc"]["ci_low"] <= table["learns"]["acc"]["mean"] <= table["learns"]["acc"]["ci_high"]
    assert table["learns"]["loss"]["mean"] < table["stuck"]["loss"]["mean"]
    assert "## Metrics" in (alone / "report" / "report.md").read_text()
    assert (alone / "report" / "metric_curves.png").is_file() and "metric_curves.png" in summary["plots"]
    assert "learns,learns,20,acc," in (alone / "report" / "metrics.csv").read_text()
    d = summary["disagree_examples"]  # where the leader and the runner-up differ most
    assert (d["leader"], d["runner_up"]) == ("learns", "stuck") and d["examples"]
    assert all(e["leader"] == 1.0 and e["runner_up"] == 0.0 for e in d["examples"])
    first = d["examples"][0]  # the function's prompts and outputs, shown where they differ
    assert first["prompt"] == toy_metric.EXAMPLES[first["example"]][0]
    assert first["leader_output"] == toy_metric.EXAMPLES[first["example"]][1] != first["runner_up_output"]
    assert f"prompt {first['prompt']!r}, learns answered" in (alone / "report" / "report.md").read_text()
    best = json.loads((alone / "tasks" / "learns" / "adapter-best" / "held_out.json").read_text())
    assert best["judged_by"] == "acc"
    proc = run_cli(str(alone), module="slurm_router.export", cwd=tmp_path)
    assert proc.returncode == 0 and "tasks/learns/adapter" in proc.stdout, proc.stdout + proc.stderr


def test_prune_decides_on_the_primary_metric(tmp_path):
    """prune=true with eval.primary=acc: the run's look prunes the variant that cannot learn, worse than `learns` in
    acc (its reason says so), and its replicates still training then stop there. One look, at step 20: at step 10 the two seeds' differences
    agreed less and p (0.0247, 1 df) sat at the level 0.025, so CI's run once went on instead."""
    proc = run(
        tmp_path, *VARIANTS, "eval.primary=acc", "seeds=2", "prune=true", "train.steps=30", "train.eval_every=20"
    )
    run_dir = run_dir_of(proc)
    looks = [json.loads(line) for line in (run_dir / "decisions.jsonl").read_text().splitlines()]
    assert [(x["step"], x["metric"], x["pruned"]) for x in looks] == [(20, "acc", ["stuck"])], looks
    reason = looks[0]["decisions"]["stuck"]["reason"]
    assert "worse than learns by" in reason and " in acc (95% CI" in reason, reason
    # a stuck replicate still training at the look stops there, saying why; one that ran ahead of learns-s1 (with
    # two slots, a replicate may reach step 30 before the other variant's second seed reaches step 20) ended before
    for path in run_dir.glob("tasks/stuck-s*/result.json"):
        r = json.loads(path.read_text())
        if r.get("exit_state") == "pruned":
            assert r["metric"] == "acc" and "worse than learns by" in r["reason"] and " in acc (95% CI" in r["reason"]
        else:
            rows = [json.loads(line) for line in (path.parent / "events-rank0.jsonl").read_text().splitlines()]
            end = max(row["time"] for row in rows if row.get("event") == "end")
            assert end <= looks[0]["time"] + 5.0, (path.parent.name, end, looks[0]["time"])


def test_loss_and_the_metric_naming_different_winners_is_one_line():
    from slurm_router.analysis.winner import disagreement

    loss = {"variant": "a", "score": 1.2}
    assert disagreement(loss, {"variant": "a", "score": 0.9}, "acc") is None
    line = disagreement(loss, {"variant": "b", "score": 0.9}, "acc")
    assert line == (
        "held-out loss and acc name different winners: a has the lowest held-out loss (1.2000), b the best acc "
        "(0.9000); the verdict, prune=true and export follow eval.primary=acc"
    )


def test_trackers_get_eval_slash_metric():
    from slurm_router.rundir.events import EvalRow
    from slurm_router.tracking.trackers import metrics_of

    row = EvalRow(step=3, val_loss=2.0, val_tokens=4, batch_loss_sums=[8.0], batch_tokens=[4])
    assert metrics_of(row) == {"eval/loss": 2.0}
    row.metrics = {"acc": {"scores": [1.0, 0.0, 1.0, 1.0], "higher_is_better": True}}
    assert metrics_of(row) == {"eval/loss": 2.0, "eval/acc": 0.75}


def test_a_local_lm_eval_multiple_choice_task_scores_every_example_and_decides(tmp_path):
    """eval.metrics.mc=TASK.yaml (lm-eval's own task machinery, offline): each document is an example, scored by
    the choices' log-likelihoods under the variant's model; eval.primary=mc decides. A generate_until task (one
    greedy token, exact match) scores each example as the user's argmax function does."""
    pytest.importorskip("lm_eval")
    task, gen = toy_metric.write_task(tmp_path / "task"), toy_metric.write_generation_task(tmp_path / "gen")
    run_dir = run_dir_of(
        run(tmp_path, *VARIANTS, f"eval.metrics.mc={task}", f"eval.metrics.gen={gen}", "eval.primary=mc")
    )
    for name in ("learns", "stuck"):
        evals = [r for r in event_rows(run_dir / "tasks" / name) if r["event"] == "eval"]
        assert [r["step"] for r in evals] == [0, 10, 20]
        assert all(len(r["metrics"]["mc"]["scores"]) == len(toy_metric.EXAMPLES) for r in evals)
        # generate_until, 1 greedy token, exact match: the function's own argmax test, example by example
        assert all(r["metrics"]["gen"]["scores"] == r["metrics"]["acc"]["scores"] for r in evals)
    summary = json.loads((run_dir / "report" / "summary.json").read_text())
    assert summary["primary"] == "mc" and summary["winner"]["metric"] == "mc"
    assert "mc" in summary["metrics"]["learns"] and "in mc" in summary["ab"][0]["sentence"]


def test_a_task_file_that_would_need_the_network_is_one_line_before_anything_is_written(tmp_path, capsys):
    pytest.importorskip("lm_eval")
    from slurm_router.__main__ import main

    task = toy_metric.write_task(tmp_path / "task", dataset_path="someone/a_hub_dataset")
    code = main([f"eval.metrics.mc={task}", "train.steps=1", f"run_root={tmp_path / 'runs'}"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, lines
    assert f"eval.metrics.mc={task}: lm-eval cannot load the task 'toy_mc'" in lines[0]
    assert "it would need the network" in lines[0] and not (tmp_path / "runs").exists()


def test_a_task_stopped_during_an_evaluation_resumes_and_counts_it_once(tmp_path):
    """SIGTERM to the task while its step-10 evaluation is scoring: the evaluation ends and is recorded, the task
    stops at the next step's end (a stop is decided at step boundaries) with a checkpoint after the evaluation;
    resume= goes on from there without evaluating step 10 again (one eval row a step)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    data, mark, root = toy_metric.write_data(tmp_path / "toy.jsonl"), tmp_path / "scoring", tmp_path / "runs"
    extra = env(TOY_METRIC_SLOW_CALL="2", TOY_METRIC_MARK=str(mark))
    proc = start_cli(*common(data), f"run_root={root}", cwd=tmp_path, env=extra)
    try:
        wait_until(mark.exists, "the step-10 evaluation", 300)
        run_dir = next(root.glob("default/*"))
        os.kill(read_json(run_dir / "manifest.json")["tasks"]["main"]["pid"], signal.SIGTERM)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0, out[-2000:] + err[-2000:]
    task = run_dir / "tasks" / "main"
    assert [p.name for p in (task / "checkpoints").glob("*.pt")] == ["step-00000011.pt"], out[-2000:] + err[-2000:]
    resumed = run_cli(f"resume={run_dir}", cwd=tmp_path, env=env(), timeout=900)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert sorted(scores(run_dir, "main")) == [0, 10, 20]  # scores() refuses a step evaluated twice


def test_the_readmes_ten_line_metric_runs_as_written(tmp_path):
    """The README's metric, copied from its code block into my_pkg/metrics.py, scores every evaluation of a real
    run (the bare command's model and data) and decides it: three examples, one score each."""
    block = (TESTS.parent / "README.md").read_text().split("```python\n")[1].split("```")[0]
    (tmp_path / "my_pkg").mkdir()
    (tmp_path / "my_pkg" / "__init__.py").write_text("")
    (tmp_path / "my_pkg" / "metrics.py").write_text(block)
    proc = run_cli(
        "train.steps=4",
        "train.eval_every=2",
        "train.eval_batches=1",
        "data.max_documents=20",
        "eval.metrics.em=my_pkg.metrics:exact_match",
        "eval.primary=em",
        f"run_root={tmp_path / 'runs'}",
        cwd=tmp_path,
        env={"PYTHONPATH": os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)},
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = run_dir_of(proc)
    (task,) = [p.parent for p in run_dir.glob("tasks/*/result.json")]
    evals = [r for r in event_rows(task) if r["event"] == "eval" and r["device"] == 0]
    assert [r["step"] for r in evals] == [0, 2, 4]
    assert all(len(r["metrics"]["em"]["scores"]) == 3 and r["metrics"]["em"]["higher_is_better"] for r in evals)
    assert read_json(run_dir / "report" / "summary.json")["primary"] == "em"
