"""`mtp generate`: decoding one prompt from a checkpoint, and the decoding flags it shares with
`mtp bench decode` (`mtp.bench.decode`).

`mtp generate` streams one completion, with the tokens that came from accepted drafts shown apart
from those the verifier added (colour on a terminal, `[[...]]` otherwise), and ends with tokens,
forwards, L, ms/token and the speedup over greedy measured right after.

The decoding flags map to a `mtp.decoding.DecodeRequest`, whose one validator holds every rule of
a request; this module only maps the request's fields to flags (`flag`), so each problem names
its flag. The parser imports nothing heavy, so `--help` answers at once; torch and the model load
when a command runs.
"""

from __future__ import annotations

import argparse
import sys

from mtp.decoding.names import DECODERS, LOOKUP_TOKENS

# --------------------------------------------------------------------------------------------
# Arguments shared by both commands: flags map to a `mtp.decoding.DecodeRequest`, which checks them

#: The flag of each field of a decode request (and of what it is checked against) that is not
#: `--` and the field's name with dashes.
FLAGS = {"model": "--ckpt", "draft_model": "--draft-ckpt", "prompts": "--prompt"}


def flag(field: str) -> str:
    """The flag of a field of `mtp.decoding.DecodeRequest`, for its messages
    (`RequestError.messages(flag)`)."""
    return FLAGS.get(field) or "--" + field.replace("_", "-")


def device_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's choice)")


def decoding_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per prompt")
    p.add_argument("--temperature", type=float, default=None,
                   help="0 = greedy (default for every decoder but sample, which defaults to 1)")
    p.add_argument("--top-k", type=int, default=None, help="sample from the k likeliest tokens")
    p.add_argument("--top-p", type=float, default=None,
                   help="sample from the top-p nucleus, 0 < p <= 1")
    p.add_argument("--tree", default="3,2,1",
                   help="tree of the `tree` decoder: top-k widths per depth, e.g. 3,2,1 (cut to "
                        "the heads used), or `dynamic` (at most 32 nodes) or `dynamic:N`: a tree "
                        "grown each round where the heads are sure, sized by this machine's "
                        "measured forward time")
    p.add_argument("--draft-ckpt", default=None,
                   help="checkpoint of the small draft model for decoder `draft`")
    p.add_argument("--gamma", type=int, default=4, help="tokens the draft model proposes")
    p.add_argument("--lookup", type=int, default=0, metavar="N",
                   help="prompt lookup: the most tokens a round copies from the text so far "
                        f"(decoder lookup: default {LOOKUP_TOKENS}); with self-spec or tree, "
                        "verified as one more branch beside the heads' drafts (0: none)")
    p.add_argument("--lookup-ngram", type=int, default=2, metavar="N",
                   help="prompt lookup matches the text's last N..1 tokens")
    p.add_argument("--stop", action="append", default=[],
                   help="stop string (repeatable); searched in the new text")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")


def decode_request(args: argparse.Namespace, **fields):
    """The decoding flags as a `mtp.decoding.DecodeRequest`; `fields` give the rest (the
    decoder, heads, tree) or override a flag."""
    from mtp.decoding.request import DecodeRequest

    flags = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                 top_k=args.top_k, top_p=args.top_p, gamma=args.gamma, lookup=args.lookup,
                 lookup_ngram=args.lookup_ngram)
    return DecodeRequest(**{**flags, **fields})


def check_args(args: argparse.Namespace):
    """The flags beside a request's, before anything loads: `--tree` as a `mtp.decoding.Tree`
    or `DynamicTree` (None where it is refused) and the problems of `--tree`, `--threads` and
    `--device`."""
    import torch

    from mtp.decoding.tree import MAX_TREE_NODES, DynamicTree, Tree

    problems = []
    if args.threads is not None and args.threads < 1:
        problems.append(f"--threads must be >= 1 (got {args.threads})")
    try:
        torch.device(args.device)
    except RuntimeError as e:
        problems.append(f"--device {args.device!r}: {e}")
    tree = None
    if args.tree.startswith("dynamic"):
        nodes = args.tree.removeprefix("dynamic").removeprefix(":")
        try:
            return DynamicTree(max_nodes=int(nodes or DynamicTree.max_nodes)), problems
        except ValueError:
            return None, [*problems, f"--tree dynamic:N needs 1 <= N <= {MAX_TREE_NODES} "
                                     f"nodes (got {args.tree!r})"]
    try:
        widths = [int(w) for w in args.tree.split(",")]
        if min(widths) < 1:
            raise ValueError(args.tree)
    except ValueError:
        problems.append(f"--tree must be comma-separated widths >= 1, e.g. 3,2,1, or dynamic "
                        f"(got {args.tree!r})")
    else:
        try:
            tree = Tree.from_widths(widths)
        except ValueError as e:
            problems.append(f"--tree {args.tree}: {e}")
    return tree, problems


