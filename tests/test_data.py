"""Corpora, split and sampler: pure logic, fast."""

import json

import numpy as np
import pytest
from omegaconf import OmegaConf

from slurm_router.config.schema import DataConfig
from slurm_router.errors import UserError
from slurm_router.train.data import GlobalBatchSampler, build_corpus, eval_batches, jsonl_documents
from slurm_router.train.tokenizer import ByteTokenizer


def _cfg(**kw):
    return OmegaConf.structured(DataConfig(**kw))


# What a fresh process builds (another PYTHONHASHSEED: every task of a run builds its corpus in its own processes),
# with the functions this file imports: a digest of the stdlib corpus's samples and the held-out batches.
FRESH_PROCESS = f"""
import hashlib, json
from omegaconf import OmegaConf
from {DataConfig.__module__} import DataConfig
from {build_corpus.__module__} import build_corpus, eval_batches
from {ByteTokenizer.__module__} import ByteTokenizer
c = build_corpus(OmegaConf.structured(DataConfig(max_documents=200)), ByteTokenizer())
digest = lambda split: hashlib.sha256(split.tokens.tobytes() + split.lengths.tobytes()).hexdigest()
print(json.dumps({{"train": digest(c.train), "val": digest(c.val), "eval": eval_batches(c.val, 2, 3, 0)}}))
"""


def _fresh_process() -> dict:
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    proc = subprocess.run([sys.executable, "-c", FRESH_PROCESS], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def _digest(split) -> str:
    import hashlib

    return hashlib.sha256(split.tokens.tobytes() + split.lengths.tobytes()).hexdigest()


def test_stdlib_corpus_is_real_deterministic_and_split():
    """Samples are pieces of the standard library's source, byte for byte, each after the start token; train and
    held-out come from different files (200 files: the hash holds out 11, enough to split by file); another
    process builds the same corpus."""
    from slurm_router.train.sources import stdlib_documents

    tok = ByteTokenizer()
    a = build_corpus(_cfg(max_documents=200), tok)
    assert len(a.train) > 100 and len(a.val) > 0
    assert a.train.lengths.max() <= 256 and a.train.lengths.min() >= 2
    assert len(set(a.train.lengths.tolist())) > 50, "lengths should vary like real data"
    docs = [text.encode("utf-8") for _, (_, text) in zip(range(200), stdlib_documents())]
    rng = np.random.default_rng(0)
    for split in (a.train, a.val):
        for i in rng.choice(len(split), size=min(40, len(split)), replace=False):
            sample = split.sample(int(i))
            assert sample[0] == tok.start_id and sample[1:].max() < 256, "a sample is the start token, then bytes"
            piece = bytes(sample[1:].astype(np.uint8))
            assert any(piece in d for d in docs), (
                f"sample {i} is not a piece of the first 200 stdlib files: {piece[:80]}"
            )

    # the split is by file: the files the long (found in one file only) training and held-out pieces come from
    def origins(split) -> set[int]:
        out = set()
        for i in np.flatnonzero(split.lengths > 200):
            piece = bytes(split.sample(int(i))[1:].astype(np.uint8))
            found = [k for k, d in enumerate(docs) if piece in d]
            out |= set(found) if len(found) == 1 else set()
        return out

    train_files, val_files = origins(a.train), origins(a.val)
    assert train_files and val_files and not train_files & val_files, (train_files, val_files)
    fresh = _fresh_process()
    assert (fresh["train"], fresh["val"]) == (_digest(a.train), _digest(a.val)), "another process built another corpus"


def test_text_dir_and_jsonl(tmp_path):
    d = tmp_path / "t"
    (d / "sub").mkdir(parents=True)
    for i in range(30):
        (d / "sub" / f"{i}.txt").write_text(f"document {i}\n\n" + "word " * (10 + i))
    c = build_corpus(_cfg(kind="text_dir", path=str(d), max_len=32), ByteTokenizer())
    assert len(c.train) + len(c.val) >= 60 and c.n_documents == 30
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join(json.dumps({"text": f"row {i} " * 20}) for i in range(20)) + "\n")
    c = build_corpus(_cfg(kind="jsonl", path=str(f)), ByteTokenizer())
    assert c.n_documents == 20 and len(c.val) >= 1


@pytest.mark.parametrize("n_files", [3, 120])
def test_text_dir_holds_out_whole_files_or_the_end_of_each_never_text_it_trains_on(tmp_path, n_files):
    """Many files: held out by file, so no held-out file feeds training. A few (the hash holds out fewer than
    eight): the last pieces of each file, one contiguous span, the rest trains. Either way no held-out text is
    trained on, and each held-out sample names its file (one cluster in the verdict)."""
    d = tmp_path / "t"
    d.mkdir()
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "ember"]
    files = []
    for f in range(n_files):
        lines = [f"file {f} line {i}: " + " ".join(rng.choice(words, 6)) for i in range(300 if n_files < 10 else 12)]
        files.append("\n".join(lines).encode())
        (d / f"{f:03d}.txt").write_bytes(files[-1])
    c = build_corpus(_cfg(kind="text_dir", path=str(d), max_len=64, val_fraction=0.2), ByteTokenizer())

    def where(split) -> list[tuple[int, int]]:  # (file, byte offset) of each sample, in the file it names
        out = []
        for i in range(len(split)):
            piece, k = bytes(split.sample(i)[1:].astype(np.uint8)), int(split.sources[i])
            assert piece in files[k], f"sample {i} is not from the file it names ({k})"
            out.append((k, files[k].find(piece) if len(piece) >= 40 else -1))  # a short one may be anywhere
        return out

    train, val = where(c.train), where(c.val)
    assert val and train
    trained = b"\0".join(bytes(c.train.sample(i)[1:].astype(np.uint8)) for i in range(len(c.train)))
    for i in range(len(c.val)):
        piece = bytes(c.val.sample(i)[1:].astype(np.uint8))
        assert not any(piece[j : j + 48] in trained for j in range(0, len(piece) - 47, 8)), piece[:80]
    if n_files > 10:
        assert not {k for k, _ in train} & {k for k, _ in val}, "a held-out file also feeds training"
        return
    for k in {k for k, _ in val}:
        last_trained = max((o for f, o in train if f == k), default=-1)
        held = sorted(o for f, o in val if f == k and o >= 0)
        assert held and held[0] > last_trained, f"file {k}: its held-out pieces are not one span at its end"


