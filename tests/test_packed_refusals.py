"""The packed attention refuses what it does not implement (issue 36, finding 9): a per-layer sliding window,
attention-logit soft-capping, attention sinks (s_aux), a 2-D mask or a keyword it does not know raise one error
naming the argument, instead of running plain causal attention without them. What GPT-2, Llama and Qwen2 pass in
the installed transformers (position_ids, use_cache, sliding_window=None) still runs (tests/test_packed.py).

    pytest tests/test_packed_refusals.py
"""

import pytest
import torch
import torch.nn.functional as F

from slurm_router.train.packed import enable, packed_attention, why_not_packable

SPANS = ((0, 4), (4, 10))


class Attention(torch.nn.Module):
    num_key_value_groups = 1


def _qkv():
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(1, 2, 10, 8, generator=gen) for _ in range(3)]


@pytest.mark.parametrize("spans", [SPANS, None], ids=["packed", "plain"])
@pytest.mark.parametrize(
    "name,value,shown",
    [
        ("sliding_window", 4, "sliding_window=4"),
        ("softcap", 30.0, "softcap=30.0"),
        ("s_aux", torch.zeros(2), "s_aux=Tensor"),
        ("is_causal", False, "is_causal=False"),
        ("output_attentions", True, "output_attentions=True"),
        ("alibi_slopes", torch.ones(2), "alibi_slopes=Tensor"),
    ],
)
def test_an_argument_it_does_not_implement_is_refused_by_name(spans, name, value, shown):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=f"Attention passes {shown} to the packed attention.*train.packing=false"):
        packed_attention(Attention(), q, k, v, None, packed_spans=spans, **{name: value})


def test_a_mask_is_refused_in_a_packed_row_and_a_2d_mask_anywhere():
    q, k, v = _qkv()
    causal = torch.ones(10, 10, dtype=torch.bool).tril()
    with pytest.raises(ValueError, match="attention_mask=a 4-D mask"):
        packed_attention(Attention(), q, k, v, causal[None, None], packed_spans=SPANS)
    with pytest.raises(ValueError, match="attention_mask=a 2-D mask"):
        packed_attention(Attention(), q, k, v, torch.ones(1, 10, dtype=torch.bool))
    out, _ = packed_attention(Attention(), q, k, v, causal[None, None])  # without spans: SDPA takes a 4-D mask
    assert torch.allclose(out.transpose(1, 2), F.scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-6)


def test_what_transformers_passes_harmlessly_runs():
    q, k, v = _qkv()
    harmless = {
        "position_ids": torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5]]),
        "use_cache": False,
        "cache_position": None,
        "sliding_window": None,
        "softcap": None,
        "s_aux": None,
        "is_causal": True,
        "output_attentions": False,
    }
    out, _ = packed_attention(Attention(), q, k, v, None, packed_spans=SPANS, **harmless)
    expected = torch.cat(
        [F.scaled_dot_product_attention(*(t[:, :, a:b] for t in (q, k, v)), is_causal=True) for a, b in SPANS], dim=2
    )
    assert torch.allclose(out.transpose(1, 2), expected, atol=1e-6)


def test_a_model_with_attention_sinks_is_refused_at_its_first_packed_forward():
    """gpt-oss without a sliding window passes the check on its config, and its sinks (s_aux) reach the attention."""
    from transformers import AutoModelForCausalLM, GptOssConfig

    torch.manual_seed(0)
    config = GptOssConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=2,
        num_experts_per_tok=1,
        sliding_window=None,
        layer_types=["full_attention"],
    )
    model = AutoModelForCausalLM.from_config(config)
    assert why_not_packable(model) is None
    enable(model)
    spans = {"position_ids": torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5]]), "packed_spans": SPANS}
    with pytest.raises(ValueError, match="GptOssAttention passes s_aux=Parameter to the packed attention"):
        model(input_ids=torch.randint(0, 64, (1, 10)), use_cache=False, **spans)
