"""A toy task and its metric for tests/test_metrics.py: 'c>' is answered 'y' for the letters a-p, 'z' for q-x. The metric
scores an example 1.0 when the model's most likely next byte after the prompt is the answer (teacher-forced, one
forward), else 0.0; examples of one vowel group share a source (a cluster)."""

from __future__ import annotations

import json
import os
import string
import time
from pathlib import Path

from slurm_router.config.metrics import Scores

_calls = [0, 0]  # changing()'s calls, next_letter()'s calls with examples

LETTERS = string.ascii_lowercase[:-2]  # 24 prompts: a> y, ..., p> y, q> z, ..., x> z
EXAMPLES = [(f"{c}>", "y" if c < "q" else "z") for c in LETTERS]
SOURCES = [i // 2 for i in range(len(EXAMPLES))]  # 12 pairs of neighbouring letters


def write_data(path: Path, repeat: int = 12) -> Path:
    """The training file: every example `repeat` times as prompt/completion rows."""
    rows = [{"prompt": p, "completion": a} for _ in range(repeat) for p, a in EXAMPLES]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def next_letter(model, tokenizer, device, examples) -> Scores:
    import torch

    scores, outputs = [], []
    _calls[1] += bool(examples)
    if examples and os.environ.get("TOY_METRIC_SLOW_CALL") == str(_calls[1]):  # a stop signal comes meanwhile
        Path(os.environ["TOY_METRIC_MARK"]).touch()
        time.sleep(3)
    for i in examples:  # TOY_METRIC_FAIL_AT=i: example i raises, from the TOY_METRIC_FAIL_CALL-th evaluation on
        if os.environ.get("TOY_METRIC_FAIL_AT") == str(i) and _calls[1] >= int(os.environ["TOY_METRIC_FAIL_CALL"]):
            raise RuntimeError(f"cannot score example {i}")
        prompt, answer = EXAMPLES[i]
        ids = torch.as_tensor(tokenizer.encode(prompt), dtype=torch.long, device=device)[None]
        logits = model(input_ids=ids).logits[0, -1]
        scores.append(float(int(logits.argmax()) == int(tokenizer.encode(answer)[0])))
        outputs.append(tokenizer.decode([int(logits.argmax())]))
    prompts = [p for p, _ in EXAMPLES]
    return Scores(scores, len(EXAMPLES), True, sources=SOURCES, prompts=prompts, outputs=outputs)


def wrong_length(model, tokenizer, device, examples) -> Scores:
    return Scores([1.0] * (len(examples) + 1), n_examples=3)


def not_a_number(model, tokenizer, device, examples) -> Scores:
    return Scores([float("nan")] * len(examples), n_examples=3)


def nan_count(model, tokenizer, device, examples) -> Scores:
    return Scores([], n_examples=float("nan"))  # type: ignore[arg-type]


def touches_model(model, tokenizer, device, examples) -> Scores:
    model.eval()
    return Scores([], n_examples=3)


def changing(model, tokenizer, device, examples) -> Scores:
    _calls[0] += 1
    return Scores([0.0] * len(examples), n_examples=3 + _calls[0])


def plain_list(model, tokenizer, device, examples):
    return [0.0] * len(examples)


def write_task(folder: Path, dataset_path: str = "json") -> Path:
    """The same task as a local lm-evaluation-harness multiple-choice task: its YAML and JSONL, in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"prompt": p, "label": "yz".index(a)} for p, a in EXAMPLES]
    (folder / "toy_mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = f"dataset_kwargs:\n  data_files:\n    test: {folder / 'toy_mc.jsonl'}\n" if dataset_path == "json" else ""
    (folder / "toy_mc.yaml").write_text(
        f"task: toy_mc\ndataset_path: {dataset_path}\n{data}test_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "{{prompt}}"\ndoc_to_choice: ["y", "z"]\ndoc_to_target: label\ntarget_delimiter: ""\n'
        "metric_list:\n  - metric: acc\n    higher_is_better: true\n    aggregation: mean\n"
    )
    return folder / "toy_mc.yaml"


def write_generation_task(folder: Path) -> Path:
    """The same task as a local lm-evaluation-harness generate_until task (exact match of 1 new token)."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"prompt": p, "answer": a} for p, a in EXAMPLES]
    (folder / "toy_gen.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "toy_gen.yaml").write_text(
        f"task: toy_gen\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder / 'toy_gen.jsonl'}\n"
        'test_split: test\noutput_type: generate_until\ndoc_to_text: "{{prompt}}"\ndoc_to_target: "{{answer}}"\n'
        'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 1\n'
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n"
    )
    return folder / "toy_gen.yaml"


def flips_direction(model, tokenizer, device, examples) -> Scores:
    """higher_is_better True with no examples (the submission's check), False when it scores (issue 50, 4)."""
    return Scores([0.0] * len(examples), n_examples=3, higher_is_better=not examples)
