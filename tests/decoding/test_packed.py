"""Prepacked CPU weights for decoding (`mtp.decoding.packed`): the same product as `F.linear`, in
force only inside the block and only where it applies, repacked when a weight changes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mtp.config import ModelConfig
from mtp.decoding.generation import generate
from mtp.decoding.packed import can_pack, packed_linears
from mtp.model.transformer import MTPTransformer

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                reason="torch built without oneDNN")


@pytest.mark.parametrize("rows", [1, 3, 4, 17])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_product_is_f_linear(rows, bias):
    torch.manual_seed(0)
    lin = nn.Linear(96, 160, bias=bias)
    x = torch.randn(2, rows, 96)
    exact = F.linear(x.double(), lin.weight.double(), None if lin.bias is None else
                     lin.bias.double())
    with torch.no_grad(), packed_linears(lin):
        assert "forward" in vars(lin)
        y = lin(x)
    assert "forward" not in vars(lin)  # restored on exit
    assert y.shape == (2, rows, 160) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), exact, rtol=1e-5, atol=1e-5)


def test_a_weight_changed_in_place_is_packed_again():
    lin = nn.Linear(32, 48, bias=False)
    x = torch.randn(5, 32)
    with torch.no_grad():
        with packed_linears(lin):
            lin(x)
        lin.weight.mul_(-2.0)
        with packed_linears(lin):
            y = lin(x)
    torch.testing.assert_close(y, F.linear(x, lin.weight), rtol=1e-5, atol=1e-5)


def test_gradients_and_other_dtypes_take_f_linear():
    lin = nn.Linear(16, 8)
    x = torch.randn(3, 16, requires_grad=True)
    with packed_linears(lin):
        lin(x).sum().backward()  # gradients on: the ordinary product, differentiable
    assert x.grad is not None and lin.weight.grad is not None
    assert can_pack(lin)
    assert not can_pack(nn.Linear(4, 4).to(torch.bfloat16))
    assert not can_pack(nn.Linear(4, 4).double())
    lin64 = nn.Linear(4, 4).double()
    with packed_linears(lin64):
        assert "forward" not in vars(lin64)  # left alone


def test_greedy_and_self_speculation_are_unchanged_by_packing():
    """Every decoder runs on the packed product; its output is greedy's, and greedy's is the
    unpacked model's on a random model (where ties in the argmax are improbable)."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=101, d_model=64, n_layers=3, n_attn_heads=4, n_future=3,
                      max_seq_len=96)
    model = MTPTransformer(cfg).eval()
    prompts = [[5, 9, 2, 7], [3, 1, 4, 1, 5, 9, 2]]
    with torch.no_grad():
        reference = []
        for p in prompts:  # plain F.linear, one token at a time, no cache
            ids = torch.tensor([p])
            for _ in range(12):
                nxt = model(ids, heads=1)[0, 0, -1].argmax()  # (K, B, T, V)
                ids = torch.cat([ids, nxt.view(1, 1)], 1)
            reference.append(ids[0, len(p):].tolist())
    greedy, _ = generate(model, prompts, 12, decoder="greedy")
    spec, stats = generate(model, prompts, 12, decoder="self-spec")
    assert greedy == spec == reference
    assert all("forward" not in vars(m) for m in model.modules())
