"""The stub's "cluster": `python -m stub_backend.cluster JOB_FILE` runs one queued job, detached from whoever
submitted it. It waits until the job it depends on has ended (cancelled if that one did not complete), then runs
each of its commands in order with STUB_JOB_ID set, recording each one's state in RUN_DIR/stub/<id>.json."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path


def state_file(run_dir: str, job_id: str) -> Path:
    return Path(run_dir) / "stub" / f"{job_id}.json"


def read_state(run_dir: str, job_id: str) -> dict:
    try:
        return json.loads(state_file(run_dir, job_id).read_text())
    except (OSError, ValueError):
        return {"state": "PENDING"}


def write_state(run_dir: str, job_id: str, **state) -> None:
    path = state_file(run_dir, job_id)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state))
    tmp.replace(path)


def main(job_file: str) -> int:
    job = json.loads(Path(job_file).read_text())
    run_dir, after = job["run_dir"], job.get("after")
    while after and read_state(run_dir, after)["state"] in ("PENDING", "RUNNING"):
        time.sleep(0.2)
    ok = not after or read_state(run_dir, after)["state"] == "COMPLETED" or job.get("afterany")
    states = []
    for task in job["tasks"]:
        if not ok:
            write_state(run_dir, task["job_id"], state="CANCELLED", reason="the job it waited on did not complete")
            states.append("CANCELLED")
            continue
        write_state(run_dir, task["job_id"], state="RUNNING", started=time.time())
        env = {**os.environ, "STUB_JOB_ID": task["job_id"]}
        with open(task["log_path"], "a") as out, open(task["err_path"], "a") as err:
            code = subprocess.call(task["argv"], env=env, stdout=out, stderr=err)
        state = "COMPLETED" if code == 0 else "FAILED"
        write_state(run_dir, task["job_id"], state=state, exit_code=code)
        states.append(state)
    whole = "COMPLETED" if states and all(s == "COMPLETED" for s in states) else "FAILED"
    write_state(run_dir, job["job_id"], state=whole)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
