"""What each verdict cost (analysis/cost.py), on synthetic event rows loaded the way the report loads them: the
split into training, evaluation and the rest, a pruned task's fixed-design estimate from its own pace, a fused
group counted once, the evaluation at which the winner was first decided. No run needed."""

import json

import numpy as np

from slurm_router.analysis import cost
from slurm_router.analysis.document import document
from slurm_router.analysis.load import load_task
from slurm_router.analysis.render import to_markdown

H = 3600.0


def write_task(
    run_dir,
    name,
    *,
    steps=4,
    trained=None,
    t_step=10.0,
    eval_every=2,
    t_eval=3.0,
    device=0,
    gap_only=False,
    loss=2.0,
    rng=None,
    attempt=0,
    t0=0.0,
    end="completed",
    waited=0.0,
):
    """One rank's events: a start row, an eval at step 0, `trained` steps of t_step seconds with an evaluation
    every eval_every steps (t_eval seconds each), then the final evaluation and an end row (or a pruned end)."""
    trained = steps if trained is None else trained
    rng = rng or np.random.default_rng(0)
    rows, now = [], t0

    def row(kind, **f):
        rows.append({"event": kind, "time": now, "attempt": attempt, "device": device, "task": name, **f})

    def evaluate(step):
        nonlocal now
        now += t_eval
        sums = (loss + 0.01 * rng.standard_normal(8)) * 100
        extra = {} if gap_only else {"t_eval_s": t_eval}
        row(
            "eval",
            step=step,
            val_loss=float(sums.sum() / 800),
            batch_loss_sums=sums.tolist(),
            batch_tokens=[100] * 8,
            **extra,
        )

    if waited:  # a seeds=auto reserve that held its devices until its round's call (supervise/job.py)
        now += waited
        row("wait", waited_s=waited, reason="seeds=auto reserve: waiting for its round's call")
    row("start", steps=steps, world=1)
    evaluate(0)
    for s in range(trained):
        now += t_step
        row("step", step=s, loss=loss, n_tokens=100, t_step_s=t_step, busy_s_all=[t_step], n_samples=4)
        if (s + 1) % eval_every == 0 and s + 1 < steps:
            evaluate(s + 1)
    if end == "pruned":
        row("end", exit_state="pruned", step=trained, detail=f"{name}: pruned at step {trained}")
    else:
        evaluate(steps)
        row("end", exit_state="completed")
    folder = run_dir / "tasks" / name
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"events-rank{device}.jsonl", "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return now - t0


def load(run_dir, name, **meta):
    variant, _, seed = name.partition("-s")
    return load_task(run_dir, name, {"stage": "variants", "variant": variant, "seed": int(seed or 0), **meta})


def test_device_hours_split_into_training_evaluation_and_the_rest(tmp_path):
    span = write_task(tmp_path, "a")  # 4 steps of 10 s, evaluations at 0, 2, 4 of 3 s each
    t = load(tmp_path, "a")
    got = cost.task_costs([t], {"a": 2 * span / H})  # as if the report had counted 2x the events' span
    c = got["a"]
    assert c["train_device_hours"] == 40 / H and c["eval_device_hours"] == 9 / H
    assert abs(c["other_device_hours"] - (2 * span - 49) / H) < 1e-12 and c["steps_per_s"] == 0.1
    assert c["remaining_device_hours"] == 0 and c["fixed_design_device_hours"] == c["device_hours"]


def test_an_old_eval_row_without_t_eval_s_counts_the_time_since_the_row_before_it(tmp_path):
    write_task(tmp_path, "a", gap_only=True, t_eval=5.0)
    e = cost.eval_seconds(load(tmp_path, "a"))
    assert list(e["step"]) == [0, 2, 4] and list(e["eval_s"]) == [5.0, 5.0, 5.0]


def test_a_pruned_task_adds_its_untrained_steps_at_its_own_pace_and_its_skipped_evaluations(tmp_path):
    write_task(tmp_path, "good-s0", steps=8)
    span = write_task(tmp_path, "bad-s0", steps=8, trained=2, end="pruned", t_step=5.0)
    tasks = [load(tmp_path, "good-s0"), load(tmp_path, "bad-s0")]
    tasks[1].meta["devices"] = 2
    c = cost.task_costs(tasks, {"good-s0": 1.0, "bad-s0": span / H})["bad-s0"]
    assert c["state"] == "pruned" and c["steps_per_s"] == 0.2
    assert c["remaining_steps"] == 6 and c["remaining_evaluations"] == 3  # steps 4 and 6, and the final one
    assert abs(c["remaining_device_hours"] - (6 * 5.0 + 3 * 3.0) / H) < 1e-12  # one device: its step rows say so
    assert c["fixed_design_device_hours"] > c["device_hours"]


