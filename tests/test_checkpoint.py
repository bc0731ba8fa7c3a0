"""Checkpoints and requeue bookkeeping, in process: atomic saves, last-K pruning, integrity checks and the
fallback to an older checkpoint, exact state round trips, the requeue rule (time limits vs preemptions)."""

import json
import os
import signal
import subprocess
import time

import pytest
import torch
import torch.distributed as dist

from slurm_router.rundir.layout import TaskPaths
from slurm_router.rundir.spec import TaskSpec
from slurm_router.worker.checkpoint import (
    CheckpointError,
    checkpoint_path,
    latest_valid_checkpoint,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)


def _state(step: int) -> dict:
    return {
        "step": step,
        "w": torch.arange(1000, dtype=torch.float32) * step,
        "rng": torch.get_rng_state().numpy().tobytes(),
    }


def test_save_keeps_the_newest_k_with_sidecars(tmp_path):
    (tmp_path / ".step-00000001.pt.abc.tmp").write_bytes(b"half")  # an interrupted save, long ago
    os.utime(tmp_path / ".step-00000001.pt.abc.tmp", (0, 0))
    for step in range(1, 6):
        meta = save_checkpoint(tmp_path, step, _state(step), keep=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"step-{s:08d}.{ext}" for s in (3, 4, 5) for ext in ("json", "pt")
    ]
    sidecar = json.loads((tmp_path / "step-00000005.json").read_text())
    assert sidecar["step"] == 5 and sidecar["sha256"] == meta["sha256"] and sidecar["bytes"] == meta["bytes"]
    assert verify_checkpoint(checkpoint_path(tmp_path, 5)) is None
    path, warnings = latest_valid_checkpoint(tmp_path)
    assert path == checkpoint_path(tmp_path, 5) and warnings == []
    assert torch.equal(load_checkpoint(path, "cpu")["w"], _state(5)["w"])


@pytest.mark.parametrize(
    "damage, why",
    [
        (lambda p: p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2]), "truncated"),
        (lambda p: p.write_bytes(bytes(b ^ 0xFF if i == 200 else b for i, b in enumerate(p.read_bytes()))), "sha256"),
        (lambda p: p.with_suffix(".json").unlink(), "no sidecar"),
        (lambda p: p.with_suffix(".json").write_text("{not json"), "unreadable sidecar"),
        (lambda p: p.unlink(), "unreadable"),
    ],
    ids=["truncated", "bit-flip", "no-sidecar", "bad-sidecar", "data-file-gone"],
)
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous(tmp_path, damage, why):
    for step in (2, 4):
        save_checkpoint(tmp_path, step, _state(step), keep=3)
    damage(checkpoint_path(tmp_path, 4))
    path, warnings = latest_valid_checkpoint(tmp_path)
    assert path == checkpoint_path(tmp_path, 2)
    assert len(warnings) == 1 and "step-00000004.pt" in warnings[0] and why in warnings[0], warnings


def test_no_valid_checkpoint_is_a_one_line_error_and_none_at_all_is_a_fresh_start(tmp_path):
    assert latest_valid_checkpoint(tmp_path / "missing") == (None, [])
    assert latest_valid_checkpoint(tmp_path) == (None, [])
    save_checkpoint(tmp_path, 3, _state(3), keep=3)
    checkpoint_path(tmp_path, 3).write_bytes(b"garbage")
    with pytest.raises(CheckpointError) as e:
        latest_valid_checkpoint(tmp_path)
    assert "\n" not in str(e.value) and "no valid checkpoint" in str(e.value) and "delete" in str(e.value)


def test_load_of_a_file_damaged_after_the_check_names_it(tmp_path):
    p = tmp_path / "x.pt"
    p.write_bytes(b"PK\x03\x04 not a zip")
    with pytest.raises(CheckpointError, match="x.pt cannot be loaded"):
        load_checkpoint(p, "cpu")


@pytest.fixture
def process_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def capture(model, optimizer, router, train_losses, next_step, world, device, identity):
    """One model's checkpoint around worker/state.py's capture_around, in a task alone's layout: its trainable
    tensors (only what training changes), optimizer and losses."""
    from slurm_router.worker import state

    def payload() -> dict:
        weights = {n: p.detach().cpu().clone() for n, p in model.named_parameters() if p.requires_grad}
        return {"model": weights, "optimizer": optimizer.state_dict(), "train_losses": list(train_losses)}

    return state.capture_around(payload, router, next_step, world, device, identity)


def restore(ckpt, model, optimizer, router, rank, device, identity):
    """capture's checkpoint loaded into a replica through restore_around: (next step, losses so far)."""
    from slurm_router.worker import state

    def load(ckpt: dict) -> None:
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, value in ckpt["model"].items():
                params[name].copy_(value.to(device))
        optimizer.load_state_dict(ckpt["optimizer"])

    return state.restore_around(ckpt, load, router, rank, device, identity), list(ckpt["train_losses"])


