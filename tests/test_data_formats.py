"""Prompt/completion, chat and parquet data (issue 13): which tokens are targets, and only those count.

    pytest tests/test_data_formats.py

The masks are checked against what each format means, computed here apart from slurm_router's own code: the
completion (+ the closing end-of-text) of a prompt/completion pair; the assistant contents and their end token
in the Llama-style and ChatML templates of tests/tiny_checkpoints.py. The loss is then proven to be the
cross-entropy over those positions only, and a real run's n_target_tokens to be the completions' token count.
"""

import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F
from conftest import run_cli, run_dir_of
from omegaconf import OmegaConf
from tiny_checkpoints import chat_rows, make_checkpoint, prompt_completion_rows, write_jsonl

from slurm_router.config.schema import DataConfig, ModelConfig
from slurm_router.errors import UserError
from slurm_router.rundir.events import MicroRow, StepRow, read_events
from slurm_router.train.data import build_corpus
from slurm_router.train.loss import target_positions, token_loss_sum
from slurm_router.train.tokenizer import ByteTokenizer, make_tokenizer
from slurm_router.worker.microbatch import batch_tensors

PC = {"prompt_field": "prompt", "completion_field": "completion"}
CHAT = {"messages_field": "messages"}


def _data(**kw):
    return OmegaConf.structured(DataConfig(**kw))


def _hf(folder):
    return make_tokenizer(OmegaConf.structured(ModelConfig(kind="hf", name_or_path=str(folder))))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {arch: make_checkpoint(root / arch, arch) for arch in ("llama", "qwen2")}


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each run of True."""
    edges = np.flatnonzero(np.diff(np.concatenate(([0], mask.astype(np.int8), [0]))))
    return list(zip(edges[0::2], edges[1::2]))


def _all_samples(corpus):
    return [(s.sample(i), s.target_mask(i)) for s in (corpus.train, corpus.val) for i in range(len(s))]


# ---- masks -------------------------------------------------------------------------------------------------
def test_plain_text_targets_every_token_but_the_first():
    corpus = build_corpus(_data(max_documents=30), ByteTokenizer())
    for split in (corpus.train, corpus.val):
        assert np.array_equal(split.n_targets, split.lengths - 1)
        for i in range(0, len(split), 7):
            assert not split.target_mask(i)[0] and split.target_mask(i)[1:].all()
            assert split.sample(i)[0] == ByteTokenizer.eot_id


@pytest.mark.parametrize("arch, first, pad", [("llama", "<s>", "</s>"), ("qwen2", "<|im_end|>", "<|endoftext|>")])
def test_checkpoint_tokenizer_special_tokens(tmp_path, checkpoints, arch, first, pad):
    """A text sample starts with BOS where the tokenizer has one (Llama), else with EOS (Qwen2, GPT-2); the pad
    token is the tokenizer's own, or EOS where it has none (Llama)."""
    tok = _hf(checkpoints[arch])
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": f"line {i}\n\nmore words {i}"} for i in range(12)])
    corpus = build_corpus(_data(kind="jsonl", path=str(path)), tok)
    assert {
        tok.tok.convert_ids_to_tokens(int(s.sample(i)[0])) for s in (corpus.train, corpus.val) for i in range(len(s))
    } == {first}
    assert tok.tok.convert_ids_to_tokens(tok.pad_id) == pad


