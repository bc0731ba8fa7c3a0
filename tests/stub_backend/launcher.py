"""launcher=stub: each stage is one queued job of the stub's cluster (cluster.py), after the stage before; the
report is a last job after them all. Task states come from the cluster's state files; cancel ends its jobs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from slurm_router.launch.base import Launcher, RunJobs, StageJobs, TaskJob
from slurm_router.rundir.spec import Stage
from slurm_router.scheduler.task_view import TaskView
from stub_backend import StubLauncherConfig
from stub_backend.cluster import read_state

ENDED = ("COMPLETED", "FAILED", "CANCELLED")


class StubLauncher(Launcher):
    schema = StubLauncherConfig
    synchronous = False

    def _submit(self, name: str, after: str | None, tasks: list[dict], afterany: bool = False) -> str:
        queue = self.layout.root / "stub"
        queue.mkdir(exist_ok=True)
        job_id = f"{len(list(queue.glob('job-*.json'))) + 1}"
        for i, task in enumerate(tasks):
            task["job_id"] = f"{job_id}_{i}"
        job = {"job_id": job_id, "name": name, "run_dir": str(self.layout.root), "after": after, "tasks": tasks}
        job["afterany"] = afterany
        job_file = queue / f"job-{job_id}.json"
        job_file.write_text(json.dumps(job))
        proc = subprocess.Popen(
            [sys.executable, "-m", "stub_backend.cluster", str(job_file)],
            start_new_session=True,  # the cluster's, not the submitter's: it outlives the command
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        (queue / f"pid-{job_id}").write_text(str(proc.pid))
        return job_id

    def submit_stage(self, stage: Stage, after: str | None, after_round: str | None = None) -> StageJobs:
        self.layout.logs.mkdir(parents=True, exist_ok=True)
        tasks = [
            {
                "name": t.name,
                "argv": [sys.executable, "-m", "slurm_router.supervise.job", str(self.layout.task(t.name).task_file)],
                "log_path": str(self.layout.logs / f"{t.name}.out"),
                "err_path": str(self.layout.logs / f"{t.name}.err"),
            }
            for t in stage.tasks
        ]
        job_id = self._submit(stage.name, after, tasks)
        jobs = {t["name"]: TaskJob(t["job_id"], t["log_path"], t["err_path"]) for t in tasks}
        return StageJobs(job_id=job_id, tasks=jobs, job_name=stage.name)

    def report_job(self, after: str | None) -> str | None:
        argv = [sys.executable, "-m", "slurm_router.analysis", str(self.layout.root)]
        logs = str(self.layout.logs / "report.out")
        return self._submit(
            "report", after, [{"name": "report", "argv": argv, "log_path": logs, "err_path": logs}], True
        )

    def finish(self, run: RunJobs) -> int:
        print(f"stub jobs: {', '.join(run.job_ids)}; report job {run.report_job_id}")
        if self.cfg.launcher.wait and run.report_job_id:
            while read_state(str(self.layout.root), run.report_job_id)["state"] not in ENDED:
                time.sleep(0.5)
        states = self.task_states(self.manifest.refresh().data)
        print(f"run_dir: {self.layout.root}")
        return 0 if all(t.state == "COMPLETED" for t in states) else 1

    @classmethod
    def task_states(cls, manifest: dict) -> list[TaskView]:
        out = []
        for name, info in (manifest.get("tasks") or {}).items():
            job_id = str(info.get("job_id") or "")
            state = read_state(manifest["run_dir"], job_id) if job_id else {"state": "PENDING"}
            out.append(
                TaskView(
                    stage=str(info.get("stage", "")),
                    variant=name,
                    job_id=job_id or "-",
                    state=state["state"],
                    exit_code=None if state.get("exit_code") is None else str(state["exit_code"]),
                    reason=state.get("reason", ""),
                    log_path=info.get("log_path"),
                    err_path=info.get("err_path"),
                )
            )
        return out

    @classmethod
    def cancel(cls, manifest: dict) -> str | None:
        queue = Path(manifest["run_dir"]) / "stub"
        ended = []
        for pid_file in sorted(queue.glob("pid-*")):
            try:
                os.killpg(int(pid_file.read_text()), signal.SIGTERM)
                ended.append(pid_file.name[4:])
            except (OSError, ValueError):
                continue
        return f"stub: ended jobs {', '.join(ended)}" if ended else None
