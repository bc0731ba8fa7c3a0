"""seeds=auto (verdict/contest.py Auto and reserve_call, worker/auto_seeds.py): every variant starts with 2 seeds;
a reserve replicate runs only once the rounds before it ended with the contest undecided, and ends at once
(`not_needed`) when its variant was pruned, the contest is decided or the budget is spent. A later round's rows
reopen a step the run looked at before (a look per depth and step), and the looks' levels still sum to 5%."""

from __future__ import annotations

import json

import numpy as np
import pytest
from omegaconf import OmegaConf
from verdict_calibration import simulate

from slurm_router.errors import UserError
from slurm_router.rundir.spec import TaskSpec
from slurm_router.verdict import contest
from slurm_router.verdict.contest import RUN, SKIP, WAIT, Auto, Replicate, Schedule
from slurm_router.verdict.pruning import equivalent
from slurm_router.worker import auto_seeds, prune

TWO_LOOKS = Schedule((2, 4), 5, grace=0)  # the looks at steps 2 and 4 these simulated rounds evaluate at


def _cfg(**over):
    base = {"seed": 0, "seeds": "auto", "prune": True, "auto_seeds": {"max": 6, "budget_device_hours": None}}
    return OmegaConf.create({**base, **over})


def test_seeds_auto_plans_the_cap_and_refuses_what_cannot_work():
    from slurm_router.config.variants import auto_cap, training_seeds

    assert training_seeds(_cfg()) == [0, 1, 2, 3, 4, 5]
    assert training_seeds(_cfg(seed=7, auto_seeds={"max": 3})) == [7, 8, 9]
    for bad in (2, 0, "many", 1.5):
        with pytest.raises(UserError, match=r"^auto_seeds.max=.*give a whole number from 3"):
            auto_cap(_cfg(auto_seeds={"max": bad}))


@pytest.mark.parametrize(
    "over, message",
    [
        ({"prune": False}, "seeds=auto adds replicates only where the prune contest is undecided: set prune=true"),
        ({"auto_seeds": {"max": 6, "budget_device_hours": -1}}, "auto_seeds.budget_device_hours=-1: give a number"),
    ],
)
def test_the_command_refuses_seeds_auto_it_cannot_run(tmp_path, over, message):
    """The real command: one line naming the key, exit code 2, no run directory."""
    from conftest import run_cli

    args = ["+experiment=lora_ab", "base.enabled=false", "seeds=auto", f"run_root={tmp_path / 'runs'}"]
    args += ["prune=false"] if over.get("prune") is False else ["prune=true"]
    if "auto_seeds" in over:
        args.append(f"auto_seeds.budget_device_hours={over['auto_seeds']['budget_device_hours']}")
    proc = run_cli(*args, cwd=tmp_path)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "runs").exists()


def test_the_levels_of_every_look_seeds_auto_can_take_sum_to_five_percent():
    for cap in (3, 4, 6, 10):
        for n_looks in (1, 3, 8):
            auto = Auto(cap)
            total = sum(contest.spend(0, n_looks, depth=d, auto=auto) * n_looks for d in range(2, cap + 1))
            assert total == pytest.approx(0.05), (cap, n_looks)
            assert contest.spend(0, n_looks, depth=cap + 1, auto=auto) == 0
    assert Auto(6).spending(2, 4) == "half of 5% / 4 looks at 2 seeds"
    assert Auto(6).spending(3, 4) == "half of 5% / 4 depths (3-6 seeds) / 4 looks"


def _row():
    return {"loss_sums": [1.0, 1.0], "tokens": [10, 10]}