def test_prompt_completion_targets_are_the_completion_and_its_end(tmp_path, checkpoints):
    rows = prompt_completion_rows(40)
    path = write_jsonl(tmp_path / "pc.jsonl", rows)
    byte = build_corpus(_data(kind="jsonl", path=str(path), max_len=512, **PC), ByteTokenizer())
    expect = {}
    for r in rows:
        p, c = r["prompt"].encode(), r["completion"].encode()
        expect[bytes([*p, *c])] = len(p)
    seen = 0
    for tokens, mask in _all_samples(byte):
        assert tokens[0] == tokens[-1] == 256  # end-of-text starts and ends it
        n_prompt = expect[bytes(tokens[1:-1].astype(np.uint8))]
        assert not mask[: 1 + n_prompt].any() and mask[1 + n_prompt :].all()
        seen += 1
    assert seen == len(rows)

    tok = _hf(checkpoints["llama"])  # Llama: BOS first, EOS a target
    llama = build_corpus(_data(kind="jsonl", path=str(path), max_len=512, **PC), tok)
    enc = tok.tok
    completions = {}
    for r in rows:
        p = enc.encode(r["prompt"], add_special_tokens=False)
        c = enc.encode(r["completion"], add_special_tokens=False)
        completions[tuple([enc.bos_token_id, *p, *c, enc.eos_token_id])] = len(c) + 1
    for tokens, mask in _all_samples(llama):
        n = completions[tuple(tokens.tolist())]
        assert _runs(mask) == [(len(tokens) - n, len(tokens))]


@pytest.mark.parametrize("arch, turn_end, lead", [("llama", "</s>", " "), ("qwen2", "<|im_end|>", "")])
def test_chat_targets_are_the_assistant_turns_and_their_end_token(tmp_path, checkpoints, arch, turn_end, lead):
    """Llama-2 style ([INST] user [/INST] answer</s>) and ChatML (<|im_start|>assistant\\n answer<|im_end|>\\n):
    exactly each assistant content and its end token, never a system or user turn, nor ChatML's '\\n' after."""
    rows = chat_rows(24)
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    tok = _hf(checkpoints[arch])
    corpus = build_corpus(_data(kind="jsonl", path=str(path), max_len=512, **CHAT), tok)
    answers = {tuple(m["content"] for m in r["messages"] if m["role"] == "assistant") for r in rows}
    found = set()
    for tokens, mask in _all_samples(corpus):
        spans = [tok.tok.decode(tokens[a:b]) for a, b in _runs(mask)]
        assert all(s.startswith(lead) and s.endswith(turn_end) for s in spans), spans
        found.add(tuple(s[len(lead) : -len(turn_end)] for s in spans))
        assert int(mask.sum()) < len(tokens) // 2
    assert found == answers


def test_chat_template_that_is_not_prefix_consistent_is_named(tmp_path, checkpoints):
    tok = _hf(checkpoints["qwen2"])
    # renders the last turn apart: rendering up to an earlier answer is not the start of the whole conversation
    tok.tok.chat_template = (
        "{% for m in messages %}{% if loop.last %}LAST {% endif %}{{ m['role'] + ': ' + "
        "m['content'] + '\\n' }}{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
    )
    path = write_jsonl(tmp_path / "chat.jsonl", chat_rows(4))
    with pytest.raises(UserError, match=r"line 1 of .*chat.jsonl: the chat template is not prefix-consistent"):
        build_corpus(_data(kind="jsonl", path=str(path), **CHAT), tok)


def test_chat_without_an_assistant_turn_and_an_opening_assistant_turn(tmp_path, checkpoints):
    tok = _hf(checkpoints["qwen2"])
    rows = chat_rows(12)
    rows[3] = {"messages": [{"role": "user", "content": "Nobody answers."}]}
    rows[5] = {"messages": [{"role": "assistant", "content": "I speak first."}, {"role": "user", "content": "Fine."}]}
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    corpus = build_corpus(_data(kind="jsonl", path=str(path), max_len=512, **CHAT), tok)
    assert corpus.n_without_targets == 1 and len(corpus.train) + len(corpus.val) == 11
    assert "1 without an assistant turn left out" in corpus.counts_note()
    spans = [tok.tok.decode(t[a:b]) for t, m in _all_samples(corpus) for a, b in _runs(m)]
    assert "I speak first.<|im_end|>" in spans
    write_jsonl(path, [rows[3]] * 3)
    with pytest.raises(UserError, match="has an assistant turn"):
        build_corpus(_data(kind="jsonl", path=str(path), **CHAT), tok)


