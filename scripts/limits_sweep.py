"""The cases of `bad_input_sweep.py` about sizes, disks and flags (issue 41): sizes beyond the
memory (flags, stored configs, YAML aliases), writes that fail (a full disk, a read-only folder, a
quota), Lightning's `--trainer.*` flags, paths that are not regular files and numbers out of
range. Each must end in one clear line and exit 2, or in a correct result.

The full and read-only disks are tmpfs file systems mounted for the sweep (as root, as on the
development and CI machines; `unmount_all` takes them down); where none can be mounted, a
read-only folder is a folder of mode 555 (not as root) and the cases that need a small disk are
left out. A quota is `ulimit -f` on the case's process (`Case.file_size_limit`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from hostile_sweep import DEBUG, MTP, Case, Run, command_failed, env, jsonl_rows, run_again

__all__ = ["limits_cases", "limits_fixtures", "unmount_all"]

#: The tmpfs file systems mounted for this sweep, unmounted by `unmount_all`.
MOUNTS: list[Path] = []


def _mount(folder: Path, options: str) -> bool:
    folder.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)],
                          capture_output=True).returncode == 0
    if done:
        MOUNTS.append(folder)
    return done


def unmount_all() -> None:
    while MOUNTS:
        subprocess.run(["umount", "-l", str(MOUNTS.pop())], capture_output=True)


def _fill(folder: Path) -> None:
    """Fill the file system of `folder` with one file, `filler`."""
    with open(folder / "filler", "wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 16))
                f.flush()
        except OSError:
            pass


def _laughs(levels: int = 9) -> str:
    names = "abcdefghijklmnop"[:levels]
    lines = [f"{names[0]}: &{names[0]} [" + ", ".join(['"lol"'] * 10) + "]"]
    lines += [f"{n}: &{n} [" + ", ".join([f"*{p}"] * 10) + "]" for p, n in zip(names, names[1:])]
    return "\n".join(lines) + f"\nloss:\n  head_weights: *{names[-1]}\n"


def _write(path: Path, text: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


def limits_fixtures(root: Path, paths: dict[str, str]) -> dict[str, str]:
    """Stored configs too large for any machine, YAML that expands, pipes, a transformers
    folder of pickled weights, and the disks: read-only, tiny, full after a first evaluation."""
    import torch

    out: dict[str, str] = {}
    for name, change in (("HUGEVOCAB", {"vocab_size": 4_000_000_000}),
                         ("HUGECTX", {"max_seq_len": 10**13})):
        ckpt = torch.load(paths["K4"], map_location="cpu", weights_only=True)
        ckpt["mtp"]["model_config"].update(change)
        out[name] = str(root / f"{name}.ckpt")
        torch.save(ckpt, out[name])
    out["LAUGHS"] = _write(root / "laughs.yaml", _laughs())
    out["SELFALIAS"] = _write(root / "self-alias.yaml", "loss:\n  head_weights: &a [1, *a]\n")
    names = "abcdefghi"
    out["LAUGHSFLOW"] = "[&a [" + ", ".join(["1"] * 10) + "], " + ", ".join(
        f"&{n} [" + ", ".join([f"*{p}"] * 10) + "]" for p, n in zip(names, names[1:])) + "]"
    llama = {"model_type": "llama", "vocab_size": 320, "hidden_size": 32,
             "num_attention_heads": 2, "num_hidden_layers": 2, "intermediate_size": 64,
             "max_position_embeddings": 64}
    _write(root / "binonly" / "config.json", json.dumps(llama))
    (root / "binonly" / "pytorch_model.bin").write_bytes(b"a pickle, which mtp loads nowhere")
    out["BINONLY"] = str(root / "binonly")
    out["HFHUGE"] = _write(root / "hf-huge" / "config.json",
                           json.dumps({**llama, "vocab_size": 4_000_000_000}))
    out["HFHUGE"] = str(root / "hf-huge")
    out["COMP2"] = _write(root / "completions-two.jsonl", "".join(
        json.dumps({"task_id": f"HumanEval/{i}", "completion": "    return 1\n"}) + "\n"
        for i in range(2)))
    for name in ("pipe.ckpt", "pipe.jsonl", "pipe.yaml", "pipe.txt"):
        os.mkfifo(root / name)
        out[name] = str(root / name)
    # disks: read-only, tiny (64 KiB), and one full after a first evaluation into it
    ro = root / "ro"
    if _mount(ro, "ro,size=64k"):
        out["RO"] = str(ro)
    elif os.geteuid() != 0:
        ro.mkdir()
        ro.chmod(0o555)
        out["RO"] = str(ro)
    if _mount(root / "tiny", "size=64k"):
        out["TINY"] = str(root / "tiny")
    full = root / "full"
    if _mount(full, "size=1m"):
        out["FULL"] = str(full)
        proc = subprocess.run([*MTP, "eval", "humaneval", "--completions", out["COMP2"],
                               "--limit", "1", "--output", str(full / "out")],
                              capture_output=True, text=True, env=env())
        if proc.returncode:
            raise RuntimeError(f"the first evaluation onto the small disk failed: {proc.stderr}")
        _fill(full)
    return out


def _full_disk_eval(run: Run) -> str | None:
    """Issue 41, case 3: the failed run left the earlier samples whole; with room again, the
    same command completes them."""
    out = Path(run.case.argv[run.case.argv.index("--output") + 1])
    rows = jsonl_rows(out / "samples.jsonl")  # every line whole JSON, or this raises
    if not rows or rows[0]["task_id"] != "HumanEval/0":
        return f"samples.jsonl lost its earlier line: {rows}"
    (out.parent / "filler").unlink()
    problem = command_failed(*run_again(run, run.case.argv), "the same command with room")
    if problem:
        return problem
    ids = [r["task_id"] for r in jsonl_rows(out / "samples.jsonl")]
    return None if ids == ["HumanEval/0", "HumanEval/1"] else \
        f"samples.jsonl holds {ids} after the rerun, not HumanEval/0 and /1"


def _under_dir(run: Run) -> str | None:
    """`--trainer.default_root_dir DIR`: the run's checkpoints under DIR, none in ./runs."""
    last = Path("DIR") / "runs" / "mtp" / "version_0" / "checkpoints" / "last.ckpt"
    if not (run.folder / last).is_file():
        return f"no {last}"
    return "runs/ written in the working directory too" if (run.folder / "runs").exists() \
        else None


