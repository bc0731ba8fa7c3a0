"""Config schema (dataclasses registered in Hydra's ConfigStore) and the checks that turn a bad value into
one line saying what to do. Values live in conf/*.yaml; this file only says what is allowed."""
from __future__ import annotations

import dataclasses
import errno
import math
import os
import pickle
import re
import tempfile
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from slurm_router.router.types import RouterSettings


class UserError(Exception):
    """A mistake in the user's config or files: reported as one line, exit code 2, no traceback."""


@dataclass
class LoraConfig:
    enabled: bool = True
    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    # auto: peft's own per-architecture defaults (all-linear where peft has none) | all-linear | [names]
    target_modules: Any = "auto"
    use_rslora: bool = False                # rank-stabilised scaling alpha/sqrt(r) (peft)
    use_dora: bool = False                  # weight-decomposed LoRA (peft)


@dataclass
class ModelConfig:
    kind: str = "gpt2"                      # gpt2: built from this config | hf: a local checkpoint
    name_or_path: Optional[str] = None      # kind=hf: a local directory (never downloaded)
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 128
    n_positions: int = 512
    vocab_size: int = 257                   # byte-level: 256 bytes + end-of-text
    dtype: str = "auto"                     # frozen weights: auto (bf16 on GPU, fp32 on CPU) | fp32 | bf16
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class DataConfig:
    kind: str = "stdlib"                    # stdlib | text_dir | jsonl | parquet | synthetic
    path: Optional[str] = None              # text_dir: a folder; jsonl: a file; parquet: a file or a folder
    text_field: str = "text"                # jsonl/parquet: the field holding the text (loss on every token)
    prompt_field: Optional[str] = None      # jsonl/parquet: with completion_field, loss on the completion only
    completion_field: Optional[str] = None
    messages_field: Optional[str] = None    # jsonl/parquet: chat turns, loss on the assistant turns only
    max_len: int = 256                      # tokens per sample; longer documents are cut into pieces
    split_on: str = "\n\n"                  # a document is cut into samples at this separator first
    val_fraction: float = 0.05              # documents held out (by a hash of their name: stable)
    max_documents: Optional[int] = None
    # data=synthetic: token sequences with a controllable length distribution (benchmarks)
    n_samples: int = 4096
    length_dist: str = "lognormal"          # lognormal | uniform | fixed
    mean_len: int = 96
    sigma: float = 0.8
    min_len: int = 8


@dataclass
class RouterConfig:
    """The router's knobs; their defaults (and meanings) live once, in router.types.RouterSettings."""
    policy: str = RouterSettings.policy                     # round_robin | least_loaded | affinity | balanced
    cost: str = RouterSettings.cost                         # tokens | tokens_attention
    attention_weight: float = RouterSettings.attention_weight
    attention_ref_len: int = RouterSettings.attention_ref_len
    microbatch_overhead_tokens: int = RouterSettings.microbatch_overhead_tokens
    memory_headroom: float = RouterSettings.memory_headroom  # above 1 over-commits (OOM-path testing aid)
    max_tokens_per_microbatch: Optional[int] = RouterSettings.max_tokens_per_microbatch
    affinity_boundaries: List[int] = field(default_factory=list)
    speed_model: str = RouterSettings.speed_model           # robust | ema | none (router/speed_model.py)
    speed_ema: float = RouterSettings.speed_ema
    # Testing aid: per-device multiplier on compute time (2.0 = half speed), makes heterogeneity testable on CPU.
    device_slowdown: List[float] = field(default_factory=list)
    # Testing aid: a memory cap (bytes) per CPU worker; a micro-batch predicted above it raises a simulated OOM.
    cpu_memory_cap_bytes: Optional[int] = None


@dataclass
class LauncherConfig:
    """What every launcher has. One schema per launcher below, registered in the `launcher` group: a key that
    the chosen launcher does not have is an error naming the launchers that have it (launcher_key_error)."""
    kind: str = MISSING                     # each schema's own default; the registry in slurm_router.launch.registry


@dataclass
class LocalLauncherConfig(LauncherConfig):
    kind: str = "local"
    cpu_slots: Optional[int] = None         # without GPUs: CPU worker slots (default: the core count)


