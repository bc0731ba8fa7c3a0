"""Nothing a user sets is silently ignored (issue 29, "Done when"): every key of the composed config, for each data
source (conf/data/*.yaml) and each launcher (conf/launcher/*.yaml), is either read by the code or refused in one
line naming it when the user sets it.

- read: READS names, for each key, the module and the code that reads it; the test finds that code in the module,
  comments and docstrings left out. This shows where the key is read, not what it changes: the data.* keys have
  the stronger test in tests/test_ignored_settings.py (a read key changes the corpus built), and the walk uses
  their rule (config/checks.py, data_keys_read).
- read under a condition (config/unread.py RULES: base.steps only with a base stage, ...): where the composed
  config leaves the condition off, the key must be refused; test_a_conditional_read_... shows each rule both ways.
- refused: set to CHANGED[key] through the command's own checks, as `python -m slurm_router` runs them
  (compose, then check_new_run with the keys the overrides set), it gives a UserError whose one line starts
  with the key.

A key added to a conf/*.yaml or the schema without code that reads it fails here: read it, refuse it, or drop it.

    pytest tests/test_every_setting.py
"""

from __future__ import annotations

import ast
import copy
import io
import json
import tokenize
from functools import cache
from pathlib import Path

import pytest
from omegaconf import DictConfig, OmegaConf

from slurm_router.cli.checks import check_new_run
from slurm_router.config.checks import data_keys_read
from slurm_router.config.compose import compose
from slurm_router.config.schema import conf_dir, free_form_keys
from slurm_router.config.sweep import parse_overrides
from slurm_router.config.unread import RULE_OF, RULES, set_keys
from slurm_router.errors import UserError

PACKAGE = Path(__file__).resolve().parents[1] / "slurm_router"
DATA = sorted(p.stem for p in Path(conf_dir(), "data").glob("*.yaml"))
LAUNCHERS = sorted(p.stem for p in Path(conf_dir(), "launcher").glob("*.yaml"))

