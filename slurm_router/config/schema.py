"""Config schema: dataclasses registered in Hydra's ConfigStore, the choices and ranges each key allows.
Values live in conf/*.yaml; this file only says what is allowed. The checks: checks.py, variants.py.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Callable, Dict, Iterable, List, Optional, cast

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from slurm_router.config.metrics import EvalConfig
from slurm_router.router.types import RouterSettings

# The byte-level tokenizer (train/tokenizer.py) model=gpt2 reads text with: 256 bytes + end-of-text.
BYTE_VOCAB_SIZE = 257
FUSE_AUTO = "auto"  # resources.fuse_variants=auto


def fusing(cfg) -> bool:
    """resources.fuse_variants asks for fused tasks: auto, or K >= 2 (checked: an int or auto)."""
    width = cfg.resources.get("fuse_variants", 1)
    return width == FUSE_AUTO or int(width) >= 2


@dataclass
class LoraConfig:
    enabled: bool = True  # False: no LoRA, the whole model trains
    r: int = 8  # LoRA rank
    alpha: float = 16.0  # LoRA scaling numerator: the update is scaled by alpha/r
    dropout: float = 0.0  # dropout on the LoRA path's input
    # auto: peft's own per-architecture defaults (all-linear where peft has none) | all-linear | [names]
    target_modules: Any = "auto"
    use_rslora: bool = False  # rank-stabilised scaling alpha/sqrt(r) (peft)
    use_dora: bool = False  # weight-decomposed LoRA (peft)


@dataclass
class ModelConfig:
    kind: str = "gpt2"  # gpt2: built from this config | hf: a local checkpoint
    name_or_path: Optional[str] = None  # kind=hf: a local directory (never downloaded)
    n_layer: int = 2  # kind=gpt2: transformer blocks
    n_head: int = 4  # kind=gpt2: attention heads (n_embd is a multiple of it)
    n_embd: int = 128  # kind=gpt2: hidden width
    n_positions: int = 512  # kind=gpt2: the longest sequence (at least data.max_len)
    vocab_size: int = BYTE_VOCAB_SIZE  # model=gpt2's embedding rows: at least the byte-level tokenizer's
    dtype: str = "auto"  # frozen weights: auto (bf16 on GPU, fp32 on CPU) | fp32 | bf16
    base_dropout: str = "zero"  # kind=hf: zero (the checkpoint's dropout set to 0) | keep (train/base_dropout.py)
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class DataConfig:
    kind: str = "stdlib"  # stdlib | text_dir | jsonl | parquet | synthetic
    path: Optional[str] = None  # text_dir: a folder; jsonl: a file; parquet: a file or a folder
    text_field: str = "text"  # jsonl/parquet: the field holding the text (loss on every token)
    prompt_field: Optional[str] = None  # jsonl/parquet: with completion_field, loss on the completion only
    completion_field: Optional[str] = None  # jsonl/parquet: with prompt_field, the text the loss is on
    messages_field: Optional[str] = None  # jsonl/parquet: chat turns, loss on the assistant turns only
    max_len: int = 256  # tokens per sample; longer documents are cut into pieces
    split_on: str = "\n\n"  # a document is cut into samples at this separator first
    val_fraction: float = 0.05  # held out by a stable hash: rows, or files (else the last pieces of each file)
    max_documents: Optional[int] = None  # read at most this many documents (null: all)
    # data=synthetic: token sequences with a controllable length distribution (benchmarks)
    n_samples: int = 4096
    length_dist: str = "lognormal"  # lognormal | uniform | fixed
    mean_len: int = 96  # data=synthetic: the mean sequence length in tokens
    sigma: float = 0.8  # data=synthetic, lognormal: the spread of the lengths
    min_len: int = 8  # data=synthetic: the shortest sequence


@dataclass
class RouterConfig:
    """The router's knobs; their defaults (and meanings) live once, in router.types.RouterSettings."""

    policy: str = RouterSettings.policy  # round_robin | least_loaded | affinity | balanced
    cost: str = RouterSettings.cost  # tokens | tokens_attention
    attention_weight: float = RouterSettings.attention_weight  # cost=tokens_attention: the quadratic term's weight
    attention_ref_len: int = RouterSettings.attention_ref_len  # cost=tokens_attention: its length scale
    microbatch_overhead_tokens: int = RouterSettings.microbatch_overhead_tokens  # a micro-batch's fixed cost
    memory_headroom: float = RouterSettings.memory_headroom  # a device's memory budget: this x its total memory
    max_tokens_per_microbatch: Optional[int] = RouterSettings.max_tokens_per_microbatch  # cap (null: memory)
    affinity_boundaries: List[int] = field(default_factory=list)  # policy=affinity: sample-length bucket edges
    speed_model: str = RouterSettings.speed_model  # robust | ema | none (router/speed_model.py)
    speed_ema: float = RouterSettings.speed_ema  # speed_model=ema: the weight of the newest step
    row_cost: str = RouterSettings.row_cost  # packed rows: fitted (from step times, router/cost_model.py) | fixed