@dataclass
class ContainerConfig:
    """launcher.container: each task runs inside this image (slurm_router/launch/container.py); the job's own
    shell (sbatch) or submitit's process stays outside, and requeues from there. image=None: no container."""
    image: Optional[str] = None             # apptainer: a .sif file (or docker://..., library://...); pyxis: a name
    runtime: str = "apptainer"              # apptainer (apptainer exec --nv) | pyxis (srun --container-image)
    # more binds, SRC[:DST]; the run dir, data.path, model.name_or_path and the base cache are bound already
    mounts: List[str] = field(default_factory=list)
    runtime_cmd: str = "apptainer"          # apptainer: the program (a path, or a name on the compute node's PATH)


@dataclass
class SlurmLauncherConfig(LauncherConfig):
    """Shared by both Slurm launchers (submitit and sbatch)."""
    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    constraint: Optional[str] = None
    timeout_min: int = 60
    mem_gb: Optional[float] = None
    cpus_per_task: int = 1
    array_parallelism: int = 64
    additional_parameters: Dict[str, Any] = field(default_factory=dict)
    srun_workers: bool = False              # run a task's D workers as D srun tasks, one GPU each
    wait: bool = False                      # return once every task AND the report job have ended
    max_requeues: int = 3                   # time-limit requeues per task (slurm_router.requeue)
    signal_delay_s: int = 120               # USR2 this long before the time limit: checkpoint, then requeue
    # a task that failed for a reason not its own (a worker killed by a signal, NODE_FAIL) runs again from its
    # checkpoint, away from that node, up to this many times (slurm_router.retry)
    max_failures: int = 0
    # How the job runs (launch/container.py, launch/snapshot.py). setup: shell lines the job runs before the
    # task (module load, source a venv, export), as written: shell by design, trusted like your own sbatch
    # script, in the directory the run was submitted from; every other value here is quoted for the shell.
    setup: List[str] = field(default_factory=list)
    python: Optional[str] = None            # the task's interpreter; None: the submitter's (python3 in a container)
    container: ContainerConfig = field(default_factory=ContainerConfig)
    snapshot: bool = True                   # copy the checkout's source to RUN_DIR/code/ at submission; jobs import it
    mail_type: Any = None                   # Slurm's --mail-type: END,FAIL or [END, FAIL] (MAIL_TYPES)
    mail_user: Optional[str] = None         # Slurm's --mail-user (unset: Slurm mails the submitting user)


@dataclass
class SubmititLauncherConfig(SlurmLauncherConfig):
    kind: str = "slurm"


@dataclass
class SbatchLauncherConfig(SlurmLauncherConfig):
    kind: str = "sbatch"
    dry_run: bool = False                   # render RUN_DIR/submit*.sbatch, submit nothing


# OmegaConf 2.3 cannot hold typing.Literal fields, so `kind` is a str whose allowed values are these schemas'
# own defaults (CHOICES["launcher.kind"]); no other code spells the kinds out.
LAUNCHER_SCHEMAS: tuple[type[LauncherConfig], ...] = (LocalLauncherConfig, SubmititLauncherConfig,
                                                        SbatchLauncherConfig)


def launcher_schema(kind: str) -> type[LauncherConfig]:
    return next(s for s in LAUNCHER_SCHEMAS if s.kind == kind)


def launcher_setting(launcher: dict | DictConfig | None, key: str) -> Any:
    """A launcher value from a task's resolved config, or its schema default (the one place defaults live)."""
    launcher = launcher or {}
    if key in launcher:
        return launcher[key]
    for schema in LAUNCHER_SCHEMAS:     # a field with a default_factory (a list, a nested config) is no attribute
        found = {f.name: f for f in dataclasses.fields(schema)}.get(key)
        if found is not None:
            return found.default_factory() if found.default is dataclasses.MISSING else found.default
    raise KeyError(f"launcher.{key}: no launcher schema has it")


@dataclass
class TrainConfig:
    steps: int = 60
    global_batch_size: int = 16
    lr: float = 2e-3
    warmup_steps: int = 5
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    eval_every: int = 0                     # 0: evaluate at the start and the end only
    eval_batches: int = 8
    eval_batch_size: int = 16
    precision: str = "auto"                 # auto (bf16 on GPU, fp32 on CPU) | fp32 | bf16
    # Speed switches (see slurm_router/train/loss.py and README "GPU throughput")
    compile: bool = False                   # torch.compile the transformer backbone
    gradient_checkpointing: bool = False    # recompute layer activations in backward (long sequences)
    loss_chunk_tokens: int = 0              # >0: chunked cross-entropy, never the full fp32 logits (4096 on GPU)
    pad_to_multiple: int = 1                # pad micro-batch width to a multiple (fewer shapes for compile)
    prefetch: bool = True                   # build the next micro-batch's tensors while this one computes
    # Packed micro-batches: a device's samples end to end in one row, no padding (slurm_router/train/packed.py).
    # auto: on unless train.compile (a row's length changes every step); a model whose attention cannot take
    # packed rows trains padded, with one line saying why.
    packing: str = "auto"                   # auto | true | false
    checkpoint_every: int = 0               # save a checkpoint every N steps (0: only on a stop signal)
    keep_checkpoints: int = 3               # the newest K checkpoints are kept (a damaged newest falls back)


