"""The data pipeline: corpora, tokenizer training, tokenisation into shards, windows, DataModule.

source(s) (stdlib / Hugging Face / local files, or a weighted mixture of them) -> documents
streamed one at a time, split by a hash of their name (``corpus``) -> byte-level BPE (trained on
a bounded sample of the training split, or loaded: ``bpe``) -> per source, one token file per
split with an end-of-text token after each document, encoded by worker processes
(``encoder_pool``) into crash-safe, resumable shards (``shards``) -> windows of seq_len + K
tokens, so head i finds its targets i positions ahead, their samplers and the
LightningDataModule (``datamodule``). Imports the model stage (a GGUF file's tokenizer) and
nothing above it. Names are imported when first used: only ``datamodule`` loads Lightning.
"""

from mtp.util.lazy import lazy_exports

#: Each public name and the module that defines it.
_EXPORTS = {
    "Corpus": "mtp.data.corpus",
    "MTPDataModule": "mtp.data.datamodule",
    "MixtureSampler": "mtp.data.datamodule",
    "ResumableSampler": "mtp.data.datamodule",
    "SourceSpec": "mtp.data.corpus",
    "TokenWindows": "mtp.data.datamodule",
    "build_datamodule": "mtp.data.datamodule",
    "build_shards": "mtp.data.shards",
    "load_corpus": "mtp.data.corpus",
    "load_shards": "mtp.data.shards",
    "load_tokenizer": "mtp.data.bpe",
    "source_specs": "mtp.data.corpus",
    "tokenizer_sample": "mtp.data.bpe",
    "train_tokenizer": "mtp.data.bpe",
    "unigram_entropy": "mtp.data.datamodule",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
