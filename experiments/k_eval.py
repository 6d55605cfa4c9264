"""The measurements `experiments/k_sweep.py` takes of each trained run: per-head validation
loss and head-1 accuracy on the same validation windows for every K, pass@1 through `mtp eval`,
and self-speculative decoding against greedy (L, per-position acceptance, speedups).
`k_sweep.evaluate` joins them into the run's row.
"""

from __future__ import annotations

import json
from pathlib import Path

from experiments.common import REPO


def validation_losses(model, dm, n_windows: int, batch_size: int) -> dict[str, float]:
    """Per-head loss and head-1 accuracy on the first `n_windows` validation windows."""
    import torch

    from mtp.train.loss import mtp_loss
    from mtp.train.targets import mtp_inputs_targets

    k = model.cfg.n_future
    losses, acc, seen = torch.zeros(k, dtype=torch.float64), 0.0, 0
    with torch.no_grad():
        for a in range(0, n_windows, batch_size):
            batch = torch.stack([dm.val_set[i] for i in range(a, min(a + batch_size,
                                                                    n_windows))])
            batch = batch.to(next(model.parameters()).device)
            out = mtp_loss(model, *mtp_inputs_targets(batch, k), path="metrics")
            losses += out.head_losses.double() * len(batch)
            acc += float(out.head_accuracies[0]) * len(batch)
            seen += len(batch)
    losses /= seen
    row = {f"loss_head{i + 1}": float(v) for i, v in enumerate(losses)}
    row |= {"next_token_loss": float(losses[0]), "val_loss_mean": float(losses.mean()),
            "acc_head1": acc / seen}
    return row


def n_val_windows(dm, preset: dict) -> int:
    """Validation windows scored for every K: the same windows, whatever K's window width."""
    seq_len = dm.cfg.seq_len
    widest = seq_len + max(preset["ks"])
    available = (len(dm.val_tokens) - widest) // seq_len + 1
    return max(1, min(preset["eval"]["val_windows"], available))


def pass_at_1(ckpt: Path, benchmark: str, out_dir: Path, ev: dict) -> tuple[float, int]:
    """pass@1 and task count from `mtp eval <benchmark> --ckpt ...` with the preset's settings."""
    limit = ev[f"{benchmark}_limit"]
    if not limit:
        return float("nan"), 0
    from mtp.eval.cli import main as eval_main

    argv = [benchmark, "--ckpt", str(ckpt), "--limit", str(limit), "--n-samples", "1",
            "--temperature", "0", "--k", "1", "--max-new-tokens", str(ev["max_new_tokens"]),
            "--batch-size", str(ev["batch_size"]), "--workers", str(ev["workers"]),
            "--device", ev["device"], "--output", str(out_dir)]
    if benchmark == "mbpp" and ev.get("mbpp_file"):
        argv += ["--data-file", str(REPO / ev["mbpp_file"])]
    status = eval_main(argv)
    if status:
        raise RuntimeError(f"mtp eval {' '.join(argv)} failed with status {status}")
    summary = json.loads((out_dir / "summary.json").read_text())
    return float(summary["pass@1"]), int(summary["n_tasks"])


def speculative(model, dm, ev: dict, eot_id: int | None, baseline=None) -> dict:
    """L, per-position acceptance and speedups of self-speculative decoding (batch 1).

    Prompts are the starts of validation windows (code the model has not trained on). Timing is
    interleaved: for every prompt, `spec_repeat` rounds each run greedy, self-spec and, given
    `baseline` (the K = 1 model), its greedy, in an order that rotates from round to round and
    prompt to prompt, so load on the machine falls on all of them alike. A decoder's time on a
    prompt is the median of its rounds; its ms per token is the sum of those medians over the
    tokens it emitted. Each decoder runs once on the first prompt before timing, so one-time
    costs are not counted.
    """
    import statistics

    from mtp.decoding.generation import generate
    from mtp.decoding.stats import DecodeStats

    n, plen, new = ev["spec_prompts"], ev["spec_prompt_tokens"], ev["spec_new_tokens"]
    stride = max(1, len(dm.val_set) // n)
    prompts = [dm.val_set[i * stride][:plen].tolist() for i in range(n)]
    runs = {"greedy": (model, "greedy")}
    if model.cfg.n_future > 1:
        runs["self-spec"] = (model, "self-spec")
    if baseline is not None:
        runs["k1"] = (baseline, "greedy")
    names = list(runs)
    for m, dec in runs.values():
        generate(m, prompts[:1], new, decoder=dec, eot_id=eot_id)
    seconds = dict.fromkeys(names, 0.0)
    tokens = dict.fromkeys(names, 0)
    outputs = {name: [] for name in names}
    stats = {name: DecodeStats() for name in names}
    for pi, p in enumerate(prompts):
        rounds = {name: [] for name in names}
        for r in range(ev.get("spec_repeat", 1)):
            shift = (pi + r) % len(names)
            for name in names[shift:] + names[:shift]:
                m, dec = runs[name]
                out, st = generate(m, [p], new, decoder=dec, eot_id=eot_id)
                rounds[name].append(st.seconds)
                if r == 0:
                    outputs[name].append(out[0])
                    stats[name].add(st)
                    tokens[name] += len(out[0])
        for name in names:
            seconds[name] += statistics.median(rounds[name])
    ms = {name: 1000 * seconds[name] / max(1, tokens[name]) for name in names}
    row = {"spec_L": stats["greedy"].tokens_per_forward, "greedy_ms_per_token": ms["greedy"]}
    if "k1" in ms:
        row["k1_greedy_ms_per_token"] = ms["k1"]
    if "self-spec" not in runs:
        # K = 1 has no draft heads: L is that of greedy decoding, and there is no speedup.
        return row
    s = stats["self-spec"]
    row |= {"spec_L": s.tokens_per_forward, "spec_ms_per_token": ms["self-spec"],
            "spec_speedup": ms["greedy"] / ms["self-spec"],
            "spec_identical": int(outputs["greedy"] == outputs["self-spec"])}
    row |= {f"accept_pos{i + 1}": a for i, a in enumerate(s.acceptance)}
    if "k1" in ms:
        row["spec_speedup_vs_k1"] = ms["k1"] / ms["self-spec"]
    return row
