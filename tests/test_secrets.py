"""A credential in a setting never lands where others can read it (config/secrets.py): the whole run dir, stdout and
stderr are searched for a planted password, for a dry run and for a real run whose MLflow server asks for that
password (and gets the run)."""

from __future__ import annotations

import base64
import json
import os
import shutil
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from conftest import run_cli, run_dir_of

PASSWORD = "pw-" + uuid.uuid4().hex[:12]  # drawn, not spelled here: a Slurm run's code snapshot holds this file
TINY = ["base.enabled=false", "train.steps=2", "train.eval_every=1", "train.eval_batches=2", "data.max_documents=40"]


def clean_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "MLFLOW_"))}
    return {**env, "MLFLOW_TRACKING_URI": "", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", **extra}


def assert_nowhere(secret: str, root: Path, *outputs: str) -> None:
    """Not in any file under root (pickles, event files and logs too) but the owner-only secrets.json, nor in the
    command's output."""
    for out in outputs:
        assert secret not in out, out[-3000:]
    for path in (p for p in root.rglob("*") if p.is_file() and p.name != "secrets.json"):
        assert secret.encode() not in path.read_bytes(), f"{path} holds the password"


@pytest.mark.parametrize(
    "setting, shown",
    [
        (f"tracker.mlflow_uri=http://alice:{PASSWORD}@host:5000", "mlflow_uri: http://alice:***@host:5000"),
        (f"tracker.mlflow_uri=postgresql://bob:{PASSWORD}@db.lab/mlflow", "mlflow_uri: postgresql://bob:***@db.lab"),
        (f"tracker.mlflow_uri=https://{PASSWORD}@mlflow.lab", "mlflow_uri: https://***@mlflow.lab"),
        ("tracker.mlflow_uri=${oc.env:SR_TEST_MLFLOW_URI}", "mlflow_uri: '***'"),
    ],
    ids=["http", "postgresql", "token", "oc.env"],
)
def test_a_dry_run_shows_the_password_nowhere(tmp_path, setting, shown):
    env = clean_env(SR_TEST_MLFLOW_URI=f"https://carol:{PASSWORD}@mlflow.lab")
    args = ["tracker=mlflow", setting, "seeds=2", f"run_root={tmp_path / 'runs'}", "dry_run=true", *TINY]
    proc = run_cli(*args, cwd=tmp_path, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = run_dir_of(proc)
    assert shown in (run_dir / "config.yaml").read_text()
    assert sorted(p.name for p in (run_dir / "tasks").iterdir()) == ["main-s0", "main-s1"]
    assert_nowhere(PASSWORD, tmp_path, proc.stdout, proc.stderr)
    assert not (run_dir / "secrets.json").exists(), "a preview runs nothing: it needs no credential"


# ---- an MLflow server that asks for the password ----------------------------------------------------------------
class FakeMlflow:
    """The REST calls MlflowClient makes for one run (experiment, run, params and metrics, status), each refused
    without alice's password (HTTP basic auth, as MLflow's auth app asks)."""

    def __init__(self, password: str):
        self.auth = "Basic " + base64.b64encode(f"alice:{password}".encode()).decode()
        self.run: dict = {}
        self.params: dict = {}
        self.metrics: list = []
        self.refused = 0
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.port = self.server.server_address[1]

    def _answer(self, path: str, body: dict) -> tuple[int, dict]:
        if path == "experiments/get-by-name":
            return 404, {"error_code": "RESOURCE_DOES_NOT_EXIST", "message": "no such experiment"}
        if path == "experiments/create":
            return 200, {"experiment_id": "1"}
        if path == "runs/create":
            self.run = {"run_id": "r1", "run_uuid": "r1", "experiment_id": "1", "run_name": body.get("run_name")}
            self.run.update(status="RUNNING", start_time=body.get("start_time", 0), lifecycle_stage="active")
            return 200, {"run": {"info": self.run, "data": {}}}
        if path == "runs/get":
            return 200, {"run": {"info": self.run, "data": {}}}
        if path == "runs/log-batch":
            self.params.update({p["key"]: p["value"] for p in body.get("params", [])})
            self.metrics += body.get("metrics", [])
            return 200, {}
        if path == "runs/update":
            self.run["status"] = body.get("status")
            return 200, {"run_info": self.run}
        return 404, {"error_code": "ENDPOINT_NOT_FOUND", "message": path}

    def _handler(self):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _serve(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                if self.headers.get("Authorization") != fake.auth:
                    fake.refused += 1
                    code, answer = 401, {"error_code": "UNAUTHENTICATED", "message": "credentials needed"}
                else:
                    code, answer = fake._answer(self.path.split("?")[0].rsplit("/mlflow/", 1)[-1], body)
                data = json.dumps(answer).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PATCH = _serve

        return Handler


@pytest.mark.integration
def test_a_local_run_reaches_a_password_protected_mlflow_and_writes_the_password_nowhere(tmp_path):
    pytest.importorskip("mlflow")
    mlflow = FakeMlflow(PASSWORD)
    try:
        uri = f"http://alice:{PASSWORD}@127.0.0.1:{mlflow.port}"
        args = ["tracker=mlflow", f"tracker.mlflow_uri={uri}", f"run_root={tmp_path / 'runs'}", *TINY]
        proc = run_cli(*args, cwd=tmp_path, env=clean_env(), timeout=600)
    finally:
        mlflow.server.shutdown()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = run_dir_of(proc)
    # the server got the run, with the password (it refuses any call without it), and its parameters show none
    assert mlflow.refused == 0 and mlflow.run["status"] == "FINISHED", (mlflow.refused, mlflow.run)
    assert sorted(m["step"] for m in mlflow.metrics if m["key"] == "train/loss") == [0, 1]
    assert mlflow.params["tracker.mlflow_uri"] == f"http://alice:***@127.0.0.1:{mlflow.port}"
    assert PASSWORD not in json.dumps(mlflow.params)
    secrets = run_dir / "secrets.json"
    assert secrets.stat().st_mode & 0o777 == 0o600 and PASSWORD in secrets.read_text()
    # resume= reads config.yaml as shown (*** equals the tasks' *** : not an edit) and the real values back
    again = run_cli(f"resume={run_dir}", cwd=tmp_path, env=clean_env(), timeout=300)
    assert again.returncode == 0 and "every task of" in again.stdout, again.stdout[-3000:] + again.stderr[-3000:]
    assert_nowhere(PASSWORD, tmp_path, proc.stdout, proc.stderr, again.stdout, again.stderr)


@pytest.mark.slurm
@pytest.mark.skipif(shutil.which("sbatch") is None, reason="no sbatch on PATH: run scripts/slurm_test_cluster.sh first")
@pytest.mark.parametrize("launcher", ["slurm", "sbatch"])
def test_a_slurm_run_reaches_a_password_protected_mlflow_and_writes_the_password_nowhere(tmp_path, launcher):
    """The Slurm launchers: the job reads the credential from RUN_DIR/secrets.json; the pickles submitit writes, the
    rendered sbatch scripts and the job logs show none."""
    pytest.importorskip("mlflow")
    mlflow = FakeMlflow(PASSWORD)
    try:
        uri = f"http://alice:{PASSWORD}@127.0.0.1:{mlflow.port}"
        args = [f"launcher={launcher}", "launcher.wait=true", "launcher.timeout_min=10", f"run_root={tmp_path}"]
        proc = run_cli("tracker=mlflow", f"tracker.mlflow_uri={uri}", *args, *TINY, cwd=tmp_path, env=clean_env())
    finally:
        mlflow.server.shutdown()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert mlflow.refused == 0 and mlflow.run["status"] == "FINISHED", (mlflow.refused, mlflow.run)
    assert sorted(m["step"] for m in mlflow.metrics if m["key"] == "train/loss") == [0, 1]
    assert_nowhere(PASSWORD, tmp_path, proc.stdout, proc.stderr)


def test_a_requeued_task_continues_its_mlflow_run_with_the_real_credential(tmp_path):
    """tracker.json keeps the URI as shown; the next attempt's Target maps it back to the real one from
    secrets.json (a fresh Target each attempt, as a requeued or resumed job makes)."""
    from slurm_router.config.secrets import hide, write_secrets
    from slurm_router.rundir.spec import TaskSpec
    from slurm_router.tracking.trackers import Target

    uri = f"postgresql://alice:{PASSWORD}@db.lab/mlflow"
    shown, found = hide({"seed": 0, "tracker": {"mlflow": True, "mlflow_uri": uri}})
    write_secrets(tmp_path / "secrets.json", {"config": found, "tasks": {"main": found}})
    spec = dict(run_id="r", run_dir=str(tmp_path), experiment="e", stage="variants", variant="main", index=0)
    spec.update(devices=1, steps=2, lr=0.1, global_batch_size=4, lora=True)
    target = Target.of(TaskSpec(name="main", config=shown, **spec))
    assert target.mlflow_uri == uri and target.config["tracker"]["mlflow_uri"] == "postgresql://alice:***@db.lab/mlflow"
    written = target.show(target.mlflow_uri)  # what MlflowLogger records in tracker.json
    assert PASSWORD not in written and Target.of(TaskSpec(name="main", config=shown, **spec)).real(written) == uri
    assert (tmp_path / "secrets.json").stat().st_mode & 0o077 == 0


def test_a_container_image_with_a_password_is_refused_in_one_line(tmp_path):
    """The job scripts hold the image as the runtime takes it: a password there would be readable by all."""
    image = f"docker://bob:{PASSWORD}@registry.lab/train:1"
    args = ["launcher=sbatch", f"launcher.container.image={image}", f"run_root={tmp_path / 'runs'}", "dry_run=true"]
    proc = run_cli(*args, cwd=tmp_path, env=clean_env(), timeout=300)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert err[0].startswith("error: launcher.container: ") and "APPTAINER_DOCKER_PASSWORD" in err[0], err[0]
    assert_nowhere(PASSWORD, tmp_path, proc.stdout, proc.stderr)
    assert not (tmp_path / "runs").exists()
