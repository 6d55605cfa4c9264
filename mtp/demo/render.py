"""The race as HTML and as data: each lane's text with every token coloured by its origin and
each round marked, its live tokens/s and L, the legend, the verdict and the per-depth acceptance
chart. Pure functions of a `Lane` (no torch, no Gradio), so the tests read what the page shows.

The colours are the terminal's hues of `mtp generate` (`mtp.decoding.cli`): head 2 cyan, head 3
green, head 4 amber, later heads violet, lookup blue, a draft model pink; head 1's own tokens
are plain.
"""

from __future__ import annotations

import html
from collections import Counter
from collections.abc import Callable

from mtp.decoding.origin import DRAFT_MODEL, HEAD_1, LOOKUP, ORACLE, origin_name
from mtp.demo.race import Lane

__all__ = ["CSS", "TextPieces", "acceptance_html", "lane_data", "lane_html", "legend_html",
           "origin_class", "verdict_html"]

#: The page's style: origins' colours, round marks, lanes, the chart.
CSS = """
.mtp-lane { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; }
.mtp-head { font-family: system-ui, sans-serif; margin-bottom: 6px; }
.mtp-head b { font-size: 1.05em; }
.mtp-speed { font-weight: 600; }
.mtp-text { white-space: pre-wrap; line-height: 1.55; font-size: 13px; min-height: 14em;
            max-height: 30em; overflow-y: auto; padding: 8px; border: 1px solid #ddd;
            border-radius: 6px; background: #fff; color: #111; }
.mtp-round { border-left: 1px solid #c8c8c8; }
.mtp-round:hover { outline: 1px dashed #777; }
.mtp-tok { border-radius: 2px; }
.mtp-o-h1 { }
.mtp-o-h2 { background: #c9ecf8; }
.mtp-o-h3 { background: #cdeec9; }
.mtp-o-h4 { background: #f8e7b0; }
.mtp-o-hn { background: #e6d3f6; }
.mtp-o-lookup { background: #d2dafb; }
.mtp-o-draft { background: #f8d2e5; }
.mtp-o-oracle { background: #e3e3e3; }
.mtp-legend { font-family: system-ui, sans-serif; font-size: 13px; }
.mtp-legend .mtp-tok { padding: 1px 6px; margin-right: 4px; border: 1px solid #ccc; }
.mtp-verdict { font-family: system-ui, sans-serif; font-size: 15px; }
.mtp-chart { font-family: system-ui, sans-serif; font-size: 13px; max-width: 560px; }
.mtp-bar-row { display: flex; align-items: center; margin: 3px 0; }
.mtp-bar-label { width: 150px; }
.mtp-bar-track { flex: 1; background: #eee; height: 14px; border-radius: 3px; }
.mtp-bar { height: 14px; border-radius: 3px; background: #5b9bd5; }
.mtp-bar-value { width: 120px; text-align: right; }
.mtp-note { font-family: system-ui, sans-serif; font-size: 12px; color: #555; }
"""


def origin_class(origin: int) -> str:
    """The CSS class of an origin's colour."""
    if origin >= HEAD_1:
        return f"mtp-o-h{origin}" if origin <= 4 else "mtp-o-hn"
    return {LOOKUP: "mtp-o-lookup", DRAFT_MODEL: "mtp-o-draft", ORACLE: "mtp-o-oracle"}[origin]


