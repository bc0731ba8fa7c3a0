"""model=hf on the checkpoints people bring: Llama, Qwen2 and GPT-2 architectures (tiny, made on the spot by
tests/tiny_checkpoints.py), LoRA target layers (auto, all-linear, a list; a wrong name is one line listing the
layers), frozen weights in bf16 with fp32 LoRA weights, gradient checkpointing, base weights from a folder, and
the memory model's seed bound on GPT-2- and Llama-shaped models built on the meta device."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import run_cli, run_dir_of, step_losses
from omegaconf import OmegaConf
from tiny_checkpoints import make_checkpoint

from slurm_router.config.lora_targets import gpt2_lora_layers
from slurm_router.config.schema import ModelConfig
from slurm_router.config.variants import validate
from slurm_router.errors import UserError
from slurm_router.router import MemoryModel
from slurm_router.train.model import (
    build_model,
    check_architecture,
    frozen_dtype,
    lora_layers,
    lora_targets,
    parameter_bytes,
    trainable_parameters,
)

VOCAB = 512  # tiny_checkpoints' tokenizer size


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    return {arch: make_checkpoint(root / arch, arch) for arch in ("llama", "qwen2", "gpt2")}


def _hf(path, **settings):
    cfg = OmegaConf.structured(ModelConfig(kind="hf", name_or_path=str(path)))
    for key, value in settings.items():
        OmegaConf.update(cfg, key, value)
    return cfg


def _adapted(model) -> set[str]:
    """The short names of the layers that got a LoRA adapter."""
    return {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if hasattr(m, "lora_A")}


def _losses(model, steps: int = 3, seed: int = 0) -> list[float]:
    """A few AdamW steps on one fixed batch: the token-summed loss of each."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (4, 24), generator=g)
    opt = torch.optim.AdamW(trainable_parameters(model), lr=1e-2)
    losses = []
    for _ in range(steps):
        logits = model(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].float().reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1), reduction="sum"
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


# ---- architectures and target layers ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "arch, adapted", [("llama", {"q_proj", "v_proj"}), ("qwen2", {"q_proj", "v_proj"}), ("gpt2", {"c_attn"})]
)
def test_each_architecture_loads_with_peft_default_layers_and_trains(checkpoints, arch, adapted):
    cfg = _hf(checkpoints[arch])
    assert cfg.lora.target_modules == "auto"
    check_architecture(cfg)
    model = build_model(cfg, VOCAB, seed=0)
    assert model.training and _adapted(model) == adapted  # peft's own defaults for the architecture
    losses = _losses(model)
    assert all(map(torch.isfinite, torch.tensor(losses))) and losses[-1] < losses[0]


@pytest.mark.parametrize(
    "targets, adapted",
    [
        ("all-linear", {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}),
        (["q_proj", "o_proj"], {"q_proj", "o_proj"}),
        ("k_proj", {"k_proj"}),  # one name alone
        (["self_attn.v_proj"], {"v_proj"}),  # peft's rule: a dotted suffix
    ],
)
def test_all_linear_and_explicit_lists(checkpoints, targets, adapted):
    cfg = _hf(checkpoints["llama"], **{"lora.target_modules": targets})
    check_architecture(cfg)
    model = build_model(cfg, VOCAB, seed=0)
    assert _adapted(model) == adapted
    losses = _losses(model)
    assert losses[-1] < losses[0]


def test_auto_is_all_linear_where_peft_has_no_default(checkpoints):
    cfg = _hf(checkpoints["llama"])
    unknown = type("M", (), {"config": type("C", (), {"model_type": "no-peft-default"})()})()
    assert lora_targets(cfg, unknown) == "all-linear"
    assert lora_targets(_hf(checkpoints["llama"], **{"lora.target_modules": "all-linear"}), unknown) == "all-linear"


def test_a_layer_the_model_lacks_is_one_line_listing_its_layers(checkpoints):
    cfg = _hf(checkpoints["qwen2"], **{"lora.target_modules": ["q_proj", "c_attn"]})
    with pytest.raises(UserError) as e:
        check_architecture(cfg, where="variants.attn: ")
    assert str(e.value) == (
        "variants.attn: model.lora.target_modules: 'c_attn' is not a layer of Qwen2ForCausalLM "
        "that LoRA can adapt: its layers are embed_tokens, q_proj, k_proj, v_proj, o_proj, "
        "gate_proj, up_proj, down_proj, lm_head (or use auto or all-linear)"
    )
    with pytest.raises(UserError, match="'self_attn' is not a layer of LlamaForCausalLM"):  # not a leaf layer
        check_architecture(_hf(checkpoints["llama"], **{"lora.target_modules": ["self_attn"]}))
    check_architecture(_hf(checkpoints["llama"], **{"lora.enabled": False, "lora.target_modules": ["nope"]}))


