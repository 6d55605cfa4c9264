"""The `mtp` command: one line per subcommand, each imported only when it runs, so that
`mtp --help` answers at once (torch and Lightning take seconds to import).

    mtp fit | validate | generate | demo | eval | bench | export | distill | lm-eval ...
"""

from __future__ import annotations

import sys

COMMANDS = {
    "fit": "train a model (LightningCLI; `mtp fit --help`)",
    "validate": "evaluate a checkpoint's validation loss (LightningCLI)",
    "generate": "decode from a checkpoint with any decoder",
    "demo": "a local page: greedy and the heads race, tokens coloured by who drafted them",
    "eval": "HumanEval / MBPP: generate or score completions, pass@k",
    "bench": "benchmarks: loss | train | kernel | decode | tokenize | sandbox",
    "export": "write a checkpoint for transformers (`export hf`) or vLLM Medusa (`export medusa`)",
    "distill": "a self-distillation corpus: the model's own answers to coding requests",
    "lm-eval": "EleutherAI's lm-evaluation-harness with the `mtp` model (`--model mtp`)",
}


def main(argv: list[str] | None = None) -> int:
    """Dispatch `mtp <command> ...`. A user's mistake (`mtp.util.errors.UserError`) is reported in a
    line or two and exits 2, a Ctrl-C in a line and exit status 130 (`mtp fit` keeps what it
    can, `mtp.train.fault`); `--debug` anywhere on the line shows the traceback instead."""
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in argv
    if debug:
        argv = [a for a in argv if a != "--debug"]
    try:
        return _dispatch(argv)
    except Exception as err:
        from mtp.util.errors import UserError

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
            from mtp.train.fit_help import stored_help

            text = stored_help(cmd)
            if text is not None:
                print(text, end="")
                return 0
        from mtp.train.cli import fit_main

        return fit_main(argv)
    if cmd == "generate":
        from mtp.decoding.cli import generate_main

        return generate_main(rest)
    if cmd == "demo":
        from mtp.demo.cli import demo_main

        return demo_main(rest)
    if cmd == "eval":
        from mtp.eval.cli import main as eval_main

        return eval_main(rest)
    if cmd == "bench":
        from mtp.bench import main as bench_main

        return bench_main(rest)
    if cmd == "export":
        from mtp.interop.cli import export_main

        return export_main(rest)
    if cmd == "distill":
        from mtp.interop.distill import main as distill_main

        return distill_main(rest)
    if cmd == "lm-eval":
        try:
            from mtp.interop.lm_eval_model import main as lmeval_main
        except ModuleNotFoundError as e:
            print(f"mtp lm-eval: needs lm-eval ({e}); pip install -e \".[lmeval]\"",
                  file=sys.stderr)
            return 2
        return lmeval_main(rest)
    print(f"mtp: unknown command {cmd!r}; choose from {', '.join(COMMANDS)}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
