"""The `mtp` command: one line per subcommand, each imported only when it runs, so that
`mtp --help` answers at once (torch and Lightning take seconds to import).

    mtp fit | validate | generate | eval | bench | export | distill | lm-eval ...
"""

from __future__ import annotations

import sys

COMMANDS = {
    "fit": "train a model (LightningCLI; `mtp fit --help`)",
    "validate": "evaluate a checkpoint's validation loss (LightningCLI)",
    "generate": "decode from a checkpoint with any decoder",
    "eval": "HumanEval / MBPP: generate or score completions, pass@k",
    "bench": "benchmarks: loss | train | kernel | decode | tokenize | sandbox",
    "export": "write a checkpoint for transformers (`export hf`) or vLLM Medusa (`export medusa`)",
    "distill": "a self-distillation corpus: the model's own answers to coding requests",
    "lm-eval": "EleutherAI's lm-evaluation-harness with the `mtp` model (`--model mtp`)",
}


def main(argv: list[str] | None = None) -> int:
    """Dispatch `mtp <command> ...`. A user's mistake (`mtp.config.UserError`) is reported in a
    line or two and exits 2, a Ctrl-C in a line and exit status 130 (`mtp fit` keeps what it
    can, `mtp.fault`); `--debug` anywhere on the line shows the traceback instead."""
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in argv
    if debug:
        argv = [a for a in argv if a != "--debug"]
    try:
        return _dispatch(argv)
    except Exception as err:
        from mtp.config import UserError

        if debug or not isinstance(err, UserError):
            raise
        print(f"mtp {argv[0]}: error: {err}\n(--debug shows where it was raised)",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"\nmtp {argv[0]}: interrupted", file=sys.stderr)
        return 130


def _dispatch(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: mtp <command> [args]\n\ncommands:")
        for name, doc in COMMANDS.items():
            print(f"  {name:<9} {doc}")
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd in ("fit", "validate"):
        if rest in (["--help"], ["-h"]):
            from mtp.fit_help import stored_help

            text = stored_help(cmd)
            if text is not None:
                print(text, end="")
                return 0
        from mtp.fit_cli import fit_main

        return fit_main(argv)
    if cmd == "generate":
        from mtp.decode_cli import generate_main

        return generate_main(rest)
    if cmd == "eval":
        from mtp.eval.cli import main as eval_main

        return eval_main(rest)
    if cmd == "bench":
        from mtp.bench import main as bench_main

        return bench_main(rest)
    if cmd == "export":
        return _export(rest)
    if cmd == "distill":
        from mtp.distill import main as distill_main

        return distill_main(rest)
    if cmd == "lm-eval":
        try:
            from mtp.lmeval import main as lmeval_main
        except ModuleNotFoundError as e:
            print(f"mtp lm-eval: needs lm-eval ({e}); pip install -e \".[lmeval]\"",
                  file=sys.stderr)
            return 2
        return lmeval_main(rest)
    print(f"mtp: unknown command {cmd!r}; choose from {', '.join(COMMANDS)}", file=sys.stderr)
    return 2


def _export(argv: list[str]) -> int:
    """`mtp export hf --ckpt CKPT --output DIR` (`mtp.hf`) and `mtp export medusa --ckpt CKPT
    --output DIR` (`mtp.medusa`)."""
    import argparse
    from pathlib import Path

    parser = argparse.ArgumentParser(prog="mtp export", description="Write a checkpoint in "
                                     "another library's layout (see `mtp.hf`, `mtp.medusa`).")
    sub = parser.add_subparsers(dest="format", required=True)
    helps = {"hf": "a transformers LlamaForCausalLM directory (head 1), with the other heads "
                   "beside it",
             "medusa": "heads 2..K of a --model.head_type medusa1 checkpoint as vLLM's Medusa "
                       "draft model (vLLM head j is mtp head j + 2)"}
    for name, text in helps.items():
        p = sub.add_parser(name, help=text)
        p.add_argument("--ckpt", required=True, help="mtp checkpoint (or exported directory)")
        p.add_argument("--output", required=True, type=Path, help="new directory to write")
    args = parser.parse_args(argv)
    from mtp.checkpoint import load_checkpoint
    from mtp.hf import MTP_HEADS, ExportError, export, llama_layers

    try:
        model, tokenizer = load_checkpoint(args.ckpt)
        if args.format == "medusa":
            from mtp import medusa

            out = medusa.export(model, args.output)
        else:
            out = export(model, tokenizer, args.output)
    except (ExportError, FileNotFoundError, ValueError) as e:
        print(f"mtp export: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a file where a folder of --output is, another export there meanwhile
        print(f"mtp export: error: --output {args.output}: {e.strerror} ({e.filename}); nothing "
              "was written", file=sys.stderr)
        return 2
    n = model.cfg.n_future
    if args.format == "medusa":
        print(f"wrote {out}: vLLM Medusa heads 0..{n - 2} (mtp heads 2..{n}); serve with "
              f"speculative_config method medusa, model {out}, num_speculative_tokens <= {n - 1}")
        return 0
    print(f"wrote {out}: LlamaForCausalLM of {llama_layers(model.cfg)} layers (head 1)"
          + (f", heads 2..{n} in {MTP_HEADS}" if n > 1 else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
