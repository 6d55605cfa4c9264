"""`mtp distill`: a self-distillation corpus, the model's own answers to coding requests.

Heads drafting for an instruct model must predict what that model writes when it answers, in its
chat template: code in a fence, prose around it. Medusa trains its heads on the base model's own
responses for that reason. The requests come from the Python standard library (each public function
with a docstring becomes "write this function" with its signature and docstring), so nothing is
downloaded and no benchmark task is among them; the model answers each greedily, `--batch-size` at
once. `--style benchmark` words them as `mtp eval --prompt-format chat` asks the benchmarks' tasks
(EvalPlus's request around the function's stub, or for every other function Austin et al.'s MBPP
wording, its doctest examples as the asserts), so the heads learn the answers they will draft at
evaluation. Every line of the output is ``{"text": prompt + answer, "request": ..., "finished":
...}``, the text as the model saw and wrote it, for `mtp fit --data.source FILE --data.text_field
text` with `--loss.targets greedy` (where the text follows the model's greedy path, which is nearly
everywhere in its own answers, every head learns the exact token speculation accepts). `--style
continue` asks no chat at all: the model continues windows of the code itself, every prompt of one
length, so more of the machine's time goes to new tokens. `--style mbpp-train` asks the tasks of
MBPP's training split (ids 601-974 of `--tasks mbpp.jsonl`) in `mtp eval --prompt-format chat`'s
words: requests written by people, as the benchmarks' are, which no evaluation reads (MBPP's test
split is ids 11-510). Requests are answered shortest prompt first, `--batch-size` rows decoding at
once, and as rows end the next requests join in their places, prefilled a few at a time (continuous
batching, `mtp.decoding.engine.run`), so that the rounds run full rows to the last requests;
requests of similar length prefill together, in few forwards (a forward pads its prompts to the
longest of them: `mtp.decoding.engine.length_groups`). Every `--batch-size` answers, a line prints
the new tokens per second so far and the rate of the model's useful arithmetic; the end of a run
prints that rate against one batched forward of the same model on the same machine. `--dtype bf16`
on a CPU with bf16 products multiplies in bf16 and attends in fp32
(`mtp.decoding.engine.new_cache`); its answers are the bf16 model's, of which `--loss.targets
greedy` trains on the positions where they follow the fp32 model's greedy path.

Each answer's line is appended as soon as the answer ends, in one write, and fsynced
(`mtp.util.atomic.AppendOnlyFile`); a rerun answers the requests whose prompt no line begins with,
so an interrupted run loses only the answers under way, whatever `--requests` the rerun has, and a
write that fails (a full disk, a read-only folder) is named and leaves the earlier lines as they
were. One run at a time writes an `--out` file: a second one started meanwhile is refused.
"""

from __future__ import annotations

import argparse
import ast
import bisect
import json
import random
import sys
import sysconfig
import time
from pathlib import Path

__all__ = ["STYLES", "main", "requests"]

_REQUEST = "Write a Python function `{name}({args})` that does the following:\n\n{doc}"
STYLES = ("write", "benchmark", "continue", "mbpp-train")


def _benchmark_request(node: ast.FunctionDef, doc: str, mbpp: bool) -> str:
    """The request in the words `mtp eval --prompt-format chat` uses for a benchmark's task:
    HumanEval's (the stub to complete) or, with `mbpp`, MBPP's (the asserts from the docstring's
    doctest examples, where it has any)."""
    import doctest

    from mtp.eval.data import Task
    from mtp.eval.prompts import chat_request

    examples = [e for e in doctest.DocTestParser().get_examples(doc)
                if e.want.strip() and node.name in e.source and "\n" not in e.source.strip()]
    if mbpp:
        sentence = doc.strip().split("\n\n")[0].replace("\n", " ")
        asserts = tuple(f"assert {e.source.strip()} == {e.want.strip()}" for e in examples[:3])
        task = Task(task_id=node.name, prompt=f"Write a function {node.name}() that: {sentence}",
                    entry_point=node.name, canonical_solution="", test="",
                    completes_prompt=False, examples=asserts)
    else:
        body = "\n".join(f"    {line}" if line else "" for line in doc.strip().splitlines())
        stub = f'def {node.name}({ast.unparse(node.args)}):\n    """{body.lstrip()}\n    """\n'
        task = Task(task_id=node.name, prompt=stub, entry_point=node.name,
                    canonical_solution="", test="", completes_prompt=True)
    return chat_request(task)


