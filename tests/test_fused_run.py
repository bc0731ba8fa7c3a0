"""Fused variants through the real command (issue 28): resources.fuse_variants=2 trains r8 and r32 in one task
over one base, and each variant's losses equal its separate run's, per step, on 1 to 3 devices and any policy;
its adapter is peft's, equal to the separate run's; a diverged variant leaves the group and the other trains on
as if alone; a stopped group resumes bitwise. Real multi-process workers (gloo)."""

import json
import os
import signal
from pathlib import Path

import pytest
from conftest import event_rows, read_json, run_cli, run_dir_of, slowdown, start_cli, wait_until

pytestmark = pytest.mark.integration

COMMON = [
    "+experiment=lora_ab",
    "base.enabled=false",
    "train.steps=6",
    "train.global_batch_size=12",
    "train.warmup_steps=0",
    "train.lr=1e-2",
    "train.eval_every=3",
    "train.eval_batches=1",
    "train.eval_batch_size=4",
    "train.checkpoint_every=1",
    "data.max_documents=40",
    "data.max_len=128",
    "launcher.cpu_slots=2",
]
RTOL = 1e-5
FUSED = "resources.fuse_variants=2"


def _run(tmp_path: Path, *args: str, env: dict | None = None) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    proc = run_cli(*COMMON, *args, f"run_root={tmp_path / 'runs'}", cwd=tmp_path, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run_dir_of(proc)


def _curves(run_dir: Path, attempt_last: bool = False) -> dict[str, dict[str, list[float]]]:
    """variant -> {"train": per-step losses, "eval": held-out losses} from its own task directory."""
    out = {}
    for name in ("r8", "r32"):
        rows = event_rows(run_dir / "tasks" / name)
        steps: dict[int, float] = {}
        for r in sorted((r for r in rows if r["event"] == "step"), key=lambda r: (r["attempt"], r["time"])):
            steps[r["step"]] = r["loss"]  # a step run again after a resume: its last attempt's
        evals = {r["step"]: r["val_loss"] for r in rows if r["event"] == "eval"}
        out[name] = {"train": [steps[s] for s in sorted(steps)], "eval": [evals[s] for s in sorted(evals)]}
    return out


@pytest.fixture(scope="module")
def alone(tmp_path_factory) -> Path:
    return _run(tmp_path_factory.mktemp("alone"), "resources.devices_per_task=1", "router=round_robin")


def _same(fused: dict, ref: dict, names=("r8", "r32")) -> None:
    for name in names:
        for kind in ("train", "eval"):
            assert len(fused[name][kind]) == len(ref[name][kind]), (name, kind, fused[name], ref[name])
            assert fused[name][kind] == pytest.approx(ref[name][kind], rel=RTOL), (name, kind)


@pytest.mark.parametrize(
    "args, env",
    [
        (["resources.devices_per_task=1", "router=round_robin"], {}),
        (["resources.devices_per_task=2", "router=balanced"], {}),
        (["resources.devices_per_task=2", "router=least_loaded", "train.fused_layout=row"], {}),
        (
            ["resources.devices_per_task=3", "router=balanced", "router.max_tokens_per_microbatch=200"],
            slowdown("1,2,4"),
        ),
    ],
    ids=["1dev", "2dev-balanced", "2dev-one-row", "3dev-slow-split"],
)
def test_fused_variants_train_exactly_as_alone(tmp_path, alone, args, env):
    run_dir = _run(tmp_path, FUSED, *args, env=env)
    manifest = read_json(run_dir / "manifest.json")
    assert manifest["tasks"]["r32"]["fused_into"] == "r8" and manifest["tasks"]["r32"]["state"] == "completed"
    assert [s["tasks"] for s in manifest["stages"] if s["name"] == "variants"] == [["r8"]]  # one task ran
    _same(_curves(run_dir), _curves(alone))
    for name in ("r8", "r32"):  # each variant's own result, beside its separate run's
        mine, ref = (read_json(d / "tasks" / name / "result.json") for d in (run_dir, alone))
        assert mine["val_loss"] == pytest.approx(ref["val_loss"], rel=RTOL), name
        assert Path(mine["adapter"]).is_dir()


def test_a_fused_adapter_is_peft_and_equals_the_separate_runs(tmp_path, alone):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    run_dir = _run(tmp_path, FUSED)
    for name in ("r8", "r32"):
        mine, ref = (read_json(d / "tasks" / name / "result.json") for d in (run_dir, alone))
        a = load_file(str(Path(mine["adapter"]) / "adapter_model.safetensors"))
        b = load_file(str(Path(ref["adapter"]) / "adapter_model.safetensors"))
        assert sorted(a) == sorted(b), name
        for key in a:
            assert (a[key] - b[key]).abs().max().item() <= 1e-4 * max(1.0, b[key].abs().max().item()), (name, key)
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(mine["base_model"]), mine["adapter"])
        assert json.loads((Path(mine["adapter"]) / "adapter_config.json").read_text())["r"] == int(name[1:])
        assert sum(p.numel() for n, p in model.named_parameters() if "lora_" in n) > 0