# key -> (module under slurm_router/, the code that reads it), or {launcher kind: (module, code)}
SLURM, SBATCH = "backends/slurm/submitit_launcher.py", "backends/slurm/sbatch_launcher.py"
COMMON, CONTAINER = "backends/slurm/common.py", "backends/slurm/container.py"
MODEL, PLAN, SETUP = "train/model.py", "launch/plan.py", "worker/setup.py"
WORKER, MICRO = "worker/worker.py", "worker/microbatch.py"
TRACKERS, ROUTER, PACKING = "tracking/trackers.py", "router/router.py", "router/packing.py"
READS: dict[str, tuple[str, str] | dict[str, tuple[str, str]]] = {
    "experiment": (PLAN, "experiment=cfg.experiment"),
    "seed": (PLAN, "seed=cfg.seed"),
    "seeds": ("config/variants.py", "value = cfg.seeds"),
    "prune": ("worker/decisions.py", 'self.cfg.get("prune")'),
    "auto_seeds.max": ("config/variants.py", '.get("max", 6)'),
    "auto_seeds.budget_device_hours": ("worker/auto_seeds.py", '.get("budget_device_hours")'),
    "auto_seeds.min_effect": ("worker/prune.py", 'auto.get("min_effect")'),
    "eval.primary": ("config/metrics.py", "str(ev.primary)"),
    "eval.metrics": ("config/metrics.py", "(ev.metrics or {})"),
    "dry_run": ("cli/run.py", "if cfg.dry_run"),
    "run_root": ("rundir/manifest.py", "Path(cfg.run_root)"),
    "variants": ("config/variants.py", "cfg.variants.items()"),
    "model.kind": (MODEL, 'model_cfg.kind == "hf"'),
    "model.name_or_path": (MODEL, "os.path.expanduser(model_cfg.name_or_path)"),
    "model.n_layer": (MODEL, "n_layer=model_cfg.n_layer"),
    "model.n_head": (MODEL, "n_head=model_cfg.n_head"),
    "model.n_embd": (MODEL, "n_embd=model_cfg.n_embd"),
    "model.n_positions": (MODEL, "n_positions=model_cfg.n_positions"),
    "model.vocab_size": (SETUP, "cfg.model.vocab_size,"),  # the model the task trains (and the previews size)
    "model.dtype": (MODEL, 'model_cfg.dtype == "bf16"'),
    "model.base_dropout": (MODEL, 'getattr(model_cfg, "base_dropout", "zero") != base_dropout.KEEP'),
    "model.lora.enabled": (MODEL, "model_cfg.lora.enabled"),
    "model.lora.r": (MODEL, "r=lc.r"),
    "model.lora.alpha": (MODEL, "lora_alpha=lc.alpha"),
    "model.lora.dropout": (MODEL, "lora_dropout=lc.dropout"),
    "model.lora.target_modules": (MODEL, "target_module_names(model_cfg.lora.target_modules)"),
    "model.lora.use_rslora": (MODEL, "use_rslora=lc.use_rslora"),
    "model.lora.use_dora": (MODEL, "use_dora=lc.use_dora"),
    # the router's keys reach it as RouterSettings.from_config(cfg.router) (worker/setup.py)
    "router.policy": (ROUTER, "POLICIES[self.settings.policy]"),
    "router.cost": (PACKING, 'settings.cost == "tokens_attention"'),
    "router.attention_weight": (PACKING, "settings.attention_weight / settings.attention_ref_len"),
    "router.attention_ref_len": (PACKING, "settings.attention_weight / settings.attention_ref_len"),
    "router.microbatch_overhead_tokens": (PACKING, "settings.microbatch_overhead_tokens"),
    "router.memory_headroom": (ROUTER, "self.settings.memory_headroom"),
    "router.max_tokens_per_microbatch": (PACKING, "settings.max_tokens_per_microbatch"),
    "router.affinity_boundaries": ("router/policies.py", "settings.affinity_boundaries"),
    "router.speed_model": (ROUTER, "make_speed_model(self.settings.speed_model"),
    "router.row_cost": (ROUTER, 'self.settings.row_cost == "fitted"'),
    "router.speed_ema": (ROUTER, "self.settings.speed_ema"),
    "launcher.kind": ("cli/checks.py", "launcher_class(cfg.launcher.kind)"),
    "launcher.cpu_slots": ("backends/local/launcher.py", 'cfg.launcher.get("cpu_slots")'),
    "launcher.partition": {"slurm": (SLURM, '"partition", "account"'), "sbatch": (SBATCH, "partition=lc.partition")},
    "launcher.account": {"slurm": (SLURM, '"partition", "account"'), "sbatch": (SBATCH, "account=lc.account")},
    "launcher.qos": {"slurm": (SLURM, '"account", "qos"'), "sbatch": (SBATCH, "qos=lc.qos")},
    "launcher.constraint": {"slurm": (SLURM, '"qos", "constraint"'), "sbatch": (SBATCH, "constraint=lc.constraint")},
    "launcher.timeout_min": {
        "slurm": (SLURM, "timeout_min=lc.timeout_min"),
        "sbatch": (SBATCH, "timeout_min=lc.timeout_min"),
    },
    "launcher.mem_gb": {"slurm": (SLURM, 'params["mem_gb"] = lc.mem_gb'), "sbatch": (SBATCH, "mem_gb=lc.mem_gb")},
    "launcher.cpus_per_task": (COMMON, "int(lc.cpus_per_task)"),
    "launcher.cpus_per_device": (COMMON, 'launcher_setting(lc, "cpus_per_device")'),
    "launcher.array_parallelism": {
        "slurm": (SLURM, "slurm_array_parallelism=lc.array_parallelism"),
        "sbatch": (SBATCH, "array_parallelism=lc.array_parallelism"),
    },
    "launcher.additional_parameters": {
        "slurm": (SLURM, "dict(lc.additional_parameters or {})"),
        "sbatch": (SBATCH, "(lc.additional_parameters or {}).items()"),
    },
    "launcher.srun_workers": {"slurm": (SLURM, "if lc.srun_workers:"), "sbatch": (SBATCH, "if lc.srun_workers else")},
    "launcher.wait": (COMMON, "self.cfg.launcher.wait"),
    "launcher.max_requeues": ("supervise/requeue.py", 'launcher_setting(launcher, "max_requeues")'),
    "launcher.signal_delay_s": {
        "slurm": (SLURM, "slurm_signal_delay_s=lc.signal_delay_s"),
        "sbatch": (SBATCH, "signal_delay_s=lc.signal_delay_s"),
    },
    "launcher.max_failures": ("supervise/retry.py", '"max_failures")'),
    "launcher.setup": {
        "slurm": (SLURM, 'launcher_setting(cfg.launcher, "setup")'),
        "sbatch": (SBATCH, 'launcher_setting(lc, "setup")'),
    },
    "launcher.python": (CONTAINER, 'cfg.launcher.get("python")'),
    "launcher.container.image": (CONTAINER, "str(c.image)"),
    "launcher.container.runtime": (CONTAINER, "runtime=str(c.runtime)"),
    "launcher.container.mounts": (CONTAINER, "c.mounts or ()"),
    "launcher.container.runtime_cmd": (CONTAINER, "str(c.runtime_cmd)"),
    "launcher.snapshot": (COMMON, 'self.cfg.launcher.get("snapshot", False)'),
    "launcher.mail_type": (COMMON, 'launcher_setting(launcher, "mail_type")'),
    "launcher.mail_user": (COMMON, 'launcher_setting(launcher, "mail_user")'),
    "launcher.dry_run": (SBATCH, "cfg.launcher.dry_run"),
    "train.steps": (PLAN, "steps=vcfg.train.steps"),
    "train.global_batch_size": (PLAN, "global_batch_size=vcfg.train.global_batch_size"),
    "train.lr": (PLAN, "lr=vcfg.train.lr"),
    "train.warmup_steps": (WORKER, "self.cfg.train.warmup_steps"),
    "train.weight_decay": (SETUP, "cfg.train.weight_decay"),
    "train.grad_clip": (WORKER, "self.cfg.train.grad_clip"),
    "train.eval_every": (WORKER, "self.cfg.train.eval_every"),
    "train.eval_batches": (SETUP, "cfg.train.eval_batches"),
    "train.eval_batch_size": (SETUP, "cfg.train.eval_batch_size"),
    "train.precision": (MICRO, "cfg.train.precision"),
    "train.compile": (SETUP, "if cfg.train.compile:"),
    "train.gradient_checkpointing": (SETUP, "gradient_checkpointing=cfg.train.gradient_checkpointing"),
    "train.loss_chunk_tokens": (MICRO, "cfg.train.loss_chunk_tokens"),
    "train.pad_to_multiple": (MICRO, "self.cfg.train.pad_to_multiple"),
    "train.prefetch": (MICRO, "self.cfg.train.prefetch"),
    "train.packing": ("train/packed.py", "str(train_cfg.packing).lower()"),
    "train.checkpoint_every": (WORKER, "self.cfg.train.checkpoint_every"),
    "train.keep_checkpoints": (WORKER, "self.cfg.train.keep_checkpoints"),
    "base.enabled": ("artifacts/base_cache.py", "bool(cfg.base.enabled)"),
    "base.steps": (PLAN, "steps=cfg.base.steps"),
    "base.lr": (PLAN, "lr=cfg.base.lr"),
    "base.global_batch_size": (PLAN, "global_batch_size=cfg.base.global_batch_size"),
    "base.cache_dir": ("artifacts/base_cache.py", "cfg.base.cache_dir or"),
    "resources.devices_per_task": (PLAN, "devices=vcfg.resources.devices_per_task"),
    "resources.tasks_per_gpu": {
        "local": ("backends/local/launcher.py", "cfg.resources.tasks_per_gpu or"),
        "slurm": (COMMON, "int(cfg.resources.tasks_per_gpu)"),
        "sbatch": (COMMON, "int(cfg.resources.tasks_per_gpu)"),
    },
    "resources.nodes_per_task": (COMMON, "int(cfg.resources.nodes_per_task)"),
    "resources.fuse_variants": (PLAN, "cfg.resources.fuse_variants"),
    "train.fused_layout": ("worker/fused.py", "self.cfg.train.fused_layout"),
    "tracker.tensorboard": (TRACKERS, 'KINDS = ("tensorboard", "mlflow", "wandb")'),
    "tracker.mlflow": (TRACKERS, 'KINDS = ("tensorboard", "mlflow", "wandb")'),
    "tracker.wandb": (TRACKERS, 'KINDS = ("tensorboard", "mlflow", "wandb")'),
    "tracker.dir": (TRACKERS, 'tracker.get("dir")'),
    "tracker.mlflow_uri": (TRACKERS, 'tracker.get("mlflow_uri")'),
    "tracker.mlflow_experiment": (TRACKERS, 'tracker.get("mlflow_experiment")'),
    "tracker.wandb_project": (TRACKERS, 'tracker.get("wandb_project")'),
    "tracker.wandb_entity": (TRACKERS, 'tracker.get("wandb_entity")'),
    "tracker.wandb_mode": (TRACKERS, 'tracker.get("wandb_mode")'),
}