def test_a_later_round_reopens_a_step_once_per_depth():
    """After the 2-seed round looked at steps 2 and 4, the third seeds' rows at step 2 give a look there (depth 3);
    a fixed-seeds run never looks back. Each (depth, step) is looked at once."""
    two = {"a": {0: _row(), 1: _row()}, "b": {0: _row(), 1: _row()}}
    tables = {2: json.loads(json.dumps(two)), 4: json.loads(json.dumps(two))}
    looked = [{"step": 2, "depth": 2, "pruned": []}, {"step": 4, "depth": 2, "pruned": []}]
    assert contest.next_look(tables, {}, looked, Auto(4)) is None
    tables[2]["a"][2] = _row()  # a's third seed reached step 2; b's has not started (not seen): no wait for it
    assert contest.next_look(tables, {}, looked, Auto(4)) is None  # depth still 2 (b has 2 seeds)
    tables[2]["b"][2] = _row()
    assert contest.next_look(tables, {}, looked, Auto(4)) == 2
    assert contest.next_look(tables, {}, looked) is None  # fixed seeds: forward only
    looked.append({"step": 2, "depth": 3, "pruned": []})
    assert contest.next_look(tables, {}, looked, Auto(4)) is None
    tables[4]["a"][2], tables[4]["b"][2] = _row(), _row()
    assert contest.next_look(tables, {}, looked, Auto(4)) == 4


def test_a_reserve_waits_for_the_round_before_it_then_runs_or_is_not_needed():
    reps = [Replicate(v, i, ended=i < 2 and not (v == "b" and i == 1)) for v in ("a", "b") for i in range(4)]
    assert contest.reserve_call("a", 2, reps, []) == (WAIT, None)  # b-s1 still running
    reps = [Replicate(r.variant, r.index, r.ended or r.index < 2) for r in reps]
    assert contest.reserve_call("a", 2, reps, []) == (RUN, None)
    assert contest.reserve_call("a", 3, reps, []) == (WAIT, None)  # round 3 waits for round 2
    pruned_b = [{"look": 2, "step": 4, "pruned": ["b"]}]
    call, why = contest.reserve_call("b", 2, reps, pruned_b)
    assert call == SKIP and why == "b's replicate 3 not run: b was pruned at look 2 (step 4)"
    call, why = contest.reserve_call("a", 2, reps, pruned_b)
    assert call == SKIP and why == "a's replicate 3 not run: the contest is decided, a is the only variant left"
    call, why = contest.reserve_call("a", 2, reps, [], spent_device_hours=2.5, budget_device_hours=2.0)
    assert call == SKIP and "auto_seeds.budget_device_hours=2 is spent (2.5 device-hours so far); a, b undecided" in why
    c = [*reps, Replicate("c", 0, True), Replicate("c", 1, False)]  # a third variant's round-1 task still runs
    assert contest.reserve_call("a", 2, c, [])[0] == WAIT
    assert contest.reserve_call("a", 2, c, [{"look": 1, "step": 2, "pruned": ["c"]}])[0] == RUN  # not waited for


def test_a_running_reserve_stops_only_when_the_contest_is_decided_for_its_variant(tmp_path):
    """decided_stop: the winner's running reserve stops once every other variant is pruned; not while two are
    left, not a settled contest's (a later look may still prune), and never a first-round replicate (the worker
    asks only for a reserve: auto_seeds.decided_reserve)."""
    looks = [{"look": 1, "step": 2, "pruned": []}, {"look": 3, "step": 4, "pruned": ["b", "c"]}]
    why = contest.decided_stop("a", 2, {"a", "b", "c"}, looks)
    assert why == "a's replicate 3 not needed: the contest was decided at look 3 (step 4), a is the only variant left"
    assert contest.decided_stop("a", 2, {"a", "b", "c"}, looks[:1]) is None
    assert contest.decided_stop("a", 2, {"a", "b", "c"}, [{"look": 1, "step": 2, "pruned": ["b"]}]) is None
    assert contest.decided_stop("b", 2, {"a", "b", "c"}, looks) is None  # b's replicates stop as pruned
    settled = [{"look": 1, "step": 2, "pruned": [], "equivalent": {"b": {}}}]
    assert contest.decided_stop("a", 2, {"a", "b"}, settled) is None
    for v, i in (("a", 0), ("a", 1), ("a", 2), ("b", 2)):
        _task(tmp_path, v, i)
    (tmp_path / "decisions.jsonl").write_text(json.dumps({"look": 2, "step": 4, "pruned": ["b"]}) + "\n")
    assert auto_seeds.decided_reserve(_task(tmp_path, "a", 2)).startswith("a's replicate 3 not needed")
    assert auto_seeds.decided_reserve(_task(tmp_path, "a", 1)) is None  # the first round trains to the end