def test_a_replicate_pruned_before_its_first_step_costs_its_steps_at_its_variant_s_pace(tmp_path):
    """It started after its variant lost (prune=true's look): no step of its own to time, so the fixed design adds
    its steps at the pace of its variant's replicates that trained."""
    write_task(tmp_path, "bad-s0", steps=8, trained=2, end="pruned", t_step=5.0)
    write_task(tmp_path, "bad-s1", steps=8, trained=0, end="pruned")
    write_task(tmp_path, "good-s0", steps=8, t_step=20.0)
    tasks = [load(tmp_path, n) for n in ("bad-s0", "bad-s1", "good-s0")]
    c = cost.task_costs(tasks, {t.name: 0.001 for t in tasks})["bad-s1"]
    assert c["steps"] == 0 and c["steps_per_s"] is None and c["remaining_steps"] == 8
    assert c["remaining_evaluations"] == 4  # steps 2, 4, 6 and the final one
    assert abs(c["remaining_device_hours"] - (8 * 5.0 + 4 * 3.0) / H) < 1e-12


def test_a_fused_group_counts_its_evaluation_once_and_shares_it(tmp_path):
    write_task(tmp_path, "a", t_eval=3.0)  # the leader's rows count from the group's evaluation start
    write_task(tmp_path, "b", t_eval=5.0)  # the member's row is written last: the group's whole evaluation
    a, b = load(tmp_path, "a", members=["b"]), load(tmp_path, "b", fused_into="a")
    got = cost.task_costs([a, b], {"a": 0.01, "b": 0.01}, {"a": 0.25, "b": 0.75})
    assert abs(got["a"]["eval_device_hours"] - 0.25 * 15 / H) < 1e-12
    assert abs(got["b"]["eval_device_hours"] - 0.75 * 15 / H) < 1e-12
    assert abs(got["a"]["train_device_hours"] + got["b"]["train_device_hours"] - 40 / H) < 1e-12


def test_a_pruned_fused_variant_costs_its_part_of_each_group_step_it_did_not_train(tmp_path):
    write_task(tmp_path, "a", t_eval=3.0)
    write_task(tmp_path, "b", t_eval=5.0, trained=2, end="pruned")  # the group's evaluations at 0 and 2: 5 s
    a, b = load(tmp_path, "a", members=["b"]), load(tmp_path, "b", fused_into="a")
    got = cost.task_costs([a, b], {"a": 0.02, "b": 0.01}, {"a": 2 / 3, "b": 1 / 3})  # b: 200 of the 600 tokens
    assert abs(got["a"]["train_device_hours"] + got["b"]["train_device_hours"] - 40 / H) < 1e-12  # 4 steps of 10 s
    assert abs(got["a"]["eval_device_hours"] + got["b"]["eval_device_hours"] - 13 / H) < 1e-12  # 5 + 5 + 3 s
    # b had half of each step it trained: 2 more steps at 10 s and the final evaluation (13 s / 3), half each
    assert abs(got["b"]["remaining_device_hours"] - 0.5 * (20 + 13 / 3) / H) < 1e-12


def test_the_decision_is_the_first_evaluation_at_which_the_final_winner_was_decided(tmp_path):
    rng = np.random.default_rng(4)
    for s in range(2):
        write_task(tmp_path, f"good-s{s}", steps=8, rng=rng, loss=2.0)
        write_task(tmp_path, f"bad-s{s}", steps=8, trained=4, end="pruned", rng=rng, loss=2.0)
    tasks = [load(tmp_path, f"{v}-s{s}") for v in ("good", "bad") for s in range(2)]
    per_task = {t.name: {"device_hours": t.events["time"].max() / H} for t in tasks}
    winner = {"variant": "good", "decided": True}
    assert cost.decision(tasks, winner) == 4  # both of bad's seeds were pruned at step 4: decided there
    summary = cost.account(tasks, per_task, winner)
    d = summary["to_decision"]
    assert d["decided"] and d["step"] == 4 and d["winner"] == "good" and d["text"].endswith("at step 4")
    good = tasks[0]
    at4 = float(good.evals.loc[good.evals["step"] == 4, "time"].iloc[0])
    want = 2 * at4 / H + 2 * per_task["bad-s0"]["device_hours"]
    assert abs(d["device_hours"] - want) < 1e-12 and d["device_hours"] < summary["device_hours"]
    assert abs(summary["device_hours"] - sum(c["device_hours"] for c in summary["tasks"].values())) < 1e-12
    assert summary["fixed_design_device_hours"] > summary["device_hours"] and summary["saved_device_hours"] > 0
    assert summary["by_variant"]["bad"]["pruned"] == ["bad-s0", "bad-s1"]
    assert cost.account(tasks, per_task, {"variant": "good", "decided": False})["to_decision"]["text"] == "not decided"


