"""The decoding stage: greedy and sampling baselines, self-speculation (chain, tree), draft-model
speculation.

`generate` validates a request (`request`: every rule once, each problem naming its field) and
runs the one decode loop (`engine`) with one drafter (`drafters`): plain decoding proposes
nothing; `self-spec` and `tree` draft with heads 2..h (parallel heads run as one stacked block,
`stacked`; cascaded heads, each reading the one before, run on their own drafts, `cascaded`);
`draft` with a separate model; `lookup` copies drafts from the text so far (prompt lookup,
`lookup`), alone or as one more branch beside the heads' drafts. The acceptance rules
(`acceptance`) are exact: speculative greedy output is plain greedy output token for token, and
speculative sampling draws from the distribution of plain sampling (`sampling`). `tree` holds the
candidate trees, `stopper` the stop conditions, `stats` what a call did, and `policy` how many
drafts a round verifies (all it can, or as many as pay).

`generate` (`generation`) is the entry point, `cli` the `mtp generate` command and the decoding
flags `mtp bench decode` shares. Imports the model stage only. Names are imported when first
used, so the command line's `--help` loads no torch.
"""

from mtp.util.lazy import lazy_exports

#: Each public name and the module that defines it.
_EXPORTS = {
    "DECODERS": "mtp.decoding.names",
    "LOOKUP_TOKENS": "mtp.decoding.names",
    "PHASES": "mtp.decoding.stats",
    "DecodeRequest": "mtp.decoding.request",
    "DecodeStats": "mtp.decoding.stats",
    "RequestError": "mtp.decoding.request",
    "Sampling": "mtp.decoding.sampling",
    "Tree": "mtp.decoding.tree",
    "generate": "mtp.decoding.generation",
    "head_accuracy": "mtp.decoding.tree",
    "probs_from_logits": "mtp.decoding.sampling",
    "sample_from_logits": "mtp.decoding.sampling",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
