"""A token's origin: what produced it, as `generate(..., on_tokens=...)` tells its listener.

A round emits the drafts the verifier accepted, then one token of the verifier's own (head 1's).
Each emitted token carries one code: `HEAD_1` for the verifier's tokens (every token of plain
decoding, and the prefill's), k >= 2 for a draft of head k, and a negative code for a draft of
prompt lookup, of a separate draft model or of the oracle. Head numbers count from 1, as
everything shown to people does (head k predicts the token k positions ahead). Torch-free: a
page or a terminal reads the codes without the model.
"""

from __future__ import annotations

__all__ = ["DRAFT_MODEL", "HEAD_1", "LOOKUP", "ORACLE", "origin_name"]

#: Head 1: the verifier's own token (greedy's argmax or a sample of its distribution).
HEAD_1 = 1
#: A draft copied by prompt lookup (`mtp.decoding.lookup`).
LOOKUP = -1
#: A draft of a separate draft model (decoder `draft`).
DRAFT_MODEL = -2
#: A draft of the oracle, which proposes a given reference (`mtp bench decode --oracle`).
ORACLE = -3

_NAMES = {LOOKUP: "lookup", DRAFT_MODEL: "draft model", ORACLE: "oracle"}


def origin_name(code: int) -> str:
    """The origin as people read it: `head 1`, `head 3`, `lookup`, `draft model`, `oracle`."""
    if code >= HEAD_1:
        return f"head {code}"
    if code not in _NAMES:
        raise ValueError(f"no token origin has the code {code}")
    return _NAMES[code]