def test_missing_and_empty(tmp_path):
    with pytest.raises(UserError, match="not a folder"):
        build_corpus(_cfg(kind="text_dir", path=str(tmp_path / "nope")), ByteTokenizer())
    (tmp_path / "e").mkdir()
    with pytest.raises(UserError, match="no training text"):
        build_corpus(_cfg(kind="text_dir", path=str(tmp_path / "e")), ByteTokenizer())


def test_synthetic_lengths_follow_the_config():
    c = build_corpus(_cfg(kind="synthetic", n_samples=2000, mean_len=100, sigma=0.5, max_len=512), ByteTokenizer())
    assert 80 < c.train.lengths.mean() < 120
    f = build_corpus(_cfg(kind="synthetic", n_samples=100, length_dist="fixed", mean_len=64), ByteTokenizer())
    assert set(f.train.lengths.tolist()) == {64}


def test_sampler_is_seeded_and_covers_each_epoch():
    s = GlobalBatchSampler(50, 8, seed=3)
    assert s.batch(4) == GlobalBatchSampler(50, 8, seed=3).batch(4)
    assert s.batch(0) != GlobalBatchSampler(50, 8, seed=4).batch(0)
    first_epoch = [i for step in range(7) for i in s.batch(step)][:50]
    assert sorted(first_epoch) == list(range(50))
    assert all(len(s.batch(k)) == 8 for k in range(20))


def test_eval_batches_fixed():
    """The held-out batches: n batches of distinct held-out samples, the same in every process (the base and each
    variant's task evaluate apart), chosen by the seed; a split smaller than n x size gives all of it, once."""
    c = build_corpus(_cfg(max_documents=200), ByteTokenizer())
    batches = eval_batches(c.val, 2, 3, 0)
    assert [len(b) for b in batches] == [3, 3]
    ids = [i for b in batches for i in b]
    assert len(set(ids)) == 6 and all(isinstance(i, int) and 0 <= i < len(c.val) for i in ids), batches
    assert _fresh_process()["eval"] == batches, "another process evaluates on other batches"
    others = {tuple(map(tuple, eval_batches(c.val, 2, 3, seed))) for seed in range(1, 6)}
    assert tuple(map(tuple, batches)) not in others and len(others) > 1, "the seed does not choose the batches"
    everything = eval_batches(c.val, 100, len(c.val), 0)
    assert sorted(i for b in everything for i in b) == list(range(len(c.val))) and len(everything) == 1


# Texts that json.dumps writes on one line but that break a reader splitting at more than '\n':
# str.splitlines() also splits at \x0b \x0c \x1c-\x1e \x85 U+2028 U+2029 (written raw with ensure_ascii=False).
ODD_TEXTS = [
    "line\u2028separator",
    "para\u2029graph",
    "next\x85line",
    "tab\tand\rreturn",
    "caf\u00e9 \U0001f600",
    "\ufeffinner bom",
    'quote " and \\ backslash',
    "  spaces  ",
    '{"not": "parsed"}',
    "\x1cfile sep",
    "escaped \\u2028 stays text",
]


@pytest.mark.parametrize("ensure_ascii", [True, False])
@pytest.mark.parametrize("layout", ["plain", "crlf", "bom", "blank_lines", "no_final_newline"])
def test_every_file_json_dumps_writes_loads(tmp_path, ensure_ascii, layout):
    """JSON Lines as the format defines them: one object a line, lines end at '\\n' (a '\\r' before it is
    JSON whitespace); a byte order mark, blank lines and a last line without '\\n' are fine."""
    rows = [json.dumps({"text": t, "id": i}, ensure_ascii=ensure_ascii) for i, t in enumerate(ODD_TEXTS)]
    end = "\r\n" if layout == "crlf" else "\n\n  \n" if layout == "blank_lines" else "\n"
    text = end.join(rows) + ("" if layout == "no_final_newline" else end)
    f = tmp_path / "d.jsonl"
    f.write_bytes(("\ufeff" if layout == "bom" else "").encode() + text.encode("utf-8"))
    assert [t for _, t in jsonl_documents(str(f), "text")] == ODD_TEXTS
    c = build_corpus(_cfg(kind="jsonl", path=str(f), split_on=""), ByteTokenizer())
    assert c.n_documents == len(ODD_TEXTS)


def test_jsonl_line_that_is_not_an_object_is_named(tmp_path):
    f = tmp_path / "d.jsonl"
    for value, what in [([1, 2], "an array"), (5, "a number"), ("x", "a string"), (None, "null"), (True, "a boolean")]:
        f.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps(value) + "\n")
        with pytest.raises(UserError, match=f"line 2 of {f} is a JSON {what.split()[-1]}, not an object"):
            list(jsonl_documents(str(f), "text"))


def test_every_data_source_has_its_reader():
    """data.kind branches in one place a side: the config's sources (config/data_sources/) and the training
    readers (train/sources.py) are the same kinds, in the same order."""
    from slurm_router.config.data_sources import SOURCES
    from slurm_router.train.sources import READERS

    assert list(READERS) == list(SOURCES), "a data source needs its reader in train/sources.py READERS"