def _task(run, variant, index, cap=4, steps=6, min_effect=None) -> TaskSpec:
    """A variants-stage task of a seeds=auto run, its task.json written as create_run_dir writes it."""
    config = {"seed": 0, "seeds": "auto", "auto_seeds": {"max": cap, "budget_device_hours": None}}
    config["auto_seeds"]["min_effect"] = min_effect
    spec = TaskSpec(
        run_id="r", run_dir=str(run), experiment="e", name=f"{variant}-s{index}", stage="variants", variant=variant,
        index=0, devices=1, config=config, steps=steps, lr=1e-3, global_batch_size=8, lora=True, seed=index,
    )  # fmt: skip
    spec.task_dir.mkdir(parents=True, exist_ok=True)
    spec.task_dir.joinpath("task.json").write_text(spec.to_json())
    return spec


def test_the_files_a_reserve_reads_and_the_call_every_rank_follows(tmp_path):
    """worker/auto_seeds.py on a run directory: the planned tasks (task.json), which ended (result.json, or a
    failed end row), the device-hours spent (events), and the call recorded once in reserve.json."""
    specs = {(v, i): _task(tmp_path, v, i) for v in ("good", "bad") for i in range(4)}
    assert auto_seeds.reserve_index(specs["good", 1]) is None and auto_seeds.reserve_index(specs["good", 2]) == 2
    reps = {(r.variant, r.index): r.ended for r in auto_seeds.replicates(tmp_path)}
    assert reps == {(v, i): False for v in ("good", "bad") for i in range(4)}
    for v in ("good", "bad"):
        (tmp_path / "tasks" / f"{v}-s0" / "result.json").write_text("{}")
        (tmp_path / "tasks" / f"{v}-s1" / "events-rank0.jsonl").write_text(
            json.dumps({"event": "start", "time": 100.0})
            + "\n"
            + json.dumps({"event": "end", "time": 100.0 + 1800, "exit_state": "failed"})
            + "\n"  # fmt: skip
        )
    assert all(
        ended
        for (v, i), ended in {(r.variant, r.index): r.ended for r in auto_seeds.replicates(tmp_path)}.items()
        if i < 2
    )
    assert auto_seeds.spent_device_hours(tmp_path) == pytest.approx(1.0)  # two tasks x half an hour x 1 device
    assert auto_seeds.wait_for_call(specs["good", 2], poll_s=0.01) is None  # round 2 runs: the contest is open
    made = json.loads((tmp_path / "tasks" / "good-s2" / auto_seeds.RESERVE_FILE).read_text())
    assert made["call"] == RUN and made["index"] == 2
    stopped = auto_seeds.wait_for_call(specs["good", 3], stop=lambda: True, poll_s=0.01)  # waits for round 2
    assert stopped is None and not (tmp_path / "tasks" / "good-s3" / auto_seeds.RESERVE_FILE).exists()
    # the run then pruned bad: bad's reserve of round 2 is not needed, and the call is kept for a requeued attempt
    (tmp_path / "decisions.jsonl").write_text(json.dumps({"look": 1, "step": 2, "pruned": ["bad"]}) + "\n")
    result = auto_seeds.wait_for_call(specs["bad", 2], poll_s=0.01)
    assert result == {"exit_state": "not_needed", "reason": "bad's replicate 3 not run: bad was pruned at look 1 "
                      "(step 2)", "steps": 6}  # fmt: skip
    assert auto_seeds.wait_for_call(specs["good", 2], poll_s=0.01) is None  # the recorded call stands
    assert auto_seeds.wait_for_call(specs["good", 3], poll_s=0.01)["reason"] == (
        "good's replicate 4 not run: the contest is decided, good is the only variant left"
    )


