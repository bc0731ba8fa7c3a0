"""The schema's sections (model.*, model.lora.*, data.*, train.*, base.*, resources.*, tracker.*, auto_seeds.*):
each key declared beside its field (config/settings.py), the comment beside it its help line. Parts of
config/schema.py's Config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from slurm_router.config import conditions as when
from slurm_router.config import data_sources, model_families
from slurm_router.config.model_families.gpt2 import BYTE_VOCAB_SIZE
from slurm_router.config.settings import setting


@dataclass
class LoraConfig:
    enabled: bool = setting(
        True, reader="train/model.py: model_cfg.lora.enabled"
    )  # False: no LoRA, the whole model trains
    r: int = setting(
        8, bounds=(1, 4096, True), reader="train/model.py: r=lc.r", read_if=when.LORA, example="4"
    )  # LoRA rank
    alpha: float = setting(
        16.0, bounds=(0, None, False), reader="train/model.py: lora_alpha=lc.alpha", read_if=when.LORA, example="8"
    )  # LoRA scaling numerator: the update is scaled by alpha/r
    dropout: float = setting(
        0.0, bounds=(0, 1, True), reader="train/model.py: lora_dropout=lc.dropout", read_if=when.LORA, example="0.1"
    )  # dropout on the LoRA path's input
    # auto: peft's own per-architecture defaults (all-linear where peft has none) | all-linear | [names]
    target_modules: Any = setting(
        "auto",
        takes="str or list",
        reader="train/model.py: target_module_names(model_cfg.lora.target_modules)",
        read_if=when.LORA,
        example="all-linear",
    )
    use_rslora: bool = setting(
        False, reader="train/model.py: use_rslora=lc.use_rslora", read_if=when.LORA, example="true"
    )  # rank-stabilised scaling alpha/sqrt(r) (peft)
    use_dora: bool = setting(
        False, reader="train/model.py: use_dora=lc.use_dora", read_if=when.LORA, example="true"
    )  # weight-decomposed LoRA (peft)


@dataclass
class ModelConfig:
    kind: str = setting(
        "gpt2",
        choices=tuple(model_families.FAMILIES),
        reader="config/model_families/__init__.py: family(str(model_cfg.kind))",
    )  # gpt2: built from this config | hf: a local checkpoint
    name_or_path: Optional[str] = setting(
        None,
        reader="train/model.py: os.path.expanduser(model_cfg.name_or_path)",
        read_if=when.family_reads("model.name_or_path", on=("model=hf",)),
        example="/tmp",
    )  # kind=hf: a local directory (never downloaded)
    n_layer: int = setting(
        2,
        bounds=(1, 1024, True),
        reader="train/model.py: n_layer=model_cfg.n_layer",
        read_if=when.family_reads("model.n_layer", off=when.HF),
        example="3",
    )  # kind=gpt2: transformer blocks
    n_head: int = setting(
        4,
        bounds=(1, 1024, True),
        reader="train/model.py: n_head=model_cfg.n_head",
        read_if=when.family_reads("model.n_head", off=when.HF),
        example="2",
    )  # kind=gpt2: attention heads (n_embd is a multiple of it)
    n_embd: int = setting(
        128,
        bounds=(1, 65536, True),
        reader="train/model.py: n_embd=model_cfg.n_embd",
        read_if=when.family_reads("model.n_embd", off=when.HF),
        example="64",
    )  # kind=gpt2: hidden width
    n_positions: int = setting(
        512,
        bounds=(2, 1 << 20, True),
        reader="train/model.py: n_positions=model_cfg.n_positions",
        read_if=when.family_reads("model.n_positions", off=when.HF),
        example="256",
    )  # kind=gpt2: the longest sequence (at least data.max_len)
    vocab_size: int = setting(
        BYTE_VOCAB_SIZE,
        bounds=(2, 1 << 22, True),
        reader="worker/setup.py: cfg.model.vocab_size,",
        read_if=when.family_reads("model.vocab_size", off=when.HF),
        example="300",
    )  # model=gpt2's embedding rows: at least the byte-level tokenizer's
    dtype: str = setting(
        "auto",
        choices=("auto", "fp32", "bf16"),
        reader='train/model.py: model_cfg.dtype == "bf16"',
        read_if=when.LORA,
        example="bf16",
    )  # frozen weights: auto (bf16 on GPU, fp32 on CPU) | fp32 | bf16
    base_dropout: str = setting(
        "zero",
        choices=("zero", "keep"),
        reader='train/model.py: getattr(model_cfg, "base_dropout", "zero") != base_dropout.KEEP',
        read_if=when.family_reads("model.base_dropout", on=when.HF),
        example="keep",
    )  # kind=hf: zero (the checkpoint's dropout set to 0) | keep (train/base_dropout.py)
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class DataConfig:
    kind: str = setting(
        "stdlib", choices=tuple(data_sources.SOURCES)
    )  # stdlib | text_dir | jsonl | parquet | synthetic
    path: Optional[str] = setting(
        None, example="/nonexistent/texts"
    )  # text_dir: a folder; jsonl: a file; parquet: a file or a folder
    text_field: str = setting("text", example="body")  # jsonl/parquet: the field holding the text (loss on every token)
    prompt_field: Optional[str] = setting(
        None, example="prompt"
    )  # jsonl/parquet: with completion_field, loss on the completion only
    completion_field: Optional[str] = setting(
        None, example="completion"
    )  # jsonl/parquet: with prompt_field, the text the loss is on
    messages_field: Optional[str] = setting(
        None, example="messages"
    )  # jsonl/parquet: chat turns, loss on the assistant turns only
    max_len: int = setting(
        256, bounds=(2, 1 << 20, True), example="16"
    )  # tokens per sample; longer documents are cut into pieces
    split_on: str = setting("\n\n", example="'\\n'")  # a document is cut into samples at this separator first
    val_fraction: float = setting(
        0.05, bounds=(0, 1, False), example="0.5"
    )  # held out by a stable hash: rows, or files (else the last pieces of each file)
    max_documents: Optional[int] = setting(
        None, bounds=(1, None, True), example="3"
    )  # read at most this many documents (null: all)
    # data=synthetic: token sequences with a controllable length distribution (benchmarks)
    n_samples: int = setting(4096, bounds=(1, 1 << 26, True), example="100")
    length_dist: str = setting(
        "lognormal", choices=("lognormal", "uniform", "fixed"), example="uniform"
    )  # lognormal | uniform | fixed
    mean_len: int = setting(
        96, bounds=(1, 1 << 20, True), example="40"
    )  # data=synthetic: the mean sequence length in tokens
    sigma: float = setting(
        0.8, bounds=(0, 10, True), example="0.3"
    )  # data=synthetic, lognormal: the spread of the lengths
    min_len: int = setting(8, bounds=(2, 1 << 20, True), example="20")  # data=synthetic: the shortest sequence


@dataclass
class TrainConfig:
    steps: int = setting(
        60, bounds=(1, 10_000_000, True), reader="launch/plan.py: steps=vcfg.train.steps"
    )  # optimiser steps per variant
    global_batch_size: int = setting(
        16, bounds=(1, 1 << 20, True), reader="launch/plan.py: global_batch_size=vcfg.train.global_batch_size"
    )  # samples per step, over all of a task's devices
    lr: float = setting(
        2e-3, bounds=(0, 10, False), reader="launch/plan.py: lr=vcfg.train.lr"
    )  # peak learning rate (AdamW), after warmup_steps
    warmup_steps: int = setting(
        5, bounds=(0, None, True), reader="worker/worker.py: self.cfg.train.warmup_steps"
    )  # linear warmup from 0 to lr
    weight_decay: float = setting(
        0.0, bounds=(0, 10, True), reader="worker/setup.py: cfg.train.weight_decay"
    )  # AdamW's weight decay
    grad_clip: float = setting(
        1.0, bounds=(0, None, True), reader="worker/worker.py: self.cfg.train.grad_clip"
    )  # clip the gradient norm to this (0: off)
    eval_every: int = setting(
        0, bounds=(0, None, True), reader="worker/worker.py: self.cfg.train.eval_every"
    )  # 0: evaluate at the start and the end only
    eval_batches: int = setting(
        8, bounds=(1, 100000, True), reader="worker/setup.py: cfg.train.eval_batches"
    )  # held-out batches per evaluation
    eval_batch_size: int = setting(
        16, bounds=(1, 1 << 20, True), reader="worker/setup.py: cfg.train.eval_batch_size"
    )  # samples per held-out batch
    precision: str = setting(
        "auto", choices=("auto", "fp32", "bf16"), reader="worker/microbatch.py: cfg.train.precision"
    )  # auto (bf16 on GPU, fp32 on CPU) | fp32 | bf16
    # Speed switches (see slurm_router/train/loss.py and README "GPU throughput")
    compile: bool = setting(
        False, reader="worker/setup.py: if cfg.train.compile:"
    )  # torch.compile the transformer backbone
    gradient_checkpointing: bool = setting(
        False, reader="worker/setup.py: gradient_checkpointing=cfg.train.gradient_checkpointing"
    )  # recompute layer activations in backward (long sequences)
    loss_chunk_tokens: int = setting(
        0, bounds=(0, None, True), reader="worker/microbatch.py: cfg.train.loss_chunk_tokens"
    )  # >0: chunked cross-entropy, never the full fp32 logits (4096 on GPU)
    pad_to_multiple: int = setting(
        1,
        bounds=(1, 4096, True),
        reader="worker/microbatch.py: self.cfg.train.pad_to_multiple",
        read_if=when.PADDED,
        example="8",
    )  # pad micro-batch width to a multiple (fewer shapes for compile)
    prefetch: bool = setting(
        True, reader="worker/microbatch.py: self.cfg.train.prefetch"
    )  # build the next micro-batch's tensors while this one computes
    # Packed micro-batches: a device's samples end to end in one row, no padding (slurm_router/train/packed.py).
    # auto: on unless train.compile (a row's length changes every step); a model whose attention cannot take
    # packed rows trains padded, with one line saying why.
    packing: str = setting(
        "auto", choices=("auto", "true", "false"), reader="train/packed.py: str(train_cfg.packing).lower()"
    )  # auto | true | false
    # resources.fuse_variants >= 2 (slurm_router/worker/fused.py): a micro-batch's variants in one packed row (one
    # forward and backward: bigger kernels, a GPU's choice) or one row per variant through the shared model (the
    # activations of one variant at a time: faster on CPU, benchmarks/results/fused-cpu.md). auto: per_variant on
    # CPU, row on a GPU.
    fused_layout: str = setting(
        "auto",
        choices=("auto", "row", "per_variant"),
        reader="worker/fused.py: self.cfg.train.fused_layout",
        read_if=when.FUSED,
        example="row",
    )  # auto | row | per_variant
    checkpoint_every: int = setting(
        0, bounds=(0, None, True), reader="worker/worker.py: self.cfg.train.checkpoint_every"
    )  # save a checkpoint every N steps (0: only on a stop signal)
    keep_checkpoints: int = setting(
        3, bounds=(1, 1000, True), reader="worker/worker.py: self.cfg.train.keep_checkpoints"
    )  # the newest K checkpoints are kept (a damaged newest falls back)


@dataclass
class BaseStageConfig:
    enabled: bool = setting(
        False, reader="artifacts/base_cache.py: bool(cfg.base.enabled)", read_if=when.BASE_ENABLED, example="true"
    )  # train a base model first (no LoRA), cached by its config hash
    steps: int = setting(
        200,
        bounds=(1, 10_000_000, True),
        reader="launch/plan.py: steps=cfg.base.steps",
        read_if=when.BASE_STAGE,
        example="5",
    )  # the base stage's optimiser steps
    lr: float = setting(
        3e-3, bounds=(0, 10, False), reader="launch/plan.py: lr=cfg.base.lr", read_if=when.BASE_STAGE, example="1e-3"
    )  # the base stage's peak learning rate
    global_batch_size: int = setting(
        16,
        bounds=(1, 1 << 20, True),
        reader="launch/plan.py: global_batch_size=cfg.base.global_batch_size",
        read_if=when.BASE_STAGE,
        example="8",
    )  # the base stage's samples per step
    cache_dir: Optional[str] = setting(
        None,
        reader="artifacts/base_cache.py: cfg.base.cache_dir or",
        read_if=when.BASE_STAGE,
        example="/tmp/slurm_router_base_cache",
    )  # default: ~/.cache/slurm_router/base


@dataclass
class ResourcesConfig:
    devices_per_task: int = setting(
        1, bounds=(1, 4096, True), reader="launch/plan.py: devices=vcfg.resources.devices_per_task"
    )  # devices (GPUs, or CPU workers) per task; the router splits each batch over them
    # Co-located variants: tasks sharing one GPU (small LoRA jobs leave most of a big GPU idle).
    # 1 = a GPU per task; N = up to N tasks per GPU; 0 = as many as their predicted memory fits.
    tasks_per_gpu: int = setting(
        1,
        bounds=(0, 64, True),
        reader={
            "local": "backends/local/launcher.py: cfg.resources.tasks_per_gpu or",
            "slurm": "backends/slurm/common.py: int(cfg.resources.tasks_per_gpu)",
            "sbatch": "backends/slurm/common.py: int(cfg.resources.tasks_per_gpu)",
        },
    )
    # Nodes a task's devices spread over, devices_per_task/N on each (Slurm launchers with launcher.srun_workers:
    # one srun task per device, --nodes=N --ntasks-per-node=D/N); 1: every device of a task on one node.
    nodes_per_task: int = setting(
        1,
        bounds=(1, 4096, True),
        reader="backends/slurm/common.py: int(cfg.resources.nodes_per_task)",
        variant="a stage is one array job, each of its tasks on the same number of nodes",
    )
    # Fused variants: up to K compatible LoRA tasks of the variants stage train in one task over one shared base
    # (launch/fuse.py groups them, worker/fused.py trains them); 1 = every task alone; auto (launcher=local) = the
    # tasks spread over the slots the machine runs at once, as far as the memory model fits a fused task
    # (backends/local/launcher.py auto_fuse_variants). Set once, at the top level.
    fuse_variants: Any = setting(
        1,
        bounds=(1, 64, True),
        takes="int or auto",
        reader="launch/plan.py: cfg.resources.fuse_variants",
        sweep="it groups the run's variants with each other, so it is one setting for the whole run: set it once (resources.fuse_variants=auto or K), or run each value on its own",
        variant="it groups the variants with each other",
    )  # K (1-64) | auto


@dataclass
class TrackerConfig:
    """Experiment trackers that rank 0 of each task logs to, from the rows it writes to the events file
    (slurm_router/tracking/trackers.py): tracker=tensorboard | mlflow | wandb, several as tracker=[tensorboard,mlflow]
    (conf/tracker/). Packages: pip install -e '.[tracking]'."""

    tensorboard: bool = setting(
        False, reader='tracking/trackers.py: KINDS = ("tensorboard", "mlflow", "wandb")'
    )  # log to TensorBoard (tracker=tensorboard sets it)
    mlflow: bool = setting(
        False, reader='tracking/trackers.py: KINDS = ("tensorboard", "mlflow", "wandb")'
    )  # log to MLflow (tracker=mlflow sets it)
    wandb: bool = setting(
        False, reader='tracking/trackers.py: KINDS = ("tensorboard", "mlflow", "wandb")'
    )  # log to Weights & Biases (tracker=wandb sets it)
    dir: Optional[str] = setting(
        None, reader='tracking/trackers.py: tracker.get("dir")'
    )  # default RUN_DIR/trackers: tensorboard/, mlruns/, wandb/ in it
    mlflow_uri: Optional[str] = setting(
        None, reader='tracking/trackers.py: tracker.get("mlflow_uri")'
    )  # default $MLFLOW_TRACKING_URI, else a file store in <dir>/mlruns
    mlflow_experiment: Optional[str] = setting(
        None, reader='tracking/trackers.py: tracker.get("mlflow_experiment")'
    )  # default: the experiment's name
    wandb_project: Optional[str] = setting(
        None, reader='tracking/trackers.py: tracker.get("wandb_project")'
    )  # default $WANDB_PROJECT, else the experiment's name
    wandb_entity: Optional[str] = setting(
        None, reader='tracking/trackers.py: tracker.get("wandb_entity")'
    )  # the W&B team or user (default: yours)
    wandb_mode: Optional[str] = setting(
        None, reader='tracking/trackers.py: tracker.get("wandb_mode")'
    )  # offline | online; default $WANDB_MODE, else offline (no internet there)


@dataclass
class AutoSeedsConfig:  # seeds=auto: how far the contest may add replicates (docs/decisions.md, "seeds=auto")
    max: int = setting(
        6, reader='config/variants.py: .get("max", 6)', read_if=when.AUTO_SEEDS, example="4"
    )  # replicates per variant at most (2 to start with, one more per undecided round)
    budget_device_hours: Optional[float] = setting(
        None, reader='worker/auto_seeds.py: .get("budget_device_hours")', read_if=when.AUTO_SEEDS, example="2.5"
    )  # stop adding replicates once the run has spent this much
    min_effect: Optional[float] = setting(
        None, reader='worker/prune.py: auto.get("min_effect")', read_if=when.AUTO_SEEDS, example="0.02"
    )  # stop adding them once every variant is within this of the best (metric units)