def planted(run_dir, worse_at: set[int], steps=6) -> list:
    """good and bad, 3 seeds each, no pruning; bad's evaluations at the steps in worse_at are far worse."""
    rng = np.random.default_rng(5)
    for s in range(3):
        write_task(run_dir, f"good-s{s}", steps=steps, rng=rng)
        write_task(run_dir, f"bad-s{s}", steps=steps, rng=rng)
        path = run_dir / "tasks" / f"bad-s{s}" / "events-rank0.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        for r in rows:
            if r["event"] == "eval" and r["step"] in worse_at:
                r["batch_loss_sums"] = [x + 50 + 10 * rng.standard_normal() for x in r["batch_loss_sums"]]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [load(run_dir, f"{v}-s{s}") for v in ("good", "bad") for s in range(3)]


def test_a_statistical_win_is_decided_where_the_evaluations_show_it_from_then_on(tmp_path):
    """The loser equal at step 2 and worse from step 4: decided at 4. Worse at step 2, equal at 4, worse at 6 and
    8: the decision at 2 did not hold, so the decision is at 6."""
    from slurm_router.analysis import abtest
    from slurm_router.analysis import winner as winners

    tasks = planted(tmp_path / "a", {4, 6})
    final = winners.winner(tasks, abtest.compare_all(tasks))
    assert final and final["variant"] == "good" and final["decided"]
    assert cost.decision(tasks, final) == 4
    tasks = planted(tmp_path / "b", {2, 6, 8}, steps=8)
    assert cost.decision(tasks, winners.winner(tasks, abtest.compare_all(tasks))) == 6


def test_the_report_section_names_the_figures(tmp_path):
    write_task(tmp_path, "good-s0", steps=8)
    write_task(tmp_path, "bad-s0", steps=8, trained=2, end="pruned")
    tasks = [load(tmp_path, "good-s0"), load(tmp_path, "bad-s0")]
    summary = {"cost": cost.account(tasks, {t.name: {"device_hours": 0.01} for t in tasks}, None)}
    text = to_markdown(cost.section(summary))
    assert "## What the verdict cost" in text and "device-hours in all: 0.0200" in text
    assert "to the decision: not decided" in text and "the run saved" in text and "| bad " in text
    assert cost.section({"cost": {"device_hours": 0.0}}) == [] and callable(document)


def test_every_attempt_counts_a_step_trained_again_after_a_requeue_cost_twice(tmp_path):
    write_task(tmp_path, "a", trained=2, end="pruned")  # the first attempt: 2 steps, evaluations at 0 and 2
    write_task(tmp_path, "a", attempt=1, t0=100.0)  # the second: all 4 steps again, evaluations at 0, 2, 4
    t = load(tmp_path, "a")
    c = cost.task_costs([t], {"a": 1.0})["a"]
    assert c["train_device_hours"] == 60 / H and c["eval_device_hours"] == 15 / H
    assert c["state"] != "pruned" and c["steps_per_s"] == 0.1 and c["remaining_device_hours"] == 0


