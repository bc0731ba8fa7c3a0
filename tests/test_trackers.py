"""Experiment trackers (slurm_router/tracking/trackers.py), read back with each tracker's own reader: TensorBoard's
EventAccumulator, MLflow's search_runs and get_metric_history on the run's file store, and the W&B offline run's
.wandb file decoded with wandb's own protobuf Records. What they hold must be the events file's step and eval
rows, each step once, across a stop signal and resume= (the same tracker run continues), across a crash (steps
that run again are not logged twice), and after a replay (`python -m slurm_router.analysis RUN_DIR --to KIND`)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import event_rows, run_cli, run_dir_of, slowdown, start_cli, wait_until

pytest.importorskip("tensorboard")
pytest.importorskip("mlflow")
pytest.importorskip("wandb")

ALL = "tracker=[tensorboard,mlflow,wandb]"
# one task, steps slow enough (SLOW) for a Ctrl-C to land mid-run; an evaluation every 2 steps
FAST = [
    "base.enabled=false",
    "train.steps=8",
    "train.eval_every=2",
    "train.eval_batches=2",
    "data.max_documents=60",
    "launcher.cpu_slots=1",
]
SLOW = slowdown("2")
METRIC = {"step": ("loss", "train/loss"), "eval": ("val_loss", "eval/loss")}


def tracker_env(tmp: Path) -> dict:
    """W&B's own folders in tmp, and no tracker setting from the caller's environment (the defaults apply)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "MLFLOW_"))}
    return {
        **env,
        "PYTHONUNBUFFERED": "1",
        **{f"WANDB_{d}_DIR": str(tmp / "wandb-home" / d.lower()) for d in ("CONFIG", "CACHE", "DATA")},
    }


@pytest.fixture
def clean_env(tmp_path, monkeypatch):
    for k in list(os.environ):
        if k.startswith(("WANDB_", "MLFLOW_")):
            monkeypatch.delenv(k)
    for k, v in tracker_env(tmp_path).items():
        if k.startswith("WANDB_"):
            monkeypatch.setenv(k, v)


# ---- what the events file says, and what each tracker reads back -------------------------------------------------
def first_logged(task_dir: Path) -> dict[str, dict[int, float]]:
    """Per row kind, step -> value as first written to rank 0's events file (the value a tracker keeps)."""
    out = {kind: {} for kind in METRIC}
    for r in event_rows(task_dir):
        if r["event"] in METRIC:
            out[r["event"]].setdefault(r["step"], r[METRIC[r["event"]][0]])
    return out