def requests(root: Path, n: int, seed: int, style: str = "write") -> list[str]:
    """n requests from the public top-level functions of the .py files under `root` that have a
    docstring, in a seeded random order: "write function f(args) that: docstring", or in
    `benchmark` style the benchmarks' chat wording (`_benchmark_request`)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if any(part in ("test", "tests", "idlelib", "site-packages") for part in path.parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if doc and len(doc) >= 40:
                paragraph = doc.strip().split("\n\n")[0]
                if style == "benchmark":
                    found.append(_benchmark_request(node, doc, mbpp=len(found) % 2 == 1))
                else:
                    found.append(_REQUEST.format(name=node.name, args=ast.unparse(node.args),
                                                 doc=paragraph))
    found = sorted(set(found))
    random.Random(seed).shuffle(found)
    return found[:n]


def prefixes(root: Path, n: int, seed: int, tokenize, length: int) -> list[list[int]]:
    """n windows of `length` tokens of the .py files under `root`, at most one every
    4 * `length` tokens of a file, in a seeded random order: prompts for `--style continue`,
    which asks for no chat at all and gives every prompt of a batch the same length."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if any(part in ("test", "tests", "idlelib", "site-packages") for part in path.parts):
            continue
        try:
            ids = tokenize(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, ValueError, OSError):
            continue
        found += [ids[i:i + length] for i in range(0, len(ids) - length + 1, 4 * length)]
    random.Random(seed).shuffle(found)
    return found[:n]


def _load(model_arg: str, max_seq_len: int):
    """An mtp checkpoint or export, or a pretrained model (`--model.init_from`'s forms)."""
    from mtp.config import ModelConfig
    from mtp.data.bpe import load_tokenizer
    from mtp.interop.hf_import import pretrained_config, pretrained_tokenizer, resolve_pretrained
    from mtp.model.checkpoint import is_export, load_checkpoint
    from mtp.model.transformer import build_model

    path = resolve_pretrained(model_arg)
    if path.suffix in (".ckpt", ".pt") or is_export(path):
        return load_checkpoint(path)
    from mtp.interop.hf_import import init_from_pretrained

    cfg = pretrained_config(path, ModelConfig(n_future=1, max_seq_len=max_seq_len))
    model = build_model(cfg)
    init_from_pretrained(model)
    return model.eval(), load_tokenizer(pretrained_tokenizer(cfg.init_from))


def _answered(out: Path, texts: list[str]) -> list[bool]:
    """Which of `texts` (the prompts as the model sees them) `out` already answers: a line whose
    text begins with the prompt. A rerun thus goes on with the rest, in whatever order and with
    whatever --requests the earlier run had."""
    if not out.exists():
        return [False] * len(texts)
    lines = sorted(json.loads(line)["text"] for line in out.read_text(encoding="utf-8")
                   .splitlines() if line.strip())
    # the first line >= a prompt in sort order is the one that begins with it, if any does
    found = [bisect.bisect_left(lines, t) for t in texts]
    return [j < len(lines) and lines[j].startswith(t) for j, t in zip(found, texts)]


class _Meter:
    """New tokens per second, and the rate of the model's useful arithmetic: 2 FLOPs per weight
    of the trunk and head 1 for every prompt and new token, and 2 per weight of the unembedding
    for every new one (attention, padding and finished rows left out)."""

    def __init__(self, model) -> None:
        self.trunk = 2 * sum(p.numel() for part in (model.blocks, model.heads[0])
                             for p in part.parameters() if p.dim() > 1)
        self.unembed = 2 * model.unembed.weight.numel()
        self.prompt = self.new = self.answers = 0
        self.began = time.perf_counter()

    def add(self, prompts: list[int], new: list[int]) -> None:
        self.prompt, self.new = self.prompt + sum(prompts), self.new + sum(new)
        self.answers += len(new)

    @property
    def flops(self) -> float:
        return self.trunk * (self.prompt + self.new) + self.unembed * self.new

    def __str__(self) -> str:
        seconds = time.perf_counter() - self.began
        return (f"{self.new / seconds:.0f} new tokens/s, {self.flops / seconds / 1e9:.3g} "
                "GFLOP/s")

    def summary(self) -> str:
        seconds = time.perf_counter() - self.began
        return (f"{self.new} new tokens after {self.prompt} prompt tokens in {seconds:.0f} s: "
                f"{self}")


