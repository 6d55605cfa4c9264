"""`mtp bench tokenize`: time and peak memory of tokenising a local corpus, over worker counts.

Generates (or reuses, in `--dir`) a corpus of `--size-mb` of synthetic Python files, each the
concatenation of one to four standard-library sources drawn at random; trains (or loads) a
byte-level BPE; then tokenises the corpus into shards once per worker count, each run in a fresh
process so that its time and memory are its own. Columns:

workers         `--data.tokenize_workers`
bytes, tokens   corpus size on disk; tokens written (both splits, end-of-text tokens included)
seconds         the tokenisation alone (not the interpreter start, not the tokenizer)
bytes_per_s     bytes / seconds
peak_rss_mib    peak resident memory of the main process (VmHWM)
worker_rss_mib  peak resident memory of the largest worker; a forked worker shares most of its
                pages with the main process, and they are counted in both
total_pss_mib   peak proportional set size of the main process and its workers together (shared
                pages split among the processes that share them), sampled every 0.2 s
speedup         seconds of the first run (1 worker) / seconds
identical       1 when the shards are byte-identical to the first run's (same sha256)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path

MIB = 1 << 20


def generate_corpus(path: Path, size_bytes: int, seed: int = 0) -> dict:
    """Write files of concatenated standard-library sources until they hold `size_bytes`."""
    manifest = path.with_name(path.name + ".json")
    if manifest.is_file():
        return json.loads(manifest.read_text())
    shutil.rmtree(path, ignore_errors=True)
    root = Path(sysconfig.get_paths()["stdlib"])
    sources = []
    for p in sorted(root.rglob("*.py")):
        if "site-packages" in p.parts:
            continue
        try:
            sources.append((str(p.relative_to(root)), p.read_text(encoding="utf-8")))
        except (OSError, UnicodeDecodeError):
            continue
    rng = random.Random(seed)
    written, n = 0, 0
    while written < size_bytes:
        parts = rng.sample(sources, rng.randint(1, 4))
        text = "".join(f"# --- {name} ---\n{body}\n" for name, body in parts)
        data = text.encode()[:size_bytes - written]
        file = path / f"{n // 1000:04d}" / f"{n:07d}.py"
        file.parent.mkdir(parents=True, exist_ok=True)
        # cutting the last file mid-character would make it unreadable: keep whole characters
        file.write_bytes(data.decode("utf-8", errors="ignore").encode())
        written, n = written + len(data), n + 1
    info = {"bytes": sum(f.stat().st_size for f in path.rglob("*.py")), "files": n}
    manifest.write_text(json.dumps(info))
    return info


def _tokenizer(args: argparse.Namespace, corpus: Path) -> Path:
    if args.tokenizer is not None:
        return Path(args.tokenizer)
    path = Path(args.dir) / f"tokenizer-v{args.vocab}-{corpus.name}.json"
    if not path.is_file():
        from mtp.config import DataConfig
        from mtp.data.bpe import tokenizer_sample, train_tokenizer
        from mtp.data.corpus import source_specs

        budget = int(args.tokenizer_train_mb * MIB)
        specs = source_specs(DataConfig(source=str(corpus)))
        train_tokenizer(tokenizer_sample(specs, budget), args.vocab, budget).save(str(path))
    return path


# -- one run, in a fresh process ----------------------------------------------------------------


def _pss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("Pss:"))
    except (OSError, StopIteration):
        return 0


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


class _PssSampler(threading.Thread):
    """The largest total PSS of this process and its children, sampled (Linux only)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak_kib, self.done = 0, threading.Event()

    def run(self) -> None:
        me = os.getpid()
        while not self.done.wait(0.2):
            self.peak_kib = max(self.peak_kib, sum(_pss_kib(p) for p in [me, *_children(me)]))


def _run(spec: dict) -> dict:
    import resource

    from tokenizers import Tokenizer

    from mtp.config import DataConfig
    from mtp.data.corpus import source_specs
    from mtp.data.shards import build_shards

    source = source_specs(DataConfig(source=spec["corpus"]))[0]
    tokenizer = Tokenizer.from_file(spec["tokenizer"])
    root = Path(spec["shards"])
    shutil.rmtree(root, ignore_errors=True)
    sampler = _PssSampler()
    sampler.start()
    start = time.perf_counter()
    meta = build_shards(source, tokenizer, root, workers=spec["workers"])
    seconds = time.perf_counter() - start
    sampler.done.set()
    sampler.join()
    # ru_maxrss is in KiB on Linux; RUSAGE_CHILDREN covers the workers, joined by now
    return {"tokens": meta["train_tokens"] + meta["val_tokens"], "seconds": seconds,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "worker_rss_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
            "total_pss_mib": sampler.peak_kib / 1024 or None, "sha256": meta["sha256"]}


def _run_in_subprocess(spec: dict) -> dict:
    out = subprocess.run([sys.executable, "-m", "mtp.bench", "_tokenize_run", json.dumps(spec)],
                         stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


# -- entry point --------------------------------------------------------------------------------


def worker(spec_json: str) -> int:
    """Internal: one tokenisation in this (fresh) process; prints its measurements as JSON."""
    print(json.dumps(_run(json.loads(spec_json))))
    return 0


def run(p: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """`mtp bench tokenize`: print the table and append it to `--csv`."""
    from mtp.bench.report import publish

    if args.size_mb <= 0:
        p.error(f"--size-mb must be > 0 (got {args.size_mb})")
    if min(args.workers) < 1:
        p.error(f"--workers must be >= 1 (got {min(args.workers)})")
    if args.tokenizer is not None and not Path(args.tokenizer).is_file():
        p.error(f"--tokenizer {args.tokenizer}: no such file")
    size = int(args.size_mb * MIB)
    corpus = Path(args.dir).absolute() / f"corpus-{args.size_mb:g}MiB"
    info = generate_corpus(corpus, size)
    tokenizer = _tokenizer(args, corpus)
    rows, first = [], None
    for workers in args.workers:
        shards = corpus.with_name(f"shards-w{workers}")
        result = _run_in_subprocess({"corpus": str(corpus), "tokenizer": str(tokenizer),
                                     "shards": str(shards), "workers": workers})
        if not args.keep_shards:
            shutil.rmtree(shards, ignore_errors=True)
        first = first or result
        rows.append({"workers": workers, "bytes": info["bytes"], "tokens": result["tokens"],
                     "seconds": result["seconds"],
                     "bytes_per_s": info["bytes"] / result["seconds"],
                     "peak_rss_mib": result["peak_rss_mib"],
                     "worker_rss_mib": result["worker_rss_mib"],
                     "total_pss_mib": result["total_pss_mib"],
                     "speedup": first["seconds"] / result["seconds"],
                     "identical": int(result["sha256"] == first["sha256"])})
    publish(rows, args.csv, args.command)
    return 0
