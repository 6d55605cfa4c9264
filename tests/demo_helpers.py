"""What the tests of `mtp demo` share: a small K = 4 checkpoint whose heads' drafts are often
accepted (so the page shows every colour), and a server of the page started as a user starts
it, `mtp demo` in a process of its own."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

from mtp.config import ModelConfig

TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for i in range(10):\n    print(i)\n",
]


def trained_checkpoint(path: Path, *, n_future: int = 4, max_seq_len: int = 512,
                       steps: int = 150) -> Path:
    """A debug-sized checkpoint trained for a few seconds on TEXTS, written to `path`: it
    continues code with the texts' lines, and its heads draft them."""
    from checkpoint_helpers import bpe_tokenizer

    from mtp.model.checkpoint import save_checkpoint
    from mtp.model.transformer import MTPTransformer

    tok = bpe_tokenizer(TEXTS * 10)
    stream = torch.tensor(tok.encode("".join(TEXTS) * 8).ids)
    torch.manual_seed(0)
    cfg = ModelConfig.from_name("debug", vocab_size=320, n_future=n_future,
                                max_seq_len=max_seq_len)
    model = MTPTransformer(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    k = n_future
    for _ in range(steps):
        start = torch.randint(0, len(stream) - 40, (16, 1), generator=g)
        seq = stream[start + torch.arange(32 + k)]  # (16, 32 + K)
        logits = model(seq[:, :32])
        loss = sum(torch.nn.functional.cross_entropy(logits[i].flatten(0, 1),
                                                     seq[:, i + 1 : i + 33].flatten())
                   for i in range(k))
        opt.zero_grad()
        loss.backward()
        opt.step()
    save_checkpoint(path, model.eval(), tok)
    return path


def running_race(timeout: float):
    """The one race on the page once it has heard a few rounds (within `timeout` seconds)."""
    from mtp.demo.race import live_races

    deadline = time.monotonic() + timeout
    while not (live_races() and live_races()[0].version > 4):
        assert time.monotonic() < deadline, "the race did not start"
        time.sleep(0.01)
    (race,) = live_races()
    return race


def assert_stopped(race, timeout: float, max_new_tokens: int) -> None:
    """The race ends within `timeout` seconds, each lane stopped short of `max_new_tokens`."""
    from mtp.demo.race import live_races

    deadline = time.monotonic() + timeout
    while live_races():
        assert time.monotonic() < deadline, "the race went on after it was stopped"
        time.sleep(0.05)
    assert all(lane.error == "stopped" and len(lane.tokens) < max_new_tokens
               for lane in race.lanes)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_demo(ckpt: Path, port: int, *extra: str) -> subprocess.Popen:
    """`mtp demo --ckpt CKPT --port PORT` in a process of its own, once it serves."""
    env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "mtp.cli", "demo", "--ckpt", str(ckpt),
                             "--port", str(port), "--threads", "1", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mtp demo exited with {proc.returncode}:\n{proc.stdout.read()}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError("mtp demo did not serve within 180 s")


def stop_demo(proc: subprocess.Popen) -> str:
    """Stop the server (as Ctrl-C does); returns what it printed."""
    proc.terminate()
    try:
        out, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    return out