@dataclass
class BaseStageConfig:
    enabled: bool = False                   # train a base model first (no LoRA), cached by its config hash
    steps: int = 200
    lr: float = 3e-3
    global_batch_size: int = 16
    cache_dir: Optional[str] = None         # default: ~/.cache/slurm_router/base


@dataclass
class ResourcesConfig:
    devices_per_task: int = 1
    # Variant packing: tasks sharing one GPU (small LoRA jobs leave most of a big GPU idle).
    # 1 = a GPU per task; N = up to N tasks per GPU; 0 = as many as their predicted memory fits.
    tasks_per_gpu: int = 1
    # Nodes a task's devices spread over, devices_per_task/N on each (Slurm launchers with launcher.srun_workers:
    # one srun task per device, --nodes=N --ntasks-per-node=D/N); 1: every device of a task on one node.
    nodes_per_task: int = 1


@dataclass
class TrackerConfig:
    """Experiment trackers that rank 0 of each task logs to, from the rows it writes to the events file
    (slurm_router/trackers.py): tracker=tensorboard | mlflow | wandb, several as tracker=[tensorboard,mlflow]
    (conf/tracker/). Packages: pip install -e '.[tracking]'."""
    tensorboard: bool = False
    mlflow: bool = False
    wandb: bool = False
    dir: Optional[str] = None               # default RUN_DIR/trackers: tensorboard/, mlruns/, wandb/ in it
    mlflow_uri: Optional[str] = None        # default $MLFLOW_TRACKING_URI, else a file store in <dir>/mlruns
    mlflow_experiment: Optional[str] = None     # default: the experiment's name
    wandb_project: Optional[str] = None     # default $WANDB_PROJECT, else the experiment's name
    wandb_entity: Optional[str] = None
    wandb_mode: Optional[str] = None        # offline | online; default $WANDB_MODE, else offline (no internet there)


