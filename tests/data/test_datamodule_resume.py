"""The data position of a resume (`MTPDataModule`'s state): windows are counted as they are
drawn, so a resume with another batch size continues at the next window not yet drawn, and
accumulated batches count."""

import torch
from data_helpers import fit_windows

from mtp.data import ResumableSampler


def test_a_resume_with_another_batch_size_continues_where_the_data_stopped(tiny_corpus,
                                                                           tmp_path):
    cache = tmp_path / "cache"
    a, b = tmp_path / "a.ckpt", tmp_path / "b.ckpt"
    first, dm = fit_windows(tiny_corpus, cache, 8, 2, save_to=a)  # windows 0..15 of the stream
    second, _ = fit_windows(tiny_corpus, cache, 16, 4, ckpt_path=a, save_to=b)  # 16..47
    # global_step x batch size would say 4 x 16 = 64
    assert torch.load(b, weights_only=True)["MTPDataModule"]["samples_consumed"] == 48
    third, _ = fit_windows(tiny_corpus, cache, 16, 5, ckpt_path=b)  # 48..63
    stream = iter(ResumableSampler(len(dm.train_set), dm.cfg.seed))
    drawn = [next(stream) for _ in range(64)]
    want = torch.stack([dm.train_set[i] for i in drawn])
    assert [len(x) for x in first + second + third] == [8, 8, 16, 16, 16]
    assert torch.equal(torch.cat(first + second + third), want)


def test_accumulated_batches_count_as_drawn(tiny_corpus, tmp_path):
    ckpt = tmp_path / "a.ckpt"
    batches, dm = fit_windows(tiny_corpus, tmp_path / "cache", 4, 3, save_to=ckpt, accumulate=2)
    assert len(batches) == 6 and dm.samples_consumed == 24
    assert torch.load(ckpt, weights_only=True)["MTPDataModule"]["samples_consumed"] == 24