def tensorboard_read(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] as TensorBoard's own reader loads the log dir (every attempt's event file; nothing
    purged, so a step logged twice would show twice)."""
    from tensorboard.backend.event_processing.event_accumulator import TENSORS, EventAccumulator
    from tensorboard.util.tensor_util import make_ndarray

    acc = EventAccumulator(str(log_dir), size_guidance={TENSORS: 0}, purge_orphaned_data=False)
    acc.Reload()
    return {
        tag: [(e.step, make_ndarray(e.tensor_proto).item()) for e in acc.Tensors(tag)]
        for tag in acc.Tags()["tensors"]
        if "/" in tag and not tag.startswith("config")
    }


def mlflow_read(record: dict, run_name: str) -> tuple[object, dict[str, list[tuple[int, float]]]]:
    """(the run's row from search_runs, metric -> [(step, value)] from get_metric_history) on its store."""
    import mlflow
    from mlflow.tracking import MlflowClient

    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    mlflow.set_tracking_uri(record["tracking_uri"])
    runs = mlflow.search_runs(search_all_experiments=True, filter_string=f"attributes.run_name = '{run_name}'")
    assert len(runs) == 1, runs  # one MLflow run for the task, every attempt
    client = MlflowClient(record["tracking_uri"])
    history = {
        m: [(x.step, x.value) for x in client.get_metric_history(record["run_id"], m)]
        for m in ("train/loss", "eval/loss")
    }
    return runs.iloc[0], history


def wandb_records(path: Path):
    """The protobuf Records of a .wandb file: wandb's header (':W&B', 0xBEE1, version), then LevelDB's log format
    (32 KiB blocks; records of crc32, length, type: full, first, middle, last). Decoded with wandb.proto."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert struct.unpack("<4sHB", data[:7])[:2] == (b":W&B", 0xBEE1), path
    pos, block, parts = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7]) if left >= 7 else (0, 0, 0)
        if left < 7 or kind == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        parts = chunk if kind in (1, 2) else parts + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            yield record


def wandb_read(record: dict) -> tuple[list[tuple[str, str, str]], dict[str, list[tuple[int, float]]]]:
    """([(run id, name, group)] per offline folder of the task, in start order; metric -> [(step, value)]
    over all of them)."""
    runs, history = [], {"train/loss": [], "eval/loss": []}
    for folder in sorted(Path(record["dir"], "wandb").glob(f"offline-run-*-{record['id']}")):
        for r in wandb_records(folder / f"run-{record['id']}.wandb"):
            kind = r.WhichOneof("record_type")
            if kind == "run":
                runs.append((r.run.run_id, r.run.display_name, r.run.run_group))
            elif kind == "history":
                row = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item}
                for m in history:
                    if m in row:
                        history[m].append((row["_step"], row[m]))
    return runs, history


def _wandb_steps(record: dict) -> list[int] | None:
    """The steps of train/loss in the task's W&B offline log so far (None while a record is half written)."""
    try:
        return sorted(step for step, _ in wandb_read(record)[1]["train/loss"])
    except Exception:
        return None


def check_once_and_equal(
    got: dict[str, list[tuple[int, float]]], want: dict[str, dict[int, float]], who: str, complete: bool = True
) -> None:
    """Each step once, with the events file's value (exactly: TensorBoard holds float64 scalars here)."""
    for kind, (_, metric) in METRIC.items():
        steps = [s for s, _ in got[metric]]
        assert len(steps) == len(set(steps)), f"{who} {metric}: a step logged twice: {sorted(steps)}"
        assert set(steps) <= set(want[kind]), f"{who} {metric}: steps the events file lacks"
        if complete:
            assert sorted(steps) == sorted(want[kind]), f"{who} {metric}: {sorted(steps)} != {sorted(want[kind])}"
        for step, value in got[metric]:
            assert value == want[kind][step], f"{who} {metric} step {step}: {value} != {want[kind][step]}"


def check_all(task_dir: Path, run_name: str, records: dict) -> tuple:
    """Every tracker of the task against its events file; returns what each read (for the replay's comparison)."""
    want = first_logged(task_dir)
    tb = tensorboard_read(Path(records["tensorboard"]["log_dir"]))
    check_once_and_equal(tb, want, "tensorboard")
    run, ml = mlflow_read(records["mlflow"], run_name)
    check_once_and_equal(ml, want, "mlflow")
    runs, wb = wandb_read(records["wandb"])
    check_once_and_equal(wb, want, "wandb")
    assert {r for r in runs} == {(records["wandb"]["id"], run_name, run_name.split("/")[0])}, runs
    return tb, run, ml, runs, wb


# ---- the option --------------------------------------------------------------------------------------------------
def test_tracker_option_picks_one_or_several():
    from slurm_router.config.compose import compose
    from slurm_router.tracking.trackers import enabled

    assert enabled(compose([]).tracker) == []
    assert enabled(compose(["tracker=wandb"]).tracker) == ["wandb"]
    cfg = compose(["tracker=[mlflow,tensorboard]", "tracker.wandb_project=lab"])
    assert enabled(cfg.tracker) == ["tensorboard", "mlflow"] and cfg.tracker.wandb_project == "lab"


# ---- a crash: the steps after the last checkpoint run again, and reach each tracker once -------------------------
ATTEMPT = textwrap.dedent("""
    import sys, time
    from slurm_router.rundir import events as ev
    from slurm_router.rundir.spec import TaskSpec
    from slurm_router.tracking.trackers import task_sink
    spec = TaskSpec.load(sys.argv[1])
    attempt, first, last = map(int, sys.argv[2:5])
    path = spec.task_dir / "events-rank0.jsonl"
    writer = ev.EventWriter(path, task_sink(spec, path), run_id=spec.run_id, task=spec.name, variant=spec.variant,
                            stage=spec.stage, attempt=attempt, device=0, policy="balanced")
    for step in range(first, last + 1):
        if step % 2 == 0:           # the evaluation after `step` steps comes before that step's row
            writer.write(ev.EvalRow(step=step, val_loss=5.0 - step / 7 + attempt / 1e3, val_tokens=99,
                                    batch_loss_sums=[1.0], batch_tokens=[99]))
        if step == last:
            break
        writer.write(ev.StepRow(step=step, loss=5.5 - step / 9 + attempt / 1e3, n_tokens=640, n_target_tokens=600,
            n_samples=8, t_step_s=0.25, t_sync_wait_s=0.0, lr=1e-3, busy_s=0.2, busy_s_all=[0.2], planned_cost=[640.0],
            n_micro=[1], speed=[1.0], cost_balance_ratio=1.0, oom_retries=0, n_pad_tokens=0, mem_peak_bytes=1 << 20,
            mem_total_bytes=1 << 30, util=50.0))
    if attempt == 0:                # the test kills it (SIGKILL, a crash: nothing is closed) once W&B has the rows
        print("written", flush=True)
        time.sleep(600)
    writer.write(ev.EndRow(exit_state="completed"))
    writer.close()
""")


def test_a_crashed_attempt_and_its_rerun_steps_reach_each_tracker_once(tmp_path, clean_env):
    """Attempt 0 logs steps 0-5 and the evaluation after them, and dies (SIGKILL); attempt 1 resumes from a
    checkpoint at step 4 and runs 4-9 again. The tracker runs named in tracker.json continue; steps 4 and 5 and the
    evaluation at 6 keep their first values, once (W&B gets that evaluation from the events file: attempt 0 held
    it for step 6's row)."""
    from slurm_router.rundir.spec import TaskSpec

    run_dir = tmp_path / "run"
    spec = TaskSpec(
        run_id="crash-1",
        run_dir=str(run_dir),
        experiment="crash",
        name="r8",
        stage="variants",
        variant="r8",
        index=0,
        devices=1,
        steps=10,
        lr=1e-3,
        global_batch_size=8,
        lora=True,
        config={
            "experiment": "crash",
            "train": {"lr": 1e-3, "steps": 10},
            "tracker": {"tensorboard": True, "mlflow": True, "wandb": True},
        },
    )
    spec.task_dir.mkdir(parents=True)
    spec.task_dir.joinpath("task.json").write_text(spec.to_json())
    script = tmp_path / "attempt.py"
    script.write_text(ATTEMPT)

    def argv(n: int, first: int, last: int) -> list[str]:
        return [sys.executable, str(script), str(spec.task_dir / "task.json"), str(n), str(first), str(last)]

    crashing = subprocess.Popen(
        argv(0, 0, 6), env=tracker_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert crashing.stdout.readline() == "written\n", crashing.communicate(timeout=60)[1][-2000:]
        records = json.loads((spec.task_dir / "tracker.json").read_text())
        # W&B's offline log is flushed every second (trackers.WandbLogger): the crash comes once it holds steps 0-5
        wait_until(
            lambda: _wandb_steps(records["wandb"]) == list(range(6)),
            "steps 0-5 in W&B's offline log",
            timeout=60,
            poll_s=0.1,
        )
        crashing.kill()
        assert crashing.wait(timeout=60) == -signal.SIGKILL
    finally:
        if crashing.poll() is None:
            crashing.kill()
        crashing.communicate()
    done = subprocess.run(argv(1, 4, 10), env=tracker_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((spec.task_dir / "tracker.json").read_text()) == records, "a later attempt starts no new run"
    want = first_logged(spec.task_dir)
    assert sorted(want["step"]) == list(range(10)) and want["step"][4] == 5.5 - 4 / 9  # attempt 0's value
    assert sorted(want["eval"]) == [0, 2, 4, 6, 8, 10] and want["eval"][6] == 5.0 - 6 / 7
    _, run, _, runs, _ = check_all(spec.task_dir, "crash-1/r8", records)
    assert run["status"] == "FINISHED" and len(runs) == 2  # W&B: one offline folder per attempt, one id


# ---- a real run: Ctrl-C, resume=, then the same runs replayed from the events ------------------------------------
@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory):
    """A real run logging to all three trackers, stopped by Ctrl-C mid-run and finished by resume=RUN_DIR."""
    tmp = tmp_path_factory.mktemp("tracked")
    env = {**tracker_env(tmp), **SLOW}
    proc = start_cli(ALL, *FAST, f"run_root={tmp}", cwd=tmp, env=env)
    try:
        task_dir = wait_until(
            lambda: next(
                (
                    d
                    for d in tmp.glob("default/*/tasks/main")
                    if any(r["event"] == "step" and r["step"] >= 2 for r in event_rows(d))
                ),
                None,
            ),
            "step 2",
            timeout=600,
        )
        records = json.loads((task_dir / "tracker.json").read_text())
        proc.send_signal(signal.SIGINT)  # what Ctrl-C sends the launcher
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out[-2000:] + err[-2000:]
    run_dir = task_dir.parents[1]
    resumed = run_cli(f"resume={run_dir}", cwd=tmp, env=env, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert run_dir_of(resumed) == run_dir
    return tmp, run_dir, task_dir, records, resumed


@pytest.mark.integration
def test_a_run_logs_to_all_trackers_and_resume_continues_their_runs(tracked_run):
    tmp, run_dir, task_dir, records, resumed = tracked_run
    rows = event_rows(task_dir)
    assert {r["attempt"] for r in rows if r["event"] == "step"} == {0, 1}, "the Ctrl-C came too late to test resume"
    assert json.loads((task_dir / "tracker.json").read_text()) == records, "resume= started new tracker runs"
    run_id = json.loads((run_dir / "manifest.json").read_text())["run_id"]
    want = first_logged(task_dir)
    assert sorted(want["step"]) == list(range(8)) and sorted(want["eval"]) == [0, 2, 4, 6, 8]
    _, run, _, runs, _ = check_all(task_dir, f"{run_id}/main", records)
    assert run["status"] == "FINISHED" and run["params.train.steps"] == "8" and run["tags.slurm_router.task"] == "main"
    assert len(runs) == 2  # two attempts: two offline folders of the one W&B run id
    assert Path(records["tensorboard"]["log_dir"]) == run_dir / "trackers" / "tensorboard" / run_id / "main"

    # the run's last lines say where to look, and how to upload the offline W&B runs; that line works as printed
    sync = next(line for line in resumed.stdout.splitlines() if line.startswith("wandb: offline runs"))
    command = sync.split("upload them with: ", 1)[1]
    assert command == f"wandb sync {run_dir}/trackers/wandb/offline-run-*", sync
    assert f"tensorboard --logdir {run_dir}/trackers/tensorboard" in resumed.stdout
    dry = subprocess.run(
        ["bash", "-c", command.replace("wandb sync", "wandb sync --dry-run", 1)],
        capture_output=True,
        text=True,
        env=tracker_env(tmp),
        timeout=120,
    )
    assert dry.returncode == 0 and "Would sync 2 run(s)" in dry.stdout + dry.stderr, dry.stdout + dry.stderr


@pytest.mark.integration
def test_replay_writes_what_the_live_run_logged(tracked_run, tmp_path, clean_env, capsys):
    """`analysis RUN_DIR --to KIND` on a copy of the run without its trackers: each tracker reads back what the live
    run logged, step for step (the same sink, fed from the events files). A second replay is refused."""
    from slurm_router.analysis.__main__ import main as analysis

    _, run_dir, task_dir, records, _ = tracked_run
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("trackers", "tracker.json", "checkpoints"))
    for kind in ("tensorboard", "mlflow", "wandb"):
        assert analysis([str(copy), "--to", kind]) == 0
    out = capsys.readouterr().out
    assert "main: 8 steps, 5 evaluations -> wandb" in out and f"wandb sync {copy}/trackers/wandb/offline-run-*" in out
    replayed = json.loads((copy / "tasks" / "main" / "tracker.json").read_text())
    assert set(replayed) >= {"tensorboard", "mlflow", "wandb"} and replayed["wandb"]["id"] != records["wandb"]["id"]
    run_id = json.loads((run_dir / "manifest.json").read_text())["run_id"]
    live, again = (
        check_all(task_dir, f"{run_id}/main", records),
        check_all(copy / "tasks" / "main", f"{run_id}/main", replayed),
    )
    assert live[0] == again[0] and live[2] == again[2], "tensorboard and mlflow: the same steps and values"
    assert sorted(live[4]["train/loss"]) == sorted(again[4]["train/loss"])

    assert analysis([str(copy), "--to", "mlflow"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "task main already has a mlflow run" in err[0], err