@dataclass
class LauncherConfig:
    """What every launcher has. One schema per launcher (LAUNCHER_SCHEMAS), registered in the `launcher` group: a
    key that the chosen launcher does not have is an error naming the launchers that have it (launcher_key_error)."""

    kind: str = MISSING  # each schema's own default; its backend in slurm_router.scheduler.registry


@dataclass
class LocalLauncherConfig(LauncherConfig):
    kind: str = "local"
    cpu_slots: Optional[int] = None  # without GPUs: CPU worker slots (default: the core count)


# OmegaConf 2.3 cannot hold typing.Literal fields, so `kind` is a str whose allowed values are these schemas'
# own defaults (CHOICES["launcher.kind"]); no other code spells the kinds out. A scheduler's backend adds its
# launchers' schemas when it loads (scheduler/registry.py add_launcher_schema; Slurm's: backends/slurm/config.py);
# the command loads every backend before it composes a config.
LAUNCHER_SCHEMAS: list[type[LauncherConfig]] = [LocalLauncherConfig]


def launcher_schema(kind: str) -> type[LauncherConfig]:
    return next(s for s in LAUNCHER_SCHEMAS if s.kind == kind)


def launcher_setting(launcher: dict | DictConfig | None, key: str) -> Any:
    """A launcher value from a task's resolved config, or its schema default (the one place defaults live)."""
    launcher = launcher or {}
    if key in launcher:
        return launcher[key]
    for schema in LAUNCHER_SCHEMAS:  # a field with a default_factory (a list, a nested config) is no attribute
        found = {f.name: f for f in dataclasses.fields(schema)}.get(key)
        if found is not None:
            return (
                cast(Callable[[], Any], found.default_factory)()
                if found.default is dataclasses.MISSING
                else found.default
            )
    raise KeyError(f"launcher.{key}: no launcher schema has it")


@dataclass
class TrainConfig:
    steps: int = 60  # optimiser steps per variant
    global_batch_size: int = 16  # samples per step, over all of a task's devices
    lr: float = 2e-3  # peak learning rate (AdamW), after warmup_steps
    warmup_steps: int = 5  # linear warmup from 0 to lr
    weight_decay: float = 0.0  # AdamW's weight decay
    grad_clip: float = 1.0  # clip the gradient norm to this (0: off)
    eval_every: int = 0  # 0: evaluate at the start and the end only
    eval_batches: int = 8  # held-out batches per evaluation
    eval_batch_size: int = 16  # samples per held-out batch
    precision: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | fp32 | bf16
    # Speed switches (see slurm_router/train/loss.py and README "GPU throughput")
    compile: bool = False  # torch.compile the transformer backbone
    gradient_checkpointing: bool = False  # recompute layer activations in backward (long sequences)
    loss_chunk_tokens: int = 0  # >0: chunked cross-entropy, never the full fp32 logits (4096 on GPU)
    pad_to_multiple: int = 1  # pad micro-batch width to a multiple (fewer shapes for compile)
    prefetch: bool = True  # build the next micro-batch's tensors while this one computes
    # Packed micro-batches: a device's samples end to end in one row, no padding (slurm_router/train/packed.py).
    # auto: on unless train.compile (a row's length changes every step); a model whose attention cannot take
    # packed rows trains padded, with one line saying why.
    packing: str = "auto"  # auto | true | false
    # resources.fuse_variants >= 2 (slurm_router/worker/fused.py): a micro-batch's variants in one packed row (one
    # forward and backward: bigger kernels, a GPU's choice) or one row per variant through the shared model (the
    # activations of one variant at a time: faster on CPU, benchmarks/results/fused-cpu.md). auto: per_variant on
    # CPU, row on a GPU.
    fused_layout: str = "auto"  # auto | row | per_variant
    checkpoint_every: int = 0  # save a checkpoint every N steps (0: only on a stop signal)
    keep_checkpoints: int = 3  # the newest K checkpoints are kept (a damaged newest falls back)


@dataclass
class BaseStageConfig:
    enabled: bool = False  # train a base model first (no LoRA), cached by its config hash
    steps: int = 200  # the base stage's optimiser steps
    lr: float = 3e-3  # the base stage's peak learning rate
    global_batch_size: int = 16  # the base stage's samples per step
    cache_dir: Optional[str] = None  # default: ~/.cache/slurm_router/base