@dataclass
class Config:
    experiment: str = "default"
    seed: int = 0                           # the base model's init and the held-out eval batches
    # training seeds (LoRA init, data order), one task per variant and seed: N (seed, seed+1, ..., seed+N-1) or a
    # list [0, 5, 9]; 1 = one task per variant, named as the variant (training_seeds)
    seeds: Any = 1
    # stop a clear loser at an in-training evaluation (train.eval_every), by the verdict's statistics: prune.py
    prune: bool = False
    run_root: str = "runs"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    launcher: Any = MISSING                 # one of LAUNCHER_SCHEMAS, picked by the launcher group (conf/launcher/)
    train: TrainConfig = field(default_factory=TrainConfig)
    base: BaseStageConfig = field(default_factory=BaseStageConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    variants: Dict[str, Any] = field(default_factory=dict)   # name -> overrides, e.g. {model: {lora: {r: 8}}}
    tracker: TrackerConfig = field(default_factory=TrackerConfig)   # picked by the tracker group (conf/tracker/)


CHOICES = {
    "model.kind": ("gpt2", "hf"),
    "data.kind": ("stdlib", "text_dir", "jsonl", "parquet", "synthetic"),
    "model.dtype": ("auto", "fp32", "bf16"),
    "data.length_dist": ("lognormal", "uniform", "fixed"),
    "router.policy": ("round_robin", "least_loaded", "affinity", "balanced"),
    "router.cost": ("tokens", "tokens_attention"),
    "router.speed_model": ("robust", "ema", "none"),
    "launcher.kind": tuple(s.kind for s in LAUNCHER_SCHEMAS),
    "train.precision": ("auto", "fp32", "bf16"),
    "train.packing": ("auto", "true", "false"),
}
# key -> (low, high, low_inclusive); None = unbounded
RANGES = {
    "seed": (0, None, True),
    "model.n_layer": (1, 1024, True), "model.n_head": (1, 1024, True), "model.n_embd": (1, 65536, True),
    "model.n_positions": (2, 1 << 20, True), "model.vocab_size": (2, 1 << 22, True),
    "model.lora.r": (1, 4096, True), "model.lora.alpha": (0, None, False), "model.lora.dropout": (0, 1, True),
    "data.max_len": (2, 1 << 20, True), "data.val_fraction": (0, 1, False), "data.max_documents": (1, None, True),
    "data.n_samples": (1, 1 << 26, True), "data.mean_len": (1, 1 << 20, True), "data.sigma": (0, 10, True),
    "data.min_len": (2, 1 << 20, True),
    "router.attention_weight": (0, None, True), "router.memory_headroom": (0, 4, False),
    "router.attention_ref_len": (1, None, True), "router.microbatch_overhead_tokens": (0, None, True),
    "router.max_tokens_per_microbatch": (1, None, True), "router.speed_ema": (0, 1, False),
    "router.cpu_memory_cap_bytes": (1, None, True),
    "launcher.cpu_slots": (1, 4096, True), "launcher.timeout_min": (1, None, True), "launcher.mem_gb": (0, None, False),
    "launcher.cpus_per_task": (1, 4096, True), "launcher.array_parallelism": (1, None, True),
    "launcher.max_requeues": (0, 1000, True), "launcher.signal_delay_s": (0, 3600, True),
    "launcher.max_failures": (0, 1000, True),
    "train.steps": (1, 10_000_000, True), "train.global_batch_size": (1, 1 << 20, True), "train.lr": (0, 10, False),
    "train.warmup_steps": (0, None, True), "train.weight_decay": (0, 10, True), "train.grad_clip": (0, None, True),
    "train.eval_every": (0, None, True), "train.eval_batches": (1, 100_000, True),
    "train.eval_batch_size": (1, 1 << 20, True), "train.checkpoint_every": (0, None, True),
    "train.keep_checkpoints": (1, 1000, True),
    "train.loss_chunk_tokens": (0, None, True), "train.pad_to_multiple": (1, 4096, True),
    "base.steps": (1, 10_000_000, True), "base.lr": (0, 10, False), "base.global_batch_size": (1, 1 << 20, True),
    "resources.devices_per_task": (1, 4096, True), "resources.tasks_per_gpu": (0, 64, True),
    "resources.nodes_per_task": (1, 4096, True),
}
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,63}$")
# Layers of transformers' GPT-2 that peft LoRA can adapt (embeddings, Conv1D projections, the LM head), by their
# dotted names: model=gpt2_* is checked without building it (no torch here); tests/test_hf_models.py checks
# them against the real model. model=hf builds its architecture on the meta device (model.check_architecture).
GPT2_LORA_BLOCK = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
TARGET_MODULES_HINT = "auto (peft's default layers for the architecture), all-linear, or a list of layer names"


def gpt2_lora_layers(n_layer: int) -> list[str]:
    return ["transformer.wte", "transformer.wpe",
            *(f"transformer.h.{i}.{b}" for i in range(n_layer) for b in GPT2_LORA_BLOCK), "lm_head"]


def target_module_names(value: Any, where: str = "") -> list[str] | None:
    """model.lora.target_modules as a list of layer names (one name alone is a list of one); None for auto and
    all-linear, which peft resolves. UserError if it is none of these."""
    if value in ("auto", "all-linear"):
        return None
    is_list = isinstance(value, (list, tuple)) or OmegaConf.is_list(value)
    names = ([value] if value else []) if isinstance(value, str) else list(value) if is_list else None
    if names is None or not all(isinstance(n, str) and n for n in names):
        raise UserError(f"{where}model.lora.target_modules={value!r} is not valid: use {TARGET_MODULES_HINT}")
    if not names:
        raise UserError(f"{where}model.lora.target_modules is empty: name the layers to adapt, or use "
                        f"{TARGET_MODULES_HINT}")
    return names


def check_target_modules(names: list[str], layers: list[str], model: str, where: str = "") -> None:
    """Each name is a layer LoRA can adapt (peft's rule: a layer's dotted name is it or ends with '.' + it);
    else UserError listing the layers `model` has."""
    for name in names:
        if not any(layer == name or layer.endswith("." + name) for layer in layers):
            have = ", ".join(dict.fromkeys(layer.rsplit(".", 1)[-1] for layer in layers))
            raise UserError(f"{where}model.lora.target_modules: {name!r} is not a layer of {model} that LoRA can "
                            f"adapt: its layers are {have} (or use auto or all-linear)")


def _mapping_fields(schema: type, prefix: str = "") -> typing.Iterator[str]:
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        if typing.get_origin(hints[f.name]) is dict:
            yield prefix + f.name
        elif dataclasses.is_dataclass(hints[f.name]):
            yield from _mapping_fields(hints[f.name], f"{prefix}{f.name}.")