def simulated_rounds(run, rng, effect: float, min_effect: float | None = None) -> tuple[int, list[dict]]:
    """A seeds=auto run of good and bad (worse by `effect`), cap 4, through worker/prune.after_eval and
    contest.reserve_call: (rounds run, the run's looks)."""
    sides = dict(zip(("good", "bad"), simulate(rng, 4, effects=(0.0, effect))))
    rows = {v: {s: {k: [float(x) for x in val] for k, val in r.items()} for s, r in side.items()}
            for v, side in sides.items()}  # fmt: skip
    specs = {(v, i): _task(run, v, i, min_effect=min_effect) for v in rows for i in range(4)}
    rounds = 0
    for index in (None, 2, 3):
        batch = [(v, i) for v in rows for i in ((0, 1) if index is None else (index,))]
        if index is not None:
            reps = auto_seeds.replicates(run)
            batch = [(v, i) for v, i in batch if contest.reserve_call(v, i, reps, prune.read_looks(run))[0] == RUN]
        if not batch:
            break
        rounds += 1
        for step in (2, 4):
            for v, i in batch:
                prune.after_eval(specs[v, i], step, *rows[v][i].values(), schedule=TWO_LOOKS)
        for v, i in batch:
            (run / "tasks" / f"{v}-s{i}" / "result.json").write_text("{}")
    return rounds, prune.read_looks(run)


def test_under_the_real_protocol_seeds_auto_adds_a_round_only_while_undecided(tmp_path):
    """The production code (worker/prune.after_eval, contest.reserve_call) on simulated rounds: a clear loser is
    pruned in the first round and no reserve runs; between equal variants the rounds go on to the cap, the looks
    at every depth, with no false prune in these runs."""
    rng = np.random.default_rng(3)
    for effect, expect_rounds in ((0.3, 1), (0.0, 3)):
        rounds, looks = simulated_rounds(tmp_path / str(effect), rng, effect)
        assert rounds == expect_rounds, looks
        if effect:
            assert looks[0]["pruned"] == ["bad"] and looks[0]["depth"] == 2
        else:
            assert not contest.pruned_in(looks) and sorted({line["depth"] for line in looks}) == [2, 3, 4]
            assert contest.auto_line(looks, {"good": 4, "bad": 4}, [], 4).endswith(
                "good, bad reached auto_seeds.max=4 seeds undecided"
            )


def test_min_effect_settles_equal_variants_before_the_cap_and_still_prunes_a_loser(tmp_path):
    """auto_seeds.min_effect: equal variants whose interval already excludes a difference of 0.05 stop adding
    seeds before the cap (the look records why, a reserve says it, the report's line too); a loser worse by far
    more than min_effect is still pruned in the first round, never settled."""
    rng = np.random.default_rng(3)
    rounds, looks = simulated_rounds(tmp_path / "loser", rng, 0.3, min_effect=0.02)
    assert rounds == 1 and looks[0]["pruned"] == ["bad"] and not contest.settled_by(looks)
    rounds, looks = simulated_rounds(tmp_path / "equal", rng, 0.0, min_effect=0.05)
    settled = contest.settled_by(looks)
    assert settled is not None and rounds == settled["depth"] - 1 < 3 and not contest.pruned_in(looks), looks
    (pair,) = settled["equivalent"].values()
    assert -0.05 < pair["ci_low"] <= pair["diff"] <= pair["ci_high"] < 0.05 and settled["min_effect"] == 0.05
    reps = auto_seeds.replicates(tmp_path / "equal")
    call, why = contest.reserve_call("good", 3, reps, looks)
    assert call == SKIP and why.startswith("good's replicate 4 not run: the contest is settled: bad and good are ")
    assert f"within auto_seeds.min_effect=0.05 of each other at look {settled['look']}" in why
    line = contest.auto_line(looks, {"good": rounds + 1, "bad": rounds + 1}, [why, why], 4)
    assert "; the contest is settled: bad and good are within auto_seeds.min_effect=0.05" in line


