"""`mtp bench loss | train | kernel | decode | tokenize | sandbox`: tables of memory and
speed, ratios from one run.

loss      peak memory and time of the loss path (trunk output -> heads -> loss -> dL/dh) for
          the naive pass, the sequential pass with an unfused cross-entropy, and the sequential
          pass with the fused kernel, over K; on CUDA also the sequential pass with torch's own
          `linear_cross_entropy`, Liger-Kernel and cut-cross-entropy when installed.
train     time of a whole training step (forward, backward, AdamW) at matched parameters over
          K, beside the FLOP model's ratio (`MTPTransformer.flops_per_token`) and the FLOP/s.
kernel    the fused linear cross-entropy alone against the alternatives.
decode    the decoders over a prompt set.
tokenize  tokenising a local corpus with 1 and 2 worker processes.
sandbox   scoring reference solutions under each isolation (bubblewrap, unshare, a bare process).

Every table is printed and appended to a CSV whose rows carry the command that made them, the
hardware, versions and git revision (`mtp.bench.report`). This module only parses the command
line (so `--help` answers at once); each benchmark's module is imported when it runs. The
benchmarks sit above every stage and may import any.
"""

from __future__ import annotations

import argparse
import importlib
import shlex
import sys
from pathlib import Path

from mtp.config import HEAD_TYPES
from mtp.decoding.names import DECODERS

__all__ = ["PROMPT_TOKENS", "TRANSFORMERS_DECODERS", "comma_ints", "main", "parser"]

#: transformers' decoders `mtp bench decode --transformers` times beside mtp's (`mtp.bench.decode`).
TRANSFORMERS_DECODERS = ("greedy", "prompt-lookup")

#: Tokens of a prompt of `mtp bench decode --prompts validation` (`--prompt-tokens`).
PROMPT_TOKENS = 128

# subcommand (and its module under mtp.bench): help line
_BENCHMARKS = {
    "loss": "loss-path peak memory and time over K",
    "train": "training-step time over K at matched parameters, against the FLOP model's ratio",
    "kernel": "the fused linear cross-entropy alone against the alternatives",
    "decode": "speed and acceptance of every decoder over a prompt set, against greedy",
    "tokenize": "tokenising a local corpus over worker counts: bytes/s and peak memory",
    "sandbox": "scoring reference solutions under each isolation that works here",
}


def comma_ints(text: str) -> list[int]:
    """An argparse type: comma-separated integers, e.g. `1,2,4`."""
    try:
        return [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers (got {text!r})")


def _timing_args(p: argparse.ArgumentParser, warmup: int, reps: int) -> None:
    p.add_argument("--warmup", type=int, default=warmup, help="untimed calls first")
    p.add_argument("--reps", type=int, default=reps, help="timed calls; the median is reported")


def _loss_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--n", type=int, default=None, help="tokens N (default: 16384 on CUDA, 4096)")
    p.add_argument("--d", type=int, default=None, help="width d (default: 4096 on CUDA, 512)")
    p.add_argument("--vocab", type=int, default=None,
                   help="vocabulary V (default: 128256 on CUDA, 32768)")
    p.add_argument("--seq-len", type=int, default=2048, help="T; the batch is N / T sequences")
    p.add_argument("--ks", type=comma_ints, default=[1, 2, 4, 8], help="values of K, e.g. 1,2,4,8")
    p.add_argument("--methods", default=None, help="subset, e.g. naive,sequential+fused")
    p.add_argument("--head-type", default="block", choices=HEAD_TYPES,
                   help="the heads' design (--model.head_type)")
    p.add_argument("--max-naive-gib", type=float, default=16.0,
                   help="skip naive configurations estimated to need more memory")
    p.add_argument("--fsdp", type=int, default=1, metavar="RANKS",
                   help="shard the heads with FSDP2 over this many processes (gloo on CPU, "
                        "one GPU each on CUDA); N tokens per rank, the worst rank reported")


def _train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="cpu", help="registry name (mtp.config.MODEL_REGISTRY)")
    p.add_argument("--n-layers", type=int, default=None,
                   help="blocks of the K = 1 trunk (default: the registry's); K - 1 move to heads")
    p.add_argument("--ks", type=comma_ints, default=[1, 2, 4])
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--loss", choices=["sequential", "naive"], default="sequential")
    p.add_argument("--compile", choices=["off", "on", "both"], default="off",
                   help="torch.compile the blocks (`--compile.enabled`), or run both ways")


