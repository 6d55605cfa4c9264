"""When a row ends: max new tokens, end-of-text, stop strings or stop conditions on the text."""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["Stop", "Stopper"]

#: A stop string, or a predicate on a row's new text that stays true as the text grows.
Stop = str | Callable[[str], bool]


class Stopper:
    """Collects each row's new tokens and applies max_new_tokens, end-of-text and stops.

    A stop is a string, met when the new text contains it, or a predicate on the new text that,
    once it holds, holds of every longer text (as containing a string does). A row
    ends at the first token that meets a stop; that token is kept (the caller cuts the text at
    the stop string). Stops see the new text only: a prompt ending in `def` must not stop on
    `\\ndef`.
    """

    def __init__(
        self,
        n_rows: int,
        max_new_tokens: int,
        eot_id: int | None,
        stop: Sequence[Stop],
        decode: Callable[[list[int]], str] | None,
        on_tokens: Callable[[int, list[int], int], None] | None,
    ) -> None:
        self.out: list[list[int]] = [[] for _ in range(n_rows)]
        self.max_new, self.eot_id, self.stop, self.decode = max_new_tokens, eot_id, stop, decode
        self.on_tokens = on_tokens

    def remaining(self, row: int) -> int:
        return self.max_new - len(self.out[row])

    def extend(self, row: int, tokens: list[int], drafted: int = 0) -> tuple[int, bool]:
        """Append tokens to a row up to its first stop; returns (tokens kept, row finished).

        The first `drafted` tokens came from accepted drafts, the rest from the verifier;
        `on_tokens(row, kept tokens, drafted among them)` hears of every append.
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
            self.on_tokens(row, out[start:], min(drafted, len(out) - start))
        return len(out) - start, done

    def _stop_in(self, tokens: list[int]) -> bool:
        text = self.decode(tokens)
        return any(s(text) if callable(s) else s in text for s in self.stop)
