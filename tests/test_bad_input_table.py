"""Bad input, systematically: every row is a bad configuration, file or run directory, and each must exit 2
with one line on stderr naming the problem, no traceback, and nothing written (no run directory).

The command's own main() runs in process (the same code path as `python -m slurm_router ARGS`, minus
interpreter start-up: ~0.1 s a row instead of ~3 s); tests/test_bad_input.py covers the real subprocess.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from pathlib import Path

import pytest
from conftest import run_cli

from slurm_router.__main__ import main
from slurm_router.config.compose import compose

FAST = ["train.steps=1"]  # (base.steps= would be refused where no base stage trains)


def _safetensors(path: Path, cut: int = 0) -> None:
    """A tiny whole safetensors file (one float32 tensor of 4), less its last `cut` bytes."""
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    data = len(header).to_bytes(8, "little") + header + bytes(16)
    path.write_bytes(data[: len(data) - cut])


def _checkpoint(root: Path, name: str, config: dict | None = None, weights: str = "whole") -> Path:
    """A local model=hf checkpoint without tokenizer files; weights: whole, cut, none."""
    d = root / name
    d.mkdir()
    if config is not None:
        (d / "config.json").write_text(json.dumps(config))
    if weights != "none":
        _safetensors(d / "model.safetensors", cut=5 if weights == "cut" else 0)
    return d


def _files(root: Path) -> dict[str, Path]:
    """Bad data files and run directories, made once per test in its tmp dir."""
    root.mkdir()
    (root / "emptydir").mkdir()
    (root / "a.txt").write_text("hello\n")
    (root / "empty.jsonl").write_bytes(b"")
    (root / "binary.jsonl").write_bytes(bytes(range(256)) * 40)
    (root / "latin1.jsonl").write_bytes('{"text": "caf\xe9"}\n'.encode("latin-1"))
    (root / "array.jsonl").write_text("[1, 2]\n")
    (root / "number.jsonl").write_text('{"text": 5}\n')
    (root / "dangling").mkdir()
    (root / "dangling" / "x.txt").symlink_to(root / "nowhere.txt")
    (root / "locked").mkdir()
    (root / "locked" / "x.txt").write_text("secret text\n\n" * 50)
    os.chmod(root / "locked" / "x.txt", 0)
    (root / "hf").mkdir()
    (root / "hf" / "config.json").write_text("{}")
    # JSON Lines that are valid JSON but not one object with a text field a line; unreadable files
    (root / "null.jsonl").write_text("null\n")
    (root / "string.jsonl").write_text('{"text": "fine"}\n"just a string"\n')
    (root / "nofield.jsonl").write_text('{"body": "x", "id": 1}\n')
    (root / "deep.jsonl").write_text("[" * 100_000 + "\n")
    (root / "dangling.jsonl").symlink_to(root / "nowhere.jsonl")
    (root / "io.jsonl").symlink_to("/proc/self/mem")  # reading it fails: Input/output error
    (root / "ioerror").mkdir()
    (root / "ioerror" / "a.txt").write_text("some text\n\n" * 50)
    (root / "ioerror" / "b.txt").symlink_to("/proc/self/mem")
    (root / "gone_link").symlink_to(root / "gone")
    # local checkpoints, each missing one thing (none has tokenizer files)
    gpt2 = {"model_type": "gpt2", "n_positions": 1024}
    _checkpoint(root, "hf_notok", gpt2)
    _checkpoint(root, "hf_noweights", gpt2, weights="none")
    _checkpoint(root, "hf_cut", gpt2, weights="cut")
    _checkpoint(root, "hf_noconfig", None)
    _checkpoint(root, "hf_short", {"model_type": "gpt2", "n_positions": 16})
    _checkpoint(root, "hf_t5", {"model_type": "t5"})  # whole, but not a causal LM
    _checkpoint(
        root,
        "hf_llama",
        {
            "model_type": "llama",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "vocab_size": 512,
        },
    )
    (_checkpoint(root, "hf_bin", gpt2, weights="none") / "pytorch_model.bin").write_bytes(b"PK\x03\x04" + bytes(64))
    shards = _checkpoint(root, "hf_shards", gpt2, weights="none")
    (shards / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": "model-00001-of-00002.safetensors", "v": "model-00002-of-00002.safetensors"}})
    )
    _safetensors(shards / "model-00001-of-00002.safetensors")
    (root / "not_a_run").mkdir()
    (root / "broken_run").mkdir()
    (root / "broken_run" / "manifest.json").write_text("{not json")
    (root / "no_config_run").mkdir()
    (root / "no_config_run" / "manifest.json").write_text(json.dumps({"stages": [], "tasks": {}}))
    _format_files(root)
    _config_dirs(root)
    return {p.name: p for p in root.iterdir()}


def _config_dirs(root: Path) -> None:
    """The user's own config folders (--config-dir, issue 41 item 1), each with one thing wrong."""
    files = {
        "cd_typo/experiment/mine.yaml": "# @package _global_\ntrain:\n  lrr: 1\n",
        "cd_nopkg/experiment/mine.yaml": "experiment: mine\ntrain:\n  steps: 2\n",
        "cd_shadow/experiment/lora_ab.yaml": "# @package _global_\ntrain:\n  steps: 2\n",
        "cd_group/modle/big.yaml": "n_layer: 4\n",
        "cd_yaml/experiment/broken.yaml": "# @package _global_\ntrain: [steps: 2\n",
        "cd_root/config.yaml": "seed: 1\n",
        "cd_root/experiment/mine.yaml": "# @package _global_\n",
        "cd_hot/experiment/hot.yaml": "# @package _global_\ntrain:\n  lr: 50\n",
        # issue 50, 5 and 6: a typo inside a variant of the file; a variants map with no variant
        "cd_vtypo/experiment/mine.yaml": "# @package _global_\nvariants:\n  a:\n    train: {lrr: 1}\n",
        "cd_novariant/experiment/mine.yaml": "# @package _global_\nexperiment: mine\nvariants: {}\n",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def _format_files(root: Path) -> None:
    """Prompt/completion, chat and parquet data (issue 13), each with one thing wrong."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def jsonl(name, *rows):
        (root / name).write_text("".join(json.dumps(r) + "\n" for r in rows))

    jsonl("pc_nofield.jsonl", {"prompt": "a", "completion": "b"}, {"prompt": "c", "answer": "d"})
    jsonl("chat.jsonl", {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
    jsonl(
        "chat_role.jsonl",
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "yo"}]},
    )
    jsonl("chat_content.jsonl", {"messages": [{"role": "user", "content": ["hi"]}]})
    jsonl("long_prompts.jsonl", *[{"prompt": "x" * 40, "completion": "y"}] * 5)
    pq.write_table(pa.table({"body": ["x", "y"]}), root / "nocol.parquet")
    pq.write_table(pa.table({"text": ["fine", None]}), root / "nulls.parquet")
    (root / "corrupt.parquet").write_bytes(b"PAR1" + bytes(200) + b"PAR1")


# (arguments, what the one line must say). {name} is a file or folder from _files() (or SPECIAL), in both.
# FAST is appended unless the row sets train.steps itself or is a resume= row (which takes no other arguments);
# run_root= unless the row sets its own, which must then hold nothing of a run either.
CASES = [
    # out of range, wrong type, absurd sizes
    (["train.steps=0"], "train.steps=0 is out of range"),
    (["train.steps=1.5"], "train.steps: Value '1.5'"),
    (["train.steps=[1,2]"], "train.steps"),
    (["train.steps=99999999999999999999"], "train.steps"),
    (["train.global_batch_size=-3"], "train.global_batch_size=-3 is out of range"),
    (["train.checkpoint_every=-1"], "train.checkpoint_every=-1 is out of range"),
    (["train.keep_checkpoints=0"], "train.keep_checkpoints=0 is out of range"),
    (["train.precision=fp8"], "choose one of auto, fp32, bf16"),
    (["train.lr=nan"], "train.lr=nan is not a number"),
    (["train.lr=inf"], "train.lr=inf is out of range"),
    (["data.val_fraction=1.5"], "data.val_fraction=1.5 is out of range"),
    (["data.max_len=1"], "data.max_len=1 is out of range"),
    (["data.max_len=100000000"], "data.max_len=100000000 is out of range"),
    (["data=synthetic", "data.n_samples=999999999999"], "data.n_samples=999999999999 is out of range"),
    (["data=synthetic", "data.mean_len=2000000"], "data.mean_len=2000000 is out of range"),
    (["data.max_documents=0"], "data.max_documents=0 is out of range"),
    (["model.n_layer=100000"], "model.n_layer=100000 is out of range"),
    (["model.lora.dropout=2"], "model.lora.dropout=2.0 is out of range"),
    (["model.lora.target_modules=[]"], "model.lora.target_modules is empty"),
    (
        ["model.lora.target_modules=[nosuchlayer]"],
        "'nosuchlayer' is not a layer of GPT2LMHeadModel that LoRA can "
        "adapt: its layers are wte, wpe, c_attn, c_proj, c_fc, lm_head",
    ),
    (["model.lora.target_modules=5"], "model.lora.target_modules=5 is not valid: use auto"),
    (["router.memory_headroom=0"], "router.memory_headroom=0.0 is out of range"),
    (["router.memory_headroom=1.5"], "router.memory_headroom=1.5 is out of range: it must be > 0 and <= 1"),
    # testing aids are environment variables (slurm_router/config/testing_aids.py), never a user's setting
    (["router.device_slowdown=[1,3]"], "the environment variable SLURM_ROUTER_TEST_DEVICE_SLOWDOWN"),
    (
        ["+variants.v.router.cpu_memory_cap_bytes=1000"],
        "variants.v: router.cpu_memory_cap_bytes is no setting: it is a testing aid",
    ),
    (["router.affinity_boundaries=[64,32]"], "strictly increasing"),
    (["router.speed_model=fast"], "router.speed_model='fast' is not valid: choose one of robust, ema, none"),
    (["launcher=sbatch", "launcher.dry_run=true", "launcher.timeout_min=0"], "launcher.timeout_min=0 is out of range"),
    (
        ["launcher=sbatch", "launcher.dry_run=true", "launcher.max_requeues=-1"],
        "launcher.max_requeues=-1 is out of range",
    ),
    (
        ["launcher=sbatch", "launcher.dry_run=true", "launcher.max_failures=-1"],
        "launcher.max_failures=-1 is out of range",
    ),
    (["launcher.max_failures=2"], "launcher.max_failures does not apply to launcher=local"),
    (["resources.nodes_per_task=2", "resources.devices_per_task=2"], "launcher=local runs on this machine only"),
    (
        ["launcher=sbatch", "launcher.dry_run=true", "resources.nodes_per_task=2", "resources.devices_per_task=2"],
        "resources.nodes_per_task=2 needs launcher.srun_workers=true",
    ),
    (
        [
            "launcher=sbatch",
            "launcher.dry_run=true",
            "launcher.srun_workers=true",
            "resources.nodes_per_task=2",
            "resources.devices_per_task=3",
        ],
        "resources.devices_per_task=3 does not split evenly over",
    ),
    (
        [
            "launcher=slurm",
            "launcher.srun_workers=true",
            "resources.nodes_per_task=2",
            "resources.devices_per_task=2",
            "+variants.a.resources.devices_per_task=1",
        ],
        "variants.a.resources.devices_per_task=1 does not split evenly",
    ),
    (
        [
            "launcher=sbatch",
            "launcher.dry_run=true",
            "launcher.srun_workers=true",
            "resources.devices_per_task=2",
            "+variants.a.resources.nodes_per_task=2",
        ],
        "variants.a.resources.nodes_per_task: it is set once",
    ),
    (
        ["launcher=sbatch", "launcher.dry_run=true", "resources.nodes_per_task=0"],
        "resources.nodes_per_task=0 is out of range",
    ),
    (
        ["launcher=sbatch", "launcher.dry_run=true", "launcher.signal_delay_s=99999"],
        "launcher.signal_delay_s=99999 is out of range",
    ),
    (["seed=-1"], "seed=-1 is out of range"),
    (["resources.devices_per_task=100000"], "resources.devices_per_task=100000 is out of range"),
    # unknown options and keys, wrong shapes
    (["launcher=nope"], "launcher=nope: no such launcher in conf/launcher/; choose one of: local, sbatch, slurm"),
    (["model=nope"], "model=nope: no such model"),
    (["train.nope=1"], "unknown key 'train.nope'"),
    (["variants=5"], "variants"),
    (["+variants.x=3"], "variants.x must be a mapping of overrides"),
    (["+variants.x.variants.y.train.lr=1"], "a variant cannot declare variants"),
    (["+variants.base.train.lr=1"], "'base' is the name of the base stage"),
    (["launcher=sbatch", "launcher.dry_run=true", "+launcher.additional_parameters.bad_key=1"], "extra_sbatch key"),
    # an option of another launcher, or of none; a dotted key under a plain value
    (
        ["launcher=slurm", "launcher.dry_run=true"],
        "launcher.dry_run does not apply to launcher=slurm: it is an option of launcher=sbatch only",
    ),
    (
        ["launcher.partition=gpu"],
        "launcher.partition does not apply to launcher=local: it is an option of launcher=slurm, launcher=sbatch only",
    ),
    (["+launcher.partition=gpu"], "launcher.partition does not apply to launcher=local"),
    (["launcher=slurm", "launcher.cpu_slots=2"], "it is an option of launcher=local only"),
    (["launcher=sbatch", "launcher.nope=1"], "unknown key 'launcher.nope': valid keys for launcher=sbatch are"),
    # job setup, containers, mail (issue 15): the Slurm launchers' options, checked before anything is written
    (
        ["launcher.setup=[module load cuda]"],
        "launcher.setup does not apply to launcher=local: it is an option of launcher=slurm, launcher=sbatch only",
    ),
    (
        ["launcher=sbatch", "launcher.dry_run=true", "launcher.container.image={a.txt}.missing.sif"],
        "launcher.container.image='{a.txt}.missing.sif': no such image file",
    ),
    (
        ["launcher=slurm", "launcher.container.image={a.txt}", "launcher.container.runtime=docker"],
        "launcher.container.runtime='docker' is not valid: choose one of apptainer, pyxis",
    ),
    (["launcher=sbatch", "launcher.dry_run=true", "launcher.mail_type=[END,FIAL]"], "'FIAL' is not a Slurm mail type"),
    (["launcher=slurm", "launcher.mail_type=sometimes"], "'SOMETIMES' is not a Slurm mail type"),
    (
        [
            "launcher=sbatch",
            "launcher.dry_run=true",
            "launcher.container.image={a.txt}",
            "launcher.container.mounts=['/data,/more']",
        ],
        "launcher.container: launcher.container.mounts entry",
    ),
    (["launcher=sbatch", "launcher.dry_run=true", "launcher.python="], "launcher.python is empty"),
    (
        ["experiment.seeds=2"],
        "experiment is a string, the experiment's name, set by conf/experiment/NAME.yaml: "
        "pick one with +experiment=NAME",
    ),
    (["experiment=lora_ab"], "pick one with +experiment=NAME"),
    (["train.lr.x=1"], "train.lr is a number and has no keys under it: set train.lr=VALUE"),
    # hostile names: never run by a shell, never a path outside the run dir
    (["+variants.$(touch pwned).train.lr=1"], "cannot read the override '+variants.$(touch pwned)"),
    (["+variants.../escape.train.lr=1"], "+variants."),
    (["+variants.a b.train.lr=1"], "+variants.a"),
    (["+experiment=../lora_ab"], "experiment"),
    # files: missing, empty, binary, not UTF-8, wrong shape, unreadable, not what was asked for
    (["data=text_dir", "data.path={emptydir}"], "has no training text"),
    (["data=text_dir", "data.path={a.txt}"], "is not a folder"),
    (["data=text_dir", "data.path={dangling}"], "x.txt is a dangling symbolic link (to "),
    (["data=text_dir", "data.path={locked}"], "locked"),
    (["data=jsonl", "data.path={empty.jsonl}"], "has no training text"),
    (["data=jsonl", "data.path={binary.jsonl}"], "is not UTF-8"),
    (["data=jsonl", "data.path={latin1.jsonl}"], "is not UTF-8"),
    (["data=jsonl", "data.path={array.jsonl}"], "array.jsonl is a JSON array, not an object with a 'text' field"),
    (["data=jsonl", "data.path={null.jsonl}"], "line 1 of {null.jsonl} is a JSON null, not an object"),
    (["data=jsonl", "data.path={string.jsonl}"], "line 2 of {string.jsonl} is a JSON string, not an object"),
    (["data=jsonl", "data.path={number.jsonl}"], "field 'text' is a number, not a string"),
    (
        ["data=jsonl", "data.path={nofield.jsonl}"],
        "has no field 'text' (its fields: 'body', 'id'): set data.text_field",
    ),
    (["data=jsonl", "data.path={deep.jsonl}"], "is JSON nested too deeply to read"),
    (["data=jsonl", "data.path={emptydir}"], "is a folder, not a file"),
    (["data=jsonl", "data.path={dangling.jsonl}"], "is a dangling symbolic link (to "),
    (["data=jsonl", "data.path={io.jsonl}"], "io.jsonl cannot be read (Input/output error)"),
    (["data=text_dir", "data.path={ioerror}"], "b.txt cannot be read (Input/output error)"),
    # local checkpoints: each missing piece named before anything is written (workers would find it later)
    (["model=hf", "model.name_or_path={hf}"], "has no model weights (none of model.safetensors"),
    (["model=hf", "model.name_or_path={hf_noweights}"], "hf_noweights has no model weights"),
    (
        ["model=hf", "model.name_or_path={hf_cut}"],
        "model.safetensors is truncated or damaged (81 bytes; its header declares 86)",
    ),
    (["model=hf", "model.name_or_path={hf_bin}"], "pytorch_model.bin is truncated (not a whole zip file)"),
    (["model=hf", "model.name_or_path={hf_shards}"], "model-00002-of-00002.safetensors is missing (1 of the 2 shards"),
    (["model=hf", "model.name_or_path={hf_noconfig}"], "hf_noconfig has no config.json"),
    (["model=hf", "model.name_or_path={hf_short}"], "data.max_len=256 exceeds the n_positions=16 of"),
    (
        ["model=hf", "model.name_or_path={hf_notok}"],
        "hf_notok has no tokenizer (none of tokenizer.json, tokenizer_config.json",
    ),
    (
        ["model=hf", "model.name_or_path={hf_t5}"],
        "the checkpoint is a t5 model (T5Config), not a causal language model AutoModelForCausalLM can load",
    ),
    (
        ["model=hf", "model.name_or_path={hf_llama}", "model.lora.target_modules=[q_proj,c_attn]"],
        "model.lora.target_modules: 'c_attn' is not a layer of LlamaForCausalLM that LoRA can adapt: its layers are "
        "embed_tokens, q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, lm_head",
    ),
    (
        [
            "model=hf",
            "model.name_or_path={hf_llama}",
            "+variants.attn.model.lora.target_modules=[wq,wv]",
            "+variants.linear.model.lora.target_modules=all-linear",
        ],
        "variants.attn: model.lora.target_modules: 'wq' is not a layer of LlamaForCausalLM",
    ),
    # run_root that cannot hold a run: found before anything is written (one line naming the path and the cause)
    (["run_root=/proc/slurm_router_test"], "run_root='/proc/slurm_router_test': cannot write in /proc"),
    (["run_root={a.txt}"], "a.txt is a file, not a folder: set run_root= to a folder you can write"),
    (["run_root={a.txt}/sub/dir"], "a.txt is a file, not a folder"),
    (["run_root={gone_link}"], "gone_link is a dangling symbolic link"),
    (["run_root={readonly}"], "readonly ("),
    (["run_root={tiny_fs}", "data=synthetic", "data.n_samples=64"], "No space left on device"),
    # base.cache_dir that cannot take the base weights: found before anything trains (or is written)
    (["base.enabled=true", "base.cache_dir={a.txt}"], "a file, not a folder"),
    (["base.enabled=true", "base.cache_dir={readonly}"], "base.cache_dir="),
    (["base.enabled=true", "base.cache_dir={tiny_fs}"], "weights need about"),
    # a typo in a variant's name never adds a variant; dict-valued overrides as Hydra users write them
    (
        ["+experiment=lora_ab", "variants.r9.train.lr=1e-3"],
        "variants.r9.train.lr=1e-3: the experiment has no "
        "variant 'r9' (its variants: r8, r32): fix the name, or add a new variant on purpose with "
        "+variants.r9.train.lr=1e-3",
    ),
    (["variants.r9.train.lr=1e-3"], "no variant 'r9' (it has none)"),
    (
        ["+experiment=lora_ab", "variants={r9: {train: {lr: 1e-3}}}"],
        "no variant 'r9' (its variants: r8, r32): fix the name, or add a new variant on purpose with ++variants=",
    ),
    (["launcher.additional_parameters={nice: 10}"], "launcher.additional_parameters does not apply to launcher=local"),
    (["launcher=sbatch", "launcher.dry_run=true", "launcher.additional_parameters={bad_key: 1}"], "extra_sbatch key"),
    (
        ["launcher=sbatch", "launcher.dry_run=true", "launcher.additional_parameters=5"],
        "launcher.additional_parameters: Cannot assign int",
    ),
    (["train.lr=[1"], "cannot read the override 'train.lr=[1'"),
    # resume= of something that is not a resumable run
    (["resume=/nonexistent/run"], "no such directory"),
    (["resume="], "resume= needs a run directory"),
    (["resume={not_a_run}"], "no manifest.json there"),
    (["resume={broken_run}"], "the manifest is damaged"),
    (["resume={no_config_run}"], "config.yaml is missing or damaged"),
    (["resume={broken_run}", "train.steps=3"], "takes no other arguments"),
    # resume=RUN_DIR new_snapshot=true (issue 31): only with resume=, only true or false, not with launcher=local
    (["new_snapshot=true"], "new_snapshot=true goes with resume=RUN_DIR"),
    (["resume={broken_run}", "new_snapshot=maybe"], "new_snapshot=maybe: new_snapshot is true or false"),
    (
        ["resume={broken_run}", "new_snapshot=true", "launcher=local"],
        "with launcher=local the tasks run this checkout as it is: drop one of the two",
    ),
    # prompt/completion, chat and parquet data (issue 13): found by build_corpus before anything is written
    (
        ["data=jsonl", "data.path={pc_nofield.jsonl}", "data.prompt_field=prompt", "data.completion_field=completion"],
        "line 2 of {pc_nofield.jsonl} has no field 'completion' (its fields: 'prompt', 'answer'): set "
        "data.completion_field",
    ),
    (
        [
            "model=hf",
            "model.name_or_path={llama}",
            "data=jsonl",
            "data.path={chat_role.jsonl}",
            "data.messages_field=messages",
        ],
        "line 2 of {chat_role.jsonl}: message 2 has the role 'bot', not one of system, user, assistant, tool",
    ),
    (
        [
            "model=hf",
            "model.name_or_path={llama}",
            "data=jsonl",
            "data.path={chat_content.jsonl}",
            "data.messages_field=messages",
        ],
        "line 1 of {chat_content.jsonl}: message 1 (user) has content that is an array, not a string",
    ),
    (
        [
            "model=hf",
            "model.name_or_path={llama_nochat}",
            "data=jsonl",
            "data.path={chat.jsonl}",
            "data.messages_field=messages",
        ],
        "has no chat template, which data.messages_field needs: save one beside it",
    ),
    (
        ["data=jsonl", "data.path={chat.jsonl}", "data.messages_field=messages"],
        "model=gpt2 models (a byte-level tokenizer) have none: use model=hf",
    ),
    (
        [
            "data=jsonl",
            "data.path={long_prompts.jsonl}",
            "data.prompt_field=prompt",
            "data.completion_field=completion",
            "data.max_len=16",
        ],
        "no training sample is left: data.max_len=16 cuts every target token out of 5 sample(s)",
    ),
    (
        ["data=jsonl", "data.path={chat.jsonl}", "data.prompt_field=prompt"],
        "data.prompt_field=prompt needs data.completion_field too",
    ),
    (
        [
            "data=jsonl",
            "data.path={chat.jsonl}",
            "data.messages_field=messages",
            "data.prompt_field=p",
            "data.completion_field=c",
        ],
        "set only one of data.text_field (plain text), data.prompt_field + "
        "data.completion_field, data.messages_field (chat)",
    ),
    (
        ["data.messages_field=messages"],
        "data.messages_field='messages' is not read by data=stdlib, so it would be ignored: it is read by data=jsonl, data=parquet",
    ),
    (["data=parquet"], "data.path is required with data=parquet"),
    (
        ["data=parquet", "data.path={nocol.parquet}"],
        "{nocol.parquet} has no column 'text' (its columns: 'body'): set data.text_field",
    ),
    (["data=parquet", "data.path={nulls.parquet}"], "row 2 of {nulls.parquet}: field 'text' is null, not a string"),
    (["data=parquet", "data.path={emptydir}"], "is a folder with no .parquet files"),
    (["data=parquet", "data.path={corrupt.parquet}"], "{corrupt.parquet} is not a readable parquet file ("),
    # seed replicates (issue 14): seeds=N or a list of distinct whole numbers >= 0, set once at the top level
    (["seeds=0"], "seeds=0 is out of range: it must be >= 1 and <= 1000"),
    (["seeds=-2"], "seeds=-2 is out of range"),
    (["seeds=[]"], "seeds=[] is empty: give at least one seed"),
    (["seeds=[0,5,0]"], "seeds=[0,5,0]: seed 0 is listed twice"),
    (["seeds=1.5"], "seeds=1.5 is not a whole number: seeds=N (N training seeds from seed on), a list"),
    (["seeds=auto"], "seeds=auto adds replicates only where the prune contest is undecided: set prune=true"),
    (["seeds=auto", "prune=true", "auto_seeds.max=2"], "auto_seeds.max=2: seeds=auto starts each variant with 2"),
    (["seeds=auto", "prune=true", "auto_seeds.min_effect=0"], "auto_seeds.min_effect=0: give the smallest difference"),
    (["seeds=3", "auto_seeds.min_effect=0.02"], "auto_seeds.min_effect=0.02 is not read with seeds=3"),
    (["seeds=three"], "seeds='three' is not a whole number"),
    (["seeds=[0,x]"], "seeds=[0,x]: 'x' is not a whole number >= 0"),
    (["seeds=[1,-1]"], "seeds=[1,-1]: -1 is not a whole number >= 0"),
    (["seeds=5000"], "seeds=5000 is out of range"),
    (["+experiment=lora_ab", "variants.r8.seeds=2"], "variants.r8.seeds: seeds is set once, at the top level"),
    # prune=true (issue 14): decided at in-training evaluations, between variants, set once at the top level
    (["+experiment=lora_ab", "prune=true", "train.eval_every=5"], "prune=true needs seeds >= 2 (e.g. seeds=3)"),
    (
        ["+experiment=lora_ab", "prune=true", "seeds=2", "train.eval_every=0"],
        "error: prune=true needs train.eval_every > 0 and below train.steps=",
    ),
    (
        ["+experiment=lora_ab", "prune=true", "seeds=2", "train.steps=10", "variants.r8.train.eval_every=10"],
        "variants.r8: prune=true needs train.eval_every > 0 and below train.steps=10",
    ),
    (["prune=true", "train.eval_every=5"], "prune=true compares variants with each other, and this run has one"),
    (["+experiment=lora_ab", "+variants.r8.prune=true"], "variants.r8.prune: prune is set once, at the top level"),
    (["experiment.prune=true"], "seeds= and prune= are set at the top level"),
    (["prune=maybe"], "prune"),
    # Hydra sweeps (issue 14): -m expands the grid; each bad sweep is a line naming its override
    (["train.lr=1e-3,3e-3"], "train.lr=1e-3,3e-3 is a sweep (several values): add -m"),
    (["-m", "train.lr=3e-3"], "-m (--multirun) needs at least one sweep override to expand"),
    (["--multirun", "train.steps=2"], "-m (--multirun) needs at least one sweep override"),
    (["-m", "train.lr=range(1,"], "cannot read the override 'train.lr=range(1,'"),
    (["-m", "train.lr=choice(1e-3"], "cannot read the override 'train.lr=choice(1e-3'"),
    (["-m", "train.lr=range(a,b)"], "cannot read the override 'train.lr=range(a,b)'"),
    (["-m", "train.lr=range(3,1)"], "train.lr=range(3,1): the sweep has no values"),
    (["-m", "train.lr=interval(0,1)"], "train.lr=interval(0,1): interval() draws from a continuous range"),
    (
        ["-m", "train.nope=1,2"],
        "train.nope=1,2: unknown key 'train.nope': valid keys under train are checkpoint_every, compile,",
    ),
    (
        ["-m", "model.lora.rank=4,8"],
        "model.lora.rank=4,8: unknown key 'model.lora.rank': valid keys under "
        "model.lora are alpha, dropout, enabled, r,",
    ),
    (["-m", "lr=1e-3,3e-3"], "lr=1e-3,3e-3: unknown key 'lr': valid keys at the top level are"),
    (["-m", "train.steps=1.5,2"], "train.steps=1.5,2: train.steps: Value '1.5' of type 'float' could not be converted"),
    (["-m", "train.lr.x=1,2"], "train.lr.x=1,2: train.lr is a number and has no keys under it"),
    (["-m", "train.lr=0.001,1e-3"], "train.lr=0.001,1e-3: two of its values give the variant name part 'lr1e-3'"),
    (
        ["-m", "data=text_dir", "data.path='a/b','a b'"],
        "data.path='a/b','a b': two of its values give the variant name part 'path-a-b'",
    ),
    (
        ["-m", "+experiment=lora_ab", "+variants.r8_path-a.train.lr=1e-3", "data=text_dir", "data.path=a_path-c,c"],
        "gives two variants named 'r8_path-a_path-c'",
    ),
    (["-m", "train.lr=1e-3,3e-3", "train.lr=1e-4,3e-4"], "train.lr=1e-4,3e-4: train.lr is swept twice"),
    (["-m", "train.lr=1e-3,3e-3", "train.lr=1e-4"], "train.lr=1e-3,3e-3: train.lr is also set to one value"),
    (["-m", "launcher=local,sbatch"], "launcher=local,sbatch: launcher cannot be swept: a run has one launcher"),
    (
        ["-m", "+experiment=lora_ab,other"],
        "+experiment=lora_ab,other: experiment cannot be swept: one experiment per run",
    ),
    (
        ["-m", "+experiment=lora_ab", "base.steps=10,20"],
        "base.steps=10,20: base.steps cannot be swept: the base stage is trained once",
    ),
    (["-m", "seeds=1,3"], "seeds=1,3: seeds cannot be swept"),
    (["-m", "prune=true,false"], "prune=true,false: prune cannot be swept: prune compares the variants"),
    (
        ["-m", "tracker=tensorboard,mlflow"],
        "tracker=tensorboard,mlflow: tracker cannot be swept: a run's trackers log "
        "every variant: name several at once, e.g. tracker=[tensorboard,mlflow]",
    ),
    (["-m", "seed=1,3"], "seed=1,3: seed cannot be swept: seed is the base model's init and the held-out eval batches"),
    (
        ["-m", "+experiment=lora_ab", "model=gpt2_tiny,gpt2_small"],
        "variants.r8_model-gpt2_small: model.n_layer=12 "
        "differs from the base stage's model.n_layer=2: every variant fine-tunes the one base",
    ),
    (
        ["+experiment=lora_ab", "+variants.x.model.n_embd=64"],
        "variants.x: model.n_embd=64 differs from the base stage's model.n_embd=128",
    ),
    (
        ["-m", "+experiment=lora_ab", "variants.r8.train.lr=1e-3,3e-3"],
        "variants.r8.train.lr=1e-3,3e-3: variants.r8.train.lr cannot be swept",
    ),
    (
        ["-m", "router=round_robin,nope"],
        "router=round_robin,nope: router=nope: no such router in conf/router/; "
        "choose one of: affinity, balanced, least_loaded, round_robin",
    ),
    (["-m", "train.lr=glob(*)"], "train.lr=glob(*): glob() picks options of a config group"),
    (["-m", "train.lr=1e-3,-1"], "variants.lr-1: train.lr=-1.0 is out of range: it must be > 0"),
    (["-m", "resume={broken_run}", "train.lr=1,2"], "takes no other arguments"),
    # task metrics (issue 37): each function imported and asked for zero examples before anything is written
    (["eval.metrics.acc=nosuch_module:fn"], "eval.metrics.acc=nosuch_module:fn: cannot import nosuch_module"),
    (["eval.metrics.acc=toy_metric:nope"], "eval.metrics.acc=toy_metric:nope: toy_metric has no function 'nope'"),
    (["eval.metrics.acc=toy_metric.next_letter"], "is not an import path: write it as package.module:function"),
    (["eval.metrics.acc=toy_metric:wrong_length"], "toy_metric:wrong_length: returned 1 scores for 0 examples"),
    (["eval.metrics.acc=toy_metric:nan_count"], "toy_metric:nan_count: n_examples=nan: it must be the number"),
    (["eval.metrics.acc=toy_metric:changing"], "toy_metric:changing: n_examples changed from"),
    (["eval.metrics.acc=toy_metric:plain_list"], "toy_metric:plain_list returned list, not"),
    (["eval.metrics.acc=toy_metric:touches_model"], "with no examples return Scores([], n_examples=N) without"),
    (["eval.primary=acc"], "eval.primary='acc' is not a metric of this run: choose one of loss"),
    (["eval.metrics.loss=toy_metric:next_letter"], "eval.metrics.loss: a metric name is 1-32 letters"),
    (["+variants.a.eval.primary=loss"], "variants.a.eval: eval is set once, at the top level"),
    (["eval.metrics.mc={emptydir}/nope.yaml"], "eval.metrics.mc={emptydir}/nope.yaml: no such task file: give"),
    # experiment trackers (issue 15): an unknown one, or one whose package is not installed, named before any write
    (
        ["tracker=nope"],
        "tracker=nope: no such tracker in conf/tracker/; choose one of: mlflow, none, tensorboard, wandb",
    ),
    (["tracker=[tensorboard,nope]"], "tracker=nope: no such tracker in conf/tracker/; choose one of: mlflow, none, "),
    (
        ["tracker=[tensorboard,wandb]", "run_root={without_wandb}"],
        "tracker=wandb needs the wandb package, which is "
        "not installed: pip install 'wandb>=0.19' (or pip install -e '.[tracking]' for every tracker)",
    ),
    (
        ["tracker=mlflow", "run_root={without_mlflow}"],
        "tracker=mlflow needs the mlflow package, which is not installed: pip install 'mlflow-skinny",
    ),
    (
        ["tracker=wandb", "tracker.wandb_mode=cloud"],
        "tracker.wandb_mode='cloud' is not valid: choose one of offline, online",
    ),
    (["tracker=tensorboard", "tracker.dir={a.txt}"], "tracker.dir="),
    # the user's own config folder (--config-dir DIR, -cd DIR, hydra.searchpath=[...]): issue 41 item 1
    (["--config-dir", "{emptydir}/nope", "+experiment=mine"], "--config-dir {emptydir}/nope: no folder"),
    (["-cd", "{emptydir}", "+experiment=mine"], "holds no config group folder with a .yaml file"),
    (["-cd", "{a.txt}", "+experiment=mine"], "is a file, not a folder"),
    (["--config-dir={cd_typo}", "+experiment=mine"], "{cd_typo}/experiment/mine.yaml: unknown key 'train.lrr': did"),
    (["-cd", "{cd_nopkg}", "+experiment=mine"], "mine.yaml: an experiment file starts with the line '# @package"),
    (["-cd", "{cd_shadow}", "+experiment=lora_ab"], "lora_ab.yaml: a built-in experiment is called 'lora_ab'"),
    (["-cd", "{cd_group}", "model=big"], "{cd_group}/modle/ is not a config group: did you mean model/?"),
    (["-cd", "{cd_yaml}", "+experiment=broken"], "{cd_yaml}/experiment/broken.yaml, line 3: not valid YAML"),
    (["-cd", "{cd_root}", "+experiment=mine"], "{cd_root}/config.yaml: the root config is built in"),
    (["-cd", "{cd_hot}", "+experiment=hot"], "{cd_hot}/experiment/hot.yaml: train.lr=50.0 is out of range"),
    (["-cd", "{cd_vtypo}", "+experiment=mine"], "{cd_vtypo}/experiment/mine.yaml: variants.a: unknown key 'train.lrr"),
    (
        ["-cd", "{cd_novariant}", "+experiment=mine"],
        "{cd_novariant}/experiment/mine.yaml: variants: {} names no variant: add at least one, e.g. variants: {r8: ",
    ),
    (["hydra.searchpath=[file://{emptydir}/nope]"], "hydra.searchpath entry file://{emptydir}/nope: no folder"),
    (["hydra.searchpath=file://x"], "hydra.searchpath is a list of folders"),
    (["+experiment=conf/experiment/mine.yaml"], "+experiment= takes a name, not a path: --config-dir conf +exp"),
    (["--config-path", "conf"], "--config-path: the root config is built in: add your own folder with --config-dir"),
    (["--config-dir"], "--config-dir needs a folder"),
    (["-cd", "{cd_typo}", "resume={not_a_run}"], "resume=RUN_DIR continues with the run's own config.yaml: drop"),
    # Hydra's own words no more (issue 41 item 6): '+' on a key the experiment sets, null for a key with a value
    (["+experiment=lora_ab", "+variants.r8.model.lora.r=4"], "+variants.r8.model.lora.r=...: variants.r8.model.lora"),
    (["train.eval_every=null"], "train.eval_every=null: train.eval_every takes a value, not null: give one, e.g. tr"),
    (["launcher=slurm", "launcher.timeout_min=null"], "launcher.timeout_min=60 (its default)"),
]


def _ids():
    return [" ".join(a)[:60] for a, _ in CASES]


def _run(*argv: str) -> bool:
    try:
        return subprocess.run(argv, capture_output=True).returncode == 0
    except OSError:
        return False


@contextlib.contextmanager
def _read_only_dir(path: Path):
    """A folder nobody can write, root included: a read-only tmpfs, else an immutable folder (chattr +i)."""
    path.mkdir()
    if _run("mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)):
        try:
            yield path
        finally:
            _run("umount", str(path))
    elif _run("chattr", "+i", str(path)):
        try:
            yield path
        finally:
            _run("chattr", "-i", str(path))
    else:
        pytest.skip("this machine cannot make a read-only tmpfs or use chattr +i")


@contextlib.contextmanager
def _tiny_fs(path: Path):
    """A file system with room for six files: the run directory fills it half-way through being written."""
    path.mkdir()
    if not _run("mount", "-t", "tmpfs", "-o", "size=1m,nr_inodes=6", "tmpfs", str(path)):
        pytest.skip("this machine cannot mount a tmpfs")
    try:
        yield path
    finally:
        _run("umount", str(path))


@contextlib.contextmanager
def _tiny_llama(path: Path, chat_template: bool = True):
    """A tiny Llama-architecture checkpoint with its tokenizer (tests/tiny_checkpoints.py)."""
    import io

    from tiny_checkpoints import make_checkpoint

    with contextlib.redirect_stderr(io.StringIO()):  # save_pretrained's progress bar
        folder = make_checkpoint(path, "llama", chat_template=chat_template)
    yield folder


@contextlib.contextmanager
def _without_module(path: Path, module: str):
    """A run_root folder, while `module` cannot be imported (sys.modules[module] = None: find_spec finds none)."""
    import sys

    path.mkdir()
    saved = sys.modules.get(module)
    sys.modules[module] = None
    try:
        yield path
    finally:
        if saved is None:
            del sys.modules[module]
        else:
            sys.modules[module] = saved


SPECIAL = {
    "readonly": _read_only_dir,
    "tiny_fs": _tiny_fs,  # made only for the rows that name them
    "llama": _tiny_llama,
    "llama_nochat": lambda path: _tiny_llama(path, chat_template=False),
    "without_wandb": lambda path: _without_module(path, "wandb"),
    "without_mlflow": lambda path: _without_module(path, "mlflow"),
}


def _io_error_readable() -> bool:
    """Whether reading /proc/self/mem at offset 0 fails (Input/output error), as the io rows need."""
    try:
        with open("/proc/self/mem", "rb") as f:
            f.read(1)
        return False
    except OSError:
        return True


@pytest.mark.parametrize("args, expect", CASES, ids=_ids())
def test_bad_input_exits_2_with_one_line(tmp_path, monkeypatch, capsys, args, expect):
    files = _files(tmp_path / "f")
    joined = " ".join(args)
    if "{locked}" in joined and os.access(files["locked"] / "x.txt", os.R_OK):
        pytest.skip(
            "this machine cannot make an unreadable file: chmod 000 does not stop this user (root) from reading"
        )
    if ("{io.jsonl}" in joined or "{ioerror}" in joined) and not _io_error_readable():
        pytest.skip("this machine cannot provoke an I/O error: /proc/self/mem reads without one")
    with contextlib.ExitStack() as stack:
        for name, make in SPECIAL.items():
            if "{" + name + "}" in joined:
                files[name] = stack.enter_context(make(tmp_path / name))
        for name, path in files.items():
            args = [a.replace("{" + name + "}", str(path)) for a in args]
            expect = expect.replace("{" + name + "}", str(path))
        if not any(a.startswith(("train.steps=", "resume=")) for a in args):
            args += FAST
        runs = tmp_path / "runs"
        run_root = next((Path(a.split("=", 1)[1]) for a in args if a.startswith("run_root=")), None)
        if run_root is None and not any(a.startswith("resume=") for a in args):
            args.append(f"run_root={runs}")
        monkeypatch.chdir(tmp_path)
        code = main(args)
        out, err = capsys.readouterr()
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 2, (code, out[-2000:], err[-2000:])
        assert len(lines) == 1 and lines[0].startswith("error: "), err
        assert expect in lines[0], lines[0]
        assert "Traceback" not in out + err
        for root in (runs, run_root):
            written = [
                p
                for name in ("manifest.json", "config.yaml", "task.json", ".slurm_router-write-test-*")
                for p in (root.rglob(name) if root and root.is_dir() else [])
            ]
            assert not written, f"a run directory was half-made: {written}"
        assert not any(tmp_path.rglob("pwned")), "a hostile name ran a shell command"


def test_dict_overrides_reach_both_slurm_launchers():
    """`launcher.additional_parameters={nice: 10}` (the README's syntax) and `...additional_parameters.nice=10`
    reach submitit's parameters and the rendered sbatch script (tests/test_bad_input.py submits the latter)."""
    from slurm_router.backends.slurm.sbatch_launcher import sbatch_spec
    from slurm_router.backends.slurm.sbatch_render import sbatch_directives
    from slurm_router.backends.slurm.submitit_launcher import submitit_params

    for value in ("launcher.additional_parameters={nice: 10}", "launcher.additional_parameters.nice=10"):
        cfg = compose(["launcher=slurm", value])
        assert submitit_params(cfg, 1, "variants", None)["slurm_additional_parameters"]["nice"] == 10
        cfg = compose(["launcher=sbatch", value])
        assert "#SBATCH --nice=10" in sbatch_directives(sbatch_spec(cfg, "/run", "variants", 1, 1, None))


def test_nodes_per_task_places_devices_over_nodes_for_both_slurm_launchers():
    """resources.nodes_per_task=2 with 4 devices: 2 nodes, 2 srun tasks (one GPU each) on each; 1 (the default):
    every srun task of the task on one node (tests/test_multinode.py runs it on the 2-node cluster)."""
    from slurm_router.backends.slurm.sbatch_launcher import sbatch_spec
    from slurm_router.backends.slurm.sbatch_render import sbatch_directives
    from slurm_router.backends.slurm.submitit_launcher import submitit_params

    for nodes, per_node in ((2, 2), (1, 4)):
        args = ["launcher.srun_workers=true", "resources.devices_per_task=4", f"resources.nodes_per_task={nodes}"]
        params = submitit_params(compose(["launcher=slurm", *args]), 4, "variants", None)
        assert (params["nodes"], params["tasks_per_node"], params["slurm_gpus_per_task"]) == (nodes, per_node, 1)
        lines = sbatch_directives(sbatch_spec(compose(["launcher=sbatch", *args]), "/run", "variants", 1, 4, None))
        assert {
            f"#SBATCH --nodes={nodes}",
            "#SBATCH --ntasks=4",
            f"#SBATCH --ntasks-per-node={per_node}",
            "#SBATCH --gpus-per-task=1",
        } <= set(lines)


def test_variants_are_overridden_by_name_and_added_with_plus():
    cfg = compose(["+experiment=lora_ab", "variants.r8.train.lr=1e-3", "+variants.r9.model.lora.r=4"])
    assert list(cfg.variants) == ["r8", "r32", "r9"]
    assert cfg.variants.r8.train.lr == 1e-3 and cfg.variants.r8.model.lora.r == 8 and cfg.variants.r9.model.lora.r == 4


def test_the_table_is_large_and_new():
    """The table only grows (95 rows after issue 12), none repeating tests/test_bad_input.py's."""
    old = (Path(__file__).parent / "test_bad_input.py").read_text()
    assert len(CASES) >= 95
    repeats = [a for a, _ in CASES if f"{a!r}".replace("'", '"') in old or repr(a) in old]
    assert not repeats, repeats


def test_a_free_form_key_and_a_variant_edit_in_one_command(tmp_path):
    """eval.metrics.NAME= is free-form (a Dict field): the composition that finds the experiment's variants for
    `variants.r8.train.lr=` reads the same rule, so the two together pass, as each does alone (it was 'not in
    struct', exit 2)."""
    tests = str(Path(__file__).parent)
    env = {"PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])}
    args = ["+experiment=lora_ab", "eval.metrics.em=toy_metric:next_letter", "eval.primary=em", "dry_run=true"]
    for extra in ([], ["variants.r8.train.lr=1e-3"]):
        proc = run_cli(*args, *extra, f"run_root={tmp_path / 'runs'}", cwd=tmp_path, env=env, timeout=300)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert "not in struct" not in proc.stderr
