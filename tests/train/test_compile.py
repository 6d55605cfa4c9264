"""`--compile.enabled`: the compiled blocks run, and give the eager loss and gradients."""

from collections import Counter

import torch
from torch._dynamo.utils import counters
from torch.profiler import ProfilerActivity, profile

from mtp.config import ModelConfig
from mtp.model.transformer import MTPTransformer
from mtp.train.loss import sequential_mtp_loss
from mtp.train.module import compile_blocks
from mtp.train.targets import mtp_inputs_targets


def _loss_and_grads(model, inputs, targets):
    model.zero_grad(set_to_none=True)
    out = sequential_mtp_loss(model, inputs, targets, with_accuracy=True)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters()}


def _compiled_regions(model, inputs, targets):
    """`_loss_and_grads` under the profiler, and how many compiled forwards (Dynamo's frames)
    and compiled backwards (AOTAutograd's) it ran."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        result = _loss_and_grads(model, inputs, targets)
    names = Counter(e.name for e in prof.events())
    forwards = sum(n for name, n in names.items() if name.startswith("Torch-Compiled Region"))
    return result, forwards, names["CompiledFunctionBackward"]


def test_compiled_step_equals_eager():
    """fp32 on CPU: the loss, every head's loss and accuracy, and every gradient to 1e-5, on two
    steps (the second runs the cached graphs); parameter names are unchanged. Every block's
    forward and backward ran compiled code, all five blocks from one graph, compiled once."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=199, d_model=32, n_layers=2, n_attn_heads=2, n_future=3,
                      max_seq_len=32)
    model = MTPTransformer(cfg)
    names = [n for n, _ in model.named_parameters()]
    batches = [mtp_inputs_targets(torch.randint(0, 199, (2, 19 + 3)), 3) for _ in range(2)]
    eager = [_loss_and_grads(model, *b) for b in batches]
    compile_blocks(model)
    assert [n for n, _ in model.named_parameters()] == names
    steps = [_compiled_regions(model, *b) for b in batches]
    # one graph for the 2 trunk blocks and 3 block heads, compiled once: the second step reuses it
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    for ((got, got_grads), forwards, backwards), (want, want_grads) in zip(steps, eager):
        assert (forwards, backwards) == (cfg.n_layers + cfg.n_future,) * 2
        torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=0)
        torch.testing.assert_close(got.head_losses, want.head_losses, rtol=1e-5, atol=0)
        torch.testing.assert_close(got.head_accuracies, want.head_accuracies)
        for name, g in want_grads.items():
            err = (got_grads[name] - g).norm() / g.norm()
            assert err <= 1e-5, f"{name}: relative error {err:.2e}"


def test_a_model_with_compiled_blocks_decodes_as_the_eager_one():
    """The decode loop runs compiled blocks eagerly (the prepared weights it multiplies by are not
    compilable): greedy and self-speculative output equal the eager model's."""
    from mtp.decoding import generate

    torch.manual_seed(0)
    model = MTPTransformer(ModelConfig(vocab_size=199, d_model=32, n_layers=2, n_attn_heads=2,
                                       n_future=3, max_seq_len=64)).eval()
    prompts = [[5, 6, 7, 8], [9, 10]]
    want = [generate(model, prompts, 12, decoder=d)[0] for d in ("greedy", "self-spec")]
    compile_blocks(model)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))  # a compiled forward, outside decoding
    assert [generate(model, prompts, 12, decoder=d)[0] for d in ("greedy", "self-spec")] == want
