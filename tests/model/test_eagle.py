"""EAGLE's draft layer unrolled over a window (training-time test) against a step-by-step
reference: the layer run one draft at a time through the KV cache, as decoding runs it."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import torch.nn.functional as F

from mtp.config import ModelConfig
from mtp.model.transformer import KVCache, MTPTransformer
from mtp.train.loss import naive_mtp_loss
from mtp.train.targets import IGNORE_INDEX, mtp_inputs_targets
from mtp.util.errors import ConfigError

K, T, B = 4, 12, 2


def _model(feature_layers: list[int] | None = None) -> MTPTransformer:
    torch.manual_seed(0)
    cfg = ModelConfig.from_name("debug", n_future=K, head_type="eagle", max_seq_len=64,
                                init_std=0.2, feature_layers=feature_layers or [])
    model = MTPTransformer(cfg).double().eval()
    if feature_layers:  # away from its start (the last block's part), so every part counts
        with torch.no_grad():
            model.heads[1].fuse.weight.normal_(0, 0.2)
    return model


def _step_by_step(model: MTPTransformer, h, targets, b: int, q: int, *,
                  raw: bool = False) -> list[torch.Tensor]:
    """Heads 2..K's normalised states (with `raw`, their outputs before the norm) at position q
    of row b: the first step over every position through the cache (the committed cells), then
    one step at a time, each in a scratch slot, seeing the cells up to q and the chain's own."""
    norm = (lambda x: x) if raw else model.head_norm
    cache = KVCache(model.cfg, 1, T + K, dtype=torch.float64)
    pos = torch.arange(T)[None]
    causal = (pos[0, None] <= pos[0, :, None])[None, None]  # (1, 1, T, T)
    out = model.head_output(1, h[b:b + 1], model.rotary(pos), tokens=targets[0][b:b + 1],
                            cache=cache, slots=pos, mask=causal)
    x, states = out[:, q:q + 1], [norm(out[0, q])]
    for i in range(2, K):
        slot = T + i - 2
        mask = torch.zeros(1, 1, 1, slot + 1, dtype=torch.bool)
        mask[..., : q + 1] = True  # the committed cells up to q
        mask[..., T:] = True  # the chain's earlier steps and this one
        x = model.head_output(i, x, model.rotary(torch.tensor([[q + i - 1]])),
                              tokens=targets[i - 1][b:b + 1, q:q + 1], cache=cache,
                              slots=torch.tensor([[slot]]), mask=mask)
        states.append(norm(x[0, 0]))
    return states


@pytest.mark.parametrize("feature_layers", [[], [1]], ids=["last", "features"])
def test_the_unrolled_steps_and_loss_equal_the_step_by_step_reference(feature_layers):
    model = _model(feature_layers)
    window = torch.randint(0, model.cfg.vocab_size, (B, T + K))
    inputs, targets = mtp_inputs_targets(window, K)
    targets = targets.clone()
    targets[2, 0, :3] = IGNORE_INDEX
    with torch.no_grad():
        h, rope = model.trunk(inputs)
        unrolled = list(model.head_states(h, rope, targets))  # (B, T, d) per head
    ref = torch.stack([torch.stack([torch.stack(_step_by_step(model, h, targets, b, q))
                                    for q in range(T)], 1) for b in range(B)], 1)
    got = torch.stack(unrolled[1:])  # (K - 1, B, T, d)
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)
    # the loss of every head, from the reference's states
    loss = naive_mtp_loss(model, inputs, targets)
    for i in range(1, K):
        want = F.cross_entropy(model.unembed(ref[i - 1]).flatten(0, 1), targets[i].flatten(),
                               ignore_index=IGNORE_INDEX)
        torch.testing.assert_close(loss.head_losses[i], want, rtol=1e-10, atol=0)


