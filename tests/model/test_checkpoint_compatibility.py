"""Checkpoints and exports written before the layout by stage (at 8f44af8, with the model config's
old field names `n_heads` and `n_kv_heads`) load, say that their config uses old names, and give
the logits and the decoded tokens they gave when written (tests/fixtures/8f44af8)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mtp.decoding import Tree, generate
from mtp.model import load_checkpoint

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "8f44af8"
EXPECTED = json.loads((FIXTURE / "expected.json").read_text())
DECODERS = {"greedy": {}, "self-spec": {}, "tree": {"tree": Tree.from_widths([2, 2])}}


@pytest.mark.parametrize("kind, path", [("checkpoint", "last.ckpt"), ("export", "export")])
def test_an_old_checkpoint_or_export_loads_and_decodes_as_it_did(kind, path):
    with pytest.warns(FutureWarning, match=r"old names \(n_heads, n_kv_heads\): read as "
                                           r"n_attn_heads, n_attn_kv_heads"):
        model, tokenizer = load_checkpoint(FIXTURE / path)
    assert (model.cfg.n_attn_heads, model.cfg.n_attn_kv_heads, model.cfg.n_future) == (2, 1, 3)
    want = EXPECTED[kind]
    ids = torch.tensor([tokenizer.encode("def fib(n):\n    return").ids])
    assert ids[0].tolist() == want["prompt_ids"]
    with torch.no_grad():
        logits = model(ids)
    torch.testing.assert_close(logits, torch.load(FIXTURE / "logits.pt")[kind], rtol=1e-5,
                               atol=1e-5)
    for decoder, kwargs in DECODERS.items():
        tokens, _ = generate(model, ids, 24, decoder=decoder, **kwargs)
        assert tokens[0] == want[decoder], decoder
