"""The data pipeline: corpora, tokenizer training, tokenisation into shards, windows, DataModule.

source(s) (stdlib / Hugging Face / local files, or a weighted mixture of them) -> documents
streamed one at a time, split by a hash of their name (``corpus``) -> byte-level BPE (trained on
a bounded sample of the training split, or loaded: ``bpe``) -> per source, one token file per
split with an end-of-text token after each document, encoded by worker processes
(``encoder_pool``) into crash-safe, resumable shards (``shards``) -> windows of seq_len + K
tokens, so head i finds its targets i positions ahead, their samplers and the
LightningDataModule (``datamodule``). Imports the model stage (a GGUF file's tokenizer) and
nothing above it.
"""

from mtp.data.bpe import load_tokenizer, tokenizer_sample, train_tokenizer
from mtp.data.corpus import Corpus, SourceSpec, load_corpus, source_specs
from mtp.data.datamodule import (
    MixtureSampler,
    MTPDataModule,
    ResumableSampler,
    TokenWindows,
    build_datamodule,
    unigram_entropy,
)
from mtp.data.shards import build_shards, load_shards

__all__ = [
    "Corpus",
    "MTPDataModule",
    "MixtureSampler",
    "ResumableSampler",
    "SourceSpec",
    "TokenWindows",
    "build_datamodule",
    "build_shards",
    "load_corpus",
    "load_shards",
    "load_tokenizer",
    "source_specs",
    "tokenizer_sample",
    "train_tokenizer",
    "unigram_entropy",
]
