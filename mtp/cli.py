"""The `mtp` command: one line per subcommand, each imported only when it runs, so that
`mtp --help` answers at once (torch and Lightning take seconds to import).

    mtp fit | validate | generate | eval | bench | export ...
"""

from __future__ import annotations

import sys

COMMANDS = {
    "fit": "train a model (LightningCLI; `mtp fit --help`)",
    "validate": "evaluate a checkpoint's validation loss (LightningCLI)",
    "generate": "decode from a checkpoint with any decoder",
    "eval": "HumanEval / MBPP: generate or score completions, pass@k",
    "bench": "benchmarks: loss | train | kernel | decode | tokenize | sandbox",
    "export": "write a checkpoint as a transformers directory (`mtp export hf`)",
}


def main(argv: list[str] | None = None) -> int:
    """Dispatch `mtp <command> ...`. A user's mistake (`mtp.config.UserError`) is reported in a
    line or two and exits 2; `--debug` anywhere on the line shows its traceback instead."""
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


def _dispatch(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: mtp <command> [args]\n\ncommands:")
        for name, doc in COMMANDS.items():
            print(f"  {name:<9} {doc}")
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd in ("fit", "validate"):
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
        from mtp.hf import export_main

        return export_main(rest)
    print(f"mtp: unknown command {cmd!r}; choose from {', '.join(COMMANDS)}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
