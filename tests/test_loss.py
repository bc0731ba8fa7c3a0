"""The loss's host-side bookkeeping: real-target counts and positions built on the host (so a GPU worker never
waits for the device to find them) must be exactly what the labels say.

    pytest tests/test_loss.py
"""

import pytest
import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

from slurm_router.train.loss import target_positions, token_loss_sum


def _batch(lengths, width, vocab=50):
    gen = torch.Generator().manual_seed(0)
    inputs = torch.zeros((len(lengths), width), dtype=torch.int64)
    labels = torch.full((len(lengths), width), -100, dtype=torch.int64)
    for r, n in enumerate(lengths):
        inputs[r, :n] = labels[r, :n] = torch.randint(1, vocab, (n,), generator=gen)
    return inputs, labels


def test_target_positions_match_the_labels():
    for lengths, width in (([5, 1, 3, 8], 8), ([2], 64), ([7, 7, 7], 7), ([1, 1], 4)):
        _, labels = _batch(lengths, width)
        targets = F.pad(labels[:, 1:], (0, 1), value=-100).reshape(-1)
        n, index = target_positions(lengths, width)
        assert n == int((targets != -100).sum())
        assert torch.equal(index, (targets != -100).nonzero().squeeze(1))


def test_loss_with_host_positions_equals_loss_found_on_device():
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=32, n_embd=32, n_layer=2, n_head=2)).eval()
    lengths, width = [9, 3, 16, 1, 12], 16
    inputs, labels = _batch(lengths, width)
    n, index = target_positions(lengths, width)
    for chunk in (0, 7):
        found, n_found = token_loss_sum(model, inputs, labels, chunk)
        given, n_given = token_loss_sum(model, inputs, labels, chunk, n, index)
        assert n_found == n_given == sum(L - 1 for L in lengths)
        assert torch.allclose(found, given, rtol=1e-6)
    plain, _ = token_loss_sum(model, inputs, labels, 0, n, index)
    chunked, _ = token_loss_sum(model, inputs, labels, 7, n, index)
    assert torch.allclose(plain, chunked, rtol=1e-5)


def test_gradient_accumulation_is_all_or_nothing():
    """An out-of-memory error halfway through a backward must leave the accumulated gradients as they were:
    the micro-batch is halved and retried, and a partial gradient would then be counted twice."""
    from slurm_router.worker.microbatch import SimulatedOOM
    from slurm_router.worker.microbatch import accumulate as _accumulate

    torch.manual_seed(0)
    first, second = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
    params = [*first.parameters(), *second.parameters()]
    x = torch.randn(3, 4)
    _accumulate(second(first(x)).sum(), params)  # micro-batch 1
    before = [p.grad.clone() for p in params]

    def fail(_):
        raise SimulatedOOM("out of memory in the middle of the backward pass")

    hidden = first(x)
    hidden.register_hook(fail)  # after `second`'s gradients, before `first`'s
    with pytest.raises(SimulatedOOM):
        _accumulate(second(hidden).sum(), params)
    assert all(torch.equal(p.grad, b) for p, b in zip(params, before))
    _accumulate(second(first(x)).sum(), params)  # the retry counts once
    assert all(torch.allclose(p.grad, 2 * b) for p, b in zip(params, before))
