"""`MTPTransformer.flops_per_token` against two independent references.

The first is `torch.utils.flop_counter.FlopCounterMode`, which counts the matmuls that actually
run over one real training step (forward and backward) from their shapes. Attention runs on
SDPA's math backend here: torch 2.13's FlopCounterMode has no formula for the fused CPU kernel
(`_scaled_dot_product_flash_attention_for_cpu` counts 0), while the math backend executes the
full T x T score and value matmuls as plain `bmm`s, which it counts, matching the FLOP model's
convention (full T x T, no causal halving).

Only the naive loss is compared: it runs exactly what the FLOP model describes. The sequential
pass may recompute head activations (activation checkpointing) or logits (the Triton backward),
and the chunked torch kernel accumulates dW with an in-place `addmm_`, which FlopCounterMode
does not count, so its count is neither the model FLOPs nor a bound on them.

The second is a hand count of every weight matrix and attention matmul of two tiny configs, written
out term by term from the architecture (`mtp.model.layers`, `mtp.model.heads`), not from the code's
formula.
"""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from mtp.config import ModelConfig
from mtp.model.transformer import MTPTransformer
from mtp.train.loss import naive_mtp_loss
from mtp.train.targets import mtp_inputs_targets

B, T, V, D = 2, 32, 512, 64


def _model(K: int, head_type: str, **overrides) -> MTPTransformer:
    torch.manual_seed(0)
    shape = dict(vocab_size=V, d_model=D, n_layers=2, n_attn_heads=2, max_seq_len=T)
    return MTPTransformer(ModelConfig(**{**shape, **overrides}, n_future=K, head_type=head_type))


def _counted_step_flops(model: MTPTransformer, loss_fn) -> int:
    """FLOPs FlopCounterMode counts over one forward of the loss and its backward."""
    K = model.cfg.n_future
    window = torch.randint(0, V, (B, T + K), generator=torch.Generator().manual_seed(0))
    inputs, targets = mtp_inputs_targets(window, K)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        loss_fn(model, inputs, targets).loss.backward()
    return counter.get_total_flops()


CASES = [
    pytest.param(K, head_type, {}, id=f"K{K}-{head_type}")
    for K in (1, 4) for head_type in ("block", "linear")
] + [pytest.param(4, head_type, {}, id=f"K4-{head_type}")
     for head_type in ("medusa", "medusa1", "deepseek", "eagle")] + [
    # grouped-query attention (smaller qkv matrix, same score matmuls) and a tied unembedding
    # (one tensor, still run K times)
    pytest.param(4, "block", dict(n_attn_heads=4, n_attn_kv_heads=2, tie_embeddings=True),
                 id="K4-gqa-tied"),
    # heads 2..K over a draft vocabulary: their unembedding has Vd rows, head 1's V
    pytest.param(3, "linear", dict(draft_vocab=128), id="K3-linear-draft"),
    # trunk blocks moved into the cascaded heads
    pytest.param(2, "deepseek", dict(n_layers=3, matched_params=True), id="K2-deepseek-matched"),
    # eagle's first step fusing two blocks' outputs with the last's (its map runs once)
    pytest.param(4, "eagle", dict(n_layers=3, feature_layers=[1, 2]), id="K4-eagle-features"),
]


@pytest.mark.parametrize(("K", "head_type", "overrides"), CASES)
def test_flops_per_token_matches_flop_counter(K, head_type, overrides):
    model = _model(K, head_type, **overrides)
    counted = _counted_step_flops(model, naive_mtp_loss)
    predicted = model.flops_per_token(T) * B * T
    # Both count matmuls only (elementwise work is zero in each), so they agree exactly.
    assert predicted == counted


def _block(d: int, n_heads: int, kv_heads: int, ffn: int) -> int:
    """Weight entries of one transformer block (`mtp.model.layers.Block`)."""
    hd = d // n_heads
    qkv = d * (n_heads + 2 * kv_heads) * hd
    out = d * d
    gate_up = d * 2 * ffn  # SwiGLU's gate and up projections, one matrix
    down = ffn * d
    return qkv + out + gate_up + down


# Per token, each attention layer runs Q K^T and P V over seq_len keys: 2 * seq_len * d FLOPs
# each forward, twice that backward, so 3 * (2 + 2) * seq_len * d.
def _attention(seq_len: int, d: int) -> int:
    return 3 * (2 * seq_len * d + 2 * seq_len * d)


def test_flops_per_token_matches_hand_count_block_heads():
    """K = 3 block heads, grouped-query attention, a draft vocabulary of 100 for heads 2, 3."""
    cfg = ModelConfig(vocab_size=512, d_model=64, n_layers=2, n_attn_heads=2, n_attn_kv_heads=1,
                      ffn_hidden=96, n_future=3, head_type="block", draft_vocab=100,
                      max_seq_len=64)
    seq_len = 40
    trunk = 2 * _block(64, 2, 1, 96)
    heads = 3 * _block(64, 2, 1, 96)
    unembed = 512 * 64 + 2 * 100 * 64  # head 1 over V, heads 2 and 3 over the draft vocabulary
    attention = (2 + 3) * _attention(seq_len, 64)  # the trunk's blocks and each head's
    expected = 6 * (trunk + heads + unembed) + attention  # 6 per weight entry: 2 fwd, 4 bwd
    predicted = MTPTransformer(cfg).flops_per_token(seq_len)
    assert predicted == expected


def test_flops_per_token_matches_hand_count_linear_heads():
    """K = 4 linear heads and a tied unembedding: one tensor, still run by each of the 4 heads;
    the embedding lookup costs nothing."""
    cfg = ModelConfig(vocab_size=300, d_model=32, n_layers=3, n_attn_heads=4, ffn_hidden=80,
                      n_future=4, head_type="linear", tie_embeddings=True, max_seq_len=64)
    seq_len = 24
    trunk = 3 * _block(32, 4, 4, 80)
    heads = 4 * 32 * 32  # a d x d map each
    unembed = 4 * 300 * 32
    attention = 3 * _attention(seq_len, 32)  # linear heads do not attend
    expected = 6 * (trunk + heads + unembed) + attention
    predicted = MTPTransformer(cfg).flops_per_token(seq_len)
    assert predicted == expected


def test_flop_counter_sees_attention():
    """Guards the probe: on the default backend the CPU SDPA kernel is invisible to the counter,
    which would hide a wrong attention term; on the math backend it is counted in full."""
    model = _model(1, "block")
    counted = _counted_step_flops(model, naive_mtp_loss)
    window = torch.randint(0, V, (B, T + 1), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as fused:
        naive_mtp_loss(model, *mtp_inputs_targets(window, 1)).loss.backward()
    n_attn = model.cfg.n_trunk_layers + 1  # the trunk blocks and the one block head
    # forward: Q K^T and P V, 2 B T^2 d FLOPs each; backward: twice that
    assert counted - fused.get_total_flops() == 12 * n_attn * B * T * T * D
