"""Nothing a user sets is silently ignored (issue 29, item 1): every data.* key of the composed config, for each
data source (conf/data/*.yaml), is either read (changing it changes the corpus built, or the error it gives) or
refused in one line naming it; Hydra's own settings are refused, pointing to ours; more CPU workers than cores
warn with the numbers."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from conftest import run_cli, run_dir_of

from slurm_router.cli.checks import tokenizer
from slurm_router.config.checks import check_data_keys, data_keys_read
from slurm_router.config.compose import compose
from slurm_router.config.schema import conf_dir
from slurm_router.errors import UserError
from slurm_router.train.data import build_corpus

KINDS = sorted(p.stem for p in Path(conf_dir(), "data").glob("*.yaml"))
# a value other than every source's default for each data.* key (the schema's DataConfig fields)
CHANGED = {
    "path": "/nonexistent/texts",
    "text_field": "body",
    "prompt_field": "prompt",
    "completion_field": "completion",
    "messages_field": "messages",
    "max_len": 16,
    "split_on": "\n",
    "val_fraction": 0.5,
    "max_documents": 3,
    "n_samples": 100,
    "length_dist": "uniform",
    "mean_len": 40,
    "sigma": 0.3,
    "min_len": 20,
}


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, list[str]]:
    """Each data source's overrides, on a small corpus (a few files or rows) so that building it is quick."""
    root = tmp_path_factory.mktemp("data")
    texts = root / "texts"
    texts.mkdir()
    for i in range(8):
        (texts / f"doc{i}.txt").write_text("\n\n".join(f"paragraph {j} of document {i}\nline two" for j in range(6)))
    rows = [{"text": f"row {i}\nsecond line\nthird line " * 4} for i in range(12)]
    jsonl = root / "rows.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    parquet = root / "rows.parquet"
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": [r["text"] for r in rows]}), parquet)
    return {
        "stdlib": ["data=stdlib", "data.max_documents=12"],
        "text_dir": ["data=text_dir", f"data.path={texts}"],
        "jsonl": ["data=jsonl", f"data.path={jsonl}"],
        "parquet": ["data=parquet", f"data.path={parquet}"],
        "synthetic": ["data=synthetic", "data.n_samples=200"],
    }


def _fingerprint(cfg) -> str:
    """What build_corpus made of cfg.data (every sample's bytes), or the one line it refused it with."""
    try:
        corpus = build_corpus(cfg.data, tokenizer(cfg))
    except UserError as e:
        return f"refused: {e}"
    h = hashlib.sha256(corpus.description.encode())
    for split in (corpus.train, corpus.val):
        for i in range(len(split)):
            h.update(split.sample(i).tobytes() + b"|")
    return h.hexdigest()


def test_the_data_sources_are_those_of_conf_data():
    assert KINDS == ["jsonl", "parquet", "stdlib", "synthetic", "text_dir"]


@pytest.mark.parametrize("kind", KINDS)
def test_every_data_key_is_read_or_refused(kind, sources):
    base = compose(sources[kind])
    check_data_keys(base.data)  # the source's own config passes
    before = _fingerprint(base)
    assert not before.startswith("refused"), before
    read = data_keys_read(base.data)
    keys = [k for k in base.data if k != "kind"]
    assert set(keys) <= {*CHANGED, "kind"}, f"a new data.* key: add it to CHANGED: {set(keys) - set(CHANGED)}"
    for key in keys:
        value = CHANGED[key]
        assert base.data[key] != value, key
        cfg = base.copy()
        cfg.data[key] = value
        if key in read:  # read: the corpus (or the error naming the key) changes
            check_data_keys(cfg.data)
            after = _fingerprint(cfg)
            assert after != before, f"data={kind}: data.{key} is said to be read but changes nothing"
        else:  # not read: refused in one line naming the key, the source and the fix
            with pytest.raises(UserError) as e:
                check_data_keys(cfg.data)
            line = str(e.value)
            assert line.startswith(f"data.{key}=") and f"is not read by data={kind}" in line, line
            assert "\n" not in line


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["data=synthetic", "data.length_dist=fixed", "data.sigma=0.3"], "sigma"),
        (["data=synthetic", "data.length_dist=fixed", "data.min_len=20"], "min_len"),
        (["data=synthetic", "data.length_dist=uniform", "data.sigma=0.3"], "sigma"),
    ],
)
def test_a_length_distribution_that_does_not_use_a_key_refuses_it(overrides, key):
    with pytest.raises(UserError, match=rf"^data\.{key}=.*data\.length_dist="):
        check_data_keys(compose(overrides).data)


def test_chat_or_prompt_rows_refuse_split_on(tmp_path):
    cfg = compose(["data=jsonl", "data.path=/x", "data.messages_field=messages", "data.split_on=zz"])
    with pytest.raises(UserError, match="a prompt/completion or chat row is one sample: drop data.split_on"):
        check_data_keys(cfg.data)


def test_the_data_line_names_only_what_was_read():
    cfg = compose(["data.max_documents=3"])
    assert build_corpus(cfg.data, tokenizer(cfg)).description == "the standard library"