def test_gpt2_builtin_models_are_checked_without_building_them():
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config(n_layer=3, n_embd=64, n_head=4))
    assert gpt2_lora_layers(3) == lora_layers(model)  # config.py's names are the real model's
    from slurm_router.config.compose import compose

    validate(compose(["model.lora.target_modules=[c_attn,c_proj,c_fc]"]))
    validate(compose(["model.lora.target_modules=all-linear", "+variants.a.model.lora.target_modules=[attn.c_attn]"]))
    cfg = compose(["model.lora.target_modules=[c_attn,q_proj]"])
    with pytest.raises(
        UserError,
        match="'q_proj' is not a layer of GPT2LMHeadModel that LoRA can adapt: its "
        "layers are wte, wpe, c_attn, c_proj, c_fc, lm_head",
    ):
        validate(cfg)


def test_a_checkpoint_that_is_not_a_causal_lm_is_one_line(tmp_path):
    from transformers import T5Config

    T5Config(d_model=16, d_ff=32, num_layers=1, num_heads=2, vocab_size=64).save_pretrained(tmp_path / "t5")
    with pytest.raises(UserError, match=r"the checkpoint is a t5 model \(T5Config\), not a causal language model"):
        check_architecture(_hf(tmp_path / "t5"))
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    with pytest.raises(UserError, match="transformers cannot read the config.json of"):
        check_architecture(_hf(tmp_path / "odd"))


def test_rslora_and_dora_reach_peft(checkpoints):
    model = build_model(
        _hf(checkpoints["llama"], **{"lora.use_rslora": True, "lora.use_dora": True, "lora.r": 4, "lora.alpha": 8}),
        VOCAB,
        seed=0,
    )
    peft_cfg = model.peft_config["default"]
    assert peft_cfg.use_rslora and peft_cfg.use_dora
    q = model.get_base_model().model.layers[0].self_attn.q_proj
    assert q.scaling["default"] == pytest.approx(8 / 4**0.5)  # rank-stabilised: alpha / sqrt(r)
    assert "default" in q.lora_magnitude_vector  # DoRA's magnitudes
    losses = _losses(model)
    assert losses[-1] < losses[0]
    plain = build_model(_hf(checkpoints["llama"]), VOCAB, seed=0).peft_config["default"]
    assert not plain.use_rslora and not plain.use_dora


# ---- dtypes, gradient checkpointing, base weights --------------------------------------------------------
def test_auto_dtype_is_bf16_on_a_gpu_and_fp32_on_cpu():
    cfg = OmegaConf.structured(ModelConfig())
    assert frozen_dtype(cfg, torch.device("cuda", 0)) == torch.bfloat16
    assert frozen_dtype(cfg, torch.device("cpu")) == frozen_dtype(cfg) == torch.float32
    cfg.dtype = "fp32"
    assert frozen_dtype(cfg, "cuda") == torch.float32


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_bf16_frozen_weights_with_fp32_lora_weights(checkpoints, arch):
    cfg = _hf(checkpoints[arch], dtype="bf16", **{"lora.target_modules": "all-linear"})
    model = build_model(cfg, VOCAB, seed=0)
    frozen = {p.dtype for p in model.parameters() if not p.requires_grad}
    trainable = {p.dtype for p in model.parameters() if p.requires_grad}
    assert frozen == {torch.bfloat16} and trainable == {torch.float32}
    frozen_bytes, trainable_bytes = parameter_bytes(model)
    n_frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    assert frozen_bytes == 2 * n_frozen and trainable_bytes == 4 * sum(p.numel() for p in trainable_parameters(model))
    losses = _losses(model)
    assert losses[-1] < losses[0]
    assert {p.grad.dtype for p in trainable_parameters(model)} == {torch.float32}
    # full training (the base stage) keeps fp32 master weights whatever model.dtype says
    assert {p.dtype for p in build_model(cfg, VOCAB, seed=0, lora=False).parameters()} == {torch.float32}


def test_bf16_builtin_gpt2():
    cfg = OmegaConf.structured(ModelConfig(dtype="bf16"))
    cfg.lora.target_modules = ["c_attn", "c_proj"]
    model = build_model(cfg, 257, seed=0)
    assert {p.dtype for p in model.parameters() if not p.requires_grad} == {torch.bfloat16}
    assert {p.dtype for p in trainable_parameters(model)} == {torch.float32}


def test_gradient_checkpointing_gives_the_same_losses(checkpoints):
    cfg = _hf(checkpoints["llama"], **{"lora.target_modules": "all-linear"})
    plain = build_model(cfg, VOCAB, seed=0)
    recomputed = build_model(cfg, VOCAB, seed=0, gradient_checkpointing=True)

    def checkpointing(model) -> bool:
        return any(getattr(m, "gradient_checkpointing", False) for m in model.modules())

    assert checkpointing(recomputed) and not recomputed.get_base_model().config.use_cache
    assert not checkpointing(plain)
    a, b = _losses(plain, steps=4), _losses(recomputed, steps=4)
    assert a[-1] < a[0]
    assert b == pytest.approx(a, rel=1e-5)