# a value other than the composed one, as an override's value: for each key the walk may have to see refused (the
# data.* keys, those of config/unread.py's rules, any key not in READS)
CHANGED = {
    "auto_seeds.max": "4",
    "auto_seeds.budget_device_hours": "2.5",
    "auto_seeds.min_effect": "0.02",
    "model.name_or_path": "/tmp",
    "model.n_layer": "3",
    "model.n_head": "2",
    "model.n_embd": "64",
    "model.n_positions": "256",
    "model.vocab_size": "300",
    "model.dtype": "bf16",
    "model.base_dropout": "keep",
    "model.lora.r": "4",
    "model.lora.alpha": "8",
    "model.lora.dropout": "0.1",
    "model.lora.target_modules": "all-linear",
    "model.lora.use_rslora": "true",
    "model.lora.use_dora": "true",
    "data.path": "/nonexistent/texts",
    "data.text_field": "body",
    "data.prompt_field": "prompt",
    "data.completion_field": "completion",
    "data.messages_field": "messages",
    "data.max_len": "16",
    "data.split_on": "'\\n'",
    "data.val_fraction": "0.5",
    "data.max_documents": "3",
    "data.n_samples": "100",
    "data.length_dist": "uniform",
    "data.mean_len": "40",
    "data.sigma": "0.3",
    "data.min_len": "20",
    "router.attention_weight": "0.5",
    "router.attention_ref_len": "1024",
    "router.affinity_boundaries": "[64,128]",
    "router.speed_ema": "0.5",
    "launcher.cpus_per_device": "2",
    "launcher.mail_user": "someone@example.org",
    "train.pad_to_multiple": "8",
    "train.fused_layout": "row",
    "router.row_cost": "fixed",
    "base.enabled": "true",
    "base.steps": "5",
    "base.lr": "1e-3",
    "base.global_batch_size": "8",
    "base.cache_dir": "/tmp/slurm_router_base_cache",
}

