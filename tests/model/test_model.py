"""The model against an independent reference, the head shifts, matched parameters, the cache."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from mtp.config import HEAD_TYPES, ModelConfig
from mtp.model.transformer import KVCache, MTPTransformer
from mtp.train.loss import naive_mtp_loss
from mtp.train.targets import mtp_inputs_targets
from mtp.util.errors import ConfigError


def reference_next_token_loss(state: dict, cfg: ModelConfig, idx: torch.Tensor) -> torch.Tensor:
    """A plain next-token transformer of `n_layers + 1` blocks written from the math alone:
    explicit softmax attention, rotary embeddings via complex numbers, SwiGLU, RMSNorm.
    It reads the weights of an MTP model with K = 1 and shares no code with mtp.model."""
    B, T = idx.shape[0], idx.shape[1] - 1  # the last token is a target only
    hd, H = cfg.d_model // cfg.n_attn_heads, cfg.n_attn_heads

    def rms(x, w):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + cfg.norm_eps) * w

    freqs = 1.0 / cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    rot = torch.polar(torch.ones(T, hd // 2, dtype=torch.float64),
                      torch.arange(T, dtype=torch.float64)[:, None] * freqs)  # (T, hd/2)

    def rope(x):  # (B, H, T, hd), adjacent channel pairs are (real, imaginary)
        xc = torch.view_as_complex(x.double().reshape(*x.shape[:-1], hd // 2, 2).contiguous())
        return torch.view_as_real(xc * rot).reshape(x.shape).to(x.dtype)

    def block(x, p):
        a = rms(x, state[p + "attn_norm.weight"]) @ state[p + "attn.qkv.weight"].T
        q, k, v = a.view(B, T, 3 * H, hd).transpose(1, 2).split(H, dim=1)
        q, k = rope(q), rope(k)
        scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        att = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v
        x = x + att.transpose(1, 2).reshape(B, T, -1) @ state[p + "attn.proj.weight"].T
        g, u = (rms(x, state[p + "mlp_norm.weight"]) @ state[p + "mlp.gate_up.weight"].T).chunk(
            2, dim=-1)
        return x + (g * torch.sigmoid(g) * u) @ state[p + "mlp.down.weight"].T

    x = state["embed.weight"][idx[:, :-1]]
    for i in range(cfg.n_layers):
        x = block(x, f"blocks.{i}.")
    x = block(x, "heads.0.")  # with K = 1 the head is simply the last block
    logits = rms(x, state["norm.weight"]) @ state["unembed.weight"].T
    return F.cross_entropy(logits.reshape(-1, cfg.vocab_size), idx[:, 1:].reshape(-1))


def test_k1_is_a_plain_next_token_transformer():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=97, d_model=48, n_layers=3, n_attn_heads=3, n_future=1,
                      max_seq_len=64)
    model = MTPTransformer(cfg).double()
    window = torch.randint(0, cfg.vocab_size, (3, 21))
    inputs, targets = mtp_inputs_targets(window, 1)
    ours = naive_mtp_loss(model, inputs, targets).loss
    ref = reference_next_token_loss(model.state_dict(), cfg, window)
    torch.testing.assert_close(ours, ref, rtol=1e-10, atol=0)


def test_targets_are_shifted_by_head_index():
    window = torch.arange(20).view(2, 10)
    inputs, targets = mtp_inputs_targets(window, 3)
    assert inputs.tolist() == [list(range(7)), list(range(10, 17))]
    for i in range(1, 4):
        torch.testing.assert_close(targets[i - 1], inputs + i)


def test_each_head_learns_the_token_its_offset_ahead():
    """Tokens follow a random permutation chain x[t+1] = P[x[t]]: head i can only fit its
    targets by predicting P^i(x[t]), so a head trained on the wrong shift predicts P^(i±1)."""
    torch.manual_seed(0)
    V, K = 16, 3
    perm = torch.randperm(V)
    cfg = ModelConfig(vocab_size=V, d_model=32, n_layers=1, n_attn_heads=2, n_future=K,
                      max_seq_len=32)
    model = MTPTransformer(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def chains(n: int, length: int) -> torch.Tensor:
        x = [torch.randint(0, V, (n,))]
        for _ in range(length - 1):
            x.append(perm[x[-1]])
        return torch.stack(x, 1)

    for _ in range(150):
        inputs, targets = mtp_inputs_targets(chains(32, 16 + K), K)
        loss = naive_mtp_loss(model, inputs, targets).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    x = chains(8, 16)
    pred = model(x).argmax(-1)  # (K, B, T)
    power = x
    for i in range(K):
        power = perm[power]
        assert (pred[i] == power).float().mean() > 0.99, f"head {i + 1} did not learn P^{i + 1}"


@pytest.mark.parametrize("head_type", HEAD_TYPES)
def test_kv_cache_matches_full_forward(head_type):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=50, d_model=32, n_layers=2, n_attn_heads=4, n_attn_kv_heads=2,
                      n_future=3, head_type=head_type, max_seq_len=32)
    model = MTPTransformer(cfg).eval()
    idx = torch.randint(0, 50, (2, 12))
    # cascaded heads read tokens ahead of the cached ones: decoding runs them (tests/decoding/
    # test_head_types.py); a cached forward of the model gives head 1 only
    heads = 1 if model.cascaded else None
    full = model(idx, heads=heads)
    cache = KVCache(cfg, 2, 16)
    # a 5-token prefill, then one token at a time
    steps = [(0, 5)] + [(t, t + 1) for t in range(5, 12)]
    outs = []
    for a, b in steps:
        pos = torch.arange(a, b).expand(2, -1)
        mask = (torch.arange(b)[None, :] <= torch.arange(a, b)[:, None]).expand(2, 1, -1, -1)
        outs.append(model(idx[:, a:b], heads=heads, positions=pos, cache=cache, slots=pos,
                          mask=mask))
    torch.testing.assert_close(torch.cat(outs, 2), full, rtol=1e-5, atol=1e-5)


def test_kv_cache_compact_moves_accepted_entries():
    cfg = ModelConfig(vocab_size=10, d_model=16, n_layers=1, n_attn_heads=2, n_future=1,
                      max_seq_len=16)
    cache = KVCache(cfg, 2, 8)
    cache.k.copy_(torch.arange(8.0).view(1, 1, 1, 8, 1).expand_as(cache.k))
    cache.compact(torch.tensor([[5, 7], [3, 4]]), torch.tensor([2, 3]))
    assert cache.k[0, 0, 0, :, 0].tolist() == [0, 1, 5, 7, 4, 5, 6, 7]
    assert cache.k[0, 1, 0, :, 0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7]



@pytest.mark.parametrize("rows", [[0, 1, 2, 3, 4], [1, 3, 4], [0, 2], [4], []])
def test_kv_cache_keep_holds_the_kept_rows_committed_entries(rows):
    cfg = ModelConfig(vocab_size=10, d_model=16, n_layers=2, n_attn_heads=2, n_future=1,
                      max_seq_len=16)
    cache = KVCache(cfg, 5, 8)
    torch.manual_seed(0)
    cache.k.normal_(), cache.v.normal_()
    cache.truncate(torch.tensor([3, 6, 2, 5, 1]))
    want_k, want_v, want_len = cache.k[:, rows], cache.v[:, rows], cache.lengths[rows]
    cache.keep(torch.tensor(rows, dtype=torch.long))
    assert cache.lengths.tolist() == want_len.tolist()
    assert cache.k.shape == want_k.shape and cache.v.shape == want_v.shape
    for i, n in enumerate(want_len.tolist()):  # the committed slots; the rest is never read
        torch.testing.assert_close(cache.k[:, i, :, :n], want_k[:, i, :, :n], rtol=0, atol=0)
        torch.testing.assert_close(cache.v[:, i, :, :n], want_v[:, i, :, :n], rtol=0, atol=0)

@pytest.mark.parametrize("n_layers", [8, 12])
def test_matched_params_keep_parameter_count_across_k(n_layers):
    counts = [MTPTransformer(ModelConfig(vocab_size=512, d_model=64, n_layers=n_layers,
                                         n_attn_heads=4, n_future=k,
                                         matched_params=True)).num_params()
              for k in (1, 2, 4, 8)]
    assert len(set(counts)) == 1, counts  # a head block has exactly a trunk block's parameters
    # and without the switch the heads add blocks
    plain = [MTPTransformer(ModelConfig(vocab_size=512, d_model=64, n_layers=n_layers,
                                        n_attn_heads=4, n_future=k)).num_params() for k in (1, 8)]
    assert plain[1] > 1.3 * plain[0]


def test_deepseek_matched_params_differ_by_the_module_projections_only():
    d = 64
    counts = {k: MTPTransformer(ModelConfig(vocab_size=512, d_model=d, n_layers=8, n_attn_heads=4,
                                            n_future=k, head_type="deepseek",
                                            matched_params=True)).num_params()
              for k in (1, 2, 4)}
    block = MTPTransformer(ModelConfig(vocab_size=512, d_model=d, n_layers=8, n_attn_heads=4,
                                       n_future=1, matched_params=True)).num_params()
    assert counts[1] == block  # K = 1: the same model as block heads
    for k in (2, 4):  # each module adds its 2d x d projection and two norm gains
        assert counts[k] - counts[1] == (k - 1) * (2 * d * d + 2 * d)


def test_deepseek_head_i_reads_the_token_at_offset_i():
    """Head i + 1 (0-based i) at position t is conditioned on tokens 0..t + i: changing token
    t + i changes it, changing a later one does not (teacher-forced forward)."""
    torch.manual_seed(0)
    model = MTPTransformer(ModelConfig(vocab_size=50, d_model=32, n_layers=1, n_attn_heads=2,
                                       n_future=4, head_type="deepseek", max_seq_len=32)).eval()
    idx = torch.randint(0, 50, (1, 16))
    base = model(idx)  # (K, 1, T, V)
    t = 5
    for j in range(1, 8):
        changed = idx.clone()
        changed[0, t + j] = (changed[0, t + j] + 1) % 50
        out = model(changed)
        for i in range(4):
            moved = not torch.allclose(out[i, 0, t], base[i, 0, t])
            assert moved == (j <= i), f"head {i + 1} at t: token t + {j} changed it: {moved}"


def test_medusa_heads_start_as_the_identity():
    torch.manual_seed(0)
    model = MTPTransformer(ModelConfig(vocab_size=50, d_model=32, n_layers=1, n_attn_heads=2,
                                       n_future=3, head_type="medusa")).eval()
    logits = model(torch.randint(0, 50, (2, 7)))
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=0)
    torch.testing.assert_close(logits[2], logits[0], rtol=0, atol=0)


def test_tied_embeddings_share_one_tensor():
    model = MTPTransformer(ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_attn_heads=2,
                                       tie_embeddings=True))
    assert model.unembed.weight is model.embed.weight
    assert model.num_params() == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("kwargs, flag", [
    ({"n_future": 0}, "--model.n_future must be >= 1 (got 0)"),
    ({"d_model": 100, "n_attn_heads": 3},
     "--model.d_model (100) must be divisible by --model.n_attn_heads"),
    ({"n_attn_heads": 4, "d_model": 256, "n_attn_kv_heads": 3}, "--model.n_attn_kv_heads (3)"),
    ({"matched_params": True, "n_layers": 2, "n_future": 4}, "--model.matched_params"),
    ({"head_type": "nonsense"},
     "--model.head_type must be one of block, linear, medusa, medusa1, deepseek, eagle (got "
     "'nonsense')"),
    ({"head_type": "linear", "matched_params": True},
     "--model.matched_params does not apply to --model.head_type linear"),
    ({"head_type": "medusa", "matched_params": True},
     "--model.matched_params does not apply to --model.head_type medusa"),
    ({"head_type": "deepseek", "matched_params": True, "n_layers": 2, "n_future": 4},
     "moves K - 1 = 3 trunk blocks into the heads, which leaves none"),
])
def test_bad_model_configs_name_the_flag(kwargs, flag):
    with pytest.raises(ConfigError) as err:
        ModelConfig(**kwargs)
    assert flag in str(err.value)


def test_all_problems_reported_at_once():
    with pytest.raises(ConfigError) as err:
        ModelConfig(n_future=0, d_model=100, n_attn_heads=3)
    assert "--model.n_future" in str(err.value) and "--model.d_model" in str(err.value)


def test_positions_past_the_context_length_are_rejected():
    model = MTPTransformer(ModelConfig.from_name("debug"))
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, 65, dtype=torch.long))


def test_the_old_attention_field_names_still_configure_the_model_with_a_message():
    """`n_heads` and `n_kv_heads` were renamed `n_attn_heads` and `n_attn_kv_heads` (attention
    heads, not output heads): the old names still set them, and say so."""
    with pytest.warns(FutureWarning, match="--model.n_heads is deprecated: it is now "
                                           "--model.n_attn_heads"):
        old = ModelConfig(d_model=64, n_heads=4, n_kv_heads=2)
    assert old == ModelConfig(d_model=64, n_attn_heads=4, n_attn_kv_heads=2)
    assert "n_heads" not in dataclasses.asdict(old)  # stored configs carry the new names
    with pytest.warns(FutureWarning):
        assert dataclasses.replace(ModelConfig.from_name("debug"), n_heads=4).n_attn_heads == 4