def test_base_weights_from_a_save_pretrained_folder(tmp_path):
    cfg = OmegaConf.structured(ModelConfig())
    cfg.lora.target_modules = ["c_attn", "c_proj"]
    base = build_model(cfg, 257, seed=3, lora=False)
    with torch.no_grad():
        base.transformer.h[0].mlp.c_fc.weight.add_(1.0)  # "trained": not what the seed builds
    base.save_pretrained(tmp_path / "folder")
    want = base.state_dict()
    for lora in (False, True):
        model = build_model(cfg, 257, seed=0, base_weights=str(tmp_path / "folder"), lora=lora)
        got = (model.get_base_model() if lora else model).state_dict()
        got = {k.replace(".base_layer", ""): v for k, v in got.items() if "lora_" not in k}
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want)
    # same seed, same LoRA initial weights on every worker
    a, b = (build_model(cfg, 257, seed=0, base_weights=str(tmp_path / "folder")) for _ in range(2))
    assert all(torch.equal(x, y) for x, y in zip(trainable_parameters(a), trainable_parameters(b)))


# ---- the memory model's seed: its stated bound, on the meta device ---------------------------------------
GPT2_SMALL = dict(model_type="gpt2", n_embd=768, n_layer=12, n_head=12, vocab_size=50257, n_positions=1024)
# Llama-3.2-1B's width (hidden, MLP, heads, grouped KV) with fewer layers: the bound is per layer
LLAMA_1B = dict(
    model_type="llama",
    hidden_size=2048,
    intermediate_size=8192,
    num_attention_heads=32,
    num_key_value_heads=8,
    num_hidden_layers=4,
    vocab_size=32000,
)


def _meta_lora_model(shape: dict, dtype, targets, checkpointing: bool = False, n_layers: int | None = None):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = dict(shape)
    if n_layers is not None:
        shape["n_layer" if shape["model_type"] == "gpt2" else "num_hidden_layers"] = n_layers
    config = AutoConfig.for_model(**shape)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager")
    if checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    return get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=targets, task_type="CAUSAL_LM")).train()


def _saved_bytes(model, n: int, length: int) -> int:
    """Bytes autograd saves for backward in one forward and loss (weights excluded), on the meta device."""
    params = {id(p) for p in model.parameters()}
    saved = {}

    def pack(t):
        if id(t) not in params and id(t._base) not in params:
            saved[id(t)] = t.numel() * t.element_size()
        return t

    ids = torch.zeros(n, length, dtype=torch.long, device="meta")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(input_ids=ids).logits
        torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.size(-1)), ids.reshape(-1), reduction="sum")
    return sum(saved.values())


def _seed(model, checkpointing: bool = False) -> MemoryModel:
    """The worker's own seed (train.model.memory_shape) for this model on CPU without autocast."""
    from slurm_router.train.model import memory_shape

    cfg = OmegaConf.create({"train": {"precision": "fp32", "gradient_checkpointing": checkpointing}})
    return MemoryModel.from_model_bytes(
        **memory_shape(model, cfg, torch.device("cpu")), vocab_size=model.config.vocab_size
    )


@pytest.fixture
def meta_forward(monkeypatch):
    # transformers looks for packed sequences in the position ids with a host read (.all()): nothing to read on
    # the meta device, and none are packed here
    import transformers.masking_utils as masking

    monkeypatch.setattr(masking, "find_packed_sequence_indices", lambda position_ids: None, raising=False)


@pytest.mark.parametrize("shape", [GPT2_SMALL, LLAMA_1B], ids=["gpt2-small", "llama-1b-width"])
@pytest.mark.parametrize(
    "dtype, targets",
    [(torch.float32, None), (torch.bfloat16, None), (torch.bfloat16, "all-linear")],
    ids=["fp32", "bf16", "bf16-all-linear"],
)
def test_memory_seed_within_its_stated_bound(meta_forward, shape, dtype, targets):
    model = _meta_lora_model(shape, dtype, targets)
    seed = _seed(model)
    fixed, _, _ = seed.coef
    frozen = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    trainable = [p for p in model.parameters() if p.requires_grad]
    # weights at their own dtype, then the trainable ones' fp32 gradients, Adam m and v: exactly
    assert fixed == frozen + sum(4 * p.numel() * 4 for p in trainable)
    assert {p.dtype for p in trainable} == {torch.float32}
    for n, length in [(4, 128), (2, 512), (1, 1024)]:
        measured = _saved_bytes(model, n, length)
        predicted = seed.predict(n * length, n, length) - fixed
        assert 0.5 <= predicted / measured <= 2.0, (n, length, predicted, measured)


