"""data.kind=jsonl and data.kind=parquet: rows with fields (train/records.py): text, prompt/completion or chat."""

from slurm_router.config.data_sources import FIELDS, TEXT, DataSource


def _unread(data) -> dict[str, str]:
    if data.get("prompt_field") or data.get("messages_field"):  # one sample a row (records.py refuses text_field)
        return {"split_on": "a prompt/completion or chat row is one sample: drop data.split_on"}
    return {}


SOURCES = {kind: DataSource(reads=(*TEXT, *FIELDS), unread=_unread) for kind in ("jsonl", "parquet")}
