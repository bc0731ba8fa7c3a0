"""A stand-in container runtime for tests (neither apptainer nor pyxis installs here): a real program that
checks `exec [--nv] [--bind SRC[,SRC...]] IMAGE COMMAND...` the way apptainer takes it, records the call, and
then execs COMMAND as apptainer would run it in the image, where Slurm's client is missing: `scontrol` and
`squeue` on its PATH record the attempt and fail (exit 127), as in most images.

    install_fake_apptainer(folder) -> path of the `fake-apptainer` program
    calls(folder) -> the recorded calls (argv, cwd, env it saw, where slurm_router imports from)
    slurm_calls(folder) -> the Slurm commands tried inside
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

PROGRAM = r"""#!{python}
import json, os, subprocess, sys
HERE = os.path.dirname(os.path.abspath(__file__))
args, errors = sys.argv[1:], []
if not args or args[0] != "exec":
    sys.exit(f"fake-apptainer: expected 'exec', got {{args[:1]}}")
i, nv, binds = 1, False, []
while i < len(args) and args[i].startswith("--"):
    if args[i] == "--nv":
        nv, i = True, i + 1
    elif args[i] == "--bind":
        binds, i = args[i + 1].split(","), i + 2
    else:
        sys.exit(f"fake-apptainer: unknown option {{args[i]}}")
image, command = args[i], args[i + 1:]
if not os.path.isfile(image):
    errors.append(f"no image {{image}}")
errors += [f"bind {{b}} does not exist" for b in binds if not os.path.exists(b.split(":")[0])]
if not command:
    errors.append("no command after the image")
env = {{**os.environ, "PATH": os.path.join(HERE, "no-slurm") + os.pathsep + os.environ.get("PATH", "")}}
where = subprocess.run([command[0], "-c", "import slurm_router; print(slurm_router.__file__)"], env=env,
                       capture_output=True, text=True).stdout.strip() if command else ""
keep = ("SETUP_MARK", "PYTHONPATH", "SLURM_ROUTER_REQUEUE_REQUEST", "SLURM_ROUTER_COLOCATED", "SLURM_RESTART_COUNT",
        "SLURM_ROUTER_JOB_END_TIME")
with open(os.path.join(HERE, "calls.jsonl"), "a") as f:
    f.write(json.dumps({{"argv": sys.argv, "nv": nv, "binds": binds, "image": image, "command": command,
                        "cwd": os.getcwd(), "env": {{k: os.environ.get(k) for k in keep}},
                        "slurm_router": where, "errors": errors}}) + "\n")
if errors:
    sys.exit("fake-apptainer: " + "; ".join(errors))
os.execvpe(command[0], command, env)
"""

NO_SLURM = r"""#!/bin/sh
echo "$(basename "$0") $*" >> "{record}"
echo "$(basename "$0"): command not found (inside the image)" >&2
exit 127
"""


def install_fake_apptainer(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    program = folder / "fake-apptainer"
    program.write_text(PROGRAM.format(python=sys.executable))
    program.chmod(0o755)
    (folder / "no-slurm").mkdir(exist_ok=True)
    for name in ("scontrol", "squeue", "sbatch"):
        tool = folder / "no-slurm" / name
        tool.write_text(NO_SLURM.format(record=folder / "slurm-inside.txt"))
        tool.chmod(0o755)
    return program


def calls(folder: Path) -> list[dict]:
    path = folder / "calls.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def slurm_calls(folder: Path) -> list[str]:
    path = folder / "slurm-inside.txt"
    return path.read_text().splitlines() if path.is_file() else []