def request_problems(requests, names=flag, **known) -> list[str]:
    """Every problem of `requests` (`mtp.decoding.DecodeRequest.problems(**known)`), each field
    called `names(field)`; a problem several requests share, once."""
    messages = [problem.message(names) for r in requests for problem in r.problems(**known)]
    return list(dict.fromkeys(messages))


def refuse(p: argparse.ArgumentParser, problems: list[str]) -> None:
    """Exit 2 with every problem, if any."""
    if problems:
        p.error(problems[0] if len(problems) == 1 else
                f"{len(problems)} problems:\n  " + "\n  ".join(problems))


def load(p: argparse.ArgumentParser, args: argparse.Namespace, draft: bool):
    """Model and tokenizer of --ckpt and, with `draft` and a --draft-ckpt, the draft model and
    its tokenizer (else None, None); a checkpoint that does not load names its flag."""
    import torch

    from mtp.model.checkpoint import load_checkpoint

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        model, tokenizer = load_checkpoint(args.ckpt, device=args.device)
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        p.error(f"--ckpt: {e}")
    draft_model = draft_tokenizer = None
    if draft and args.draft_ckpt is not None:
        try:
            draft_model, draft_tokenizer = load_checkpoint(args.draft_ckpt, device=args.device)
        except (FileNotFoundError, ValueError, RuntimeError) as e:
            p.error(f"--draft-ckpt: {e}")
    return model, tokenizer, draft_model, draft_tokenizer


def text_decoder(tokenizer):
    """Token ids -> text, special tokens left out."""

    def decode(t: list[int]) -> str:
        return tokenizer.decode(t, skip_special_tokens=True)
    return decode


def summary(stats) -> str:
    """One line of a `mtp.decoding.DecodeStats`."""
    return (f"tokens {stats.tokens}  forwards {stats.forwards}  "
            f"L {stats.tokens_per_forward:.2f} tokens/forward  "
            f"{stats.ms_per_token:.2f} ms/token")


# --------------------------------------------------------------------------------------------
# mtp generate


class _Stream:
    """Writes a row's text as tokens arrive, accepted drafts shown apart from verifier tokens.

    Text is decoded from all tokens so far (byte-level BPE: a character may span tokens); a
    partial UTF-8 character (decoded as U+FFFD) is held back until its last byte arrives.
    """

    COLOURS = {"draft": "\033[36m", "end": "\033[0m"}

    def __init__(self, decode, show: str) -> None:
        self.decode, self.show, self.out = decode, show, sys.stdout
        self.tokens: list[int] = []
        self.text = ""

    def _advance(self, tokens: list[int]) -> str:
        self.tokens += tokens
        stable = self.decode(self.tokens).rstrip("\ufffd")
        new = stable[len(self.text):] if stable.startswith(self.text) else ""
        self.text = max(stable, self.text, key=len)
        return new

    def _mark(self, text: str) -> str:
        if not text or self.show == "none":
            return text
        if self.show == "color":
            return f"{self.COLOURS['draft']}{text}{self.COLOURS['end']}"
        return f"[[{text}]]"

    def __call__(self, row: int, tokens: list[int], drafted: int) -> None:
        drafts = self._mark(self._advance(tokens[:drafted]))
        self.out.write(drafts + self._advance(tokens[drafted:]))
        self.out.flush()

    def finish(self, tokens: list[int]) -> None:
        """Write what was held back (a trailing partial character)."""
        self.out.write(self.decode(tokens)[len(self.text):] + "\n")
        self.out.flush()

    def legend(self) -> str:
        if self.show == "color":
            return f"{self._mark('coloured')}: tokens from accepted drafts"
        if self.show == "markers":
            return "[[...]]: tokens from accepted drafts"
        return ""