def _kernel_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shapes", default=None,
                   help="N,d,V[;N,d,V...] (default: two shapes chosen for the device)")
    p.add_argument("--impls", default=None, help="comma-separated subset of implementations")
    p.add_argument("--sweep", action="store_true", help="tile sweep of the Triton kernels")


def _decode_args(p: argparse.ArgumentParser) -> None:
    from mtp.decoding.cli import decoding_args, device_args

    p.add_argument("--ckpt", required=True, help="checkpoint to decode with")
    p.add_argument("--prompts", default="humaneval",
                   help="comma-separated prompt sources: humaneval (default), mbpp=FILE (MBPP's "
                        "test split from a local file, as `mtp eval mbpp --data-file`), a .jsonl "
                        "file with a 'prompt' field, a text file, or validation: windows of "
                        "--prompt-tokens tokens of the checkpoint's validation text (the data of "
                        "the config.yaml `mtp fit` saved in its run folder; validation=CONFIG.yaml "
                        "takes another fit config's data, validation=SOURCE another source, as "
                        "--data.source takes it), with the simulated L of the text after each")
    p.add_argument("--prompt-format", choices=("raw", "chat"), default="raw",
                   help="benchmark prompts as `mtp eval` builds them by default (raw), or in the "
                        "model's chat template (chat, as `mtp eval --prompt-format chat`)")
    p.add_argument("--limit", type=int, default=None,
                   help="use the first N prompts of each source only; of validation, N windows "
                        "spread evenly over the split (default: every window, end to end)")
    p.add_argument("--prompt-tokens", type=int, default=None, metavar="N",
                   help=f"tokens of each validation prompt (default {PROMPT_TOKENS}); the "
                        "--max-new-tokens after it in the text are its continuation")
    p.add_argument("--decoders", default="greedy,self-spec,tree,draft",
                   help="comma-separated decoders from " + ", ".join(DECODERS) + " (greedy "
                        "always runs: it is the reference); draft runs only with --draft-ckpt")
    p.add_argument("--heads", type=comma_ints, default=None,
                   help="heads used by self-spec and tree, comma-separated (default: 2..K)")
    p.add_argument("--oracle", action="store_true",
                   help="also draft the tokens greedy emits, h - 1 per round for each "
                        "--heads h: an upper bound that measures the loop's own cost")
    p.add_argument("--lookup-whole", action="store_true",
                   help="with --lookup beside a dynamic tree, also run each such row verifying "
                        "lookup's whole continuation every round, instead of the tokens worth "
                        "their forward time: the ablation of sizing the branch")
    p.add_argument("--lookup-pooled", action="store_true",
                   help="with --lookup beside a dynamic tree, also run each such row learning "
                        "what lookup's tokens add over all rounds alike, instead of per kind of "
                        "match: the ablation of learning it per kind")
    p.add_argument("--draft-int8", action="store_true",
                   help="also run each row of the heads (self-spec, tree, and their lookup "
                        "rows) drafting with 8-bit integer products (generate's draft_int8)")
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
    p.add_argument("--dynamic-tree", type=int, default=0, metavar="NODES",
                   help="also run a tree grown each round where the heads are sure, of at most "
                        "NODES nodes, sized by this machine's measured forward time (0: no)")
    p.add_argument("--calib-prompts", type=int, default=10,
                   help="prompts whose greedy continuations calibrate the auto tree")
    p.add_argument("--warmup", type=int, default=1, help="untimed prompts before measuring")
    p.add_argument("--transformers", default="", metavar="DECODERS",
                   help="also time transformers' generate on the same weights (head 1 as a "
                        "LlamaForCausalLM, mtp.model.llama_layout), comma-separated from "
                        + ", ".join(TRANSFORMERS_DECODERS) + "; greedy, one prompt at a time; "
                        "its prompt-lookup takes --lookup and --lookup-ngram as mtp's lookup does "
                        "(prompt_lookup_num_tokens, max_matching_ngram_size)")
    decoding_args(p)
    device_args(p, several_dtypes=True)