@pytest.mark.parametrize("feature_layers", [[], [1]], ids=["last", "features"])
def test_the_feature_regression_is_eagle_1s_against_the_step_by_step_features(feature_layers):
    """--loss.feature_weight: step i's feature at t (the step-by-step reference's, before the
    norm) against the trunk's last-block output at t + i, smooth L1 averaged over channels and
    over the scored positions; the total adds w times each step's head weight times it."""
    from mtp.train.loss import frozen_trunk_path, heads_loss

    model = _model(feature_layers)
    window = torch.randint(0, model.cfg.vocab_size, (B, T + K))
    inputs, targets = mtp_inputs_targets(window, K)
    targets = targets.clone()
    targets[2, 0, :3] = IGNORE_INDEX
    d = model.cfg.d_model
    with torch.no_grad():
        h, rope = model.trunk(inputs)
        ref = torch.stack([torch.stack([torch.stack(_step_by_step(model, h, targets, b, q,
                                                                  raw=True))
                                        for q in range(T)], 1) for b in range(B)], 1)
        weights = torch.tensor([0.0, 1.0, 0.8, 0.64], dtype=torch.float64)
        plain = heads_loss(model, h, rope, targets, weights.tolist(), path="frozen_trunk")
        got = heads_loss(model, h, rope, targets, weights.tolist(),
                         path=frozen_trunk_path(feature_weight=0.5))
    want = []
    for i in range(1, K):
        reg = F.smooth_l1_loss(ref[i - 1][:, : T - i], h[:, i:, -d:], reduction="none").mean(-1)
        scored = targets[i][:, : T - i] != IGNORE_INDEX
        want.append((reg * scored).sum() / scored.sum())
    want = torch.stack(want)
    torch.testing.assert_close(got.feature_losses, want.float(), rtol=1e-6, atol=0)
    torch.testing.assert_close(got.head_losses, plain.head_losses)
    torch.testing.assert_close(got.loss, plain.loss + 0.5 * (weights[1:] * want).sum().float(),
                               rtol=1e-6, atol=0)


def test_heads_2_to_k_are_one_layer_that_every_step_trains_and_a_state_dict_keeps():
    model = _model()
    assert model.heads[1] is model.heads[2] is model.heads[3]
    assert len(list(model.heads.parameters())) == len(list(model.heads[1].parameters()))
    window = torch.randint(0, model.cfg.vocab_size, (1, T + K))
    inputs, targets = mtp_inputs_targets(window, K)
    grads = []
    for w in ([0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]):  # the first step; the last alone
        model.zero_grad()
        naive_mtp_loss(model, inputs, targets, w).loss.backward()
        grads.append(model.heads[1].proj.weight.grad.clone())
    assert grads[0].abs().sum() > 0 and grads[1].abs().sum() > 0
    assert not torch.allclose(grads[0], grads[1])
    fresh = MTPTransformer(model.cfg).double().eval()
    fresh.load_state_dict(model.state_dict())
    assert fresh.heads[1] is fresh.heads[3]
    with torch.no_grad():
        torch.testing.assert_close(fresh(inputs), model(inputs), rtol=0, atol=0)


def test_feature_layers_join_the_last_output_and_start_as_it_alone():
    """`--model.feature_layers`: the trunk output is the listed blocks' outputs beside the
    last's (run block by block here); head 1 reads the last alone; at initialisation the model
    computes what the same weights compute without them."""
    model = _model([1])
    torch.manual_seed(1)
    MTPTransformer.reset_parameters(model)  # fuse back at its start
    idx = torch.randint(0, model.cfg.vocab_size, (B, T))
    with torch.no_grad():
        h, rope = model.trunk(idx)
        x, outs = model.embed(idx), []
        for block in model.blocks:
            x = block(x, *rope)
            outs.append(x)
        torch.testing.assert_close(h, torch.cat([outs[0], outs[-1]], -1), rtol=0, atol=0)
        plain = MTPTransformer(dataclasses.replace(model.cfg, feature_layers=[]))
        plain = plain.double().eval()
        plain.load_state_dict({k: v for k, v in model.state_dict().items()
                               if ".fuse." not in k})
        inputs, _ = mtp_inputs_targets(torch.randint(0, model.cfg.vocab_size, (B, T + K)), K)
        torch.testing.assert_close(model(inputs), plain(inputs), rtol=1e-12, atol=1e-12)
    assert model.trunk_width == 2 * model.cfg.d_model


@pytest.mark.parametrize("change, message", [
    ({"head_type": "deepseek"}, "--model.feature_layers feed eagle heads' draft layer; "
                                "--model.head_type deepseek"),
    ({"feature_layers": [2, 1]}, "must be increasing block numbers >= 1 (got [2, 1])"),
    ({"feature_layers": [0]}, "must be increasing block numbers >= 1 (got [0])"),
    ({"feature_layers": [3]}, "must be below the trunk's last block, 3 (got [3])"),
])
def test_bad_feature_layers_are_refused_naming_the_flag(change, message):
    kwargs = {"n_future": K, "head_type": "eagle", "feature_layers": [1]} | change
    with pytest.raises(ConfigError, match=re.escape(message)):
        ModelConfig.from_name("debug", **kwargs)
