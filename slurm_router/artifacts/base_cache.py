"""The base stage's cache: a base model trained once, reused by every run whose model shape, data, base schedule
and seed hash the same (docs/ARCHITECTURE.md, "A task's lifecycle": `cached`).

    <base.cache_dir | $SLURM_ROUTER_CACHE | ~/.cache/slurm_router>/base/<hash>/   a transformers checkpoint:
      config.json, generation_config.json    the model's config (save_pretrained)
      model.safetensors                      the full model's weights (one file)
      model.json                             its sidecar: size and sha256
      tokenizer.json, tokenizer_config.json  the byte tokenizer as a transformers tokenizer (byte_tokenizer.py)
      meta.json                              the base task's result (held-out loss, ...), written last: the
                                             cache entry is complete

`AutoModelForCausalLM.from_pretrained(<hash>/)` loads it, and the variants' adapters name it as their base
(adapters.py). The folder is written whole or not at all (a temp folder renamed into place: adapters.write_folder).

A verified artifact: it is used only when whole (meta.json present, config.json and the tokenizer there,
model.safetensors matching its sidecar's size and sha256), checked where a run decides to reuse it (plan,
submit_stages, resume) and again by every worker before it loads the weights. A damaged, truncated or missing
cache is named in one line and never used: the base stage simply trains again and rewrites it in place. Before
anything trains, the cache folder must be writable and have room for the weights (check_room). The hash's
`format` changes with the layout, so a cache of an older layout (model.pt) is never read.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import cast

from omegaconf import DictConfig, OmegaConf

from slurm_router.config import model_families
from slurm_router.config.checks import check_writable_dir, nearest_existing
from slurm_router.errors import UserError
from slurm_router.fileio import WriteError, atomic_write_text, sidecar_path, sign_file, verify_file
from slurm_router.rundir.layout import BASE_META, BASE_WEIGHTS

ABSENT = "absent"  # check(): nothing cached yet (a first run), not damage
FORMAT = 2  # 1: model.pt (a torch.save state dict); 2: a save_pretrained folder
REQUIRED = ("config.json", "tokenizer.json", "tokenizer_config.json")  # besides the verified weights
# Room asked for beyond the estimated weights: the safetensors header, config, tokenizer, sidecar, meta.json.
MARGIN = 1.10
MARGIN_BYTES = 16 << 20


class BaseCacheError(UserError):
    """The cached base weights cannot be used (damaged after the run checked them): one line naming the file."""


def needs_base_stage(cfg: DictConfig) -> bool:
    # A local checkpoint (model=hf) has already learned: its own loss at step 0 is the base's.
    return bool(cfg.base.enabled) and model_families.of(cfg).trains_base_stage


def cache_root(cfg: DictConfig) -> Path:
    root = cfg.base.cache_dir or os.environ.get("SLURM_ROUTER_CACHE") or "~/.cache/slurm_router"
    return Path(os.path.expanduser(root)) / "base"


def base_hash(cfg: DictConfig) -> str:
    """Everything that shapes the base model: model shape, data, base schedule, seed (not LoRA, not router)."""
    model = cast(dict, OmegaConf.to_container(cfg.model, resolve=True))
    model.pop("lora", None)
    base = cast(dict, OmegaConf.to_container(cfg.base, resolve=True))
    base.pop("cache_dir", None)
    base.pop("enabled", None)
    key = {
        "model": model,
        "data": OmegaConf.to_container(cfg.data, resolve=True),
        "base": base,
        "seed": cfg.seed,
        "format": FORMAT,
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def weights_path(cfg: DictConfig) -> Path:
    """<cache>/base/<hash>/: the folder this config's base model is (or will be) cached in (spec.base_weights)."""
    return cache_root(cfg) / base_hash(cfg)


def weights_file(folder: str | os.PathLike) -> Path:
    """The cache entry's weights, the file its sidecar verifies."""
    return Path(folder) / BASE_WEIGHTS


def meta_path(folder: str | os.PathLike) -> Path:
    return Path(folder) / BASE_META


# ---- verification ---------------------------------------------------------------------------------------
# A full sha256 of the weights is cheap next to training (about 1 GB/s here: GPT-2 small's 345 MB in 0.3 s),
# so every check hashes; a file already hashed in this process, unchanged since (same size, mtime, inode),
# is not hashed twice (plan, then submit_stages, then resume all ask).
_HASHED: dict[tuple, str | None] = {}
_SAID: set[str] = set()


def _stat_key(weights: Path) -> tuple | None:
    try:
        st, side = weights.stat(), sidecar_path(weights).stat()
    except OSError:
        return None
    return str(weights), st.st_size, st.st_mtime_ns, st.st_ino, side.st_mtime_ns