@pytest.mark.integration
def test_a_turn_the_template_drops_is_refused_naming_the_row_and_role(tmp_path, checkpoints):
    """The Llama-2 template renders no tool turn: [user, tool, assistant] would train without the tool's output.
    The command refuses the row in one line (exit 2) before a run directory is made; ChatML renders it."""
    rows = chat_rows(8)
    rows[4] = {
        "messages": [
            {"role": "user", "content": "What does the tool say?"},
            {"role": "tool", "content": "TOOL_OUTPUT_42"},
            {"role": "assistant", "content": "It says 42."},
        ]
    }
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    runs = tmp_path / "runs"
    args = ["model=hf", "data=jsonl", f"data.path={path}", "data.messages_field=messages", "train.steps=1"]
    proc = run_cli(*args, f"model.name_or_path={checkpoints['llama']}", f"run_root={runs}", cwd=tmp_path)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith(f"error: line 5 of {path}: message 2 (tool): the chat "), lines
    assert "does not render the role 'tool'" in lines[0]
    assert not runs.exists() or not any(runs.rglob("manifest.json"))
    tok = _hf(checkpoints["qwen2"])  # ChatML renders every role: the same rows are a corpus
    corpus = build_corpus(_data(kind="jsonl", path=str(path), max_len=512, **CHAT), tok)
    assert any("TOOL_OUTPUT_42" in tok.tok.decode(t) for t, _ in _all_samples(corpus))


# ---- the loss counts the targets only ----------------------------------------------------------------------
def test_masked_loss_is_the_cross_entropy_over_the_completions_only(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    path = write_jsonl(tmp_path / "pc.jsonl", prompt_completion_rows(16))
    split = build_corpus(_data(kind="jsonl", path=str(path), max_len=512, **PC), ByteTokenizer()).train
    ids = list(range(min(6, len(split))))
    inputs, labels, n, index = batch_tensors(split, ids, 256, torch.device("cpu"), pad_to_multiple=8)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=257, n_positions=512, n_embd=32, n_layer=2, n_head=2)).eval()
    with torch.no_grad():
        logits = model(input_ids=inputs).logits
    manual, count = torch.zeros((), dtype=torch.float64), 0
    for r, i in enumerate(ids):
        tokens, mask = split.sample(i), split.target_mask(i)
        for j in np.flatnonzero(mask):  # token j predicted at position j - 1
            manual += F.cross_entropy(logits[r, j - 1].double(), torch.tensor(int(tokens[j])))
            count += 1
    assert n == count == split.count_targets(ids) == sum(int(split.n_targets[i]) for i in ids)
    for chunk in (0, 5):
        loss, n_loss = token_loss_sum(model, inputs, labels, chunk, n, index)
        assert n_loss == count and float(loss.detach()) == pytest.approx(float(manual), rel=1e-5)

    # the prompt positions' targets change nothing: the loss's gradient at every position predicting a prompt
    # token (or padding) is zero, and nonzero at every completion position
    out = model(input_ids=inputs).logits
    out.retain_grad()
    flat_targets = F.pad(labels[:, 1:], (0, 1), value=-100)
    F.cross_entropy(
        out.reshape(-1, out.size(-1)), flat_targets.reshape(-1), ignore_index=-100, reduction="sum"
    ).backward()
    grad_rows = out.grad.abs().sum(-1)
    assert (grad_rows[flat_targets == -100] == 0).all() and (grad_rows[flat_targets != -100] > 0).all()
    n_plain, _ = target_positions([len(split.sample(i)) for i in ids], inputs.size(1))
    assert n_plain > n, "the prompts would count without the masks"