def test_a_diverged_variant_leaves_and_the_other_trains_as_alone(tmp_path, alone):
    run_dir = _run(tmp_path, FUSED, "variants.r8.train.lr=10")
    result = read_json(run_dir / "tasks" / "r8" / "result.json")
    assert result["exit_state"] == "diverged" and result["lr"] == 10.0, result
    assert event_rows(run_dir / "tasks" / "r8")[-1]["exit_state"] == "diverged"
    _same(_curves(run_dir), _curves(alone), names=("r32",))
    assert read_json(run_dir / "tasks" / "r32" / "result.json")["steps"] == 6


def test_a_stopped_fused_task_resumes_bitwise(tmp_path):
    reference = _curves(_run(tmp_path / "ref", FUSED))
    root = tmp_path / "stopped"
    proc = start_cli(*COMMON, FUSED, f"run_root={root}", cwd=tmp_path)
    try:
        task = wait_until(lambda: next(root.glob("lora_ab/*/tasks/r8"), None), "the leader's task dir", 300)
        wait_until(lambda: any(r["event"] == "step" and r["step"] >= 2 for r in event_rows(task)), "step 2", 300)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out[-2000:] + err[-2000:]
    run_dir = task.parent.parent
    manifest = read_json(run_dir / "manifest.json")
    assert {manifest["tasks"][n]["state"] for n in ("r8", "r32")} == {"interrupted"}, manifest["tasks"]
    saved = [r for r in event_rows(run_dir / "tasks" / "r32") if r["event"] == "checkpoint_saved"]
    assert saved and saved[-1]["reason"] == "signal", saved  # the member's rows name the group's checkpoint
    resumed = run_cli(f"resume={run_dir}", cwd=tmp_path, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    loaded = [r for r in event_rows(run_dir / "tasks" / "r32") if r["event"] == "checkpoint_loaded"]
    assert loaded and loaded[0]["step"] == saved[-1]["step"], loaded
    assert _curves(run_dir) == reference, "an interrupted and resumed fused task must match bitwise"
    assert read_json(run_dir / "manifest.json")["state"] == "completed"


def test_fused_llama_chat_variants_train_exactly_as_alone(tmp_path):
    """A tiny Llama checkpoint on chat data (assistant turns the only targets): r8 and r32 fused on 2 devices equal
    each one's separate run on 1 device, per step."""
    from tiny_checkpoints import chat_rows, make_checkpoint, write_jsonl

    ckpt = make_checkpoint(tmp_path / "llama", "llama")
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(60))
    chat = [
        "+experiment=lora_ab",
        "base.enabled=false",
        "model=hf",
        f"model.name_or_path={ckpt}",
        "data=jsonl",
        f"data.path={data}",
        "data.messages_field=messages",
        "data.max_len=192",
        "train.steps=5",
        "train.global_batch_size=8",
        "train.warmup_steps=0",
        "train.lr=1e-2",
        "train.eval_every=0",
        "train.eval_batches=1",
        "train.eval_batch_size=4",
        "launcher.cpu_slots=2",
    ]
    runs = {}
    for name, args in (("alone", ["resources.devices_per_task=1"]), ("fused", [FUSED, "resources.devices_per_task=2"])):
        proc = run_cli(*chat, *args, f"run_root={tmp_path / name}", cwd=tmp_path, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        runs[name] = _curves(run_dir_of(proc))
    assert runs["alone"]["r8"]["train"][-1] < runs["alone"]["r8"]["train"][0], "the separate run did not learn"
    _same(runs["fused"], runs["alone"])


def test_a_pruned_variant_leaves_the_group_and_the_others_train_as_alone(tmp_path):
    """r8 (lr 1e-6: a planted loser) against r32, 3 seeds each, all six in one fused task with prune=true: every
    evaluation is recorded before any is decided, so r8's replicates are pruned at an in-training evaluation and
    leave the group; r32-s2 trains on exactly as its separate run does."""
    prune_args = ["train.lr=3e-3", "train.eval_every=2", "train.eval_batches=4", "variants.r8.train.lr=1e-6"]
    run_dir = _run(tmp_path / "fused", "seeds=3", "prune=true", "resources.fuse_variants=6", *prune_args)
    results = {p.parent.name: read_json(p) for p in (run_dir / "tasks").glob("*/result.json")}
    assert len(results) == 6, sorted(results)
    pruned = sorted(t for t, r in results.items() if r.get("exit_state") == "pruned")
    assert pruned and all(t.startswith("r8-") for t in pruned), results
    for t in pruned:
        steps = [r["step"] for r in event_rows(run_dir / "tasks" / t) if r["event"] == "step"]
        assert results[t]["best"] == "r32" and len(steps) == results[t]["step"] < 6, (t, results[t], steps)
    summary = read_json(run_dir / "report" / "summary.json")
    assert sorted(line.split(":")[0] for line in summary["pruned"]) == pruned
    alone = _run(tmp_path / "alone", "seeds=[2]", "~variants.r8", *prune_args[:3])
    survivor = [r["loss"] for r in event_rows(run_dir / "tasks" / "r32-s2") if r["event"] == "step"]
    reference = [r["loss"] for r in event_rows(alone / "tasks" / "r32") if r["event"] == "step"]
    assert len(survivor) == 6 and survivor == pytest.approx(reference, rel=RTOL)


# ---- what a user reads of a fused group: its results, its report row, its failure -----------------------------
def test_a_fused_group_shows_every_variant_in_its_log_and_report(tmp_path):
    """The group's log (what `status --follow` streams) ends with one result line per variant, not per group; the
    report's "useful" figure of a member is its group's (the micro rows are written once, in the leader's events)."""
    run_dir = _run(tmp_path, FUSED)
    log = (run_dir / "logs" / "r8.log").read_text().splitlines()
    results = [json.loads(line) for line in log if line.startswith("{")]
    assert sorted(Path(r["adapter"]).parent.name for r in results) == ["r32", "r8"], log[-5:]
    variants = read_json(run_dir / "report" / "summary.json")["variants"]
    useful = {name: variants[name]["useful_token_fraction"] for name in ("r8", "r32")}
    assert useful["r8"] is not None and useful["r32"] == useful["r8"], useful


def test_a_diverged_fused_variant_records_the_steps_it_would_alone(tmp_path):
    """r8 at lr 10 diverges: fused with r32 it records the same steps (the diverging one included, its loss
    non-finite) and the report counts as many as when it runs alone."""
    fused = _run(tmp_path / "fused", FUSED, "variants.r8.train.lr=10")
    alone = _run(tmp_path / "alone", "variants.r8.train.lr=10", "~variants.r32")
    rows = {d: [r for r in event_rows(d / "tasks" / "r8") if r["event"] == "step"] for d in (fused, alone)}
    assert [r["step"] for r in rows[fused]] == [r["step"] for r in rows[alone]] != [], rows[alone]
    assert str(rows[fused][-1]["loss"]) == str(rows[alone][-1]["loss"]) == "nan"
    steps = [read_json(d / "report" / "summary.json")["variants"]["r8"]["steps"] for d in (fused, alone)]
    assert steps[0] == steps[1] == len(rows[alone]), steps


def _signal_the_group(tmp_path, sig: int):
    """A 60-step fused r8+r32 run whose group job process gets `sig` after its first step: (proc, out, err, run_dir)."""
    args = [a for a in COMMON if not a.startswith("train.steps=")]
    root = tmp_path / "runs"
    proc = start_cli(*args, "train.steps=60", FUSED, f"run_root={root}", cwd=tmp_path)
    try:
        task = wait_until(lambda: next(root.glob("lora_ab/*/tasks/r8"), None), "the leader's task dir", 300)
        wait_until(lambda: any(r["event"] == "step" for r in event_rows(task)), "a step", 300)
        run_dir = task.parent.parent
        os.kill(read_json(run_dir / "manifest.json")["tasks"]["r8"]["pid"], sig)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc, out, err, run_dir


def test_a_killed_fused_group_names_every_variant_and_its_log(tmp_path):
    """kill -9 of the group's job process: "failed tasks:" names both variants and the one log they share."""
    proc, out, err, run_dir = _signal_the_group(tmp_path, signal.SIGKILL)
    log = run_dir / "logs" / "r8.log"
    assert proc.returncode == 1, out[-2000:] + err[-2000:]
    assert f"failed tasks: r8, r32 (log: {log})" in err.splitlines(), err[-2000:]
    last = log.read_text().strip().splitlines()[-1]
    assert last.startswith("error: the job process of r8, r32 (pid ") and "killed by SIGKILL; " in last, last


def test_a_fused_group_stopped_by_a_signal_names_every_variant(tmp_path):
    """SIGTERM to the group's job process (a site's stop, not Ctrl-C at the launcher): it checkpoints, and
    "interrupted tasks:" names both variants, so the user knows resume= continues both."""
    proc, out, err, run_dir = _signal_the_group(tmp_path, signal.SIGTERM)
    assert proc.returncode == 1, out[-2000:] + err[-2000:]  # not finished: resume= continues it
    line = next((x for x in err.splitlines() if x.startswith("interrupted tasks")), err[-2000:])
    assert line.startswith("interrupted tasks (stopped by a signal after a checkpoint): r8, r32; continue"), line
