"""The base stage's cache: a base model trained once, reused by every run whose model shape, data, base schedule
and seed hash the same (docs/ARCHITECTURE.md, "A task's lifecycle": `cached`).

    <base.cache_dir | $SLURM_ROUTER_CACHE | ~/.cache/slurm_router>/base/<hash>/
      model.pt     the full model's weights (a state dict)
      model.json   its sidecar: size and sha256, hashed while model.pt was written (checkpoint.save_verified)
      meta.json    the base task's result (held-out loss, ...), written last: it marks the cache complete

A verified artifact: it is used only when whole (meta.json present, model.pt matching its sidecar's size and
sha256), checked where a run decides to reuse it (plan, submit_stages, resume) and again by every worker
before it loads the weights. A damaged, truncated or missing cache is named in one line and never used: the
base stage simply trains again and rewrites it in place. Before anything trains, the cache folder must be
writable and have room for the weights (check_room).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from slurm_router.checkpoint import atomic_write_text, save_verified, sidecar_path, verify_file
from slurm_router.config import UserError, check_writable_dir, nearest_existing
from slurm_router.layout import BASE_META, BASE_WEIGHTS

ABSENT = "absent"           # check(): nothing cached yet (a first run), not damage
# Room asked for beyond the estimated weights: torch.save's own overhead, the sidecar and meta.json.
MARGIN = 1.10
MARGIN_BYTES = 16 << 20


class BaseCacheError(UserError):
    """The cached base weights cannot be used (damaged after the run checked them): one line naming the file."""


def needs_base_stage(cfg: DictConfig) -> bool:
    # A local checkpoint (model=hf) has already learned: its own loss at step 0 is the base's.
    return bool(cfg.base.enabled) and cfg.model.kind == "gpt2"


def cache_root(cfg: DictConfig) -> Path:
    root = cfg.base.cache_dir or os.environ.get("SLURM_ROUTER_CACHE") or "~/.cache/slurm_router"
    return Path(os.path.expanduser(root)) / "base"


def base_hash(cfg: DictConfig) -> str:
    """Everything that shapes the base model: model shape, data, base schedule, seed (not LoRA, not router)."""
    model = OmegaConf.to_container(cfg.model, resolve=True)
    model.pop("lora", None)
    base = OmegaConf.to_container(cfg.base, resolve=True)
    base.pop("cache_dir", None)
    base.pop("enabled", None)
    key = {"model": model, "data": OmegaConf.to_container(cfg.data, resolve=True), "base": base,
           "seed": cfg.seed, "format": 1}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def weights_path(cfg: DictConfig) -> Path:
    """<cache>/<hash>/model.pt: where this config's base weights are (or will be) cached."""
    return cache_root(cfg) / base_hash(cfg) / BASE_WEIGHTS


def meta_path(weights: str | os.PathLike) -> Path:
    return Path(weights).with_name(BASE_META)


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


def check(weights: str | os.PathLike) -> str | None:
    """None if the cache at `weights` is whole and can be used; ABSENT if nothing is cached there yet; else
    why it cannot be used, in words (weights missing or truncated, sha256 mismatch, no sidecar)."""
    weights = Path(weights)
    if not meta_path(weights).is_file():
        return ABSENT       # incomplete (the save never finished) or never made: the base stage trains
    if not weights.is_file():
        return f"{weights.name} is missing (deleted after it was cached)"
    key = _stat_key(weights)
    if key is not None and key in _HASHED:
        return _HASHED[key]
    why = verify_file(weights)
    why = None if why is None else f"{weights.name}: {why}"
    if key is not None:
        _HASHED[key] = why
    return why


def say_unusable(weights: str | os.PathLike, why: str) -> None:
    """One line, once per process: the cache is not used and the base stage trains again."""
    if why == ABSENT:
        why = f"{BASE_META} is gone: the cache was deleted"
    line = (f"warning: the cached base model in {Path(weights).parent} is not usable ({why}): the base stage "
            "trains again and rewrites it")
    if line not in _SAID:
        _SAID.add(line)
        print(line, file=sys.stderr, flush=True)


def usable(weights: str | os.PathLike | None) -> bool:
    """The cache at `weights` is whole (verified); a damaged one is named (once) and counts as not there."""
    if not weights:
        return False
    why = check(weights)
    if why not in (None, ABSENT):
        say_unusable(weights, why)
    return why is None


def verify_before_load(weights: str | os.PathLike) -> None:
    """A worker, before it loads the base weights: size and sha256 against the sidecar. A damaged cache loses
    its meta.json (so the next run, or resume=, trains the base again) and raises BaseCacheError, one line."""
    why = check(weights)
    if why is None:
        return
    if why == ABSENT:
        why = f"{BASE_META} is missing (the cache was removed or never finished)"
    else:
        meta_path(weights).unlink(missing_ok=True)
    raise BaseCacheError(f"base weights {weights} cannot be used ({why}): the variant did not train on them; "
                         "run again (or resume=RUN_DIR) and the base stage trains again")


# ---- writing ----------------------------------------------------------------------------------------------
def save(state: dict, weights: str | os.PathLike, result: dict) -> None:
    """The base stage's weights into the cache: meta.json is removed first (the cache is incomplete while it is
    rewritten), then model.pt hashed on the way out, its sidecar, and meta.json last. WriteError if the disk
    refuses (one line; nothing half-written stays)."""
    meta_path(weights).unlink(missing_ok=True)
    save_verified(weights, state, format=1, kind="base weights")
    atomic_write_text(meta_path(weights), json.dumps(result, indent=1))


# ---- before anything trains -------------------------------------------------------------------------------
def estimate_bytes(cfg: DictConfig) -> int:
    """The base weights' size on disk: 4 bytes (fp32) per entry of the GPT-2 state dict built from cfg.model
    (its tied output layer counted twice: the saved dict holds a copy of each), plus MARGIN."""
    from slurm_router.train.data import make_tokenizer
    m = cfg.model
    vocab, d, layers = make_tokenizer(m).vocab_size, int(m.n_embd), int(m.n_layer)
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
    folder, setting = weights_path(cfg).parent, _setting(cfg)
    probe = nearest_existing(check_writable_dir(folder, setting))      # a writable folder, by now
    free, need = shutil.disk_usage(probe).free, estimate_bytes(cfg)
    if free < need:
        raise UserError(f"{setting}: {free / 2**20:,.1f} MiB free in {probe}, the base model's weights need about "
                        f"{need / 2**20:,.1f} MiB: free space there or set base.cache_dir= to a roomier folder")