@pytest.mark.parametrize("shape", [GPT2_SMALL, LLAMA_1B], ids=["gpt2-small", "llama-1b-width"])
def test_memory_seed_bound_with_gradient_checkpointing(meta_forward, shape):
    """With checkpointing, autograd keeps each layer's input and, in backward, one layer's activations at a time:
    measured as the saved bytes outside the checkpointed layers plus one layer's share of the plain model's."""
    n, length = 2, 512
    plain, ckpt = (_meta_lora_model(shape, torch.bfloat16, "all-linear", checkpointing=c) for c in (False, True))
    n_layers = ckpt.config.num_hidden_layers
    kept_inputs = n_layers * n * length * ckpt.config.hidden_size * 2
    one_layer = (_saved_bytes(plain, n, length) - _saved_bytes(ckpt, n, length) + kept_inputs) / n_layers
    measured = _saved_bytes(ckpt, n, length) + one_layer
    seed, plain_seed = _seed(ckpt, checkpointing=True), _seed(plain)
    assert seed.coef[0] == plain_seed.coef[0]
    predicted = seed.predict(n * length, n, length) - seed.coef[0]
    assert 0.5 <= predicted / measured <= 2.0, (predicted, measured)
    assert predicted < (plain_seed.predict(n * length, n, length) - plain_seed.coef[0]) / 2


def test_memory_seed_on_a_gpu_counts_autocast_copies_of_fp32_frozen_weights():
    from slurm_router.train.model import memory_shape

    cfg = OmegaConf.create({"train": {"precision": "auto", "gradient_checkpointing": False}})
    gpu = torch.device("cuda", 0)  # only named: nothing is allocated on the meta device
    shapes = {d: memory_shape(_meta_lora_model(LLAMA_1B, d, None), cfg, gpu) for d in (torch.bfloat16, torch.float32)}
    bf16, fp32 = shapes[torch.bfloat16], shapes[torch.float32]
    assert bf16["compute_bytes"] == fp32["compute_bytes"] == 2 and bf16["workspace_bytes"] == 0
    assert fp32["frozen_bytes"] == 2 * bf16["frozen_bytes"] == 2 * fp32["workspace_bytes"]
    assert bf16["trainable_bytes"] == fp32["trainable_bytes"]


def test_memory_seed_fixed_term_is_what_training_holds(checkpoints):
    """On a real (tiny) model after an optimizer step: weights + gradients + Adam states, byte for byte."""
    from slurm_router.train.optim import make_optimizer

    model = build_model(_hf(checkpoints["llama"], dtype="bf16", **{"lora.target_modules": "all-linear"}), VOCAB, 0)
    params = trainable_parameters(model)
    optimizer = make_optimizer(params, 1e-3, 0.0, torch.device("cpu"))
    ids = torch.randint(0, VOCAB, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    held = sum(t.numel() * t.element_size() for t in [*model.parameters(), *(p.grad for p in params)])
    held += sum(v.numel() * v.element_size() for s in optimizer.state.values() for k, v in s.items() if k != "step")
    assert _seed(model).coef[0] == held


# ---- the real command -----------------------------------------------------------------------------------
@pytest.mark.integration
def test_lora_ab_on_a_llama_checkpoint_attention_only_vs_all_linear(tmp_path, checkpoints):
    proc = run_cli(
        "model=hf",
        f"model.name_or_path={checkpoints['llama']}",
        "data=synthetic",
        "data.n_samples=96",
        "data.mean_len=24",
        "data.max_len=48",
        "base.enabled=false",
        "train.steps=3",
        "train.global_batch_size=8",
        "train.eval_batches=1",
        "train.eval_batch_size=4",
        "train.gradient_checkpointing=true",
        "model.lora.use_rslora=true",
        "+variants.attn.model.lora.target_modules=[q_proj,v_proj]",
        "+variants.linear.model.lora.target_modules=all-linear",
        f"run_root={tmp_path / 'runs'}",
        "launcher=local",
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = run_dir_of(proc)
    trainable = {}
    for variant in ("attn", "linear"):
        losses = step_losses(run_dir / "tasks" / variant)
        assert len(losses) == 3 and all(x == x for x in losses)
        start = next(
            json.loads(line)
            for line in (run_dir / "tasks" / variant / "events-rank0.jsonl").open()
            if json.loads(line)["event"] == "start"
        )
        trainable[variant] = start["n_trainable_params"]
    # rank 8 on q, v (64 -> 64 and 64 -> 32, 2 layers) vs every linear layer of the MLP and attention too
    assert trainable["attn"] == 2 * 8 * ((64 + 64) + (64 + 32))
    assert trainable["linear"] > 4 * trainable["attn"]
