"""Two decoders racing on one prompt with honest clocks: the race behind `mtp demo`'s page.

Each racer is one `generate` call on its own thread, heard round by round through the decode
loop's streaming hook (`on_tokens`: each round's tokens with their origins). On a CPU two
decodes at once would share the cores and slow each other by an amount that depends on the
machine, so the racers take turns instead: one round at a time, the racer whose clock is behind
going next. A racer's clock runs only during its own turns, so each clock reads what the decode
would have taken with the machine to itself, and the two advance side by side on the page as if
started together. The turns cost a thread switch per round, outside both clocks. The page draws
between turns too (`paused`): its own Python would otherwise run beside a racer's rounds and
slow them (on one thread, a greedy round is mostly Python).

`generate`'s own `DecodeStats.seconds` counts the waits between turns; the page's times are the
racers' clocks. Counts (tokens, forwards, acceptance) are `generate`'s.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from mtp.decoding.arithmetic import decode_linears
from mtp.decoding.generation import generate
from mtp.decoding.stats import DecodeStats
from mtp.model.transformer import MTPTransformer

__all__ = ["Cancelled", "Lane", "Race", "live_races", "race"]

_LIVE: set[Race] = set()  # races whose threads have not all ended
_LIVE_LOCK = threading.Lock()


def live_races() -> list[Race]:
    """The races whose decoding has not ended yet (a closed page's race ends within a round)."""
    with _LIVE_LOCK:
        return list(_LIVE)


class Cancelled(Exception):
    """Raised inside a racer's `generate` call (through its listener) to end it early."""


@dataclass
class Lane:
    """One racer: a decoder and what it has produced so far."""

    name: str
    """As the page shows it, e.g. `greedy` or `heads: chain + lookup`."""
    decode_kwargs: dict
    """`generate`'s arguments besides the model, the prompt and max_new_tokens."""
    rounds: list[tuple[list[int], list[int]]] = field(default_factory=list)
    """Each round's new tokens and their origins (`mtp.decoding.origin`), the prefill's first."""
    clock: float = 0.0
    """Seconds of the racer's own turns so far."""
    round_clocks: list[float] = field(default_factory=list)
    """The clock when each round was heard."""
    stats: DecodeStats | None = None
    """`generate`'s statistics, once it has returned."""
    error: str | None = None
    """Why the racer stopped early, if it did."""

    @property
    def tokens(self) -> list[int]:
        return [t for toks, _ in self.rounds for t in toks]

    @property
    def done(self) -> bool:
        return self.stats is not None or self.error is not None


class Race:
    """Two (or more) lanes decoding one prompt in turns; `start`, then read the lanes as they
    grow (`version` counts the rounds heard; `wait` blocks until it moves), `cancel` to end it.

    Args:
        model: the model every lane decodes with. Its linear layers take their decode paths
            for the whole race (`mtp.decoding.arithmetic`; a no-op where they already have
            them): each `generate` call would otherwise restore them when it ends, under the
            other lane's feet, and the two would no longer compute with one arithmetic.
        prompt: the prompt's token ids.
        max_new_tokens: the most new tokens of each lane.
        lanes: the racers; the first one starts.
        common: `generate` arguments every lane shares (eot_id, ...).
    """

    def __init__(self, model: MTPTransformer, prompt: list[int], max_new_tokens: int,
                 lanes: list[Lane], **common) -> None:
        self.model, self.prompt, self.max_new_tokens = model, prompt, max_new_tokens
        self.lanes, self.common = lanes, common
        self.turn = 0  # the lane whose turn it is
        self.busy = False  # whether that lane is decoding now (between two of its rounds)
        self.hold = False  # the page is drawing: no lane starts a turn
        self.order: list[int] = []  # the lane of each round heard, in the order heard
        self.version = 0
        self.cancelled = False
        self.cond = threading.Condition()
        self.threads: list[threading.Thread] = []
        self._linears = None

    # -- the consumer's side ------------------------------------------------------------------
    def start(self) -> Race:
        with _LIVE_LOCK:
            _LIVE.add(self)
        self._linears = decode_linears(self.model)
        self._linears.__enter__()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True,
                                         name=f"mtp-demo-lane-{i}") for i in range(len(self.lanes))]
        for t in self.threads:
            t.start()
        return self

    @property
    def finished(self) -> bool:
        return all(lane.done for lane in self.lanes)

    def wait(self, version: int, timeout: float) -> int:
        """Block until a round newer than `version` is heard, the race ends, or `timeout`
        seconds pass; returns the current version."""
        with self.cond:
            self.cond.wait_for(lambda: self.version != version or self.finished, timeout)
            return self.version

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Within the block no lane decodes: it waits for the running lane's round to end, and
        the next turn starts after the block (a page draws here, outside every clock)."""
        with self.cond:
            self.hold = True
            self.cond.wait_for(lambda: not self.busy)
        try:
            yield
        finally:
            with self.cond:
                self.hold = False
                self.cond.notify_all()

    def cancel(self) -> None:
        """End every lane at its next round (a closed page, a new run) and wait for them."""
        with self.cond:
            self.cancelled = True
            self.cond.notify_all()
        for t in self.threads:
            if t is not threading.current_thread():
                t.join(timeout=30)

    # -- the racers' side ---------------------------------------------------------------------
    def _next_turn(self) -> None:
        """Hand the turn to the unfinished lane whose clock is furthest behind (called with the
        condition held)."""
        waiting = [i for i, lane in enumerate(self.lanes) if not lane.done]
        if waiting:
            self.turn = min(waiting, key=lambda i: (self.lanes[i].clock, i != self.turn))
        self.cond.notify_all()

    def _wait_turn(self, i: int) -> None:
        """Wait until lane i may decode (called with the condition held)."""
        self.busy = False
        self.cond.notify_all()
        self.cond.wait_for(lambda: (self.turn == i and not self.hold) or self.cancelled)
        if self.cancelled:
            raise Cancelled
        self.busy = True

    def _run(self, i: int) -> None:
        lane = self.lanes[i]
        started = [0.0]

        def listen(row: int, tokens: list[int], origins: list[int]) -> None:
            lane.clock += time.perf_counter() - started[0]
            with self.cond:
                lane.rounds.append((tokens, origins))
                lane.round_clocks.append(lane.clock)
                self.order.append(i)
                self.version += 1
                self._next_turn()
                self._wait_turn(i)
            started[0] = time.perf_counter()

        try:
            with self.cond:
                self._wait_turn(i)
            started[0] = time.perf_counter()
            _, stats = generate(self.model, [self.prompt], self.max_new_tokens,
                                on_tokens=listen, **self.common, **lane.decode_kwargs)
            lane.clock += time.perf_counter() - started[0]
            lane.stats = stats
        except Cancelled:
            lane.error = "stopped"
        except Exception as e:  # shown on the page; the other lane goes on
            lane.error = f"{type(e).__name__}: {e}"
        finally:
            with self.cond:
                if lane.stats is None and lane.error is None:
                    lane.error = "stopped"
                self.busy = False
                self.version += 1
                self._next_turn()
            self._end_if_last()

    def _end_if_last(self) -> None:
        """The last lane to end unpacks the model and takes the race off the live ones."""
        with self.cond:
            if not self.finished or self._linears is None:
                return
            linears, self._linears = self._linears, None
            linears.__exit__(None, None, None)
        with _LIVE_LOCK:
            _LIVE.discard(self)


def race(model: MTPTransformer, prompt: list[int], max_new_tokens: int, lanes: list[Lane],
         on_round: Callable[[Race], None] | None = None, **common) -> Race:
    """Run a race to its end in this thread's time (for scripts and tests): `on_round(race)`
    after every round heard."""
    r = Race(model, prompt, max_new_tokens, lanes, **common).start()
    version = -1
    while not r.finished:
        version = r.wait(version, timeout=1.0)
        if on_round is not None:
            on_round(r)
    for t in r.threads:
        t.join()
    return r
