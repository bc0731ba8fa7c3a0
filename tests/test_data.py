"""Corpora, split and sampler: pure logic, fast."""
import json

import numpy as np
import pytest
from omegaconf import OmegaConf

from slurm_router.config import DataConfig, UserError
from slurm_router.train.data import ByteTokenizer, GlobalBatchSampler, build_corpus, eval_batches, jsonl_documents


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


# Texts that json.dumps writes on one line but that break a reader splitting at more than '\n':
# str.splitlines() also splits at \x0b \x0c \x1c-\x1e \x85 U+2028 U+2029 (written raw with ensure_ascii=False).
ODD_TEXTS = ["line\u2028separator", "para\u2029graph", "next\x85line", "tab\tand\rreturn", "caf\u00e9 \U0001F600",
             "\ufeffinner bom", "quote \" and \\ backslash", "  spaces  ", "{\"not\": \"parsed\"}", "\x1cfile sep",
             "escaped \\u2028 stays text"]


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
