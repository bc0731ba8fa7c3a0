"""A local lm-evaluation-harness task file as an eval.metrics function (docs/metrics.md): `eval.metrics.NAME=PATH.yaml`.

The task (YAML, its data in local files: `dataset_path: json` with `dataset_kwargs.data_files`) is loaded once
per process through lm-eval's TaskManager, from its path alone (the other files of its folder are never read: a
sibling with the same `task:` name would otherwise be the one registered and scored), with the network off (HF_DATASETS_OFFLINE, HF_HUB_OFFLINE): a task that
would download is refused in one line. Its documents are the examples; each is scored by its requests'
log-likelihoods under the variant's model (the continuation's summed log-probability after the context, and
whether every continuation token is the greedy one, as lm-eval's own models compute them), then by the task's own
process_results: the per-example value of its first metric (acc for a multiple-choice task). generate_until
requests are answered by greedy decoding, at most the task's max_gen_toks (256 at most), cut at its `until`
strings, then the task's own filters. lm-eval is an optional extra:
`pip install -e '.[lm-eval]'`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

from slurm_router.errors import UserError

SUFFIXES = (".yaml", ".yml")
OFFLINE = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
_LOADED: dict[str, Callable] = {}  # path -> its function, once per process


def is_task_file(path: str) -> bool:
    return path.endswith(SUFFIXES)


def task_metric(name: str, path: str, scores: Callable) -> Callable:
    """The metric function of the task file at `path`, returning `scores(...)` (config/metrics.py Scores, given so
    that this module does not import it back); UserError, one line, when it cannot be one."""
    if path in _LOADED:
        return _LOADED[path]
    who = f"eval.metrics.{name}={path}"
    file = Path(path)
    if not file.is_file():
        raise UserError(f"{who}: no such task file: give the path of a local lm-evaluation-harness task YAML")
    for var in OFFLINE:  # never the network: a task whose data is not local fails now, in one line
        os.environ[var] = "1"
    try:
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise UserError(
            f"{who}: an lm-evaluation-harness task needs the lm-eval package, which is not installed: "
            "pip install -e '.[lm-eval]'"
        ) from None
    import yaml

    try:
        task_name = (yaml.safe_load(file.read_text()) or {}).get("task")
    except (OSError, yaml.YAMLError, AttributeError) as e:
        raise UserError(f"{who}: cannot read the task file ({_first(e)}): fix its YAML") from None
    if not isinstance(task_name, str):
        raise UserError(f"{who}: the task file has no `task: NAME` line: name the task")
    try:  # this file alone, by its path: never a sibling's task of the same name (lm-eval registers the first)
        task = TaskManager(include_defaults=False).load([str(file.resolve())])["tasks"][task_name]
        task.build_all_requests()
    except Exception as e:
        text = _first(e)
        network = any(w in text.lower() for w in ("offline", "connect", "hub", "internet", "couldn't find"))
        fix = (
            "it would need the network (the toolkit runs lm-eval offline): set dataset_path: json and "
            "dataset_kwargs: {data_files: {test: LOCAL.jsonl}}"
            if network
            else "fix the task file"
        )
        raise UserError(
            f"{who}: lm-eval cannot load the task {task_name!r} ({type(e).__name__}: {text}): {fix}"
        ) from None
    kinds = {inst.request_type for inst in task.instances}
    if kinds - {"loglikelihood", "generate_until"}:
        raise UserError(
            f"{who}: the task's requests are {', '.join(sorted(kinds))}: multiple_choice, loglikelihood and "
            "generate_until tasks are scored"
        )
    by_doc: dict[int, list] = {}
    for inst in task.instances:
        by_doc.setdefault(inst.doc_id, []).append(inst)
    docs = list(task.eval_docs)
    prompts = [str(sorted(by_doc[i], key=lambda r: r.idx)[0].arguments[0]) for i in range(len(docs))]
    higher = task.higher_is_better()
    metric = next(iter(higher))

    def score(model: Any, tokenizer: Any, device: Any, examples) -> Any:
        out, answers = [], []
        for i in examples:
            requests = sorted(by_doc[i], key=lambda r: r.idx)
            for r in requests:  # the model's answer, then the task's own filters (e.g. take the first, a regex)
                r.resps = [respond(model, tokenizer, device, r.request_type, r.arguments)]
                r.filtered_resps = {}
            for ensemble in task._filters:
                ensemble.apply(requests)
            key = task._filters[0].name
            results = [r.filtered_resps[key] for r in requests]
            out.append(float(task.process_results(docs[i], results)[metric]))
            answers.append(answer(requests, results))
        return scores(
            out, n_examples=len(docs), higher_is_better=bool(higher[metric]), prompts=prompts, outputs=answers
        )

    _LOADED[path] = score
    return score


def answer(requests: list, results: list) -> str:
    """What the model answered: its generated text, or the choice (continuation) it found the most likely."""
    if requests[0].request_type != "loglikelihood":
        return str(results[0])
    best = max(range(len(results)), key=lambda k: results[k][0])
    return str(requests[best].arguments[1])


def respond(model: Any, tokenizer: Any, device: Any, kind: str, arguments: tuple) -> Any:
    """A request's answer, as lm-eval's models give it: (log-likelihood, greedy) or the generated text."""
    if kind == "loglikelihood":
        return loglikelihood(model, tokenizer, device, *arguments)
    context, gen_kwargs = arguments
    until = gen_kwargs.get("until") or []
    until = [until] if isinstance(until, str) else list(until)
    limit = min(int(gen_kwargs.get("max_gen_toks") or MAX_NEW_TOKENS), MAX_NEW_TOKENS)
    return generate(model, tokenizer, device, context, until, limit)


MAX_NEW_TOKENS = 256  # generate_until: the task's max_gen_toks (lm-eval's default), at most this


def generate(model: Any, tokenizer: Any, device: Any, context: str, until: list[str], limit: int) -> str:
    """Greedy text after `context`, at most `limit` tokens, cut before the first of `until` (or end-of-text)."""
    import torch

    context_ids = [int(t) for t in tokenizer.encode(context)]
    new: list[int] = []
    for _ in range(limit):  # the whole text each time (no cache: the same on every transformers version)
        ids = torch.tensor([context_ids + new], dtype=torch.long, device=device)
        token = int(model(input_ids=ids).logits[0, -1].argmax())
        if token == getattr(tokenizer, "eot_id", None):
            break
        new.append(token)
        if any(u and u in tokenizer.decode(new) for u in until):
            break
    text = tokenizer.decode(new)
    cut = min([text.index(u) for u in until if u and u in text], default=len(text))
    return text[:cut]


def loglikelihood(model: Any, tokenizer: Any, device: Any, context: str, continuation: str) -> tuple[float, bool]:
    """(summed log-probability of `continuation` after `context`, whether each of its tokens is the argmax), the
    continuation's tokens being those the whole text has beyond the context's (lm-eval's own split)."""
    import torch

    whole = [int(t) for t in tokenizer.encode(context + continuation)]
    n_ctx = len(tokenizer.encode(context))
    if n_ctx == 0 or n_ctx >= len(whole):
        raise ValueError(f"a request with an empty context or continuation ({context!r}, {continuation!r})")
    ids = torch.tensor([whole], dtype=torch.long, device=device)
    logits = model(input_ids=ids).logits[0, n_ctx - 1 : len(whole) - 1].float()
    target = torch.tensor(whole[n_ctx:], dtype=torch.long, device=device)
    logp = torch.log_softmax(logits, -1).gather(1, target[:, None]).sum()
    return float(logp), bool((logits.argmax(-1) == target).all())


def _first(e: BaseException) -> str:
    return " ".join(((str(e).strip().splitlines() or [""])[0]).split())[:200]
