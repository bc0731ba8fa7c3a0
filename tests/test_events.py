"""The event schema as code: the writer takes typed rows (or a kind and fields) and refuses anything outside
the schema, the reader skips a torn last line and raises on garbage elsewhere, parse_row gives back the typed
row, and the module docstring lists exactly the dataclasses' fields.

    pytest tests/test_events.py
"""

import dataclasses
import json
import re

import pytest

from slurm_router.rundir import events
from slurm_router.rundir.events import (
    IDENTITY,
    OMIT,
    ROWS,
    CheckpointSavedRow,
    EndRow,
    EventWriter,
    MicroRow,
    StepRow,
    fields_of,
    parse_row,
    read_events,
)

ID = dict(run_id="run", task="r8", variant="r8", stage="variants", attempt=1, device=0, policy="balanced")


def _writer(tmp_path):
    return EventWriter(tmp_path / "events-rank0.jsonl", **ID)


def _step(**over):
    values = dict(
        step=3,
        loss=2.5,
        n_tokens=100,
        n_target_tokens=96,
        n_samples=4,
        t_step_s=0.5,
        t_sync_wait_s=0.01,
        lr=1e-3,
        busy_s=0.4,
        busy_s_all=[0.4, 0.3],
        planned_cost=[10.0, 9.0],
        n_micro=[1, 2],
        speed=[1.0, 1.0],
        cost_balance_ratio=1.05,
        oom_retries=0,
        n_pad_tokens=7,
        mem_peak_bytes=123,
        mem_total_bytes=1000,
        util=50.0,
    )
    return StepRow(**{**values, **over})


def test_typed_rows_and_keyword_rows_land_on_disk_as_before(tmp_path):
    w = _writer(tmp_path)
    w.write(_step())
    w.write("requeue", reason="slurm", job_id="17", restart=1, detail="requeued by Slurm")
    w.write(EndRow(exit_state="completed", val_loss=2.0, train_loss=2.1, steps=8))
    w.write(EndRow(exit_state="completed"))
    w.close()
    rows = list(read_events(tmp_path / "events-rank0.jsonl"))
    head = ["event", "time", "host", *ID]
    assert list(rows[0]) == head + list(fields_of(StepRow))
    assert {k: rows[0][k] for k in ID} == ID and rows[0]["event"] == "step" and rows[0]["busy_s_all"] == [0.4, 0.3]
    # the keyword path keeps the caller's key order and leaves out what was not given
    assert list(rows[1]) == head + ["reason", "job_id", "restart", "detail"]
    assert list(rows[2])[len(head) :] == ["exit_state", "val_loss", "train_loss", "steps"]
    assert list(rows[3])[len(head) :] == ["exit_state"]
    for row in rows:
        typed = parse_row(row)
        assert type(typed) is ROWS[row["event"]] and typed.to_dict() == row


def test_none_is_a_value_and_numpy_values_are_written_plainly(tmp_path):
    np = pytest.importorskip("numpy")
    w = _writer(tmp_path)
    w.write(
        MicroRow(
            step=0,
            micro=0,
            sample_ids=(3, 1),
            n_samples=2,
            n_tokens=np.int64(20),
            n_pad_tokens=0,
            cost=np.float64(1.5),
            t_start=0.0,
            t_data_s=0.0,
            t_compute_s=0.1,
            mem_peak_bytes=5,
            mem_predicted_bytes=None,
            loss=2.0,
            lr=0.1,
            oom_retries=0,
        )
    )
    w.close()
    row = json.loads((tmp_path / "events-rank0.jsonl").read_text())
    assert row["mem_predicted_bytes"] is None and row["sample_ids"] == [3, 1] and row["n_tokens"] == 20


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda w: w.write("requeue", reason="slurm", job_id="1", bogus=1), "requeue rows have no field bogus"),
        (lambda w: w.write("nonsense", step=1), "unknown event kind 'nonsense'"),
        (lambda w: w.write("end"), "end row without its field 'exit_state'"),
        (lambda w: w.write(_step(loss=OMIT)), "step row without its field 'loss'"),
    ],
)
def test_nothing_outside_the_schema_is_written(tmp_path, call, message):
    w = _writer(tmp_path)
    with pytest.raises(ValueError, match=re.escape(message)):
        call(w)
    w.close()
    assert (tmp_path / "events-rank0.jsonl").read_text() == ""
    with pytest.raises(TypeError):
        StepRow(step=1, not_a_field=2)
    with pytest.raises(ValueError, match="not identity fields: color"):
        EventWriter(tmp_path / "x.jsonl", color="red")


def test_parse_row_refuses_unknown_kinds_and_fields():
    row = {
        "event": "checkpoint_saved",
        "time": 1.0,
        "host": "h",
        **ID,
        "step": 4,
        "path": "p",
        "bytes": 9,
        "sha256": "ab",
        "reason": "periodic",
        "t_save_s": 0.1,
    }
    assert parse_row(row) == CheckpointSavedRow(
        time=1.0, host="h", **ID, step=4, path="p", bytes=9, sha256="ab", reason="periodic", t_save_s=0.1
    )
    with pytest.raises(ValueError, match="not in the schema: extra"):
        parse_row({**row, "extra": 1})
    with pytest.raises(ValueError, match="without its field 'sha256'"):
        parse_row({k: v for k, v in row.items() if k != "sha256"})
    with pytest.raises(ValueError, match="unknown event kind"):
        parse_row({**row, "event": "stpe"})


def test_torn_last_line_is_skipped_and_garbage_elsewhere_raises(tmp_path):
    p = tmp_path / "events-rank0.jsonl"
    p.write_text('{"event":"step","step":0}\n{"event":"st')
    assert [r["step"] for r in read_events(p)] == [0]
    p.write_text('{"event":"step","step":0}\nnot json\n{"event":"step","step":1}\n')
    with pytest.raises(ValueError, match=":2: not an event row"):
        list(read_events(p))
    p.write_text('{"step":0}\n')
    with pytest.raises(ValueError, match="no 'event' field"):
        list(read_events(p))


def test_the_docstring_lists_exactly_the_schema():
    doc = events.__doc__
    assert all(name in doc for name in IDENTITY)
    for kind, cls in ROWS.items():
        line = re.search(rf"^  {kind} +{cls.__name__}, (.*?)(?=^  \S|\Z)", doc, re.M | re.S)
        assert line, f"{kind} missing from the docstring"
        text = re.sub(r"\([^()]*(\([^()]*\)[^()]*)*\)", "", line.group(1).split(": ", 1)[1])
        listed = [n.strip() for n in text.replace("\n", " ").split(",")]
        own = [f.name for f in dataclasses.fields(cls) if f.name not in ("time", *IDENTITY)]
        assert listed == own, kind


def test_readers_name_only_fields_of_the_schema():
    from slurm_router.analysis.load import REQUIRED

    for kind, names in REQUIRED.items():
        assert set(names) <= set(fields_of(kind)) | set(IDENTITY)
    with pytest.raises(KeyError, match="step rows have no field t_stpe_s"):
        fields_of(StepRow, "t_stpe_s")