# The free-form mappings (Dict fields: `variants`, `launcher.additional_parameters`): keys are the user's to
# choose, so `KEY={a: 1}` and `KEY.a=1` add to them without Hydra's '+' (compose() in __main__.py).
FREE_FORM_KEYS = tuple(sorted({*_mapping_fields(Config),
                               *(k for s in LAUNCHER_SCHEMAS for k in _mapping_fields(s, "launcher."))}))


def register_schema() -> None:
    """The root schema, and each launcher's as launcher/<kind>_schema (conf/launcher/<kind>.yaml extends it)."""
    store = ConfigStore.instance()
    store.store(name="schema", node=Config)
    for schema in LAUNCHER_SCHEMAS:
        store.store(group="launcher", name=f"{schema.kind}_schema", node=schema)


def conf_dir() -> str:
    """The installed conf/ folder (works from any directory, for `pip install .` and `-e .` alike)."""
    return str(resources.files("slurm_router.conf"))


def nearest_existing(path: Path) -> Path:
    """The nearest part of `path` that exists (itself, or the closest parent; a dangling link counts)."""
    while not os.path.lexists(path):
        path = path.parent
    return path


def check_writable_dir(path: str | os.PathLike, setting: str, fix: str | None = None) -> Path:
    """The folder `path` (made later, parents and all) can be written: probed by making and removing a folder in
    its nearest existing part, before anything else is written. `setting` ("run_root='runs'") leads the one
    line a UserError gives, naming the path and the cause; `fix` ends it (default: set the setting to a folder
    you can write). Returns the absolute path."""
    target = Path(os.path.expanduser(str(path))).absolute()
    probe = nearest_existing(target)
    fix = fix or f"set {setting.split('=', 1)[0]}= to a folder you can write"
    if not probe.is_dir():
        what = "a dangling symbolic link" if probe.is_symlink() and not probe.exists() else "a file, not a folder"
        raise UserError(f"{setting}: {probe} is {what}: {fix}")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".slurm_router-write-test-", dir=probe))
    except OSError as e:
        cause = "it takes no new folders" if e.errno == errno.ENOENT else e.strerror or type(e).__name__
        raise UserError(f"{setting}: cannot write in {probe} ({cause}): {fix}") from None
    return target


def valid_keys(path: str) -> list[str]:
    """The keys the schema allows under a dotted path ('' = top level): for 'unknown key' messages."""
    node = OmegaConf.structured(Config)
    if path:
        node = OmegaConf.select(node, path)
    return sorted(node.keys()) if isinstance(node, DictConfig) else []


def launcher_key_error(key: str, kind: str, where: str = "") -> UserError:
    """launcher.<name> that launcher=<kind> does not have: say which launchers have it, or which keys it has."""
    name = key.split(".", 1)[1].split(".")[0]
    have = [f"launcher={s.kind}" for s in LAUNCHER_SCHEMAS if name in {f.name for f in dataclasses.fields(s)}]
    if have:
        return UserError(f"{where}launcher.{name} does not apply to launcher={kind}: it is an option of "
                         f"{', '.join(have)} only; choose one of those or drop launcher.{name}")
    keys = sorted(f.name for f in dataclasses.fields(launcher_schema(kind)))
    return UserError(f"{where}unknown key 'launcher.{name}': valid keys for launcher={kind} are {', '.join(keys)}")


def check_launcher_keys(cfg: DictConfig) -> None:
    """Keys added under launcher with '+' pass Hydra (the group's node is not closed): refuse them here."""
    kind = cfg.launcher.kind
    allowed = {f.name for f in dataclasses.fields(launcher_schema(kind))} if kind in CHOICES["launcher.kind"] else set()
    extra = [k for k in cfg.launcher if k not in allowed]
    if allowed and extra:
        raise launcher_key_error(f"launcher.{extra[0]}", kind)


