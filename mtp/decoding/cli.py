"""`mtp generate`: decoding one prompt from a checkpoint, and the decoding flags it shares with
`mtp bench decode` (`mtp.bench.decode`).

`mtp generate` streams one completion through `generate`'s streaming hook, the hook `mtp demo`'s
page hears too: the tokens that came from accepted drafts are shown apart from those the verifier
added (each origin in its colour on a terminal, `[[...]]` otherwise) and counted by origin, and
the run ends with tokens, forwards, L, ms/token and the speedup over greedy measured right after.

The decoding flags map to a `mtp.decoding.DecodeRequest`, whose one validator holds every rule of
a request; this module only maps the request's fields to flags (`flag`), so each problem names
its flag. The parser imports nothing heavy, so `--help` answers at once; torch and the model load
when a command runs.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from itertools import groupby

from mtp.decoding.names import DECODERS, DTYPE_NAMES, LINEAR_PATHS, LOOKUP_TOKENS
from mtp.decoding.origin import DRAFT_MODEL, HEAD_1, LOOKUP, ORACLE, origin_name

# --------------------------------------------------------------------------------------------
# Arguments shared by both commands: flags map to a `mtp.decoding.DecodeRequest`, which checks them

#: The flag of each field of a decode request (and of what it is checked against) that is not
#: `--` and the field's name with dashes.
FLAGS = {"model": "--ckpt", "draft_model": "--draft-ckpt", "prompts": "--prompt"}


def flag(field: str) -> str:
    """The flag of a field of `mtp.decoding.DecodeRequest`, for its messages
    (`RequestError.messages(flag)`)."""
    return FLAGS.get(field) or "--" + field.replace("_", "-")


def device_args(p: argparse.ArgumentParser, *, several_dtypes: bool = False) -> None:
    p.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's choice)")
    p.add_argument("--dtype", default="fp32",
                   help=f"the dtype to decode in: {' or '.join(DTYPE_NAMES)} (bf16 where the CPU "
                        "multiplies bf16 natively: avx512_bf16 or AMX)"
                        + ("; comma-separated, each a set of rows (fp32,bf16)"
                           if several_dtypes else "") + " (default: fp32)")
    p.add_argument("--linear-path", choices=("auto", *LINEAR_PATHS), default="auto",
                   help="the product of every linear layer on a CPU: auto (the fastest per weight "
                        "shape, measured once per machine and cached), or one forced "
                        "(mtp.decoding.arithmetic)")


def dtypes(args: argparse.Namespace) -> list[str]:
    """`--dtype` as a list of names."""
    return [d.strip() for d in args.dtype.split(",") if d.strip()]


def linear_path(args: argparse.Namespace) -> str | None:
    """`--linear-path` as `mtp.decoding.arithmetic.decode_linears` takes it."""
    return None if args.linear_path == "auto" else args.linear_path


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


def threads_problem(threads: int | None) -> str | None:
    """What is wrong with `--threads`, or None: at least one, and no more than the CPUs this
    process may run on (more only compete for them, and torch fails to start tens of
    thousands)."""
    import os

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if threads is not None and not 1 <= threads <= (cpus or 1):
        return f"--threads must be in [1, {cpus}], the CPUs this process may run on (got " \
               f"{threads})"
    return None


def dtype_problems(args: argparse.Namespace, *, several: bool = False) -> list[str]:
    """What is wrong with `--dtype` on `--device` (a dtype the CPU does not multiply natively
    included); with `several`, a comma-separated list is allowed."""
    from mtp.decoding.arithmetic import decode_dtype

    names = dtypes(args)
    if not names or len(names) != len(set(names)) or len(names) > 1 and not several:
        return [f"--dtype {args.dtype!r}: give one of {', '.join(DTYPE_NAMES)}"
                + (", or several, each once" if several else "")]
    problems = []
    for name in names:
        try:
            decode_dtype(name, args.device)
        except ValueError as e:
            problems.append(str(e))
    return problems


def check_args(args: argparse.Namespace, *, several_dtypes: bool = False):
    """The flags beside a request's, before anything loads: `--tree` as a `mtp.decoding.Tree`
    or `DynamicTree` (None where it is refused) and the problems of `--tree`, `--threads`,
    `--seed`, `--device` and `--dtype` (`several_dtypes`: a list of them)."""
    import torch

    from mtp.config import seed_problem
    from mtp.decoding.tree import MAX_TREE_NODES, DynamicTree, Tree

    problems = []
    if (problem := threads_problem(args.threads)) is not None:
        problems.append(problem)
    if (problem := seed_problem("--seed", args.seed)) is not None:
        problems.append(problem)
    try:
        torch.device(args.device)
    except RuntimeError as e:
        problems.append(f"--device {args.device!r}: {e}")
    else:
        problems += dtype_problems(args, several=several_dtypes)
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
    its tokenizer (else None, None), in the first `--dtype`; a checkpoint that does not load
    names its flag."""
    import torch

    from mtp.decoding.arithmetic import DTYPES, to_decode_dtype
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
    dtype = DTYPES[dtypes(args)[0]]
    for m in (model, draft_model):
        if m is not None:
            to_decode_dtype(m, dtype)
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
    """Writes a row's text as tokens arrive, each token shown by its origin: the verifier's plain,
    accepted drafts in their origin's colour on a terminal, between `[[` and `]]` otherwise.
    It hears the tokens through `generate`'s streaming hook (`on_tokens`), as `mtp demo`'s page
    does, and counts them by origin, so the terminal and the page tell the same story.

    Text is decoded from all tokens so far (byte-level BPE: a character may span tokens); a
    partial UTF-8 character (decoded as U+FFFD) is held back until its last byte arrives.
    """

    #: ANSI colours by origin, the hues of `mtp demo`'s page; heads past 4 share one.
    COLOURS = {2: "\033[36m", 3: "\033[32m", 4: "\033[33m", LOOKUP: "\033[34m",
               DRAFT_MODEL: "\033[35m", ORACLE: "\033[90m"}
    MORE_HEADS, END = "\033[95m", "\033[0m"

    def __init__(self, decode, show: str) -> None:
        self.decode, self.show, self.out = decode, show, sys.stdout
        self.tokens: list[int] = []
        self.text = ""
        self.counts: Counter[int] = Counter()

    def _advance(self, tokens: list[int]) -> str:
        self.tokens += tokens
        stable = self.decode(self.tokens).rstrip("\ufffd")
        new = stable[len(self.text):] if stable.startswith(self.text) else ""
        self.text = max(stable, self.text, key=len)
        return new

    def _colour(self, origin: int) -> str:
        return self.COLOURS.get(origin, self.MORE_HEADS)

    def __call__(self, row: int, tokens: list[int], origins: list[int]) -> None:
        self.counts.update(origins)
        # Runs of one origin in colour; with markers, a round's drafts as one run.
        key = (lambda o: o) if self.show == "color" else (lambda o: o != HEAD_1)
        start, parts = 0, []
        for _, run in groupby(origins, key=key):
            n = len(list(run))
            text, origin = self._advance(tokens[start : start + n]), origins[start]
            start += n
            if not text or origin == HEAD_1 or self.show == "none":
                parts.append(text)
            elif self.show == "color":
                parts.append(f"{self._colour(origin)}{text}{self.END}")
            else:
                parts.append(f"[[{text}]]")
        self.out.write("".join(parts))
        self.out.flush()

    def finish(self, tokens: list[int]) -> None:
        """Write what was held back (a trailing partial character)."""
        self.out.write(self.decode(tokens)[len(self.text):] + "\n")
        self.out.flush()

    def by_origin(self) -> str:
        """The tokens counted by origin, head 1 first, in the colours of the text."""
        names = []
        for origin in sorted(self.counts, key=lambda o: (o < HEAD_1, abs(o))):
            name = origin_name(origin)
            if self.show == "color" and origin != HEAD_1:
                name = f"{self._colour(origin)}{name}{self.END}"
            names.append(f"{name} {self.counts[origin]}")
        return "tokens by origin: " + ", ".join(names)

    def legend(self) -> str:
        if self.show == "color":
            return f"coloured: tokens from accepted drafts; {self.by_origin()}"
        if self.show == "markers":
            return f"[[...]]: tokens from accepted drafts; {self.by_origin()}"
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
    p.add_argument("--draft-int8", action="store_true",
                   help="heads 2..h draft with 8-bit integer products on the CPU (self-spec "
                        "and tree; the output is unchanged)")
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
    request = decode_request(args, decoder=args.decoder, heads=args.heads, tree=tree,
                             draft_int8=args.draft_int8)
    refuse(p, problems + request_problems([request]))
    model, tokenizer, draft, draft_tokenizer = load(p, args, draft=args.decoder == "draft")
    ids = tokenizer.encode(args.prompt).ids
    refuse(p, request_problems([request], model=model, draft_model=draft, prompts=[ids],
                               tokenizer=tokenizer, draft_tokenizer=draft_tokenizer))
    import torch

    from mtp.decoding.arithmetic import decode_linears
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
    with decode_linears(model, draft, path=linear_path(args)) as used:
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
    print(f"{args.dtype}, linear paths: {used}")
    compare = args.compare or ("none" if args.decoder == "greedy" else "greedy")
    if compare == "greedy":
        with decode_linears(model, path=linear_path(args)):
            ref, base = generate(model, [ids], args.max_new_tokens, decoder="greedy", **common)
        equal = ref[0] == out[0]
        print(f"[greedy] {summary(base)}")
        note = ""
        if args.decoder != "greedy" and (args.temperature or args.decoder == "sample"):
            note = " (sampling: equal in distribution, not token for token)"
        print(f"speedup {base.ms_per_token / stats.ms_per_token:.2f}x over greedy; "
              f"outputs equal: {'yes' if equal else 'no'}{note}")
    return 0
