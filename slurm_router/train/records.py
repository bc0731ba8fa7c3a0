"""data=jsonl and data=parquet: rows -> records of one format (docs/design/model.md, "Target masks").

The fields set choose the format, only one of: data.text_field (plain text, the default: loss on every token),
data.prompt_field + data.completion_field (loss on the completion), data.messages_field (OpenAI-style
[{role, content}] turns: loss on the assistant turns). Every row is checked as it is read: a bad one is one
line naming the file and its line (JSONL) or row (parquet, 1-based within the file). A record's name (its
line, or its row counted over all files in order) decides its train/held-out side, so a parquet file, a
folder of its parts and the same rows as JSON Lines give the same corpus.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from slurm_router.errors import UserError
from slurm_router.train.chat import ROLES

FORMATS = {
    "text": ("text_field",),
    "prompt_completion": ("prompt_field", "completion_field"),
    "chat": ("messages_field",),
}
_WHAT = {
    "text_field": "the text",
    "prompt_field": "the prompt",
    "completion_field": "the completion",
    "messages_field": "the conversation (a list of {role, content} objects)",
}
_JSON_TYPES = {
    dict: "an object",
    list: "an array",
    str: "a string",
    int: "a number",
    float: "a number",
    bool: "a boolean",
    type(None): "null",
}


@dataclass(frozen=True)
class Fields:
    """The record format and the data.* keys naming the fields it reads, with their values."""

    format: str  # text | prompt_completion | chat
    keys: tuple[str, ...]  # e.g. ("prompt_field", "completion_field")
    names: tuple[str, ...]  # e.g. ("prompt", "completion")


def record_fields(data_cfg, reads_fields: bool) -> Fields:
    """The format the data.* fields choose (reads_fields: data.kind's rows have fields, train/sources.py); a mix or
    a half pair is an error saying what to set."""
    prompt, completion, messages = data_cfg.prompt_field, data_cfg.completion_field, data_cfg.messages_field
    chosen = [
        k for k, v in (("prompt_field", prompt), ("completion_field", completion), ("messages_field", messages)) if v
    ]
    if chosen and not reads_fields:
        raise UserError(
            f"data.{chosen[0]} applies to data=jsonl and data=parquet only (data={data_cfg.kind} "
            "reads plain text): remove it, or use data=jsonl / data=parquet"
        )
    if messages and (prompt or completion):
        raise UserError(
            "data.messages_field and data.prompt_field/completion_field are both set: set only one "
            "of data.text_field (plain text), data.prompt_field + data.completion_field, "
            "data.messages_field (chat)"
        )
    if bool(prompt) != bool(completion):
        have, need = ("prompt_field", "completion_field") if prompt else ("completion_field", "prompt_field")
        raise UserError(
            f"data.{have}={prompt or completion} needs data.{need} too: the loss covers the "
            "completion of each prompt/completion pair (for plain text set data.text_field only)"
        )
    fmt = "chat" if messages else "prompt_completion" if prompt else "text"
    if fmt != "text" and data_cfg.text_field != "text":
        raise UserError(
            f"data.text_field={data_cfg.text_field} and data.{chosen[0]} are both set: set only one "
            "of data.text_field (plain text), data.prompt_field + data.completion_field, "
            "data.messages_field (chat)"
        )
    keys = FORMATS[fmt]
    return Fields(fmt, keys, tuple(str(getattr(data_cfg, k)) for k in keys))


def checked_records(rows, fields: Fields) -> Iterator[tuple[str, str, object]]:
    """Each (name, where, row) as a record of fields.format, its fields checked."""
    for name, where, row in rows:
        values = []
        for key, field in zip(fields.keys, fields.names):
            if field not in row:
                present = ", ".join(map(repr, list(row)[:8])) or "none"
                raise UserError(
                    f"{where} has no field {field!r} (its fields: {present}): set data.{key} to the "
                    f"field holding {_WHAT[key]}"
                )
            values.append(row[field])
        if fields.format == "chat":
            yield name, where, _messages(values[0], fields.names[0], where)
            continue
        for key, field, value in zip(fields.keys, fields.names, values):
            if not isinstance(value, str):
                raise UserError(
                    f"{where}: field {field!r} is {_kind(value)}, not a string: set data.{key} to the "
                    f"field holding {_WHAT[key]}"
                )
        yield name, where, values[0] if fields.format == "text" else tuple(values)


def _kind(value) -> str:
    return _JSON_TYPES.get(type(value), type(value).__name__)


def _messages(value, field: str, where: str) -> list[dict]:
    """OpenAI-style turns, checked: a list of objects with a known role and a string content."""
    fix = f'field {field!r} must be a list of {{"role": ..., "content": "..."}} objects'
    if not isinstance(value, (list, tuple)):
        raise UserError(f"{where}: field {field!r} is {_kind(value)}, not a list of turns: {fix}")
    turns = []
    for i, m in enumerate(value, 1):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            what = f"has no {'role' if 'role' not in m else 'content'}" if isinstance(m, dict) else f"is {_kind(m)}"
            raise UserError(f"{where}: message {i} of {field!r} {what}: {fix}")
        if m["role"] not in ROLES:
            raise UserError(
                f"{where}: message {i} has the role {m['role']!r}, not one of {', '.join(ROLES)}: "
                "rename it to one of these"
            )
        if not isinstance(m["content"], str):
            raise UserError(
                f"{where}: message {i} ({m['role']}) has content that is {_kind(m['content'])}, not a "
                "string: give every turn its text as a string"
            )
        turns.append({"role": m["role"], "content": m["content"]})
    return turns


def read_bytes(p: Path) -> bytes:
    try:
        return p.read_bytes()
    except OSError as e:
        raise UserError(
            f"data file {p} cannot be read ({e.strerror or type(e).__name__}): make it readable or remove it"
        ) from None


def jsonl_rows(path: str, fields: Fields) -> Iterator[tuple[str, str, dict]]:
    """JSON Lines as the format defines them: one JSON object a line, and lines end at '\\n' only, never at
    U+2028, U+0085 or the others str.splitlines() splits at (json.dumps(..., ensure_ascii=False) writes those
    raw inside strings); CRLF line ends, a UTF-8 byte order mark, blank lines and a last line without '\\n'
    all load."""
    p = Path(os.path.expanduser(path))
    if p.is_symlink() and not p.exists():
        raise UserError(f"data.path={path!r} is a dangling symbolic link (to {os.readlink(p)}): fix it")
    if p.is_dir():
        raise UserError(
            f"data.path={path!r} is a folder, not a file: give a .jsonl file with one JSON object a "
            "line (data=text_dir reads a folder of text files)"
        )
    if not p.is_file():
        raise UserError(f"data.path={path!r} is not a file: give a .jsonl file with one JSON object a line")
    raw = read_bytes(p)
    line: Any
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise UserError(f"data file {p} is not UTF-8 (line {line}, byte {e.start}): convert it to UTF-8") from None
    field = fields.names[0]
    for n, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"line {n} of {p} is not valid JSON ({e.msg}): one JSON object a line") from None
        except RecursionError:
            raise UserError(f"line {n} of {p} is JSON nested too deeply to read: one JSON object a line") from None
        if not isinstance(row, dict):
            raise UserError(
                f"line {n} of {p} is a JSON {_JSON_TYPES[type(row)].split()[-1]}, not an object with "
                f'a {field!r} field: data=jsonl reads one object a line, e.g. {{"{field}": "..."}}'
            )
        yield f"{n}", f"line {n} of {p}", row


def parquet_files(path: str) -> list[Path]:
    """data.path of data=parquet: one file, or every *.parquet file under a folder (sorted, hidden ones left out)."""
    p = Path(os.path.expanduser(path))
    if p.is_symlink() and not p.exists():
        raise UserError(f"data.path={path!r} is a dangling symbolic link (to {os.readlink(p)}): fix it")
    if p.is_file():
        return [p]
    if not p.is_dir():
        raise UserError(f"data.path={path!r} does not exist: give a .parquet file or a folder of them")
    files = sorted(
        f
        for f in p.rglob("*.parquet")
        if f.is_file() and not any(part.startswith(".") for part in f.relative_to(p).parts)
    )
    if not files:
        raise UserError(
            f"data.path={path!r} is a folder with no .parquet files: give a .parquet file or a folder "
            "holding them (data=jsonl reads JSON Lines)"
        )
    return files


def parquet_rows(path: str, fields: Fields) -> Iterator[tuple[str, str, dict]]:
    """The rows of one parquet file or a folder of them (pyarrow), only the columns the format reads."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    n = 0
    for p in parquet_files(path):
        try:
            f = pq.ParquetFile(p)
            columns = f.schema_arrow.names
            for key, field in zip(fields.keys, fields.names):
                if field not in columns:
                    listed = ", ".join(map(repr, columns[:12])) + (", ..." if len(columns) > 12 else "")
                    raise UserError(
                        f"data file {p} has no column {field!r} (its columns: {listed or 'none'}): set "
                        f"data.{key} to the column holding {_WHAT[key]}"
                    )
            row_in_file = 0
            for batch in f.iter_batches(batch_size=1024, columns=list(fields.names)):
                for row in batch.to_pylist():
                    n, row_in_file = n + 1, row_in_file + 1
                    yield f"{n}", f"row {row_in_file} of {p}", row
        except (pa.ArrowException, OSError, ValueError) as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise UserError(
                f"data file {p} is not a readable parquet file ({first}): rewrite it, or remove it from data.path"
            ) from None