def explain(error: Exception, where: str = "") -> UserError:
    """One line for an OmegaConf/Hydra error about a key: unknown keys list the valid ones."""
    key = getattr(error, "full_key", None) or ""
    msg = str(error).splitlines()[0] if str(error) else type(error).__name__
    if isinstance(error, ConfigKeyError) or "not in struct" in msg or re.search(r"Key '.*' not in", msg):
        kind = getattr(getattr(error, "object_type", None), "kind", None)
        if key.startswith("launcher.") and kind in CHOICES["launcher.kind"]:
            return launcher_key_error(key, kind, where)
        parent = key.rsplit(".", 1)[0] if "." in key else ""
        keys = valid_keys(parent)
        under = f"under {parent}" if parent else "at the top level"
        if not keys:
            return UserError(f"{where}unknown key '{key}': {parent or 'the top level'} has no key "
                             f"{key.rsplit('.', 1)[-1]!r} ({msg})")
        return UserError(f"{where}unknown key '{key}': valid keys {under} are {', '.join(keys)}")
    if isinstance(error, ValidationError) and key and re.search(r"'dict'|'\{\}'", msg):
        return _not_a_group(key, msg, where)
    if isinstance(error, ValidationError) and key:
        return UserError(f"{where}{key}: {msg}")
    return UserError(f"{where}{msg}")


EXPERIMENT_HINT = ("experiment is a string, the experiment's name, set by conf/experiment/NAME.yaml: pick one "
                   "with +experiment=NAME (its options live under train., data., model., ...; seeds= and prune= "
                   "are set at the top level)")


def _not_a_group(key: str, msg: str, where: str = "") -> UserError:
    """`experiment.seeds=2`, `train.lr.x=1`: a dotted key under a plain value (the user guessed where it lives)."""
    if key == "experiment":
        return UserError(f"{where}experiment has no keys under it: {EXPERIMENT_HINT}")
    kinds = {"Float": "a number", "Integer": "a whole number", "Boolean": "true or false", "string": "a string"}
    what = next((v for k, v in kinds.items() if k in msg), "a single value")
    return UserError(f"{where}{key} is {what} and has no keys under it: set {key}=VALUE")


def _get(cfg: DictConfig, key: str) -> Any:
    return OmegaConf.select(cfg, key)


def check_values(cfg: DictConfig, where: str = "") -> None:
    """Choices and ranges; raises UserError naming the key (prefixed with `where`, e.g. 'variants.r8.')."""
    for key, allowed in CHOICES.items():
        value = _get(cfg, key)
        if value in ("True", "False") and value.lower() in allowed:   # a str key given true/false on the command line
            continue
        if value not in allowed:
            raise UserError(f"{where}{key}={value!r} is not valid: choose one of {', '.join(allowed)}")
    for key, (low, high, low_inclusive) in RANGES.items():
        value = _get(cfg, key)
        if value is None:
            continue
        lo = f">= {low}" if low_inclusive else f"> {low}"
        hi = f" and <= {high}" if high is not None else ""
        if isinstance(value, float) and math.isnan(value):      # nan passes every comparison below
            raise UserError(f"{where}{key}=nan is not a number: it must be {lo}{hi}")
        too_low = value < low if low_inclusive else value <= low
        if too_low or (high is not None and value > high):
            raise UserError(f"{where}{key}={value!r} is out of range: it must be {lo}{hi}")
    names = target_module_names(cfg.model.lora.target_modules, where) if cfg.model.lora.enabled else None
    if names and cfg.model.kind == "gpt2":      # model=hf: checked on its architecture (__main__._check_models)
        check_target_modules(names, gpt2_lora_layers(cfg.model.n_layer), "GPT2LMHeadModel", where)
    if cfg.model.n_embd % cfg.model.n_head:
        raise UserError(f"{where}model.n_embd={cfg.model.n_embd} must be a multiple of model.n_head={cfg.model.n_head}")
    if cfg.data.max_len > cfg.model.n_positions and cfg.model.kind == "gpt2":
        raise UserError(f"{where}data.max_len={cfg.data.max_len} exceeds model.n_positions={cfg.model.n_positions}: "
                        "lower data.max_len or raise model.n_positions")
    if cfg.model.kind == "hf" and not cfg.model.name_or_path:
        raise UserError(f"{where}model.name_or_path is required with model=hf: give a local checkpoint directory")
    if cfg.model.kind == "hf" and not Path(os.path.expanduser(cfg.model.name_or_path)).is_dir():
        raise UserError(f"{where}model.name_or_path={cfg.model.name_or_path!r} is not a directory: "
                        "give a local transformers checkpoint (nothing is downloaded)")
    if any(s <= 0 for s in cfg.router.device_slowdown):
        raise UserError(f"{where}router.device_slowdown={list(cfg.router.device_slowdown)} must be all > 0")
    if list(cfg.router.affinity_boundaries) != sorted(set(cfg.router.affinity_boundaries)):
        raise UserError(f"{where}router.affinity_boundaries must be strictly increasing token lengths")
    check_job_values(cfg.launcher, where)
    from slurm_router.trackers import check_tracker        # tracker=...: a known mode, its packages installed
    check_tracker(cfg.get("tracker"), where)