@dataclass
class ResourcesConfig:
    devices_per_task: int = 1  # devices (GPUs, or CPU workers) per task; the router splits each batch over them
    # Co-located variants: tasks sharing one GPU (small LoRA jobs leave most of a big GPU idle).
    # 1 = a GPU per task; N = up to N tasks per GPU; 0 = as many as their predicted memory fits.
    tasks_per_gpu: int = 1
    # Nodes a task's devices spread over, devices_per_task/N on each (Slurm launchers with launcher.srun_workers:
    # one srun task per device, --nodes=N --ntasks-per-node=D/N); 1: every device of a task on one node.
    nodes_per_task: int = 1
    # Fused variants: up to K compatible LoRA tasks of the variants stage train in one task over one shared base
    # (launch/fuse.py groups them, worker/fused.py trains them); 1 = every task alone; auto (launcher=local) = the
    # tasks spread over the slots the machine runs at once, as far as the memory model fits a fused task
    # (backends/local/launcher.py auto_fuse_variants). Set once, at the top level.
    fuse_variants: Any = 1  # K (1-64) | auto


@dataclass
class TrackerConfig:
    """Experiment trackers that rank 0 of each task logs to, from the rows it writes to the events file
    (slurm_router/tracking/trackers.py): tracker=tensorboard | mlflow | wandb, several as tracker=[tensorboard,mlflow]
    (conf/tracker/). Packages: pip install -e '.[tracking]'."""

    tensorboard: bool = False  # log to TensorBoard (tracker=tensorboard sets it)
    mlflow: bool = False  # log to MLflow (tracker=mlflow sets it)
    wandb: bool = False  # log to Weights & Biases (tracker=wandb sets it)
    dir: Optional[str] = None  # default RUN_DIR/trackers: tensorboard/, mlruns/, wandb/ in it
    mlflow_uri: Optional[str] = None  # default $MLFLOW_TRACKING_URI, else a file store in <dir>/mlruns
    mlflow_experiment: Optional[str] = None  # default: the experiment's name
    wandb_project: Optional[str] = None  # default $WANDB_PROJECT, else the experiment's name
    wandb_entity: Optional[str] = None  # the W&B team or user (default: yours)
    wandb_mode: Optional[str] = None  # offline | online; default $WANDB_MODE, else offline (no internet there)


@dataclass
class AutoSeedsConfig:  # seeds=auto: how far the contest may add replicates (docs/decisions.md, "seeds=auto")
    max: int = 6  # replicates per variant at most (2 to start with, one more per undecided round)
    budget_device_hours: Optional[float] = None  # stop adding replicates once the run has spent this much
    min_effect: Optional[float] = None  # stop adding them once every variant is within this of the best (metric units)