def _peak(model, meter: _Meter, rows: int = 16, length: int = 128) -> str:
    """The rate of one batched forward of the model over `rows` x `length` tokens, no cache, as
    a reference for what the machine can do with these weights, and the run's share of it."""
    import torch

    from mtp.decoding.arithmetic import decode_linears
    from mtp.decoding.engine import new_cache, prefill

    prompts = [[0] * length] * rows
    with torch.no_grad(), decode_linears(model):
        prefill(model, new_cache(model, 1, 8), [[0] * 8])  # warm-up: the weights' packing
        began = time.perf_counter()
        prefill(model, new_cache(model, rows, length), prompts)
        seconds = time.perf_counter() - began
    rate = meter.trunk * rows * length / seconds  # the prefill unembeds no position
    return (f"{100 * meter.flops / (time.perf_counter() - meter.began) / rate:.0f}% of a "
            f"batched forward's {rate / 1e9:.3g} GFLOP/s over {rows} x {length} tokens here")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="mtp distill", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True,
                   help="an mtp checkpoint or export, a transformers directory, a .gguf file or "
                        "package:PKG/FILE")
    p.add_argument("--out", required=True, help="the .jsonl file to write (appended, resumable)")
    p.add_argument("--requests", type=int, default=512, help="requests to answer")
    p.add_argument("--source", default=sysconfig.get_paths()["stdlib"],
                   help="directory whose .py files' documented functions become the requests "
                        "(default: the Python standard library)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="longest answer, in tokens")
    p.add_argument("--batch-size", type=int, default=16,
                   help="requests decoding at once (the next joins as one ends)")
    p.add_argument("--seed", type=int, default=0, help="order of the requests")
    p.add_argument("--style", choices=STYLES, default="write",
                   help="requests as 'write this function' with its docstring, or in the words "
                        "mtp eval --prompt-format chat uses for HumanEval and MBPP tasks; or "
                        "`continue`: no request, the model's continuation of --prefix-tokens "
                        "tokens of the --source files' code")
    p.add_argument("--tasks", default=None,
                   help="with --style mbpp-train: the full mbpp.jsonl, whose training split "
                        "(ids 601-974) becomes the requests")
    p.add_argument("--prefix-tokens", type=int, default=128,
                   help="with --style continue: the tokens of code each continuation follows")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                   help="the dtype to decode in (bf16 where the CPU multiplies it natively; "
                        "mtp.decoding.arithmetic)")
    args = p.parse_args(argv)
    for flag in ("requests", "max_new_tokens", "batch_size", "prefix_tokens"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1 (got {getattr(args, flag)})")
    from mtp.decoding.cli import threads_problem

    if (problem := threads_problem(args.threads)) is not None:
        p.error(problem)
    from mtp.decoding.arithmetic import decode_dtype, to_decode_dtype

    try:
        dtype = decode_dtype(args.dtype)
    except ValueError as err:
        p.error(str(err))
    source = Path(args.source)
    if not source.is_dir():
        p.error(f"--source {source} is not a directory")
    out = Path(args.out)
    if out.is_dir():
        p.error(f"--out {out} is a directory; give the .jsonl file to write")
    if (args.tasks is None) == (args.style == "mbpp-train"):
        p.error("--tasks goes with --style mbpp-train, and --style mbpp-train needs --tasks")
    if args.style == "mbpp-train":
        from mtp.eval.data import DataError, mbpp_train_tasks
        from mtp.eval.prompts import chat_request

        try:
            tasks = mbpp_train_tasks(args.tasks)
        except DataError as err:
            p.error(f"--tasks: {err}")
        random.Random(args.seed).shuffle(tasks)
        todo = [chat_request(t) for t in tasks[: args.requests]]
    else:
        todo = [] if args.style == "continue" else requests(source, args.requests, args.seed,
                                                             args.style)
    if not todo and args.style not in ("continue", "mbpp-train"):
        p.error(f"--source {source} has no documented public functions")

    import torch

    from mtp.decoding.generation import generate
    from mtp.eval.chat import ChatTemplate
    from mtp.model.memory import check_memory, inference_need
    from mtp.model.vocab import eot_id
    from mtp.util.atomic import AppendOnlyFile
    from mtp.util.environment import available_memory
    from mtp.util.errors import ConfigError, ExportError, WriteError

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        model, tokenizer = _load(args.model, max_seq_len=2048)
    except ExportError as err:  # a pretrained model that cannot be read; the message says why
        p.error(f"--model {str(err).removeprefix('--model.init_from ')}")
    to_decode_dtype(model, dtype)
    cfg = model.cfg
    if args.style == "continue":
        todo = prefixes(source, args.requests, args.seed, lambda t: tokenizer.encode(t).ids,
                        args.prefix_tokens)
        if not todo:
            p.error(f"--source {source} has no file of --prefix-tokens {args.prefix_tokens} "
                    "tokens or more")
        texts = [tokenizer.decode(ids, skip_special_tokens=False) for ids in todo]
        prompts, requests_of = todo, [None] * len(todo)
    else:
        if not cfg.chat_template:
            p.error(f"--model {args.model} has no chat template to put the requests in")
        chat = ChatTemplate(cfg.chat_template, eos_token=cfg.eot_token)
        texts = [chat.render([{"role": "user", "content": r}]) for r in todo]
        prompts, requests_of = [tokenizer.encode(x).ids for x in texts], todo
    rows = min(args.batch_size, len(todo))  # the most prompts decoded at once
    try:
        longest = max(map(len, prompts))  # the cache a batch decodes over holds its longest
        check_memory(lambda c, sizes: inference_need(
                         c, batch_size=sizes["--batch-size"], prompt_len=longest,
                         seq_len=longest + sizes["--max-new-tokens"] + 1), cfg,
                     {"--batch-size": rows, "--max-new-tokens": args.max_new_tokens},
                     available_memory("cpu"),
                     doing=f"decoding {rows} prompts at once", where="on the CPU")
    except ConfigError as err:
        p.error(str(err))
    eot = eot_id(tokenizer, cfg)
    try:
        # the lines are counted to resume: two runs appending at once would break the count
        f = AppendOnlyFile(out, "the distilled corpus", exclusive=True)
    except BlockingIOError:
        p.error(f"--out {out} is being written by another mtp distill; wait for it to end, "
                "or choose another --out")
    except WriteError as err:
        p.error(f"--out: {err}")
    with f:
        done = _answered(out, texts)
        # Shortest first: the prompts that join the batch together are of about one length.
        order = sorted((i for i in range(len(texts)) if not done[i]),
                       key=lambda i: len(prompts[i]))
        meter = _Meter(model)
        before = sum(done)

        def write(row: int, ids: list[int]) -> None:  # an answer ended: its line, now
            i = order[row]
            finished = bool(ids) and ids[-1] == eot
            answer = tokenizer.decode(ids[:-1] if finished else ids, skip_special_tokens=False)
            try:
                f.append(json.dumps({"text": texts[i] + answer, "request": requests_of[i],
                                     "finished": finished}) + "\n")
            except WriteError as err:
                p.error(f"--out: {err}; the {before + meter.answers} answers before are kept, "
                        "and the same command goes on with the requests not yet answered")
            meter.add([len(prompts[i])], [len(ids)])
            if meter.answers % args.batch_size == 0 or meter.answers == len(order):
                print(f"{before + meter.answers}/{len(todo)} requests answered, {meter}",
                      file=sys.stderr, flush=True)

        if order:
            with torch.no_grad():
                generate(model, [prompts[i] for i in order], args.max_new_tokens,
                         decoder="greedy", eot_id=eot, max_batch=args.batch_size, on_end=write)
            print(f"{meter.summary()} ({_peak(model, meter)})", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