class TextPieces:
    """Each token's share of the decoded text, the text the sequence gained with it, kept as a
    lane grows. A token that ends inside a character (byte-level BPE) gets nothing and the one
    that completes the character all of it, so the pieces join to the whole text."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode = decode
        self.tokens: list[int] = []
        self.pieces: list[str] = []
        self.shown = ""

    def sync(self, tokens: list[int]) -> list[str]:
        """The pieces of `tokens`, which extend the tokens of the last call."""
        for t in tokens[len(self.tokens):]:
            self.tokens.append(t)
            stable = self.decode(self.tokens).rstrip("\ufffd")
            grew = stable.startswith(self.shown) and len(stable) > len(self.shown)
            new = stable[len(self.shown):] if grew else ""
            self.shown += new
            self.pieces.append(new)
        pieces = self.pieces[: len(tokens)]
        if pieces:  # whatever the last token holds back (a partial character so far)
            pieces[-1] += self.decode(tokens)[len(self.shown):]
        return pieces


def _speed(lane: Lane) -> tuple[int, int, float]:
    """Tokens, forwards (rounds heard, the prefill's included) and seconds so far."""
    tokens = sum(len(t) for t, _ in lane.rounds)
    return tokens, len(lane.rounds), lane.clock


def lane_html(lane: Lane, pieces: TextPieces) -> str:
    """A lane: its name, live tokens/s and L, and its text, each token in its origin's colour
    and each round a span with a thin mark before it (hover: what the round did)."""
    rounds = list(lane.rounds)
    tokens, forwards, seconds = _speed(lane)
    texts = iter(pieces.sync([t for toks, _ in rounds for t in toks]))
    spans = []
    for n, (toks, origins) in enumerate(rounds):
        drafts = sum(o != HEAD_1 for o in origins)
        what = ", ".join(origin_name(o) for o in origins)
        title = f"round {n}: {len(toks)} token{'s' * (len(toks) != 1)}, {drafts} from " \
                f"accepted drafts ({what})"
        inner = "".join(f'<span class="mtp-tok {origin_class(o)}" data-origin="{o}">'
                        f"{html.escape(next(texts))}</span>" for o in origins)
        spans.append(f'<span class="mtp-round" title="{html.escape(title)}">{inner}</span>')
    rate = f"{tokens / seconds:.1f} tokens/s" if seconds > 0 and tokens else "- tokens/s"
    L = f"{tokens / forwards:.2f}" if forwards else "-"
    status = lane.error or ""
    head = (f'<div class="mtp-head"><b>{html.escape(lane.name)}</b> &nbsp; '
            f'<span class="mtp-speed">{rate}</span> &middot; L {L} tokens/forward &middot; '
            f"{tokens} tokens &middot; {forwards} forwards &middot; {seconds:.2f} s"
            f"{' &middot; ' + html.escape(status) if status else ''}</div>")
    return f'<div class="mtp-lane">{head}<div class="mtp-text">{"".join(spans)}</div></div>'


def legend_html(origins: list[int], counts: Counter | None = None) -> str:
    """The legend: each origin's colour, with how many tokens it gave where counted."""
    items = []
    for o in origins:
        n = f" {counts[o]}" if counts is not None else ""
        label = f"{origin_name(o)}{' (its own token)' if o == HEAD_1 else ' draft'}"
        items.append(f'<span class="mtp-tok {origin_class(o)}">{html.escape(label)}</span>'
                     f"{n}")
    marks = ('<span class="mtp-round">&nbsp;</span>: a round (one forward of the model) starts; '
             "hover over the text for what each round did")
    return f'<div class="mtp-legend">{" &nbsp; ".join(items)} &nbsp;|&nbsp; {marks}</div>'


def verdict_html(base: Lane, spec: Lane, greedy: bool) -> str:
    """The line under the lanes: the speedup and, for greedy speculation, whether the text is
    greedy's token for token."""
    if not (base.done and spec.done):
        return '<div class="mtp-verdict">racing&hellip;</div>'
    if base.error or spec.error:
        which = spec if spec.error else base
        return f'<div class="mtp-verdict">{html.escape(which.name)}: {html.escape(which.error)}' \
               "</div>"
    parts = []
    b_tok, _, b_sec = _speed(base)
    s_tok, _, s_sec = _speed(spec)
    if b_sec > 0 and s_sec > 0 and b_tok and s_tok:
        ratio = (s_tok / s_sec) / (b_tok / b_sec)
        parts.append(f"{html.escape(spec.name)}: <b>{ratio:.2f}x</b> the tokens/s of "
                     f"{html.escape(base.name)}")
    if greedy:
        same = spec.tokens == base.tokens
        parts.append(f"identical to greedy: <b>{'yes' if same else 'no'}</b>")
    else:
        parts.append("sampling: the speculative text follows plain sampling's distribution, "
                     "not its tokens")
    return f'<div class="mtp-verdict">{" &nbsp;&middot;&nbsp; ".join(parts)}</div>'


def acceptance_html(lane: Lane, heads_only: bool) -> str:
    """Per depth: how often the draft there was accepted given every earlier one was (the
    call's `DecodeStats.acceptance`), as bars."""
    stats = lane.stats
    if stats is None or not stats.offered:
        return '<div class="mtp-chart"></div>'
    rows = []
    for d, (taken, offered) in enumerate(zip(stats.taken, stats.offered, strict=True), 1):
        rate = taken / offered if offered else 0.0
        label = f"draft {d}" + (f" (head {d + 1})" if heads_only else "")
        rows.append(f'<div class="mtp-bar-row"><span class="mtp-bar-label">{label}</span>'
                    f'<div class="mtp-bar-track"><div class="mtp-bar" '
                    f'style="width: {100 * rate:.1f}%"></div></div>'
                    f'<span class="mtp-bar-value">{100 * rate:.0f}% ({taken}/{offered})</span>'
                    "</div>")
    title = (f"<b>Acceptance per depth</b> ({html.escape(lane.name)}): the share of rounds whose "
             "draft at that depth was accepted, of those that verified it with every earlier "
             "draft accepted")
    return f'<div class="mtp-chart">{title}{"".join(rows)}</div>'


def lane_data(lane: Lane, decode: Callable[[list[int]], str]) -> dict:
    """The lane as plain data (the page's JSON and its API): rounds of (tokens, origins), the
    text, the clock and, once done, `generate`'s counts."""
    out = {"name": lane.name, "rounds": [[list(t), list(o)] for t, o in lane.rounds],
           "text": decode(lane.tokens), "seconds": lane.clock, "done": lane.done,
           "error": lane.error, "stats": None}
    if lane.stats is not None:
        s = lane.stats
        out["stats"] = {"tokens": s.tokens, "forwards": s.forwards,
                        "row_forwards": s.row_forwards, "accepted": s.accepted,
                        "offered": s.offered, "taken": s.taken,
                        "tokens_per_forward": s.tokens_per_forward}
    return out