def _tokenize_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size-mb", type=float, default=1024,
                   help="corpus size in MiB (default 1024)")
    p.add_argument("--dir", default=".mtp_cache/bench_tokenize",
                   help="where the corpus, tokenizer and (while a run lasts) shards live")
    p.add_argument("--workers", type=comma_ints, default=[1, 2],
                   help="worker counts, e.g. 1,2")
    p.add_argument("--vocab", type=int, default=4096, help="vocabulary of the trained BPE")
    p.add_argument("--tokenizer", default=None, help="a tokenizer.json instead of training")
    p.add_argument("--tokenizer-train-mb", type=float, default=8,
                   help="MiB of the corpus the BPE is trained on")
    p.add_argument("--keep-shards", action="store_true", help="keep each run's shards")


def _sandbox_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--benchmark", default="humaneval",
                   choices=("humaneval", "humaneval+", "mbpp", "mbpp-sanitized", "mbpp+"))
    p.add_argument("--data-file", default=None, help="the benchmark's data file (default: "
                   "the local copy, else the Hub)")
    p.add_argument("--limit", type=int, default=None, help="first N tasks only")
    p.add_argument("--rounds", type=int, default=3, help="runs of each mode")
    p.add_argument("--workers", type=int, default=None, help="parallel sandboxes (default: "
                   "half the cores)")


def parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The `mtp bench` command line and its subcommands' parsers, one per benchmark."""
    top = argparse.ArgumentParser(prog="mtp bench", description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = top.add_subparsers(dest="what", required=True, metavar="{" + ",".join(_BENCHMARKS) + "}")
    adders = {"loss": _loss_args, "train": _train_args, "kernel": _kernel_args,
              "decode": _decode_args, "tokenize": _tokenize_args, "sandbox": _sandbox_args}
    subs = {}
    for name, help_line in _BENCHMARKS.items():
        p = subs[name] = sub.add_parser(name, help=help_line, description=help_line + ".")
        adders[name](p)
        if name in ("loss", "train", "kernel"):
            p.add_argument("--device", default=None, help="torch device (default: cuda when "
                           "available, else cpu)")
            p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"] if name == "kernel"
                           else ["fp32", "bf16"], default=None,
                           help="default: bf16 on CUDA, fp32 on CPU")
            _timing_args(p, warmup=2 if name == "kernel" else 1, reps=5 if name == "kernel"
                         else 3)
        p.add_argument("--csv", default=f"bench_results/{name}.csv", help="CSV to append to")
    return top, subs


def main(argv: list[str] | None = None) -> int:
    """`mtp bench <what> ...`: parse, then run `mtp.bench.<what>.run(parser, args)`."""
    argv = sys.argv[1:] if argv is None else list(argv)
    workers = {"_loss_worker": "loss", "_tokenize_run": "tokenize"}
    if argv[:1] and argv[0] in workers:  # internal: one run in a fresh process, which imports
        # its own benchmark only (the tokenize run's peak memory must not include torch's)
        return importlib.import_module(f"mtp.bench.{workers[argv[0]]}").worker(argv[1])
    top, subs = parser()
    args = top.parse_args(argv)
    # found before the benchmark runs, not when it ends
    from mtp.util.atomic import check_writable
    from mtp.util.paths import not_a_file

    problem = not_a_file(args.csv)
    if problem not in (None, "does not exist"):
        subs[args.what].error(f"--csv {args.csv} {problem}; give the .csv file to append to")
    check_writable(Path(args.csv).parent, "the folder of --csv")
    args.command = shlex.join(["mtp", "bench", *argv])
    module = importlib.import_module(f"mtp.bench.{args.what}")
    return module.run(subs[args.what], args)
