"""The central invariant: routing changes speed and memory, never the math.

The loss curve of 1 device with round_robin equals that of several devices with any policy, heterogeneous
speeds and micro-batch splitting, up to float reduction order. Real multi-process workers (gloo).
"""

import pytest
from conftest import memory_cap, run_cli, run_dir_of, slowdown, step_losses

from slurm_router.rundir.events import MicroRow, read_events

COMMON = [
    "base.enabled=false",
    "train.steps=6",
    "train.global_batch_size=12",
    "train.warmup_steps=0",
    "train.lr=1e-2",
    "train.eval_batches=1",
    "train.eval_batch_size=4",
    "data.max_documents=40",
    "data.max_len=128",
    "launcher.cpu_slots=4",
]
RTOL = 2e-5
OOM_CAP_BYTES = 16_000_000  # fp32; sums over a different split of the same samples differ only in reduction order


def _losses(tmp_path, *args, env: dict | None = None) -> list[float]:
    proc = run_cli(*COMMON, *args, f"run_root={tmp_path / 'runs'}", cwd=tmp_path, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return step_losses(run_dir_of(proc) / "tasks" / "main")


def _micro_rows(tmp_path) -> list[dict]:
    rows = []
    for f in (tmp_path / "runs").rglob("events-rank*.jsonl"):
        rows += [r for r in read_events(f) if r["event"] == MicroRow.KIND]
    return rows


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _losses(tmp_path_factory.mktemp("ref"), "resources.devices_per_task=1", "router=round_robin")


@pytest.mark.integration
@pytest.mark.parametrize(
    "args, env",
    [
        (["resources.devices_per_task=2", "router=round_robin"], {}),
        (["resources.devices_per_task=2", "router=balanced"], {}),
        (["resources.devices_per_task=3", "router=least_loaded"], {}),
        (["resources.devices_per_task=3", "router=affinity", "router.affinity_boundaries=[32,96]"], {}),
        # heterogeneous speeds and forced micro-batch splitting (gradient accumulation)
        (
            ["resources.devices_per_task=3", "router=balanced", "router.max_tokens_per_microbatch=200"],
            slowdown("1,2,4"),
        ),
        # a device memory cap the router's first estimate underrates: out-of-memory, halve, retry, learn
        (["resources.devices_per_task=2", "router=balanced"], memory_cap(str(OOM_CAP_BYTES))),
        # speed switches change the arithmetic's grouping only: chunked loss, padded widths, no prefetch
        (
            [
                "resources.devices_per_task=2",
                "router=balanced",
                "train.loss_chunk_tokens=64",
                "train.packing=false",  # padded micro-batches: packed rows have no width to pad
                "train.pad_to_multiple=32",
                "train.prefetch=false",
            ],
            {},
        ),
    ],
    ids=[
        "2dev-round_robin",
        "2dev-balanced",
        "3dev-least_loaded",
        "3dev-affinity",
        "3dev-balanced-hetero-split",
        "2dev-oom-retry",
        "2dev-chunked-loss-padded",
    ],
)
def test_same_loss_curve_for_any_devices_and_policy(tmp_path, reference, args, env):
    losses = _losses(tmp_path, *args, env=env)
    assert len(losses) == len(reference) == 6
    assert reference[-1] < reference[0], "the reference run did not learn"
    for step, (a, b) in enumerate(zip(reference, losses)):
        assert b == pytest.approx(a, rel=RTOL), f"step {step}: {b} vs {a} with {args}"
    # the work really was spread: every device computed samples, and the split case accumulated micro-batches
    micro = _micro_rows(tmp_path)
    n_dev = int(args[0].split("=")[1])
    assert {r["device"] for r in micro} == set(range(n_dev))
    assert sum(r["n_samples"] for r in micro) == 6 * 12, "a sample was lost or computed twice"
    for step in range(6):  # the ledger: every sample of every global batch computed exactly once
        ids = [i for r in micro if r["step"] == step for i in r["sample_ids"]]
        assert len(ids) == len(set(ids)) == 12, f"step {step}: {sorted(ids)}"
    if env == memory_cap(str(OOM_CAP_BYTES)):
        retries = {s: max(r["oom_retries"] for r in micro if r["step"] == s) for s in range(6)}
        assert retries[0] > 0, "the cap should have caught the router's optimistic first estimate"
        assert retries[5] == 0, f"the memory model did not learn: {retries}"
        assert all(r["mem_peak_bytes"] <= OOM_CAP_BYTES for r in micro)
    if any("max_tokens_per_microbatch" in a for a in args):
        assert max(r["micro"] for r in micro) >= 1
        assert all(r["n_tokens"] + r["n_pad_tokens"] <= 200 or r["n_samples"] == 1 for r in micro)


# Masked targets (issue 13): prompt/completion data, the loss and its divisor cover the completions only (the
# router's cost still counts every token). Some prompts outgrow data.max_len and are truncated. The same invariant.
MASKED = ["data=jsonl", "data.prompt_field=prompt", "data.completion_field=completion"]


@pytest.fixture(scope="module")
def masked_data(tmp_path_factory):
    from tiny_checkpoints import prompt_completion_rows, write_jsonl

    return write_jsonl(tmp_path_factory.mktemp("masked") / "pc.jsonl", prompt_completion_rows(80))


@pytest.fixture(scope="module")
def masked_reference(tmp_path_factory, masked_data):
    return _losses(
        tmp_path_factory.mktemp("masked_ref"),
        *MASKED,
        f"data.path={masked_data}",
        "resources.devices_per_task=1",
        "router=round_robin",
    )


@pytest.mark.integration
@pytest.mark.parametrize(
    "args, env",
    [
        (["resources.devices_per_task=2", "router=round_robin"], {}),
        (["resources.devices_per_task=3", "router=least_loaded"], {}),
        (["resources.devices_per_task=3", "router=affinity", "router.affinity_boundaries=[64,96]"], {}),
        # balanced with heterogeneous speeds, split micro-batches and the chunked loss (its host-side target index)
        (
            [
                "resources.devices_per_task=3",
                "router=balanced",
                "router.max_tokens_per_microbatch=300",
                "train.loss_chunk_tokens=64",
            ],
            slowdown("1,2,4"),
        ),
    ],
    ids=["masked-2dev-round_robin", "masked-3dev-least_loaded", "masked-3dev-affinity", "masked-3dev-balanced-split"],
)
def test_masked_targets_same_loss_curve(tmp_path, masked_reference, masked_data, args, env):
    losses = _losses(tmp_path, *MASKED, f"data.path={masked_data}", *args, env=env)
    assert len(losses) == len(masked_reference) == 6
    assert masked_reference[-1] < masked_reference[0], "the reference run did not learn"
    for step, (a, b) in enumerate(zip(masked_reference, losses)):
        assert b == pytest.approx(a, rel=RTOL), f"step {step}: {b} vs {a} with {args}"
    micro = _micro_rows(tmp_path)
    assert {r["device"] for r in micro} == set(range(int(args[0].split("=")[1])))
    steps = [r for f in (tmp_path / "runs").rglob("events-rank0.jsonl") for r in read_events(f) if r["event"] == "step"]
    # only the completions are targets: far fewer than the tokens computed (n - 1 per sample without masks)
    assert all(0 < s["n_target_tokens"] < (s["n_tokens"] - s["n_samples"]) / 2 for s in steps)


@pytest.mark.integration
def test_chat_targets_same_loss_curve_on_a_llama_checkpoint(tmp_path):
    """Chat data on a tiny Llama-architecture checkpoint (its tokenizer and chat template, assistant turns as
    the only targets): 1 device with round_robin and 3 with balanced, split micro-batches, give the same curve."""
    from tiny_checkpoints import chat_rows, make_checkpoint, write_jsonl

    ckpt = make_checkpoint(tmp_path / "llama", "llama")
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(60))
    chat = [
        "model=hf",
        f"model.name_or_path={ckpt}",
        "data=jsonl",
        f"data.path={data}",
        "data.messages_field=messages",
        "data.max_len=192",
    ]
    (tmp_path / "one").mkdir(), (tmp_path / "three").mkdir()
    reference = _losses(tmp_path / "one", *chat, "resources.devices_per_task=1", "router=round_robin")
    losses = _losses(
        tmp_path / "three",
        *chat,
        "resources.devices_per_task=3",
        "router=balanced",
        "router.max_tokens_per_microbatch=400",
    )
    assert reference[-1] < reference[0], "the reference run did not learn"
    assert losses == pytest.approx(reference, rel=RTOL)