def test_a_task_that_failed_before_its_first_step_costs_what_it_spent_and_trains_nothing(tmp_path):
    """A base stage that failed at start-up has a start and an end row, no step, no evaluation (the report of such a
    run crashed here: test_slurm_failed_stage)."""
    folder = tmp_path / "tasks" / "base"
    folder.mkdir(parents=True)
    rows = [
        {"event": "start", "time": 0.0, "attempt": 0, "device": 0, "task": "base", "steps": 4, "world": 1},
        {"event": "end", "time": 5.0, "attempt": 0, "device": 0, "task": "base", "exit_state": "failed"},
    ]
    (folder / "events-rank0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    write_task(tmp_path, "r8")
    tasks = [load(tmp_path, "base", stage="base"), load(tmp_path, "r8")]
    costs = cost.task_costs(tasks, {"base": 5 / 3600, "r8": 0.02})
    assert costs["base"]["train_device_hours"] == 0 and costs["base"]["device_hours"] == 5 / 3600
    assert costs["r8"]["train_device_hours"] > 0


def test_a_variant_the_contest_pruned_lost_even_when_one_replicate_finished_first(tmp_path):
    """With 2 slots a loser's first seed can finish before the look that prunes its variant: the verdict counts
    the variant as lost at that look (one decision per variant), so the winner is decided, not 'leads on 1 seed'."""
    from slurm_router.analysis import abtest
    from slurm_router.analysis import winner as winners

    rng = np.random.default_rng(5)
    for s in range(2):
        write_task(tmp_path, f"good-s{s}", steps=6, rng=rng)
    write_task(tmp_path, "bad-s0", steps=6, loss=2.5, rng=rng)  # ended before the look
    write_task(tmp_path, "bad-s1", steps=6, trained=2, loss=2.5, end="pruned", rng=rng)
    tasks = [load(tmp_path, n) for n in ("good-s0", "good-s1", "bad-s0", "bad-s1")]
    final = winners.winner(tasks, abtest.compare_all(tasks))
    assert final and final["variant"] == "good" and final["decided"], final
    assert "winner: good" in final["sentence"] and "bad (stopped while behind at step 2)" in final["sentence"], final[
        "sentence"
    ]
    assert "beats bad" not in final["sentence"]  # behind the best of its look, not beaten by the winner at the end


def test_a_reserve_waiting_for_its_call_is_shown_as_waiting_and_the_fixed_design_does_not_pay_for_it(tmp_path):
    """An A/A seeds=auto run to the cap under Slurm: nothing pruned, but a reserve held its devices 60 s waiting for
    its round's call. The wait is its own part, the fixed design (priced from the plan) does not include it, so the
    run is said to have cost more than the fixed design; it said 0 saved."""
    span = write_task(tmp_path, "a-s0")
    waited_span = write_task(tmp_path, "a-s2", waited=60.0)
    tasks = [load(tmp_path, "a-s0"), load(tmp_path, "a-s2")]
    hours = {"a-s0": {"device_hours": span / H}, "a-s2": {"device_hours": waited_span / H}}
    c = cost.account(tasks, hours, None)
    r = c["tasks"]["a-s2"]
    assert r["wait_device_hours"] == 60 / H and abs(r["fixed_design_device_hours"] - (waited_span - 60) / H) < 1e-12
    assert abs(r["other_device_hours"] - (waited_span - 60 - 40 - 9) / H) < 1e-12
    assert c["tasks"]["a-s0"]["wait_device_hours"] == 0 and abs(c["saved_device_hours"] + 60 / H) < 1e-12
    text = to_markdown(cost.section({"cost": c}))
    assert "waiting for a call 0.0167" in text and "the run cost 0.0167 more" in text, text


def test_under_seeds_auto_the_decision_pays_for_the_whole_rounds_before_it(tmp_path):
    """Decided at step 2 of the second round (replicates s2): the first round (s0, s1) had to end before that round
    started, so it counts in full; without rounds only up to its own step-2 evaluation."""
    names = [f"{v}-s{i}" for v in ("good", "bad") for i in range(3)]
    for i, name in enumerate(names):
        write_task(tmp_path, name, steps=4, t0=0.0 if name[-1] != "2" else 100.0)
    tasks = [load(tmp_path, n) for n in names]
    hours = {n: {"device_hours": 0.01} for n in names}
    costs = cost.task_costs(tasks, {n: 0.01 for n in names})
    rounds = {n: int(n[-1] == "2") for n in names}
    upto = cost.to_decision(tasks, costs, 2, rounds)
    assert upto["good-s0"] == upto["bad-s1"] == 0.01 and 0 < upto["good-s2"] < 0.01
    plain = cost.to_decision(tasks, costs, 2)
    assert plain["good-s0"] < 0.01 and plain["good-s2"] == upto["good-s2"]
    assert cost.account(tasks, hours, None, rounds)["tasks"]["good-s0"]["wait_device_hours"] == 0


def test_a_fused_members_trainable_share_is_the_one_it_has_alone(tmp_path):
    """Issue 50, 10: a fused task's model holds every member's adapters, so its start rows' n_params counted the
    other members' too (3.57% fused, 4.35% alone for one variant). The report's share is the member's alone."""
    from slurm_router.analysis.report import variants_changed

    base, adapters = 1_000_000, {"r8": 20_000, "r32": 80_000}
    for name, n_own in adapters.items():
        folder = tmp_path / "tasks" / f"{name}-s0"
        folder.mkdir(parents=True)
        row = {"event": "start", "time": 0.0, "attempt": 0, "device": 0, "task": f"{name}-s0", "steps": 4, "world": 1}
        row |= {"n_params": base + sum(adapters.values()), "n_trainable_params": n_own}
        (folder / "events-rank0.jsonl").write_text(json.dumps(row) + "\n")
    fused = {"r8-s0": None, "r32-s0": "r8-s0"}
    tasks = [load(tmp_path, n, fused_into=lead) for n, lead in fused.items()]
    got = variants_changed(tmp_path, tasks)
    assert got["r8-s0"]["n_params"] == base + 20_000 and got["r32-s0"]["n_params"] == base + 80_000, got
    alone = variants_changed(tmp_path, [load(tmp_path, "r8-s0")])
    assert alone["r8-s0"]["n_params"] == base + 100_000  # a task alone: its start row's count as written
