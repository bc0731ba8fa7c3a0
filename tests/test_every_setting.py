"""Nothing a user sets is silently ignored (issue 29, "Done when"): every key of the composed config, for each data
source (conf/data/*.yaml) and each launcher (conf/launcher/*.yaml), is either read by the code or refused in one
line naming it when the user sets it.

- read: each key's declaration (config/settings.py: `reader=`, beside its schema field; a launcher's keys: its
  backend's declared() hook) names the module and the code that reads it; the test finds that code in the module,
  comments and docstrings left out. This shows where the key is read, not what it changes: the data.* keys have
  the stronger test in tests/test_ignored_settings.py (a read key changes the corpus built), and the walk uses
  their rule (config/checks.py, data_keys_read).
- read under a condition (the declaration's `read_if`, config/conditions.py: base.steps only with a base stage,
  ...): where the composed config leaves the condition off, the key must be refused; test_a_conditional_read_...
  shows each condition both ways (its `off` and `on` overrides).
- refused: set to its declaration's `example` through the command's own checks, as `python -m slurm_router` runs them
  (compose, then check_new_run with the keys the overrides set), it gives a UserError whose one line starts
  with the key.

A key added to a conf/*.yaml or the schema without code that reads it fails here: read it, refuse it, or drop it.

    pytest tests/test_every_setting.py
"""

from __future__ import annotations

import ast
import copy
import io
import json
import tokenize
from functools import cache
from pathlib import Path

import pytest
from omegaconf import DictConfig, OmegaConf

from slurm_router.cli.checks import check_new_run
from slurm_router.config.checks import data_keys_read
from slurm_router.config.compose import compose
from slurm_router.config.schema import conf_dir, declared, free_form_keys
from slurm_router.config.settings import Condition, Setting
from slurm_router.config.sweep import parse_overrides
from slurm_router.config.unread import set_keys
from slurm_router.errors import UserError

PACKAGE = Path(__file__).resolve().parents[1] / "slurm_router"
DATA = sorted(p.stem for p in Path(conf_dir(), "data").glob("*.yaml"))
LAUNCHERS = sorted(p.stem for p in Path(conf_dir(), "launcher").glob("*.yaml"))


def declaration(key: str, launcher: str) -> Setting:
    """The key's declaration (config/settings.py: beside its schema field, or its launcher's declared() hook)."""
    found = declared(launcher).get(key)
    assert found is not None, f"launcher={launcher}: {key} has no declaration in the schema"
    return found[0]


def conditions() -> dict[str, Condition]:
    """key -> the condition it is read under, over every launcher's keys."""
    return {k: s.read_if for k, (s, _) in declared().items() if s.read_if is not None}