# each rule of config/unread.py: (overrides that leave its keys unread, overrides that make them read)
SWITCHES = {
    "base.steps": ([], ["base.enabled=true"]),
    "base.enabled": (["model=hf", "model.name_or_path=/tmp"], []),
    "model.name_or_path": ([], ["model=hf"]),
    "model.base_dropout": ([], ["model=hf", "model.name_or_path=/tmp"]),
    "model.n_layer": (["model=hf", "model.name_or_path=/tmp"], []),
    "model.dtype": (["model.lora.enabled=false"], []),
    "router.attention_weight": ([], ["router.cost=tokens_attention"]),
    "router.affinity_boundaries": ([], ["router=affinity"]),
    "router.speed_ema": ([], ["router.speed_model=ema"]),
    "train.pad_to_multiple": ([], ["train.packing=false"]),
    "train.fused_layout": ([], ["resources.fuse_variants=2"]),
    "router.row_cost": (["train.packing=false"], []),
    "launcher.cpus_per_device": (["launcher=sbatch", "launcher.cpus_per_task=2"], ["launcher=sbatch"]),
    "launcher.mail_user": (["launcher=sbatch"], ["launcher=sbatch", "launcher.mail_type=END"]),
    "auto_seeds.max": ([], ["seeds=auto", "prune=true"]),
}