@dataclass
class Config:
    experiment: str = "default"  # the run's name: runs are written under run_root/<experiment>/<time>/
    seed: int = 0  # the base model's init and the held-out eval batches
    # training seeds (LoRA init, data order), one task per variant and seed: N (seed, seed+1, ..., seed+N-1) or a
    # list [0, 5, 9]; 1 = one task per variant, named as the variant (training_seeds); auto (with prune=true): 2
    # seeds each, then one more at a time while the contest is undecided, up to auto_seeds.max (worker/auto_seeds.py)
    seeds: Any = 1
    auto_seeds: AutoSeedsConfig = field(default_factory=AutoSeedsConfig)
    # stop a clear loser at an in-training evaluation (train.eval_every), by the verdict's statistics: prune.py
    prune: bool = False
    # print the plan (stages, tasks, devices, predicted memory, array sizes, worst-case device-hours; the Slurm
    # scripts and submit commands) and write only the preview: nothing trains or is submitted (launch/preview.py)
    dry_run: bool = False
    run_root: str = "runs"  # where runs are written
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    launcher: Any = MISSING  # one of LAUNCHER_SCHEMAS, picked by the launcher group (conf/launcher/)
    train: TrainConfig = field(default_factory=TrainConfig)
    base: BaseStageConfig = field(default_factory=BaseStageConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    variants: Dict[str, Any] = field(default_factory=dict)  # name -> overrides, e.g. {model: {lora: {r: 8}}}
    tracker: TrackerConfig = field(default_factory=TrackerConfig)  # picked by the tracker group (conf/tracker/)
    eval: EvalConfig = field(default_factory=EvalConfig)  # task metrics and the primary one (config/metrics.py)


CHOICES = {
    "model.kind": ("gpt2", "hf"),
    "data.kind": ("stdlib", "text_dir", "jsonl", "parquet", "synthetic"),
    "model.dtype": ("auto", "fp32", "bf16"),
    "model.base_dropout": ("zero", "keep"),
    "data.length_dist": ("lognormal", "uniform", "fixed"),
    "launcher.kind": tuple(s.kind for s in LAUNCHER_SCHEMAS),
    "train.precision": ("auto", "fp32", "bf16"),
    "train.packing": ("auto", "true", "false"),
    "train.fused_layout": ("auto", "row", "per_variant"),
}
# key -> (low, high, low_inclusive); None = unbounded
RANGES: dict[str, tuple[float, float | None, bool]] = {
    "seed": (0, None, True),
    "model.n_layer": (1, 1024, True),
    "model.n_head": (1, 1024, True),
    "model.n_embd": (1, 65536, True),
    "model.n_positions": (2, 1 << 20, True),
    "model.vocab_size": (2, 1 << 22, True),
    "model.lora.r": (1, 4096, True),
    "model.lora.alpha": (0, None, False),
    "model.lora.dropout": (0, 1, True),
    "data.max_len": (2, 1 << 20, True),
    "data.val_fraction": (0, 1, False),
    "data.max_documents": (1, None, True),
    "data.n_samples": (1, 1 << 26, True),
    "data.mean_len": (1, 1 << 20, True),
    "data.sigma": (0, 10, True),
    "data.min_len": (2, 1 << 20, True),
    # above 1 only in tests (config/testing_aids.py); the other router.* keys: RouterSettings checks them
    "router.memory_headroom": (0, 1, False),
    "launcher.cpu_slots": (1, 4096, True),
    "launcher.timeout_min": (1, None, True),
    "launcher.mem_gb": (0, None, False),
    "launcher.cpus_per_task": (1, 4096, True),
    "launcher.cpus_per_device": (1, 1024, True),
    "launcher.array_parallelism": (1, None, True),
    "launcher.max_requeues": (0, 1000, True),
    "launcher.signal_delay_s": (0, 3600, True),
    "launcher.max_failures": (0, 1000, True),
    "train.steps": (1, 10_000_000, True),
    "train.global_batch_size": (1, 1 << 20, True),
    "train.lr": (0, 10, False),
    "train.warmup_steps": (0, None, True),
    "train.weight_decay": (0, 10, True),
    "train.grad_clip": (0, None, True),
    "train.eval_every": (0, None, True),
    "train.eval_batches": (1, 100_000, True),
    "train.eval_batch_size": (1, 1 << 20, True),
    "train.checkpoint_every": (0, None, True),
    "train.keep_checkpoints": (1, 1000, True),
    "train.loss_chunk_tokens": (0, None, True),
    "train.pad_to_multiple": (1, 4096, True),
    "base.steps": (1, 10_000_000, True),
    "base.lr": (0, 10, False),
    "base.global_batch_size": (1, 1 << 20, True),
    "resources.devices_per_task": (1, 4096, True),
    "resources.tasks_per_gpu": (0, 64, True),
    "resources.nodes_per_task": (1, 4096, True),
    "resources.fuse_variants": (1, 64, True),
}
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,63}$")


def _mapping_fields(schema: type, prefix: str = "") -> typing.Iterator[str]:
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        if typing.get_origin(hints[f.name]) is dict:
            yield prefix + f.name
        elif dataclasses.is_dataclass(hints[f.name]):
            yield from _mapping_fields(hints[f.name], f"{prefix}{f.name}.")


def free_form_keys() -> tuple[str, ...]:
    """The free-form mappings (Dict fields: `variants`, `launcher.additional_parameters`): keys are the user's to
    choose, so `KEY={a: 1}` and `KEY.a=1` add to them without Hydra's '+' (compose() in config/compose.py). Asked
    each time: a backend adds its launchers' schemas when it loads."""
    launchers = (k for s in LAUNCHER_SCHEMAS for k in _mapping_fields(s, "launcher."))
    return tuple(sorted({*_mapping_fields(Config), *launchers}))


def register_schema() -> None:
    """The root schema, and each launcher's as launcher/<kind>_schema (conf/launcher/<kind>.yaml extends it)."""
    store = ConfigStore.instance()
    store.store(name="schema", node=Config)
    for schema in LAUNCHER_SCHEMAS:
        store.store(group="launcher", name=f"{schema.kind}_schema", node=schema)


def conf_dir() -> str:
    """The installed conf/ folder (works from any directory, for `pip install .` and `-e .` alike)."""
    return str(resources.files("slurm_router.conf"))


def valid_keys(path: str) -> list[str]:
    """The keys the schema allows under a dotted path ('' = top level): for 'unknown key' messages."""
    node = OmegaConf.structured(Config)
    if path:
        node = OmegaConf.select(node, path)
    return sorted(cast(Iterable[str], node.keys())) if isinstance(node, DictConfig) else []