@pytest.fixture(scope="module")
def small_data(tmp_path_factory) -> dict[str, list[str]]:
    """Each data source's overrides, on a few files or rows (the checks build the corpus)."""
    root = tmp_path_factory.mktemp("data")
    (root / "texts").mkdir()
    for i in range(4):
        (root / "texts" / f"doc{i}.txt").write_text("\n\n".join(f"paragraph {j} of {i}\nline two" for j in range(4)))
    rows = [{"text": f"row {i}\nsecond line\nthird line " * 4} for i in range(12)]
    (root / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": [r["text"] for r in rows]}), root / "rows.parquet")
    return {
        "stdlib": ["data.max_documents=12"],
        "text_dir": [f"data.path={root / 'texts'}"],
        "jsonl": [f"data.path={root / 'rows.jsonl'}"],
        "parquet": [f"data.path={root / 'rows.parquet'}"],
        "synthetic": ["data.n_samples=60"],
    }


def leaves(node: DictConfig, prefix: str = "") -> list[str]:
    """The composed config's keys, dotted; a free-form mapping (variants, launcher.additional_parameters) is one."""
    out = []
    for key in node:
        full, value = f"{prefix}{key}", node._get_node(key)
        if isinstance(value, DictConfig) and len(value) and full not in free_form_keys():
            out += leaves(value, full + ".")
        else:
            out.append(full)
    return out


@cache
def code_of(module: str) -> str:
    """A module's source without its comments and docstrings: the code that runs."""
    source = (PACKAGE / module).read_text()
    lines = source.splitlines()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            if isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
                for n in range(body[0].lineno - 1, body[0].end_lineno or body[0].lineno):
                    lines[n] = ""
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and lines[tok.start[0] - 1]:
            lines[tok.start[0] - 1] = lines[tok.start[0] - 1][: tok.start[1]]
    return "\n".join(lines)


def refusal(overrides: list[str], cfg: DictConfig | None = None) -> str | None:
    """The one line the command's checks give for these overrides (python -m slurm_router's order: compose,
    then check_new_run with the keys they set), or None. cfg: the overrides' config, composed already."""
    try:
        check_new_run(compose(overrides) if cfg is None else cfg, set_keys(overrides))
    except UserError as e:
        return str(e)
    return None


def with_value(overrides: list[str], key: str, value: str) -> list[str]:
    return [o for o in overrides if o.split("=", 1)[0] != key] + [f"{key}={value}"]


def set_in(cfg: DictConfig, override: str) -> DictConfig:
    """A copy of cfg with one key=value override applied (Hydra's parser for the value): composing again costs
    0.1 s a key."""
    (parsed,) = parse_overrides([override])
    out = copy.deepcopy(cfg)
    OmegaConf.update(out, parsed.key_or_group, parsed.value(), merge=False)
    return out


def test_the_sources_and_launchers_are_those_of_conf():
    assert DATA == ["jsonl", "parquet", "stdlib", "synthetic", "text_dir"]
    assert LAUNCHERS == ["local", "sbatch", "slurm"]


@pytest.mark.parametrize("launcher", LAUNCHERS)
@pytest.mark.parametrize("data", DATA)
def test_every_key_is_read_or_refused(data, launcher, small_data, tmp_path):
    base = [f"data={data}", f"launcher={launcher}", *small_data[data], "dry_run=true", f"run_root={tmp_path}"]
    cfg = compose(base)
    assert refusal(base) is None  # the pair's own config passes
    for key in leaves(cfg):
        found = declaration(key, launcher)
        if key.startswith("data."):
            read = key[len("data.") :] in data_keys_read(cfg.data)  # tests/test_ignored_settings.py: each is read
        else:
            site = found.reader_for(launcher)
            read = site is not None and (found.read_if is None or found.read_if.reads(cfg))
        if read:
            if not key.startswith("data."):
                module, code = found.reader_for(launcher) or ("", "")
                assert key.rsplit(".", 1)[-1] in code and code in code_of(module), f"{key}: not read in {module}"
            continue
        example = found.example
        assert example, f"data={data} launcher={launcher}: {key} declares no reader and no example to refuse"
        assert str(OmegaConf.select(cfg, key)) != example.strip("'"), key
        override = f"{key}={example}"
        line = refusal([override], set_in(cfg, override))
        assert line is not None and line.startswith(key), (
            f"data={data} launcher={launcher}: {key}={example} is neither read (its reader) nor refused: {line}"
        )
        assert "\n" not in line


def test_every_conditional_read_has_a_switch_a_site_and_an_example():
    for key, condition in conditions().items():
        found = declaration(key, "sbatch")
        assert condition.off or condition.on, f"{key}: its condition names no override that switches it"
        assert found.reader and found.example, f"{key}: read under a condition, it needs a reader and an example"


@pytest.mark.parametrize("key", sorted(conditions()))
def test_a_conditional_read_is_refused_off_and_accepted_on(key, tmp_path):
    condition, example = conditions()[key], declaration(key, "sbatch").example
    base = ["data=synthetic", "data.n_samples=60", "dry_run=true", f"run_root={tmp_path}"]
    line = refusal(with_value([*base, *condition.off], key, example))
    assert line is not None and line.startswith(f"{key}=") and "so it would be ignored: " in line, line
    line = refusal(with_value([*base, *condition.on], key, example))  # model=hf /tmp: no checkpoint there, said later
    assert line is None or "would be ignored" not in line, line


def test_every_declared_reader_reads_its_key():
    """Each reader a declaration names (every launcher's, and keys no walk above composes as read) is code of its
    module that names the key: a reader left behind when the code moved fails here."""
    sites = []
    for key, (found, _) in declared().items():
        readers = found.reader.values() if isinstance(found.reader, dict) else [found.reader] if found.reader else []
        sites += [(key, *r.partition(": ")[::2]) for r in readers]
    assert len(sites) >= 100
    for key, module, code in sites:
        assert key.rsplit(".", 1)[-1] in code and code in code_of(module), f"{key}: {code!r} is not in {module}"


def test_model_kind_and_data_kind_are_their_registries():
    """model.kind and data.kind take what config/model_families/ and config/data_sources/ register, each kind
    answering for itself (the one place the config branches on them)."""
    from slurm_router.config import data_sources, model_families
    from slurm_router.config.schema import CHOICES

    assert CHOICES["model.kind"] == tuple(model_families.FAMILIES) == ("gpt2", "hf")
    assert CHOICES["data.kind"] == tuple(data_sources.SOURCES) == tuple(DATA_ORDER)
    assert all(model_families.family(k).kind == k for k in model_families.FAMILIES)
    assert all({"kind", "max_len"} <= set(data_sources.source(k).reads) for k in data_sources.SOURCES)


DATA_ORDER = ("stdlib", "text_dir", "jsonl", "parquet", "synthetic")