@pytest.fixture(scope="module")
def small_data(tmp_path_factory) -> dict[str, list[str]]:
    """Each data source's overrides, on a few files or rows (the checks build the corpus)."""
    root = tmp_path_factory.mktemp("data")
    (root / "texts").mkdir()
    for i in range(4):
        (root / "texts" / f"doc{i}.txt").write_text("\n\n".join(f"paragraph {j} of {i}\nline two" for j in range(4)))
    rows = [{"text": f"row {i}\nsecond line\nthird line " * 4} for i in range(12)]
    (root / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": [r["text"] for r in rows]}), root / "rows.parquet")
    return {
        "stdlib": ["data.max_documents=12"],
        "text_dir": [f"data.path={root / 'texts'}"],
        "jsonl": [f"data.path={root / 'rows.jsonl'}"],
        "parquet": [f"data.path={root / 'rows.parquet'}"],
        "synthetic": ["data.n_samples=60"],
    }


def leaves(node: DictConfig, prefix: str = "") -> list[str]:
    """The composed config's keys, dotted; a free-form mapping (variants, launcher.additional_parameters) is one."""
    out = []
    for key in node:
        full, value = f"{prefix}{key}", node._get_node(key)
        if isinstance(value, DictConfig) and len(value) and full not in free_form_keys():
            out += leaves(value, full + ".")
        else:
            out.append(full)
    return out


@cache
def code_of(module: str) -> str:
    """A module's source without its comments and docstrings: the code that runs."""
    source = (PACKAGE / module).read_text()
    lines = source.splitlines()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            if isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
                for n in range(body[0].lineno - 1, body[0].end_lineno or body[0].lineno):
                    lines[n] = ""
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and lines[tok.start[0] - 1]:
            lines[tok.start[0] - 1] = lines[tok.start[0] - 1][: tok.start[1]]
    return "\n".join(lines)


def refusal(overrides: list[str], cfg: DictConfig | None = None) -> str | None:
    """The one line the command's checks give for these overrides (python -m slurm_router's order: compose,
    then check_new_run with the keys they set), or None. cfg: the overrides' config, composed already."""
    try:
        check_new_run(compose(overrides) if cfg is None else cfg, set_keys(overrides))
    except UserError as e:
        return str(e)
    return None


def with_value(overrides: list[str], key: str, value: str) -> list[str]:
    return [o for o in overrides if o.split("=", 1)[0] != key] + [f"{key}={value}"]


def set_in(cfg: DictConfig, override: str) -> DictConfig:
    """A copy of cfg with one key=value override applied (Hydra's parser for the value): composing again costs
    0.1 s a key."""
    (parsed,) = parse_overrides([override])
    out = copy.deepcopy(cfg)
    OmegaConf.update(out, parsed.key_or_group, parsed.value(), merge=False)
    return out


def test_the_sources_and_launchers_are_those_of_conf():
    assert DATA == ["jsonl", "parquet", "stdlib", "synthetic", "text_dir"]
    assert LAUNCHERS == ["local", "sbatch", "slurm"]


@pytest.mark.parametrize("launcher", LAUNCHERS)
@pytest.mark.parametrize("data", DATA)
def test_every_key_is_read_or_refused(data, launcher, small_data, tmp_path):
    base = [f"data={data}", f"launcher={launcher}", *small_data[data], "dry_run=true", f"run_root={tmp_path}"]
    cfg = compose(base)
    assert refusal(base) is None  # the pair's own config passes
    for key in leaves(cfg):
        if key.startswith("data."):
            read = key[len("data.") :] in data_keys_read(cfg.data)  # tests/test_ignored_settings.py: each is read
        else:
            rule = RULE_OF.get(key)
            read = key in READS and (rule is None or rule.reads(cfg))
        if read:
            if not key.startswith("data."):
                entry = READS[key]
                module, code = entry[launcher] if isinstance(entry, dict) else entry
                assert key.rsplit(".", 1)[-1] in code and code in code_of(module), f"{key}: not read in {module}"
            continue
        assert key in CHANGED, f"data={data} launcher={launcher}: {key} is neither in READS nor in CHANGED"
        assert str(OmegaConf.select(cfg, key)) != CHANGED[key].strip("'"), key
        override = f"{key}={CHANGED[key]}"
        line = refusal([override], set_in(cfg, override))
        assert line is not None and line.startswith(key), (
            f"data={data} launcher={launcher}: {key}={CHANGED[key]} is neither read (READS: where) nor refused: {line}"
        )
        assert "\n" not in line


def test_every_conditional_read_has_a_switch_and_a_site():
    assert {rule.keys[0] for rule in RULES} == set(SWITCHES)
    assert all(key in READS for key in RULE_OF)


@pytest.mark.parametrize("key", sorted(RULE_OF))
def test_a_conditional_read_is_refused_off_and_accepted_on(key, tmp_path):
    rule = RULE_OF[key]
    off, on = SWITCHES[rule.keys[0]]
    base = ["data=synthetic", "data.n_samples=60", "dry_run=true", f"run_root={tmp_path}"]
    line = refusal(with_value([*base, *off], key, CHANGED[key]))
    assert line is not None and line.startswith(f"{key}=") and "so it would be ignored: " in line, line
    line = refusal(with_value([*base, *on], key, CHANGED[key]))  # model=hf /tmp: no checkpoint there, said later
    assert line is None or "would be ignored" not in line, line