@pytest.mark.integration
def test_a_run_counts_the_completion_tokens_only(tmp_path, checkpoints):
    """A real tiny run on a Llama-architecture checkpoint: each step's n_target_tokens is the completion tokens
    (+ end-of-text) of the step's samples; n_tokens (the router's cost) counts every token."""
    rows = prompt_completion_rows(48)
    path = write_jsonl(tmp_path / "pc.jsonl", rows)
    args = [
        "model=hf",
        f"model.name_or_path={checkpoints['llama']}",
        "data=jsonl",
        f"data.path={path}",
        "data.prompt_field=prompt",
        "data.completion_field=completion",
        "data.max_len=128",
        "base.enabled=false",
        "train.steps=3",
        "train.global_batch_size=8",
        "train.eval_batches=1",
        "train.eval_batch_size=4",
        "resources.devices_per_task=2",
        f"run_root={tmp_path / 'runs'}",
    ]
    proc = run_cli(*args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "(prompt/completion): " in proc.stdout
    task = run_dir_of(proc) / "tasks" / "main"
    events = [r for f in sorted(task.glob("events-rank*.jsonl")) for r in read_events(f)]
    enc = _hf(checkpoints["llama"]).tok
    completion_tokens = {}
    for r in rows:
        p = enc.encode(r["prompt"], add_special_tokens=False)
        c = enc.encode(r["completion"], add_special_tokens=False)
        full = [enc.bos_token_id, *p, *c, enc.eos_token_id]
        completion_tokens[tuple(full[:128])] = min(len(full), 128) - (1 + len(p))  # data.max_len keeps the start
    train = build_corpus(_data(kind="jsonl", path=str(path), max_len=128, **PC), _hf(checkpoints["llama"])).train
    steps = sorted((r for r in events if r["event"] == StepRow.KIND and r["device"] == 0), key=lambda r: r["step"])
    assert len(steps) == 3
    for s in steps:
        ids = [i for r in events if r["event"] == MicroRow.KIND and r["step"] == s["step"] for i in r["sample_ids"]]
        assert len(ids) == s["n_samples"] == 8
        assert s["n_target_tokens"] == sum(completion_tokens[tuple(train.sample(i).tolist())] for i in ids)
        assert s["n_tokens"] == sum(len(train.sample(i)) for i in ids) > 2 * s["n_target_tokens"]


# ---- parquet --------------------------------------------------------------------------------------------
def _parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.mark.parametrize("fmt", ["text", "prompt_completion", "chat"])
def test_parquet_file_and_folder_give_the_jsonl_corpus(tmp_path, checkpoints, fmt):
    if fmt == "text":
        rows, fields, tok = [{"text": f"row {i}\n\n" + "word " * (i % 9 + 3), "id": i} for i in range(50)], {}, None
    elif fmt == "prompt_completion":
        rows, fields, tok = prompt_completion_rows(50), PC, None
    else:
        rows, fields, tok = chat_rows(50), CHAT, _hf(checkpoints["llama"])
    tok = tok or ByteTokenizer()
    jsonl = build_corpus(
        _data(kind="jsonl", path=str(write_jsonl(tmp_path / "d.jsonl", rows)), max_len=256, **fields), tok
    )
    (tmp_path / "parts").mkdir()
    one = _parquet(tmp_path / "d.parquet", rows)
    for k, (a, b) in enumerate([(0, 7), (7, 30), (30, 50)]):
        _parquet(tmp_path / "parts" / f"train-{k:05d}-of-00003.parquet", rows[a:b])
    if fmt == "chat":
        assert pq.read_schema(one).field("messages").type == pa.list_(
            pa.struct([("role", pa.string()), ("content", pa.string())])
        )
    for path in (one, tmp_path / "parts"):
        got = build_corpus(_data(kind="parquet", path=str(path), max_len=256, **fields), tok)
        assert got.n_documents == jsonl.n_documents == 50
        for a, b in ((got.train, jsonl.train), (got.val, jsonl.val)):
            assert len(a) == len(b) > 0
            for name in ("tokens", "lengths", "is_target", "n_targets"):
                assert np.array_equal(getattr(a, name), getattr(b, name)), name


# ---- truncation ---------------------------------------------------------------------------------------------
def test_truncation_keeps_the_start_and_counts_what_it_cut(tmp_path):
    rows = prompt_completion_rows(60)
    path = write_jsonl(tmp_path / "pc.jsonl", rows)
    max_len = 64
    truncated = dropped = 0
    for r in rows:
        n_prompt, n = len(r["prompt"].encode()), len(r["prompt"].encode()) + len(r["completion"].encode()) + 2
        if n > max_len:  # start + prompt fill max_len: no completion token is left
            dropped, truncated = dropped + (1 + n_prompt >= max_len), truncated + (1 + n_prompt < max_len)
    assert truncated and dropped, "the rows should exercise both"
    corpus = build_corpus(_data(kind="jsonl", path=str(path), max_len=max_len, **PC), ByteTokenizer())
    assert (corpus.n_truncated, corpus.n_dropped) == (truncated + dropped, dropped)
    assert len(corpus.train) + len(corpus.val) == 60 - dropped
    assert corpus.train.lengths.max() == max_len and corpus.train.n_targets.min() >= 1
    assert (
        corpus.counts_note()
        == f"; {truncated + dropped} truncated to data.max_len=64, {dropped} of them dropped (no target tokens left)"
    )
    with pytest.raises(UserError, match=r"no training sample is left: data.max_len=8 cuts every target token"):
        build_corpus(_data(kind="jsonl", path=str(path), max_len=8, **PC), ByteTokenizer())


def test_the_data_line_reports_truncation(tmp_path, monkeypatch, capsys):
    from slurm_router.__main__ import main

    path = write_jsonl(tmp_path / "pc.jsonl", prompt_completion_rows(40))
    monkeypatch.chdir(tmp_path)
    code = main(
        [
            "data=jsonl",
            f"data.path={path}",
            "data.prompt_field=prompt",
            "data.completion_field=completion",
            "data.max_len=64",
            "launcher=sbatch",
            "launcher.dry_run=true",
            f"run_root={tmp_path / 'runs'}",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out[-2000:]
    line = next(line for line in out.splitlines() if line.startswith("experiment "))
    assert "(prompt/completion): " in line and "truncated to data.max_len=64, " in line
    assert line.endswith("of them dropped (no target tokens left)")


def _data_line(tmp_path, *args: str) -> str:
    proc = run_cli("data=jsonl", *args, "dry_run=true", f"run_root={tmp_path / 'runs'}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return next(line for line in proc.stdout.splitlines() if line.startswith("experiment "))


def test_the_data_line_counts_truncated_then_dropped_samples_and_empty_rows(tmp_path):
    """Through the command: samples that were cut and then dropped were truncated too (never '0 truncated'), and
    empty text rows are counted as left out, so the data line accounts for every row."""
    rows = [{"prompt": "Say hi.", "completion": " hi"} for _ in range(30)]
    rows += [{"prompt": "x" * 200, "completion": " lost"} for _ in range(3)]  # cut inside the prompt
    path = write_jsonl(tmp_path / "pc.jsonl", rows)
    line = _data_line(tmp_path, f"data.path={path}", *(f"data.{k}={v}" for k, v in PC.items()), "data.max_len=64")
    assert line.endswith(" 3 truncated to data.max_len=64, 3 of them dropped (no target tokens left)"), line

    texts = [{"text": f"row {i}: " + "some words " * (i % 5 + 1)} for i in range(69)]
    texts += [{"text": ""}] * 6 + [{"text": " \n\n  "}] * 5  # 11 of 80 rows hold no text
    path = write_jsonl(tmp_path / "text.jsonl", texts)
    line = _data_line(tmp_path, f"data.path={path}", "data.val_fraction=0.1")
    train, held_out = (int(n) for n in re.search(r": (\d+) train / (\d+) held-out samples", line).groups())
    assert train + held_out == 69 and line.endswith("held-out samples; 11 empty (no text) left out"), line


# ---- choosing a format ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw, message",
    [
        ({"prompt_field": "prompt"}, "data.prompt_field=prompt needs data.completion_field too"),
        ({"completion_field": "c"}, "data.completion_field=c needs data.prompt_field too"),
        ({**PC, **CHAT}, "set only one of data.text_field"),
        ({"text_field": "body", **CHAT}, "data.text_field=body and data.messages_field are both set"),
        ({"kind": "text_dir", **PC}, "data.prompt_field applies to data=jsonl and data=parquet only"),
    ],
)
def test_one_format_at_a_time(tmp_path, kw, message):
    path = write_jsonl(tmp_path / "d.jsonl", prompt_completion_rows(4))
    with pytest.raises(UserError, match=message.replace(".", r"\.")):
        build_corpus(_data(**{"kind": "jsonl", "path": str(path), **kw}), ByteTokenizer())