def test_state_round_trip_continues_bitwise(tmp_path, process_group):
    """Weights, AdamW moments, RNG streams and router state: a restored replica takes the same steps."""
    from slurm_router.router import Router, RouterSettings

    def setup():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))
        model[0].weight.requires_grad_(False)  # frozen, as a LoRA base weight: not saved
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        return model, opt, Router(RouterSettings(policy="balanced"), 1)

    def step(model, opt, router, i):
        x = torch.randn(4, 8)  # consumes the RNG, as dropout does
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        router.observe_step(0, 100.0 + i, 0.1, None, [])
        return loss.item()

    model, opt, router = setup()
    for i in range(3):
        step(model, opt, router, i)
    ckpt = capture(model, opt, router, [1.0, 2.0, 3.0], 3, 1, torch.device("cpu"), {"task": "t"})
    assert set(ckpt["model"]) == {"0.bias", "2.weight", "2.bias"}, "only trainable tensors are saved"
    save_checkpoint(tmp_path, 3, ckpt, keep=2)
    expected = [step(model, opt, router, i) for i in range(3, 6)]

    model2, opt2, router2 = setup()
    torch.manual_seed(123)  # a different RNG position before the restore
    loaded = load_checkpoint(checkpoint_path(tmp_path, 3), "cpu")
    next_step, losses = restore(loaded, model2, opt2, router2, 0, torch.device("cpu"), {"task": "t"})
    assert (next_step, losses) == (3, [1.0, 2.0, 3.0])
    assert [step(model2, opt2, router2, i) for i in range(3, 6)] == expected
    with pytest.raises(ValueError, match="task='t'"):
        restore(loaded, model2, opt2, router2, 0, torch.device("cpu"), {"task": "other"})


def _spec(tmp_path, **launcher) -> TaskSpec:
    return TaskSpec(
        run_id="r",
        run_dir=str(tmp_path),
        experiment="e",
        name="v",
        stage="variants",
        variant="v",
        index=0,
        devices=1,
        config={"launcher": {"max_requeues": 2, "signal_delay_s": 120, **launcher}, "router": {"policy": "balanced"}},
        steps=10,
        lr=1e-3,
        global_batch_size=4,
        lora=True,
    )


def test_requeue_rule_time_limits_are_capped_preemptions_are_not(tmp_path, monkeypatch):
    from slurm_router.supervise import requeue

    spec = _spec(tmp_path)
    spec.task_dir.mkdir(parents=True)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert requeue.decide(spec, signal.SIGUSR2).requeue is False, "no Slurm job: nothing to requeue"
    monkeypatch.setenv("SLURM_JOB_ID", "123")
    assert requeue.decide(spec, signal.SIGTERM).reason == "interrupted"
    monkeypatch.setattr(requeue, "time_left_s", lambda: 3000.0)
    assert all(requeue.decide(spec, signal.SIGUSR2).reason == "preempted" for _ in range(5))
    monkeypatch.setattr(requeue, "time_left_s", lambda: 100.0)  # within signal_delay_s + margin
    decisions = [requeue.decide(spec, signal.SIGUSR2) for _ in range(3)]
    assert [d.requeue for d in decisions] == [True, True, False] and {d.reason for d in decisions} == {"timeout"}
    assert "launcher.max_requeues=2" in decisions[-1].detail
    data = json.loads(TaskPaths(spec.task_dir).attempts.read_text())
    assert data["timeouts"] == 3 and data["preemptions"] == 5


def test_attempts_count_and_slurm_restarts_are_logged_once(tmp_path, monkeypatch):
    from slurm_router.rundir import attempts
    from slurm_router.supervise import requeue

    spec = _spec(tmp_path)
    spec.task_dir.mkdir(parents=True)
    assert [attempts.next_attempt(spec.task_dir) for _ in range(3)] == [0, 1, 2]
    monkeypatch.setenv("SLURM_JOB_ID", "55")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    requeue.note_scheduler_restart(spec)
    requeue.note_scheduler_restart(spec)
    rows = [json.loads(line) for line in (spec.task_dir / "events-rank0.jsonl").read_text().splitlines()]
    assert [(r["event"], r["reason"], r["restart"]) for r in rows] == [("requeue", "slurm", 1), ("requeue", "slurm", 2)]


def test_a_torn_last_event_line_is_dropped_before_appending(tmp_path):
    from slurm_router.supervise.requeue import repair_torn_tail

    p = tmp_path / "events-rank0.jsonl"
    p.write_bytes(b'{"event":"step"}\n{"event":"mi')
    repair_torn_tail(p)
    assert p.read_bytes() == b'{"event":"step"}\n'
    repair_torn_tail(p)
    assert p.read_bytes() == b'{"event":"step"}\n'


