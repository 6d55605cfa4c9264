"""`mtp demo --ckpt CKPT [--port 7860]`: the race page (`mtp.demo.page`) served on this machine.

The parser imports nothing heavy, so `--help` answers at once; Gradio, torch and the model load
when the command runs. Where the `demo` extra is not installed, the command says how to install
it; a port that something else holds is refused before the model loads.
"""

from __future__ import annotations

import argparse
import errno
import importlib.util
import socket
import sys

from mtp.decoding.cli import device_args, dtype_problems, linear_path, load, threads_problem

__all__ = ["INSTALL", "demo_main", "port_problem"]

#: How to install what the page needs.
INSTALL = ('mtp demo needs Gradio, which is not installed here: pip install -e ".[demo]" from a '
           'checkout of mtp (or pip install "gradio>=6")')


def port_problem(host: str, port: int) -> str | None:
    """Why the page cannot be served on host:port (None: it can), naming the flag."""
    if not 1 <= port <= 65535:
        return f"--port must lie in [1, 65535] (got {port})"
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        # as the server binds: a port left in TIME_WAIT by a server that stopped is free
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return (f"--port {port} is in use on {host} (another mtp demo?); stop what "
                        f"serves there or pick another port, e.g. --port {port + 1}")
            return f"--host {host} --port {port}: cannot serve there ({e.strerror or e})"
        except socket.gaierror as e:
            return f"--host {host}: {e.strerror or e}"
    return None


def demo_main(argv: list[str]) -> int:
    """`mtp demo --ckpt CKPT [--port 7860]`."""
    p = argparse.ArgumentParser(
        prog="mtp demo",
        description="Serve a page on which greedy and a self-speculative decoder race on the same "
                    "prompt, each token coloured by what produced it (head 1, a draft of head "
                    "2 / 3 / 4, a lookup draft). Needs the `demo` extra (Gradio).",
    )
    p.add_argument("--ckpt", required=True,
                   help="checkpoint (or `mtp export hf` directory) to decode with")
    p.add_argument("--port", type=int, default=7860, help="port to serve on (default: 7860)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to serve on (default: 127.0.0.1, this machine only)")
    p.add_argument("--max-new-tokens", type=int, default=128,
                   help="the page's max new tokens to begin with (default: 128)")
    device_args(p)
    args = p.parse_args(argv)
    problems = []
    if args.max_new_tokens < 1:
        problems.append(f"--max-new-tokens must be >= 1 (got {args.max_new_tokens})")
    if (problem := threads_problem(args.threads)) is not None:
        problems.append(problem)
    problems += dtype_problems(args)
    if args.dtype != "fp32":
        problems.append(f"--dtype {args.dtype}: the page races speculative decoders, which keep "
                        "greedy's output in fp32 only (mtp.decoding.arithmetic)")
    if importlib.util.find_spec("gradio") is None:
        print(f"mtp demo: {INSTALL}", file=sys.stderr)
        return 2
    problem = port_problem(args.host, args.port)
    if problem is not None:
        problems.append(problem)
    if problems:
        p.error(problems[0] if len(problems) == 1 else
                f"{len(problems)} problems:\n  " + "\n  ".join(problems))
    model, tokenizer, _, _ = load(p, args, draft=False)
    from mtp.decoding.arithmetic import decode_linears
    from mtp.demo.page import build_page, serve, warm_up

    if model.cfg.n_future == 1:
        print("mtp demo: note: --ckpt has a single head (--model.n_future 1): the heads' decoders "
              "need K >= 2, so the page races prompt lookup against greedy", file=sys.stderr)
    page = build_page(model, tokenizer, source=args.ckpt, max_new_tokens=args.max_new_tokens)
    # The linear paths set once for the server's life: every race computes with one arithmetic.
    with decode_linears(model, path=linear_path(args)):
        print("mtp demo: warming up the decoders", flush=True)
        warm_up(model, tokenizer)
        print(f"mtp demo: serving http://{args.host}:{args.port} (Ctrl-C stops it)", flush=True)
        try:
            serve(page, args.host, args.port, block=True)
        except OSError as e:  # taken between the check and the start
            p.error(f"--port {args.port}: cannot serve there ({e})")
    return 0