def _wrote_nothing(run: Run) -> str | None:
    left = sorted(p.name for p in run.folder.iterdir() if p.name != "cache")
    return None if not left else f"--trainer.fast_dev_run left {left}"


def limits_cases(p: dict[str, str]) -> list[Case]:
    fit = [*MTP, "fit", "--config", DEBUG, "--trainer.enable_progress_bar", "false",
           "--trainer.max_steps", "2", "--trainer.val_check_interval", "2",
           "--trainer.limit_val_batches", "1", "--data.source", p["CORPUS"],
           "--data.cache_dir", "cache"]
    gen = [*MTP, "generate", "--prompt", "def f():", "--max-new-tokens", "4"]
    he = [*MTP, "eval", "humaneval"]
    decode = [*MTP, "bench", "decode", "--limit", "1", "--repeat", "1", "--warmup", "0"]
    distill = [*MTP, "distill", "--model", p["CHAT512"], "--source", p["DOCS"], "--requests",
               "2", "--max-new-tokens", "4"]
    trained = "unigram entropy"
    cases = [
        # sizes bounded before allocation: the estimate against the memory, the flag named
        Case("sizes", [*fit, "--model.n_future", "100000"], "--model.n_future 100000"),
        Case("sizes", [*fit, "--data.batch_size", "100000000"], "--data.batch_size 100000000"),
        Case("sizes", [*fit, "--model.n_future", "10000000"], "--model.n_future 10000000"),
        Case("sizes", [*fit, "--model.vocab_size", "4000000000"],
             "--model.vocab_size 4000000000"),
        Case("sizes", [*fit, "--model.n_layers", "100000000"], "--model.n_layers 100000000"),
        Case("sizes", [*fit, "--model.d_model", "1000000", "--model.n_attn_heads", "2"],
             "--model.d_model 1000000"),
        Case("sizes", [*fit, "--model.max_seq_len", "100000000000"],
             "--model.max_seq_len 100000000000"),
        Case("sizes", [*fit, "--trainer.devices", "1000"], "training in 1000 processes"),
        Case("sizes", [*fit, "--config", p["LAUGHS"]], "its aliases expand it"),
        Case("sizes", [*fit, "--config", p["SELFALIAS"]], "or into itself"),
        Case("sizes", [*fit, "--loss.head_weights", p["LAUGHSFLOW"]],
             "--loss.head_weights: its aliases expand it"),
        Case("sizes", [*gen, "--ckpt", p["HUGEVOCAB"]], "--model.vocab_size 4000000000"),
        Case("sizes", [*gen, "--ckpt", p["HUGECTX"]], "--model.max_seq_len 10000000000000"),
        Case("sizes", [*he, "--ckpt", p["HUGEVOCAB"], "--limit", "1"], "HUGEVOCAB.ckpt"),
        Case("sizes", [*MTP, "export", "hf", "--ckpt", p["HUGEVOCAB"], "--output",
                       p["OUT"] + "-huge"], "--model.vocab_size 4000000000"),
        Case("sizes", [*fit, "--model.init_from", p["HFHUGE"]], "hf-huge/config.json"),
        Case("sizes", [*he, "--ckpt", p["K4"], "--temperature", "0.8", "--n-samples",
                       "100000000000"], "--n-samples 100000000000"),
        Case("sizes", [*gen, "--ckpt", p["K4"], "--decoder", "draft", "--draft-ckpt", p["K1"],
                       "--gamma", "1000000000"], "--gamma 1000000000"),
        Case("sizes", [*gen, "--ckpt", p["K4"], "--decoder", "self-spec", "--lookup",
                       "1000000000000"], "--lookup 1000000000000"),
        Case("sizes", [*gen, "--ckpt", p["K4"], "--threads", "100000"], "--threads"),
        # Lightning's flags: honoured, or refused with the reason
        Case("trainer", [*fit, "--trainer.default_root_dir", "DIR"], trained, status=0,
             cwd="root-dir", check=_under_dir),
        Case("trainer", [*fit, "--trainer.fast_dev_run", "true"], trained, status=0,
             cwd="fast-dev-run", check=_wrote_nothing),
        Case("trainer", [*fit, "--trainer.precision", "bf16-true"], trained, status=0,
             cwd="bf16-true"),
        Case("trainer", [*fit, "--trainer.precision", "16-true"], "float16 weights train"),
        Case("trainer", [*fit, "--trainer.devices", "0"], "--trainer.devices 0"),
        Case("trainer", [*fit, "--trainer.use_distributed_sampler", "true"],
             "--trainer.use_distributed_sampler true"),
        Case("trainer", [*fit, "--trainer.barebones", "true"], "--trainer.barebones true"),
        Case("trainer", [*fit, "--trainer.plugins",
                         "lightning.pytorch.plugins.io.TorchCheckpointIO"], "AtomicCheckpointIO"),
        Case("trainer", [*fit, "--trainer.logger", "false", "--trainer.callbacks",
                         "lightning.pytorch.callbacks.LearningRateMonitor"],
             "Cannot use `LearningRateMonitor`", timeout=300, cwd="lr-monitor"),
        Case("trainer", [*fit, "--seed_everything", "99999999999"], "--seed_everything"),
        Case("trainer", [*fit, "--data.seed", "-1"], "--data.seed"),
        # paths that are not regular files, named for what they are
        Case("paths", [*fit, "--data.tokenizer", "/dev/zero"], "is a character device"),
        Case("paths", [*gen, "--ckpt", p["pipe.ckpt"]], "is a named pipe"),
        Case("paths", [*gen, "--ckpt", "/dev/zero"], "is a character device"),
        Case("paths", [*fit, "--model.init_from", p["BINONLY"]], "pytorch_model.bin"),
        Case("paths", [*MTP, "distill", "--model", p["BINONLY"], "--out", "x.jsonl"],
             "pytorch_model.bin"),
        Case("paths", [*fit, "--model.init_from", "/dev/zero"], "is a character device"),
        Case("paths", [*fit, "--config", p["pipe.yaml"]], "is a named pipe"),
        Case("paths", [*fit, "--ckpt_path", p["pipe.ckpt"]], "is a named pipe"),
        Case("paths", [*he, "--completions", p["pipe.jsonl"]], "is a named pipe"),
        Case("paths", [*he, "--completions", p["GOOD"], "--data-file", "/dev/zero"],
             "is a character device"),
        Case("paths", [*decode, "--ckpt", p["K4"], "--prompts", p["pipe.txt"]],
             "is a named pipe"),
        Case("paths", [*decode, "--ckpt", p["K4"], "--csv", "/dev/null"],
             "is a character device"),
        # numbers in range
        Case("numbers", [*gen, "--ckpt", p["K4"], "--decoder", "sample", "--seed",
                         "1180591620717411303424"], "--seed must be"),
        Case("numbers", [*gen, "--ckpt", p["K4"], "--decoder", "sample", "--temperature",
                         "1e-40"], "--temperature 1e-40 is too small"),
        Case("numbers", [*he, "--ckpt", p["K4"], "--temperature", "1e-40"],
             "--temperature 1e-40 is too small"),
        Case("numbers", [*he, "--ckpt", p["K4"], "--temperature", "0.8", "--seed", "-5"],
             "--seed must be"),
        Case("numbers", [*decode, "--ckpt", p["K4"], "--seed", str(2**70)], "--seed must be"),
        # a quota: every file the command writes is limited to a few KiB (`ulimit -f`)
        Case("disk", fit, "File too large", cwd="quota-fit", file_size_limit=256 << 10),
        Case("disk", [*distill, "--out", "d.jsonl"], "File too large", cwd="quota-distill",
             file_size_limit=100),
        Case("disk", [*he, "--completions", p["GOOD"], "--limit", "1", "--output", "res"],
             "File too large", cwd="quota-eval", file_size_limit=300),
    ]
    if "RO" in p:
        ro = p["RO"]
        cases += [
            Case("disk", [*fit, "--trainer.default_root_dir", ro + "/DIR"],
                 "cannot write the folder of the run's logs"),
            Case("disk", [*fit, "--trainer.default_root_dir", ro, "--trainer.logger", "false"],
                 "cannot write the run's folder"),
            Case("disk", [*fit, "--data.cache_dir", ro + "/cache"], "cannot write the folder"),
            Case("disk", [*distill, "--out", ro + "/d.jsonl"],
                 "cannot write the distilled corpus"),
            Case("disk", [*MTP, "export", "hf", "--ckpt", p["K4"], "--output", ro + "/hf"],
                 "cannot write the export"),
            Case("disk", [*MTP, "export", "medusa", "--ckpt", p["M4"], "--output", ro + "/m"],
                 "cannot write the export"),
            Case("disk", [*decode, "--ckpt", p["K4"], "--csv", ro + "/decode.csv"],
                 "cannot write the folder of --csv"),
            Case("disk", [*he, "--completions", p["GOOD"], "--limit", "1", "--output",
                          ro + "/out"], "--output"),
        ]
    if "TINY" in p:
        cases += [
            Case("disk", [*fit, "--trainer.default_root_dir", p["TINY"] + "/DIR"],
                 "free on its disk"),
            Case("disk", [*MTP, "export", "hf", "--ckpt", p["K4"], "--output",
                          p["TINY"] + "/hf"], "cannot write the export"),
        ]
    if "FULL" in p:
        cases.append(Case("disk", [*he, "--completions", p["COMP2"], "--limit", "2",
                                   "--output", p["FULL"] + "/out"], "No space left on device",
                          timeout=300, check=_full_disk_eval,
                          label="a disk that filled after a first run"))
    return cases


if __name__ == "__main__":
    sys.exit("run scripts/bad_input_sweep.py, which runs these cases with the others")