def test_requeue_names_the_array_task_not_the_array(monkeypatch):
    """Slurm may give one array task the array's own id: `scontrol requeue <that id>` would requeue every task
    of the array (found on the real cluster: a time-out of one variant killed its sibling mid-checkpoint)."""
    from slurm_router.backends.slurm.job import SlurmJobEnvironment

    slurm_job_ref = SlurmJobEnvironment().job_ref

    monkeypatch.setenv("SLURM_JOB_ID", "467")
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "467")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "1")
    assert slurm_job_ref() == "467_1"
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID")
    monkeypatch.delenv("SLURM_ARRAY_TASK_ID")
    assert slurm_job_ref() == "467"


class _Children:
    def __init__(self):
        self.got = []

    def forward(self, signum):
        self.got.append(signum)


def test_a_stop_signal_during_the_spawn_reaches_the_new_children():
    """The Ctrl-C race: a signal that lands while the workers are being spawned (blocked, delivered as soon as
    the mask is restored) must be forwarded to them, not only remembered."""
    from slurm_router.supervise.supervisor import TaskSupervisor

    old = {s: signal.getsignal(s) for s in (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)}
    try:
        sup = TaskSupervisor().install()
        children = _Children()

        def spawn():
            # arrives mid-spawn: held back if this thread is the only one; handled at once, while the children
            # are not known yet, if another thread (pytest's, torch's) takes it: forwarded either way
            os.kill(os.getpid(), signal.SIGUSR2)
            time.sleep(0.05)
            return children

        assert sup.start(spawn) is children
        assert sup.signum == signal.SIGUSR2 and set(children.got) == {signal.SIGUSR2}
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def test_a_stop_before_the_start_stops_the_task_or_reaches_colocated_tasks():
    from slurm_router.supervise.supervisor import TaskStopped, TaskSupervisor

    sup = TaskSupervisor()
    sup.on_signal(signal.SIGTERM)
    with pytest.raises(TaskStopped):
        sup.start(lambda: pytest.fail("a stopped task spawns nothing"))
    group = sup.start(_Children, stop_early=False)  # co-located children each ask the after-stop policy
    assert group.got == [signal.SIGTERM]


def test_after_stop_is_the_one_policy_for_every_requeuer(tmp_path, monkeypatch):
    from slurm_router.rundir.lifecycle import TaskOutcome
    from slurm_router.supervise import requeue

    spec = _spec(tmp_path)
    spec.task_dir.mkdir(parents=True)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert requeue.after_stop(spec, signal.SIGINT, 4, "self") is TaskOutcome.STOPPED  # a local Ctrl-C
    monkeypatch.setenv("SLURM_JOB_ID", "123")
    monkeypatch.setattr(requeue, "time_left_s", lambda: 3000.0)  # a preemption
    calls = []
    from slurm_router.backends.slurm import job as slurm_job

    monkeypatch.setattr(
        slurm_job, "run_slurm", lambda argv, **k: calls.append(argv) or subprocess.CompletedProcess(argv, 0)
    )
    assert requeue.after_stop(spec, signal.SIGUSR2, 4, "colocated") is TaskOutcome.REQUEUE and not calls
    assert requeue.after_stop(spec, signal.SIGUSR2, 4, "runner") is TaskOutcome.REQUEUE and not calls
    assert requeue.after_stop(spec, signal.SIGUSR2, 4, "self") is TaskOutcome.STOPPED
    assert calls == [["scontrol", "requeue", "123"]]
    monkeypatch.setattr(requeue, "time_left_s", lambda: 10.0)  # the time limit, over budget
    spec.config["launcher"] = {"max_requeues": 0}
    assert requeue.after_stop(spec, signal.SIGUSR2, 4, "colocated") is TaskOutcome.FAILED
    rows = [json.loads(line) for line in TaskPaths(spec.task_dir).events(0).read_text().splitlines()]
    assert [(r["event"], r.get("exit_state")) for r in rows] == [("end", "interrupted")] + [("requeue", None)] * 3 + [
        ("end", "failed")
    ]


def test_a_job_process_spawned_with_stop_signals_blocked_never_dies_of_an_early_one(tmp_path):
    """A TERM the instant the job process exists (still starting its interpreter) is a clean stop before the
    first step, exit 75 and an `end` row, when the spawner blocks the stop signals across the spawn, as the
    supervisor does for its children (the local launcher should too: without it that TERM kills the process)."""
    import subprocess
    import sys

    from slurm_router.supervise.supervisor import stop_signals_blocked

    spec = _spec(tmp_path)
    paths = TaskPaths(spec.task_dir)
    paths.dir.mkdir(parents=True)
    paths.task_file.write_text(spec.to_json())
    with stop_signals_blocked():
        proc = subprocess.Popen(
            [sys.executable, "-m", "slurm_router.supervise.job", str(paths.task_file)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 75, out
    rows = [json.loads(line) for line in paths.events(0).read_text().splitlines()]
    assert rows[-1]["event"] == "end" and rows[-1]["exit_state"] == "interrupted", rows
    assert "no checkpoint yet" in out and "Traceback" not in out
