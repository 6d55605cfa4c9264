"""When a row ends: max new tokens, end-of-text, stop strings or stop conditions on the text."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from mtp.decoding.origin import HEAD_1

__all__ = ["EndListener", "Listener", "Stop", "Stopper"]

#: A stop string, or a predicate on a row's new text that stays true as the text grows.
Stop = str | Callable[[str], bool]

#: The streaming hook: called as listener(row, tokens, origins) with each round's new tokens of
#: a row and each one's origin (`mtp.decoding.origin`).
Listener = Callable[[int, list[int], list[int]], None]
#: The hook of a row's end: called as on_end(row, tokens) with all its new tokens, once.
EndListener = Callable[[int, list[int]], None]


class Stopper:
    """Collects each row's new tokens and applies max_new_tokens, end-of-text and stops.

    A stop is a string, met when the new text contains it, or a predicate on the new text that,
    once it holds, holds of every longer text (as containing a string does). A row
    ends at the first token that meets a stop; that token is kept (the caller cuts the text at
    the stop string). Stops see the new text only: a prompt ending in `def` must not stop on
    `\\ndef`.

    `on_tokens`, the streaming hook, hears every append: the row, the tokens kept and each one's
    origin. Without it, the loop neither gathers nor hands over any origin (`listening`).
    `on_end` hears each row's end (`end`, called by the loop, which also ends a row that fills
    the context length) with the row's new tokens.
    """

    def __init__(
        self,
        n_rows: int,
        max_new_tokens: int,
        eot_id: int | None,
        stop: Sequence[Stop],
        decode: Callable[[list[int]], str] | None,
        on_tokens: Listener | None,
        on_end: EndListener | None = None,
    ) -> None:
        self.out: list[list[int]] = [[] for _ in range(n_rows)]
        self.max_new, self.eot_id, self.stop, self.decode = max_new_tokens, eot_id, stop, decode
        self.on_tokens, self.on_end = on_tokens, on_end

    @property
    def listening(self) -> bool:
        """Whether someone hears the tokens, so that the loop gathers their origins."""
        return self.on_tokens is not None

    def remaining(self, row: int) -> int:
        return self.max_new - len(self.out[row])

    def extend(self, row: int, tokens: list[int],
               origins: Sequence[int] | None = None) -> tuple[int, bool]:
        """Append tokens to a row up to its first stop; returns (tokens kept, row finished).

        `origins`: each token's origin; None: all the verifier's (`HEAD_1`), as in plain
        decoding. `on_tokens(row, kept tokens, their origins)` hears of every append.
        """
        out, start = self.out[row], len(self.out[row])
        done = False
        for t in tokens:
            out.append(t)
            if t == self.eot_id or len(out) >= self.max_new:
                done = True
                break
        if self.stop and self._stop_in(out):
            # Find the first token whose text meets a stop (earlier ones did not).
            k = next(k for k in range(start + 1, len(out) + 1) if self._stop_in(out[:k]))
            del out[k:]
            done = True
        if self.on_tokens is not None and len(out) > start:
            kept = len(out) - start
            self.on_tokens(row, out[start:],
                           [HEAD_1] * kept if origins is None else list(origins[:kept]))
        return len(out) - start, done

    def end(self, row: int) -> None:
        """The row ended: its tokens are final."""
        if self.on_end is not None:
            self.on_end(row, self.out[row])

    def _stop_in(self, tokens: list[int]) -> bool:
        text = self.decode(tokens)
        return any(s(text) if callable(s) else s in text for s in self.stop)
