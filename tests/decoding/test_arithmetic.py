"""The arithmetic of a decode forward (`mtp.decoding.arithmetic`): every linear path computes
`F.linear`'s product, in force only inside the block and only where it applies; the choice is
measured once and cached per machine; bf16 decoding keeps the rotary tables and is refused where
the CPU has no bf16 products; drafting's int8 products are the quantised product, in force only
inside their block."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mtp.config import ModelConfig
from mtp.decoding import arithmetic
from mtp.decoding.arithmetic import (
    LINEAR_PATHS,
    choose_paths,
    decode_dtype,
    decode_linears,
    int8_products,
    int8_weight,
    path_available,
    to_decode_dtype,
)
from mtp.decoding.generation import generate
from mtp.model.transformer import MTPTransformer

FP32_PATHS = [p for p in LINEAR_PATHS if path_available(p, torch.float32)]


def _model(n_future: int = 3, **kw) -> MTPTransformer:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=101, d_model=64, n_layers=3, n_attn_heads=4,
                      n_future=n_future, max_seq_len=96, **kw)
    return MTPTransformer(cfg).eval()


@pytest.mark.parametrize("path", FP32_PATHS)
@pytest.mark.parametrize("rows", [1, 3, 8, 17])
@pytest.mark.parametrize("bias", [False, True])
def test_every_path_is_f_linear(path, rows, bias):
    torch.manual_seed(0)
    lin = nn.Linear(96, 160, bias=bias)
    x = torch.randn(2, rows, 96)
    exact = F.linear(x.double(), lin.weight.double(), None if lin.bias is None else
                     lin.bias.double())
    with torch.no_grad(), decode_linears(lin, path=path) as used:
        assert "forward" in vars(lin) and used.name == path
        y = lin(x)
    assert "forward" not in vars(lin)  # restored on exit
    assert y.shape == (2, rows, 160) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), exact, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", FP32_PATHS)
def test_every_path_gives_the_plain_paths_logits(path):
    """The whole model's logits on each path, against `F.linear`'s, to 1e-5 (fp32)."""
    model = _model()
    ids = torch.randint(0, 101, (2, 11))
    with torch.no_grad():
        plain = model(ids)
        with decode_linears(model, path=path):
            got = model(ids)
    torch.testing.assert_close(got, plain, rtol=1e-5, atol=1e-5)


def test_a_weight_changed_in_place_is_prepared_again():
    lin = nn.Linear(32, 48, bias=False)
    x = torch.randn(5, 32)
    for path in FP32_PATHS:
        with torch.no_grad():
            with decode_linears(lin, path=path):
                lin(x)
            lin.weight.mul_(-2.0)
            with decode_linears(lin, path=path):
                y = lin(x)
        torch.testing.assert_close(y, F.linear(x, lin.weight), rtol=1e-5, atol=1e-5)


def test_gradients_and_other_dtypes_take_f_linear():
    lin = nn.Linear(16, 8)
    x = torch.randn(3, 16, requires_grad=True)
    with decode_linears(lin, path=FP32_PATHS[-1]):
        lin(x).sum().backward()  # gradients on: the ordinary product, differentiable
    assert x.grad is not None and lin.weight.grad is not None
    lin64 = nn.Linear(4, 4).double()
    with decode_linears(lin64) as used:
        assert "forward" not in vars(lin64) and used.name == "none"  # left alone
    with pytest.raises(ValueError, match="unknown linear path 'fast'"):
        with decode_linears(lin, path="fast"):
            pass


def test_greedy_output_is_the_same_whichever_path_runs():
    """Greedy and self-speculative output on every path equal the plain model's own greedy
    decoding, one token at a time without a cache (a random model: ties in the argmax are
    improbable)."""
    model = _model()
    prompts = [[5, 9, 2, 7], [3, 1, 4, 1, 5, 9, 2]]
    with torch.no_grad():
        reference = []
        for p in prompts:
            ids = torch.tensor([p])
            for _ in range(12):
                nxt = model(ids, heads=1)[0, 0, -1].argmax()  # (K, B, T, V)
                ids = torch.cat([ids, nxt.view(1, 1)], 1)
            reference.append(ids[0, len(p):].tolist())
    for path in [None, *FP32_PATHS]:  # None: the cached choice
        with decode_linears(model, path=path) as used:
            greedy, _ = generate(model, prompts, 12, decoder="greedy")
            spec, _ = generate(model, prompts, 12, decoder="self-spec")
        assert used.layers, path
        assert greedy == spec == reference, path
    assert all("forward" not in vars(m) for m in model.modules())


def test_the_choice_is_measured_once_and_cached_per_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("MTP_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("MTP_LINEAR_PATH", raising=False)
    measured = []

    def fake(module, paths, budget_s=0.4):
        measured.append(tuple(module.weight.shape))
        return {p: (0.5 if p == paths[-1] else 1.0) for p in paths}

    monkeypatch.setattr(arithmetic, "_measure", fake)
    model = _model()
    with decode_linears(model) as used:
        pass
    shapes = {tuple(m.weight.shape) for m in model.modules() if isinstance(m, nn.Linear)}
    assert sorted(measured) == sorted(shapes)  # one measurement per shape, not per layer
    assert used.name == FP32_PATHS[-1]
    cache = json.loads((tmp_path / "linear-paths.json").read_text())
    (machine, chosen), = cache.items()
    assert f"torch {torch.__version__}" in machine and "threads" in machine
    assert {entry["path"] for entry in chosen.values()} == {FP32_PATHS[-1]}
    assert all(entry["ms"] == {p: 500.0 if p == FP32_PATHS[-1] else 1000.0 for p in FP32_PATHS}
               for entry in chosen.values())  # the times it was chosen by
    with decode_linears(_model(n_future=2)):  # the same shapes: read back, none measured
        pass
    assert len(measured) == len(shapes)
    (tmp_path / "linear-paths.json").write_text("{not json")  # a torn cache: measured again
    assert choose_paths([nn.Linear(8, 8)])["8x8+bias:fp32"]["path"] == FP32_PATHS[-1]
    assert json.loads((tmp_path / "linear-paths.json").read_text())


def test_measuring_leaves_the_callers_random_state_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("MTP_CACHE_DIR", str(tmp_path))
    lin = nn.Linear(24, 40)
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    choose_paths([lin])  # measured: nothing cached yet
    torch.testing.assert_close(torch.rand(3), expected)


def test_a_cache_that_cannot_be_written_is_a_warning(tmp_path, monkeypatch):
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setenv("MTP_CACHE_DIR", str(blocked / "cache"))  # below a file
    monkeypatch.setattr(arithmetic, "_measure", lambda m, paths, budget_s=0.4:
                        dict.fromkeys(paths, 1.0))
    with pytest.warns(UserWarning, match="measured again next time"):
        assert choose_paths([nn.Linear(8, 4, bias=False)])["4x8:fp32"]["path"] == "plain"


def test_bf16_keeps_the_rotary_tables_and_is_refused_without_bf16_products(monkeypatch):
    model = to_decode_dtype(_model(), torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.rope_cos.dtype == torch.float64
    from mtp.util import environment

    monkeypatch.setattr(environment, "cpu_flags", lambda: frozenset({"avx2", "avx512f"}))
    monkeypatch.setattr(environment, "cpu_model", lambda: "Old CPU")
    with pytest.raises(ValueError, match=r"--dtype bf16: this CPU \(Old CPU\) has no native"):
        decode_dtype("bf16")
    assert decode_dtype("fp32") == torch.float32
    with pytest.raises(ValueError, match="--dtype must be one of fp32, bf16"):
        decode_dtype("fp16")


def test_bf16_decodes_greedily_and_refuses_speculation():
    """In bf16 a verify forward's rows do not round as one-token forwards do, so speculative
    decoders are refused; greedy decoding runs, its KV cache and attention in fp32 (the CPU's
    bf16 attention kernel is the slower one)."""
    from mtp.decoding.engine import new_cache
    from mtp.decoding.request import RequestError

    model = to_decode_dtype(_model(), torch.bfloat16)
    assert new_cache(model, 2, 8).k.dtype == torch.float32
    prompts = [[5, 9, 2, 7], [3, 1, 4, 1, 5, 9, 2]]
    out, stats = generate(model, prompts, 12, decoder="greedy")
    assert [len(o) for o in out] == [12, 12] and stats.tokens == 24
    for decoder in ("self-spec", "tree", "lookup"):
        with pytest.raises(RequestError, match=f"{decoder} verifies a round of drafts in one "
                           "forward over several tokens, and in bfloat16"):
            generate(model, prompts, 12, decoder=decoder)


def test_the_chosen_path_is_row_invariant_wherever_a_candidate_is(tmp_path, monkeypatch):
    """A shape's path gives each row of a product what that row alone gives, where any path
    does: so a speculative round verifies against greedy's own logits."""
    monkeypatch.setenv("MTP_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("MTP_LINEAR_PATH", raising=False)
    torch.manual_seed(0)
    for lin in (nn.Linear(96, 160), nn.Linear(320, 64, bias=False)):
        chosen = choose_paths([lin])[arithmetic._shape_key(lin)]["path"]
        x = torch.randn(arithmetic.ROUND_ROWS, lin.in_features)

        def product(path, lin=lin):
            return arithmetic._product(path, lin.weight, lin.bias,
                                       arithmetic._prepare(path, lin.weight))
        if any(arithmetic._row_invariant(product(p), x) for p in FP32_PATHS):
            assert arithmetic._row_invariant(product(chosen), x), chosen



def _quantised_product(lin: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """The product of `int8_products` written out: the weight per output row to int8 with a
    symmetric scale, x over all its elements to 7 bits (0..127) from its range (0 included)."""
    q, scale = int8_weight(lin.weight)
    assert torch.equal(q.float().abs().amax(1), torch.full((lin.out_features,), 127.0))
    lo, hi = min(x.min().item(), 0.0), max(x.max().item(), 0.0)
    step = (hi - lo) / 127
    zero = round(-lo / step)
    xq = (torch.round(x / step) + zero).clamp(0, 127)
    out = ((xq - zero) * step) @ (q.float() * scale[:, None]).T
    return out if lin.bias is None else out + lin.bias.detach()


@pytest.mark.parametrize("rows", [1, 5, 17])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_products_are_the_quantised_product(rows, bias):
    """Inside the block a layer multiplies as the quantised product written out (to fp32
    rounding), which differs from the exact one within the quantisation's own bound."""
    torch.manual_seed(rows)
    lin = nn.Linear(96, 40, bias=bias)
    x = torch.randn(2, rows, 96) * 3 + 0.5
    with torch.no_grad():
        exact = lin(x)
        with int8_products([lin]):
            got = lin(x)
    want = _quantised_product(lin, x.reshape(-1, 96)).view(2, rows, 40)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    # |error| <= half a step of x times sum |w| + sum |x| times half a weight step (+ rounding)
    _, scale = int8_weight(lin.weight)
    step = (x.max().item() - min(x.min().item(), 0.0)) / 127
    bound = (step / 2 * lin.weight.abs().sum(1) + x.abs().sum(-1, keepdim=True) * scale / 2)
    assert ((got - exact).abs() <= bound * 1.001 + 1e-5).all()
    assert not torch.equal(got, exact)


@pytest.mark.parametrize("bias", [False, True])
def test_int8_products_of_stacked_heads_are_each_maps_quantised_product(bias):
    """A `StackedLinear` (heads 2..h as one module): each of its J maps multiplies its own slice
    of the leading axis as that map's own layer would in int8, its input quantised apart."""
    from mtp.decoding.stacked import StackedLinear

    torch.manual_seed(3)
    lins = [nn.Linear(48, 24, bias=bias) for _ in range(3)]
    for i, lin in enumerate(lins):  # maps of different magnitudes, inputs of different ranges
        lin.weight.data *= i + 1
    stacked = StackedLinear([m.weight for m in lins], [m.bias for m in lins] if bias else None)
    x = torch.randn(3, 2, 5, 48) * torch.tensor([1.0, 4.0, 0.25])[:, None, None, None]
    with torch.no_grad():
        exact = stacked(x)
        with int8_products([stacked]):
            got = stacked(x)
        assert "forward" not in vars(stacked) and torch.equal(stacked(x), exact)
    assert got.shape == exact.shape and not torch.equal(got, exact)
    for j, lin in enumerate(lins):
        want = _quantised_product(lin, x[j].reshape(-1, 48)).view(2, 5, 24)
        assert torch.allclose(got[j], want, rtol=1e-5, atol=1e-5)

def test_int8_products_hold_only_inside_their_block_and_over_an_enclosing_path():
    torch.manual_seed(0)
    lin = nn.Linear(64, 32)
    x = torch.randn(3, 64)
    with torch.no_grad():
        plain = lin(x)
        with decode_linears(lin, path="plain"):
            with int8_products([lin, lin]):  # listed twice: taken once
                inside = lin(x)
                with decode_linears(lin):  # a path chosen within leaves it as it is
                    assert torch.equal(lin(x), inside)
            assert torch.equal(lin(x), plain)  # the enclosing path again
        assert "forward" not in vars(lin) and torch.equal(lin(x), plain)
    assert torch.allclose(inside, _quantised_product(lin, x), rtol=1e-5, atol=1e-5)
    with int8_products([lin]):  # with gradients on, the exact product
        assert torch.equal(lin(x), plain)
    with pytest.raises(ValueError, match="int8 products take fp32 weights on the CPU"):
        with int8_products([nn.Linear(4, 4).to(torch.bfloat16)]):
            pass


def test_int8_drafting_is_refused_where_torch_has_no_int8_product(monkeypatch):
    """Without the quantised product (a torch build without fbgemm), `int8_products` raises and
    `generate(draft_int8=True)` is refused naming the argument; with it, both hold here."""
    from mtp.decoding import RequestError, request

    assert arithmetic.int8_available()  # the x86 CPU wheel this project pins has fbgemm
    monkeypatch.setattr(arithmetic, "int8_available", lambda: False)
    monkeypatch.setattr(request, "int8_available", lambda: False)
    with pytest.raises(ValueError, match="has no int8 product on the CPU"):
        with int8_products([nn.Linear(4, 4)]):
            pass
    with pytest.raises(RequestError, match="draft_int8: torch .* has no int8 product"):
        generate(_model(head_type="eagle"), [[1, 2, 3]], 4, decoder="tree", draft_int8=True)