# Slurm's --mail-type names (sbatch(1), 22.05 on); a list is comma-separated
MAIL_TYPES = ("NONE", "BEGIN", "END", "FAIL", "REQUEUE", "ALL", "INVALID_DEPEND", "STAGE_OUT", "TIME_LIMIT",
              "TIME_LIMIT_90", "TIME_LIMIT_80", "TIME_LIMIT_50", "ARRAY_TASKS")
CONTAINER_RUNTIMES = ("apptainer", "pyxis")


def mail_types(value: Any, where: str = "") -> list[str]:
    """launcher.mail_type as Slurm's names: 'END,FAIL', [END, FAIL] or None ([]). UserError for an unknown one."""
    if value is None:
        return []
    is_list = isinstance(value, (list, tuple)) or OmegaConf.is_list(value)
    names = [str(v).strip().upper() for v in value] if is_list else str(value).upper().split(",")
    bad = next((n for n in names if n.strip() not in MAIL_TYPES), None)
    if bad is not None:
        raise UserError(f"{where}launcher.mail_type={value!r}: {bad.strip()!r} is not a Slurm mail type: use "
                        f"{', '.join(MAIL_TYPES)} (several: launcher.mail_type='END,FAIL')")
    return [n.strip() for n in names]


def check_job_values(launcher: DictConfig, where: str = "") -> None:
    """The Slurm launchers' job options (setup, python, container, mail): what is wrong, found before any file is
    written. The apptainer image must exist here (the run dir holds its absolute path)."""
    if "mail_type" in launcher:
        mail_types(launcher.mail_type, where)
    if launcher.get("mail_user") is not None and not str(launcher.mail_user).strip():
        raise UserError(f"{where}launcher.mail_user is empty: give an address, or leave it unset")
    if launcher.get("python") is not None and not str(launcher.python).strip():
        raise UserError(f"{where}launcher.python is empty: give an interpreter, or leave it unset (the submitter's)")
    container = launcher.get("container")
    if container is None:
        return
    if container.runtime not in CONTAINER_RUNTIMES:
        raise UserError(f"{where}launcher.container.runtime={container.runtime!r} is not valid: choose one of "
                        f"{', '.join(CONTAINER_RUNTIMES)}")
    image = container.image
    if image is not None and not str(image).strip():
        raise UserError(f"{where}launcher.container.image is empty: give an image, or leave it unset (no container)")
    if image and container.runtime == "apptainer" and "://" not in image \
            and not Path(os.path.expanduser(image)).is_file():
        raise UserError(f"{where}launcher.container.image={image!r}: no such image file "
                        f"({Path(os.path.expanduser(image)).absolute()}): give the path of a .sif image, or a URI "
                        "such as docker://... that apptainer pulls")


SEEDS_HINT = "seeds=N (N training seeds from seed on) or a list of distinct whole numbers >= 0, e.g. seeds=[0,5,9]"
MAX_SEEDS = 1000


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def training_seeds(cfg: DictConfig) -> list[int]:
    """A variant's training seeds, one task each (LoRA init and data order; cfg.seed keeps the base model's init
    and the held-out eval batches): seeds=N gives seed, seed+1, ..., seed+N-1; seeds=[...] the list as given.
    Raises UserError (one line naming seeds) for anything else."""
    value = cfg.seeds
    if OmegaConf.is_list(value) or isinstance(value, (list, tuple)):
        seeds, shown = list(value), "[" + ",".join(map(str, value)) + "]"
        if not seeds:
            raise UserError(f"seeds=[] is empty: give at least one seed: {SEEDS_HINT}")
        bad = next((s for s in seeds if not _whole(s) or s < 0), None)
        if bad is not None or len(seeds) > MAX_SEEDS:
            what = f"{bad!r} is not a whole number >= 0" if bad is not None else f"more than {MAX_SEEDS} seeds"
            raise UserError(f"seeds={shown}: {what}: {SEEDS_HINT}")
        twice = next((s for i, s in enumerate(seeds) if s in seeds[:i]), None)
        if twice is not None:
            raise UserError(f"seeds={shown}: seed {twice} is listed twice: each replicate needs its own seed")
        return seeds
    if not _whole(value):
        raise UserError(f"seeds={value!r} is not a whole number: {SEEDS_HINT}")
    if not 1 <= value <= MAX_SEEDS:
        raise UserError(f"seeds={value} is out of range: it must be >= 1 and <= {MAX_SEEDS} (the number of training "
                        "seeds per variant), or a list such as seeds=[0,5,9]")
    return [cfg.seed + i for i in range(value)]


