"""Continuous batching (`generate(max_batch=N)`): prompts beyond the batch's rows join in the
places of rows that ended (`mtp.decoding.engine.run`, `KVCache.join`)."""

from __future__ import annotations

import collections

import pytest
import torch
from decoding_helpers import random_model, spread_prompts, train_cyclic

from mtp.decoding import engine
from mtp.decoding.generation import generate

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def cyclic_model():
    return train_cyclic()[0]


@pytest.mark.parametrize("max_new", [1, 32])
def test_continuous_batching_equals_each_row_alone(cyclic_model, monkeypatch, max_new) -> None:
    """Nine prompts of 1 to 76 tokens through three rows: the next prompts join in the places of
    rows that ended (with one new token, every row ends on the prefill's), each row's output is
    what it decodes alone, `on_end` hears each row once with its final tokens, and no forward
    runs more than three rows."""
    widest, forward = [], engine.forward

    def recording(model, cache, tokens, *args):
        widest.append(tokens.shape[0])
        return forward(model, cache, tokens, *args)

    monkeypatch.setattr(engine, "forward", recording)
    monkeypatch.setattr(engine, "JOIN_SHARE", 0.5)  # a join once two of the three rows are free
    random = random_model(2)
    for model in (cyclic_model, random):
        prompts = spread_prompts(model, 9, seed=3)
        free, _ = generate(model, prompts, max_new)
        eot = collections.Counter(t for o in free for t in set(o)).most_common(1)[0][0]
        ended = []
        widest.clear()
        streamed, stats = generate(model, prompts, max_new, eot_id=eot, max_batch=3,
                                   on_end=lambda row, toks: ended.append((row, list(toks))))
        alone = [generate(model, [p], max_new, eot_id=eot)[0][0] for p in prompts]
        assert streamed == alone
        assert sorted(ended) == sorted(enumerate(alone))  # each row once, its tokens final
        assert max(widest) == 3 and stats.prefills == 9
        if max_new > 1:
            assert len({len(o) for o in streamed}) > 2  # rows ended at different rounds
            assert 1 in widest[1:] and 2 in widest[1:]  # a join ran a forward of its own


def test_continuous_batching_refuses_speculative_decoders(cyclic_model) -> None:
    with pytest.raises(ValueError, match="max_batch must be >= 1 and goes with decoder greedy"):
        generate(cyclic_model, [[1, 2], [3]], 4, decoder="self-spec", max_batch=1)
    with pytest.raises(ValueError, match="max_batch must be >= 1"):
        generate(cyclic_model, [[1, 2], [3]], 4, max_batch=0)


def test_a_cache_joins_rows_into_the_room_keep_left_and_no_more(cyclic_model) -> None:
    """`KVCache.join` appends another cache's rows after the kept ones, their slots in use
    copied; rows past those allocated are refused, naming both sizes."""
    from mtp.model.transformer import KVCache

    cache, part = KVCache(cyclic_model.cfg, 3, 8), KVCache(cyclic_model.cfg, 2, 8)
    for c in (cache, part):
        c.k.normal_()
        c.v.normal_()
    cache.truncate(torch.tensor([5, 2, 7]))
    part.truncate(torch.tensor([3, 4]))
    kept = cache.k[:, 2, :, :7].clone()
    cache.keep(torch.tensor([2]))
    cache.join(part)
    assert cache.lengths.tolist() == [7, 3, 4] and cache.k.shape[1] == 3
    assert torch.equal(cache.k[:, 0, :, :7], kept)
    assert torch.equal(cache.k[:, 1:, :, :4], part.k[:, :, :, :4])
    assert torch.equal(cache.v[:, 1:, :, :4], part.v[:, :, :, :4])
    with pytest.raises(ValueError, match="2 rows of 8 slots do not fit beside 3 rows in a cache "
                       "of 3 rows of 8 slots"):
        cache.join(part)