def generate_main(argv: list[str]) -> int:
    """`mtp generate --ckpt CKPT --prompt TEXT [--decoder D] [--compare greedy]`."""
    p = argparse.ArgumentParser(
        prog="mtp generate",
        description="Decode one prompt from a checkpoint, streaming the text as tokens are "
                    "accepted; tokens from accepted drafts are shown apart.",
    )
    p.add_argument("--ckpt", required=True, help="checkpoint to decode with")
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--decoder", choices=DECODERS, default="greedy", help="decoder")
    p.add_argument("--heads", type=int, default=None,
                   help="heads used by self-spec and tree (default: all K)")
    p.add_argument("--adaptive", action="store_true",
                   help="verify only as many drafts per round as pay (see mtp.decoding.policy)")
    p.add_argument("--compare", choices=["greedy", "none"], default=None,
                   help="rerun the greedy baseline for the speedup and output equality (default: "
                        "greedy for every decoder but greedy)")
    p.add_argument("--show-drafts", choices=["auto", "color", "markers", "none"], default="auto",
                   help="how tokens from accepted drafts are shown: colour on a terminal, "
                        "[[...]] otherwise (auto), or not at all")
    decoding_args(p)
    device_args(p)
    args = p.parse_args(argv)
    tree, problems = check_args(args)
    try:  # a terminal in another encoding: Python keeps the bytes as lone surrogates
        args.prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        problems.append(f"--prompt is not UTF-8 text (character {e.start + 1} is the byte "
                        f"{ord(args.prompt[e.start]) & 0xFF:#04x}); give it in UTF-8")
    request = decode_request(args, decoder=args.decoder, heads=args.heads, tree=tree)
    refuse(p, problems + request_problems([request]))
    model, tokenizer, draft, draft_tokenizer = load(p, args, draft=args.decoder == "draft")
    ids = tokenizer.encode(args.prompt).ids
    refuse(p, request_problems([request], model=model, draft_model=draft, prompts=[ids],
                               tokenizer=tokenizer, draft_tokenizer=draft_tokenizer))
    import torch

    from mtp.decoding.generation import generate
    from mtp.model.vocab import eot_id

    decode = text_decoder(tokenizer)
    show = args.show_drafts
    if show == "auto":
        show = "color" if sys.stdout.isatty() else "markers"
    if args.decoder in ("greedy", "sample"):
        show = "none"
    stream = _Stream(decode, show)
    common = dict(eot_id=eot_id(tokenizer, model.cfg), stop=args.stop, decode=decode)
    sys.stdout.write(args.prompt)
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    out, stats = generate(model, [ids], request.max_new_tokens, **request.arguments(),
                          draft_model=draft, adaptive=args.adaptive, generator=generator,
                          on_tokens=stream, **common)
    stream.finish(out[0])
    if stream.legend():
        print(stream.legend())
    context_len = request.context_len(model, draft)
    if len(out[0]) < args.max_new_tokens and len(ids) + len(out[0]) >= context_len:
        print(f"note: stopped at the context length (--model.max_seq_len {context_len}): "
              f"{len(out[0])} of --max-new-tokens {args.max_new_tokens} new tokens after "
              f"{len(ids)} of the prompt", file=sys.stderr)
    print(f"[{args.decoder}] {summary(stats)}")
    compare = args.compare or ("none" if args.decoder == "greedy" else "greedy")
    if compare == "greedy":
        ref, base = generate(model, [ids], args.max_new_tokens, decoder="greedy", **common)
        equal = ref[0] == out[0]
        print(f"[greedy] {summary(base)}")
        note = ""
        if args.decoder != "greedy" and (args.temperature or args.decoder == "sample"):
            note = " (sampling: equal in distribution, not token for token)"
        print(f"speedup {base.ms_per_token / stats.ms_per_token:.2f}x over greedy; "
              f"outputs equal: {'yes' if equal else 'no'}{note}")
    return 0