def variant_configs(cfg: DictConfig) -> dict[str, DictConfig]:
    """Each variant's full config: the experiment's config with that variant's overrides merged in."""
    out = {}
    if not isinstance(cfg.variants, DictConfig):
        raise UserError("variants must be a mapping of name -> overrides, e.g. variants: {r8: {model: {lora: {r: 8}}}}")
    common = cfg.copy()
    common.variants = {}            # merged without the variants, a sweep's 100 variants stay linear, and a fresh
    common = pickle.dumps(common)   # copy is unpickled for each (3x faster than OmegaConf.merge's deepcopy)
    for name, overrides in cfg.variants.items():
        name = str(name)
        if not NAME_RE.match(name):
            raise UserError(f"variants.{name!r}: a variant name must be 1-64 letters, digits, '_', '.', '+', '-' "
                            "and start with a letter or digit (it names folders and Slurm jobs)")
        if name == "base":
            raise UserError("variants.base: 'base' is the name of the base stage; rename the variant")
        if overrides is not None and not isinstance(overrides, DictConfig):
            raise UserError(f"variants.{name} must be a mapping of overrides, e.g. {{train: {{lr: 1e-3}}}}")
        if overrides is not None and "variants" in overrides:
            raise UserError(f"variants.{name}: a variant cannot declare variants")
        if overrides is not None and "seeds" in overrides:
            raise UserError(f"variants.{name}.seeds: seeds is set once, at the top level (every variant runs with "
                            "the same training seeds): set seeds= outside the variant")
        if overrides is not None and "nodes_per_task" in (overrides.get("resources") or {}):
            raise UserError(f"variants.{name}.resources.nodes_per_task: it is set once, at the top level (a stage is "
                            "one array job, each of its tasks on the same number of nodes): set "
                            "resources.nodes_per_task= outside the variant")
        if overrides is not None and "prune" in overrides:
            raise UserError(f"variants.{name}.prune: prune is set once, at the top level (it compares the variants "
                            "with each other): set prune= outside the variant")
        try:
            # unsafe_merge takes over its inputs: a fresh copy, and the overrides as plain containers
            out[name] = OmegaConf.unsafe_merge(pickle.loads(common), OmegaConf.to_container(overrides) if overrides else {})
        except OmegaConfBaseException as e:
            raise explain(e, where=f"variants.{name}: ") from None
    return out


def validate(cfg: DictConfig) -> dict[str, DictConfig]:
    """All checks that need no data: returns the variants' configs. Raises UserError."""
    if not NAME_RE.match(str(cfg.experiment)):
        raise UserError(f"experiment={cfg.experiment!r}: use 1-64 letters, digits, '_', '.', '+', '-'")
    check_values(cfg)
    training_seeds(cfg)
    variants = variant_configs(cfg)
    for name, vcfg in variants.items():
        check_values(vcfg, where=f"variants.{name}: ")
    if not variants:
        variants = {"main": cfg.copy()}
    if cfg.prune:
        check_prune(cfg, variants)
    return variants


def check_prune(cfg: DictConfig, variants: dict[str, DictConfig]) -> None:
    """prune=true compares variants at their in-training evaluations: it needs two variants that evaluate."""
    if len(variants) < 2:
        raise UserError("prune=true compares variants with each other, and this run has one: give two or more "
                        "variants (variants: or a -m sweep), or leave prune off")
    if len(training_seeds(cfg)) < 2:
        raise UserError("prune=true needs seeds >= 2 (e.g. seeds=3): with one training seed per variant its interval "
                        "cannot include training noise, and eval-sample noise alone would stop equally good "
                        "variants (prune.py)")
    for name, vcfg in variants.items():
        if not vcfg.train.eval_every or vcfg.train.eval_every >= vcfg.train.steps:
            own = (vcfg.train.eval_every, vcfg.train.steps) != (cfg.train.eval_every, cfg.train.steps)
            where = f"variants.{name}: " if own else ""     # the variant's own setting, or everyone's
            raise UserError(f"{where}prune=true needs train.eval_every > 0 and below train.steps={vcfg.train.steps} "
                            f"(it decides at the in-training evaluations; train.eval_every={vcfg.train.eval_every}): "
                            "set e.g. train.eval_every=25")