def test_a_look_settles_wrongly_at_most_at_its_share_of_the_level():
    """The equivalence rule's error (verdict/pruning.equivalent): when one variant is worse by exactly min_effect,
    a look spending 5% settles in at most about 5% of tables; when they are equal it settles nearly always; one
    seed a side (no training noise in the interval) never settles."""
    rng = np.random.default_rng(11)

    def rate(effect: float, n: int = 2000, seeds: int = 4) -> float:
        hits = 0
        for _ in range(n):
            good, bad = simulate(rng, seeds, effects=(0.0, effect))
            hits += equivalent({"good": good, "bad": bad}, 0.05, 0.01) is not None
        return hits / n

    assert rate(0.01) <= 0.065  # 5% at the boundary; 2,000 tables: 3 standard errors of slack
    assert rate(0.0, n=300) >= 0.85
    assert rate(0.0, n=50, seeds=1) == 0.0


def test_a_look_waits_for_every_variants_first_round_seen_or_not(tmp_path):
    """A queue with few slots runs every variant's first seed, then the second: the run does not look while a
    variant's second seed has not started (its look would be spent without that variant, maybe the best one).
    A first-round replicate that failed before any evaluation is not waited for."""
    rng = np.random.default_rng(5)
    sides = dict(zip("abc", simulate(rng, 2, effects=(0.0, 0.0, 0.3))))
    for case in ("started late", "failed"):
        run = tmp_path / case.replace(" ", "_")
        specs = {(v, i): _task(run, v, i) for v in "abc" for i in range(4)}

        def evaluate(v: str, i: int):
            row = sides[v][i]
            return prune.after_eval(specs[v, i], 2, [float(x) for x in row["loss_sums"]], [int(t) for t in row["tokens"]],
                                    schedule=TWO_LOOKS)  # fmt: skip

        for v, i in (("a", 0), ("b", 0), ("c", 0), ("a", 1), ("b", 1)):
            evaluate(v, i)
        if case == "started late":
            assert prune.read_looks(run) == []  # c's second seed is planned, not started: no look yet
            assert evaluate("c", 1) is not None  # c, far worse, is pruned by the look its second seed made due
            (look,) = prune.read_looks(run)
            assert look["rows"] == {"a": [0, 1], "b": [0, 1], "c": [0, 1]} and look["pruned"] == ["c"]
        else:
            specs["c", 1].task_dir.joinpath("events-rank0.jsonl").write_text(
                json.dumps({"event": "end", "time": 1.0, "exit_state": "failed"}) + "\n"
            )
            evaluate("a", 1)  # the next evaluation takes the look c-s1 no longer holds up
            (look,) = prune.read_looks(run)
            assert look["rows"] == {"a": [0, 1], "b": [0, 1], "c": [0]} and look["pruned"] == []


def test_the_budget_counts_device_hours_as_the_report_does(tmp_path):
    """A fused group is counted once (its member's events used to be counted again), an ended task by the elapsed
    time its launcher recorded (what the report reads), a running one by its events' span in each attempt (not
    the gap between two attempts)."""
    lead, member, running = _task(tmp_path, "a", 0), _task(tmp_path, "b", 0), _task(tmp_path, "a", 1)
    member.fused_into = lead.name
    member.task_dir.joinpath("task.json").write_text(member.to_json())
    rows = [{"event": "start", "time": 0.0, "attempt": 0}, {"event": "step", "time": 1800.0, "attempt": 0}]
    for spec in (lead, member):
        spec.task_dir.joinpath("events-rank0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    later = [{"event": "start", "time": 7200.0, "attempt": 1}, {"event": "step", "time": 9000.0, "attempt": 1}]
    running.task_dir.joinpath("events-rank0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows + later))
    assert auto_seeds.spent_device_hours(tmp_path) == pytest.approx(0.5 + 1.0)  # the group once; 2 attempts
    manifest = {"stages": [], "tasks": {lead.name: {"elapsed_s": 2700.0}, member.name: {"elapsed_s": 2700.0}}}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    assert auto_seeds.spent_device_hours(tmp_path) == pytest.approx(0.75 + 1.0)