def check(folder: str | os.PathLike) -> str | None:
    """None if the cache entry `folder` is whole and can be used; ABSENT if nothing is cached there yet; else
    why it cannot be used, in words (a file missing, weights truncated, sha256 mismatch, no sidecar)."""
    folder = Path(folder)
    if not meta_path(folder).is_file():
        return ABSENT  # incomplete (the save never finished) or never made: the base stage trains
    weights = weights_file(folder)
    for f in (weights, *(folder / name for name in REQUIRED)):
        if not f.is_file():
            return f"{f.name} is missing (deleted after it was cached)"
    key = _stat_key(weights)
    if key is not None and key in _HASHED:
        return _HASHED[key]
    why = verify_file(weights)
    why = None if why is None else f"{weights.name}: {why}"
    if key is not None:
        _HASHED[key] = why
    return why


def say_unusable(folder: str | os.PathLike, why: str) -> None:
    """One line, once per process: the cache is not used and the base stage trains again."""
    if why == ABSENT:
        why = f"{BASE_META} is gone: the cache was deleted"
    line = (
        f"warning: the cached base model in {folder} is not usable ({why}): the base stage trains again and rewrites it"
    )
    if line not in _SAID:
        _SAID.add(line)
        print(line, file=sys.stderr, flush=True)


def usable(folder: str | os.PathLike | None) -> bool:
    """The cache entry `folder` is whole (verified); a damaged one is named (once) and counts as not there."""
    if not folder:
        return False
    why = check(folder)
    if why not in (None, ABSENT):
        say_unusable(folder, why)
    return why is None


def verify_before_load(folder: str | os.PathLike) -> None:
    """A worker, before it loads the base model: the weights' size and sha256 against the sidecar. A damaged
    cache loses its meta.json (so the next run, or resume=, trains the base again) and raises BaseCacheError,
    one line."""
    why = check(folder)
    if why is None:
        return
    if why == ABSENT:
        why = f"{BASE_META} is missing (the cache was removed or never finished)"
    else:
        meta_path(folder).unlink(missing_ok=True)
    raise BaseCacheError(
        f"base model {folder} cannot be used ({why}): the variant did not train on it; "
        "run again (or resume=RUN_DIR) and the base stage trains again"
    )


# ---- writing ----------------------------------------------------------------------------------------------
def save(model, folder: str | os.PathLike, result: dict, tokenizer=None) -> None:
    """The base stage's model into the cache entry `folder`, whole or not at all: the old entry is removed first
    (it is being rewritten: unusable, and its room is needed), then a temp folder gets model.save_pretrained
    (one safetensors file), the tokenizer (a transformers one; default: the byte tokenizer), the weights'
    sidecar and meta.json last, and is renamed into place. WriteError if the disk refuses (one line; nothing
    half-written stays)."""
    from slurm_router.artifacts.adapters import write_folder
    from slurm_router.train.byte_tokenizer import transformers_byte_tokenizer
    from slurm_router.train.model import quiet_transformers

    folder = Path(folder)
    meta_path(folder).unlink(missing_ok=True)
    try:
        if folder.is_dir():
            shutil.rmtree(folder)
    except OSError as e:
        raise WriteError.of(folder, e) from None
    quiet_transformers()
    tokenizer = tokenizer if tokenizer is not None else transformers_byte_tokenizer()

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp, max_shard_size="1000GB")
        tokenizer.save_pretrained(tmp)
        sign_file(weights_file(tmp), format=FORMAT, kind="base weights")
        atomic_write_text(meta_path(tmp), json.dumps(result, indent=1))

    write_folder(folder, write)


# ---- before anything trains -------------------------------------------------------------------------------
def estimate_bytes(cfg: DictConfig) -> int:
    """The base weights' size on disk: 4 bytes (fp32) per entry of the GPT-2 state dict built from cfg.model
    (its tied output layer counted twice, an upper bound: safetensors stores it once), plus MARGIN."""
    m = cfg.model
    vocab, d, layers = int(m.vocab_size), int(m.n_embd), int(m.n_layer)
    entries = 2 * vocab * d + int(m.n_positions) * d + layers * (12 * d * d + 13 * d) + 2 * d
    return int(4 * entries * MARGIN) + MARGIN_BYTES


def _setting(cfg: DictConfig) -> str:
    """How the user set the cache folder, for the one line: 'base.cache_dir=...' and where it came from."""
    if cfg.base.cache_dir:
        return f"base.cache_dir={cfg.base.cache_dir}"
    if os.environ.get("SLURM_ROUTER_CACHE"):
        return f"base.cache_dir=$SLURM_ROUTER_CACHE ({os.environ['SLURM_ROUTER_CACHE']})"
    return "base.cache_dir=~/.cache/slurm_router (the default)"


def check_room(cfg: DictConfig) -> None:
    """Before any file of the run is written, when the base stage is to train: its cache folder must be
    writable and have room for the weights; else UserError, one line (exit 2)."""
    folder, setting = weights_path(cfg), _setting(cfg)
    probe = nearest_existing(check_writable_dir(folder, setting))  # a writable folder, by now
    free, need = shutil.disk_usage(probe).free, estimate_bytes(cfg)
    if free < need:
        raise UserError(
            f"{setting}: {free / 2**20:,.1f} MiB free in {probe}, the base model's weights need about "
            f"{need / 2**20:,.1f} MiB: free space there or set base.cache_dir= to a roomier folder"
        )
