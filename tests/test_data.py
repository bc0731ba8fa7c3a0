"""Corpora, split and sampler: pure logic, fast."""
import json

import numpy as np
import pytest
from omegaconf import OmegaConf

from slurm_router.config import DataConfig, UserError
from slurm_router.train.data import ByteTokenizer, GlobalBatchSampler, build_corpus, eval_batches


def _cfg(**kw):
    return OmegaConf.structured(DataConfig(**kw))


def test_stdlib_corpus_is_real_deterministic_and_split():
    a = build_corpus(_cfg(max_documents=60), ByteTokenizer())
    b = build_corpus(_cfg(max_documents=60), ByteTokenizer())
    assert len(a.train) > 100 and len(a.val) > 0
    assert np.array_equal(a.train.tokens, b.train.tokens) and np.array_equal(a.val.lengths, b.val.lengths)
    assert a.train.lengths.max() <= 256 and a.train.lengths.min() >= 2
    assert len(set(a.train.lengths.tolist())) > 50, "lengths should vary like real data"
    text = bytes(a.train.sample(0)[1:].astype(np.uint8)).decode("utf-8", "replace")
    assert text.strip(), "samples hold real text"


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
    c = build_corpus(_cfg(max_documents=60), ByteTokenizer())
    assert eval_batches(c.val, 2, 3, 0) == eval_batches(c.val, 2, 3, 0)