@pytest.mark.parametrize(
    "args, expected",
    [
        (["data.path=/nonexistent/texts"], "data.path='/nonexistent/texts' is not read by data=stdlib"),
        (["data.path=/x", "data=synthetic"], "it is read by data=text_dir, data=jsonl, data=parquet"),
        (["hydra.run.dir=/tmp/out"], "hydra.run.dir=/tmp/out: runs are written under run_root"),
        (["hydra.job.chdir=true"], "hydra.job.chdir=true: the command never changes directory"),
        (["hydra/launcher=submitit_slurm"], "pick launcher=slurm (submitit)"),
        (["+hydra.verbose=true"], "Hydra's own settings are not read here"),
        (["-m", "hydra.sweep.dir=a,b", "train.lr=1e-3,2e-3"], "set run_root=a,b instead"),
        (["+experiment=lora_ab", "variants.r8.data.n_samples=5"], "variants.r8: data.n_samples=5 is not read"),
        # read only under another setting (config/unread.py; every key: tests/test_every_setting.py)
        (["base.steps=5"], "base.steps=5 is not read with base.enabled=false (no base stage)"),
        (["model.name_or_path=/tmp"], "model.name_or_path='/tmp' is not read by model.kind=gpt2"),
        (["train.pad_to_multiple=8"], "train.pad_to_multiple=8 is not read with train.packing=auto"),
        (["-m", "router.speed_ema=0.1,0.2"], "router.speed_ema=0.1 is not read with router.speed_model=robust"),
        (["+experiment=lora_ab", "model.lora.enabled=false"], "variants.r8: model.lora.r=8 is not read with"),
    ],
)
def test_the_command_refuses_what_it_would_ignore(args, expected, tmp_path):
    proc = run_cli(*args, f"run_root={tmp_path}/runs", "train.steps=1", cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.count("\n") == 1 and expected in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "runs").exists()


def test_model_vocab_size_is_the_vocabulary_trained(tmp_path):
    """model.vocab_size is the embedding the task trains (it was the memory preview's alone, while the worker
    built the tokenizer's 257 rows: conf/model/gpt2_small.yaml's 50257 trained an 85M model, not 124M); the
    output layer is tied, so each extra row adds n_embd parameters once."""
    counts = {}
    for vocab in (257, 300):
        runs = tmp_path / str(vocab)
        proc = run_cli(
            f"model.vocab_size={vocab}", "train.steps=1", "base.enabled=false", f"run_root={runs}", cwd=tmp_path
        )
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        (events,) = run_dir_of(proc).glob("tasks/*/events-rank0.jsonl")
        (start,) = [r for r in map(json.loads, events.read_text().splitlines()) if r["event"] == "start"]
        counts[vocab] = start["n_params"]
    assert counts[300] - counts[257] == (300 - 257) * 128  # model.n_embd of conf/model/gpt2_tiny.yaml
    small = run_cli("model.vocab_size=100", f"run_root={tmp_path}/runs", cwd=tmp_path)
    assert small.returncode == 2 and small.stderr.count("\n") == 1, small.stderr
    assert "model.vocab_size=100 is smaller than the byte-level tokenizer's 257 tokens" in small.stderr


def test_more_cpu_workers_than_cores_warn_with_the_numbers(monkeypatch, capsys):
    from slurm_router.backends.local import launcher as local

    monkeypatch.setattr(local, "detect_gpus", lambda: [])
    monkeypatch.setattr(local.os, "cpu_count", lambda: 2)
    local.check_devices(compose(["resources.devices_per_task=4"]))
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "warning: resources.devices_per_task=4 starts 4 CPU worker processes per task on 2 cores" in err
    assert "launcher.cpu_slots=4" in err
    local.check_devices(compose(["resources.devices_per_task=4", "launcher.cpu_slots=4"]))  # meant: no warning
    local.check_devices(compose(["resources.devices_per_task=2"]))
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    "override, shown",
    [
        ("launcher.container.mounts=[/scratch]", "launcher.container.mounts=['/scratch']"),
        ("launcher.container.runtime=pyxis", "launcher.container.runtime='pyxis'"),
        ("launcher.container.runtime_cmd=/opt/apptainer", "launcher.container.runtime_cmd='/opt/apptainer'"),
    ],
)
def test_container_settings_without_an_image_are_refused(override, shown):
    from slurm_router.config.variants import validate

    with pytest.raises(UserError) as e:
        validate(compose(["launcher=slurm", override]))
    assert (
        str(e.value)
        == f"{shown} is not read without launcher.container.image (no container): set the image, or drop it"
    )


def test_settings_one_kind_of_machine_reads_warn_on_the_other(monkeypatch, capsys):
    from slurm_router.backends.local import launcher as local

    monkeypatch.setattr(local, "detect_gpus", lambda: ["0", "1"])
    local.check_devices(compose(["launcher.cpu_slots=4"]))
    err = capsys.readouterr().err
    assert err == (
        "warning: launcher.cpu_slots=4 is not read: this machine has 2 GPU(s) and the tasks run on them "
        "(cpu_slots counts CPU workers where there is no GPU)\n"
    )
    monkeypatch.setattr(local, "detect_gpus", lambda: [])
    monkeypatch.setattr(local.os, "cpu_count", lambda: 4)
    local.check_devices(compose(["resources.tasks_per_gpu=2"]))
    assert capsys.readouterr().err.startswith("warning: resources.tasks_per_gpu=2 is not read: there is no GPU here")
