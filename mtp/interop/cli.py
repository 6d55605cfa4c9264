"""`mtp export hf | medusa`: a checkpoint written in another library's layout."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mtp.util.errors import ExportError, WriteError

__all__ = ["export_main"]


def export_main(argv: list[str]) -> int:
    """`mtp export hf --ckpt CKPT --output DIR` (`mtp.interop.hf_export`) and `mtp export medusa
    --ckpt CKPT --output DIR` (`mtp.interop.vllm_medusa`)."""
    parser = argparse.ArgumentParser(
        prog="mtp export", description="Write a checkpoint in another library's layout (see "
        "`mtp.interop.hf_export`, `mtp.interop.vllm_medusa`).")
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
    from mtp.interop import hf_export, vllm_medusa
    from mtp.model.checkpoint import MTP_HEADS, load_checkpoint
    from mtp.model.llama_layout import llama_layers

    try:
        model, tokenizer = load_checkpoint(args.ckpt)
        if args.format == "medusa":
            out = vllm_medusa.export(model, args.output)
        else:
            out = hf_export.export(model, tokenizer, args.output)
    except (ExportError, FileNotFoundError, ValueError) as e:
        print(f"mtp export: error: {e}", file=sys.stderr)
        return 2
    except WriteError as e:  # a full disk, a read-only folder: `new_directory` removed its files
        print(f"mtp export: error: --output: {e}; nothing was left there", file=sys.stderr)
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
