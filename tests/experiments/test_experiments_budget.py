"""experiments/: GPU presets, sized by tokens per parameter and power, and timed by the FLOP model
plus measured host costs (experiments/budget.py)."""

import json
import math
import re
from pathlib import Path

import pytest
import torch
import yaml
from conftest import REPO
from experiments_helpers import PROV, tiny_preset

from experiments import arithmetic, common, curves, induction, k_report, k_sweep, stats
from mtp.config import ModelConfig
from mtp.util.errors import InputError

GPU_PRESETS = [("k_sweep", "gpu"), ("k_sweep", "scan_gpu"), ("induction", "gpu"),
               ("arithmetic", "gpu")]


def _meta_params(model_cfg: ModelConfig) -> int:
    from mtp.model.transformer import MTPTransformer

    with torch.device("meta"):
        return MTPTransformer(model_cfg).num_params()


def _tokens_per_param(study: str, preset: dict) -> dict[int, tuple[float, float]]:
    """Width -> (training tokens per parameter of its K = 1 model, one step's share of it),
    from the steps each study trains the width for."""
    out = {}
    if study == "k_sweep":
        for width, sweep in k_sweep.width_sweeps(preset):
            cfg = k_sweep.sweep_config(sweep)
            model = {k: v for k, v in cfg["model"].items()
                     if k in ModelConfig.__dataclass_fields__} | {"n_future": 1}
            params = _meta_params(ModelConfig(**model))
            step = (cfg["data"]["batch_size"] * cfg["data"]["seq_len"]
                    * cfg["trainer"].get("accumulate_grad_batches", 1))
            out[width or cfg["model"]["d_model"]] = (cfg["trainer"]["max_steps"] * step / params,
                                                     step / params)
        return out
    module = {"induction": induction, "arithmetic": arithmetic}[study]
    for d in preset["sizes"]:
        params = _meta_params(module.model_config(preset, d, 1))
        step = preset["batch_size"] * preset["seq_len"]
        out[d] = (module.train_steps(preset, d) * step / params, step / params)
    return out


@pytest.mark.parametrize("study, name", GPU_PRESETS)
def test_every_gpu_preset_trains_each_width_on_the_same_tokens_per_parameter(study, name):
    preset = common.load_preset(study, name)
    tpp = preset["tokens_per_param"]
    for width, (ratio, one_step) in _tokens_per_param(study, preset).items():
        assert tpp <= ratio <= tpp + one_step, (width, ratio)  # the fewest steps that reach it


def _family_on_a_page(study: str, preset: dict) -> int:
    """The m a page prints for a complete run of the preset: pages built from made-up rows of
    every group at the preset's seeds (for a scan, the largest of its pages)."""
    seeds = range(len(preset["seeds"]))

    def m(page: str) -> int:
        return int(re.search(r"over all m = (\d+) tests", page).group(1))

    if study in ("induction", "arithmetic"):
        rows = []
        for d in preset["sizes"]:
            for k in preset["ks"]:
                for s in seeds:
                    a = 0.5 + 0.01 * s + 0.001 * k
                    rows.append({"d_model": str(d), "K": str(k), "seed": str(s),
                                 "copy_acc": str(a), "acc_in": str(a), "acc_out": str(a / 2),
                                 "curve": json.dumps([[10, a]]), "params": "1000",
                                 "train_s": "1"})
        by = common.group(rows, ["d_model", "K"])
        floor = 0.1 if study == "induction" else {"in": 0.1, "out": 0.05}
        return m("\n".join(_study_module(study).findings(by, preset["sizes"], preset["ks"],
                                                       floor)))
    pages = []
    for width, sweep in k_sweep.width_sweeps(preset):
        by = {}
        for k in sweep["ks"]:
            by[k] = [{"K": str(k), "seed": str(s), "next_token_loss": str(2 + 0.01 * s + k),
                      "spec_L": str(1 + 0.1 * k + 0.01 * s),
                      **({"spec_speedup": str(1.1 + 0.01 * s),
                          "spec_speedup_vs_k1": str(1.2 + 0.01 * s)} if k > 1 else {}),
                      "head1_depth": "3"} for s in seeds]
        conv = {("K", k): curves.convergence(f"K = {k}", []) for k in by}
        pages.append(m("\n".join(k_report.verdicts(by, sorted(by), lambda k: [], False,
                                                   k_report.Scale(1000, 1000, 512), conv))))
    if preset.get("widths"):
        by_width = {w: [{"head_type": "block", "K": str(k), "n_layers": "8", "seed": str(s),
                         "params": "1000", "steps": "10", "head1_depth": "3",
                         "next_token_loss": str(2 + 0.01 * s + k), "spec_L": "1.0", **PROV}
                        for k in preset["ks"] for s in seeds] for w in preset["widths"]}
        pages.append(m(_scan_page(preset, by_width)))
    return max(pages)


def _study_module(study: str):
    """The module of a generated-task study."""
    return {"induction": induction, "arithmetic": arithmetic}[study]


def _scan_page(preset: dict, by_width: dict) -> str:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        return k_report.scan_report(Path(tmp), preset, "cmd", by_width, 8)


@pytest.mark.parametrize("study, name", GPU_PRESETS)
def test_every_gpu_preset_has_the_seeds_for_the_stated_power(study, name):
    """The seeds detect `POWER_TARGET_SD` at Holm's strictest step over the largest family a
    page of the preset decides, and the family the estimate plans is the one a page prints."""
    from experiments import budget

    preset = common.load_preset(study, name)
    costs = budget.load_fixed_costs()
    plan = (k_sweep.estimate_plan(preset, ["block"], costs) if study == "k_sweep" else
            _study_module(study).estimate_plan(preset, costs))
    assert plan.family == _family_on_a_page(study, preset)
    assert stats.detectable_difference(len(preset["seeds"]), plan.family) <= \
        budget.POWER_TARGET_SD
    assert plan.seeds == len(preset["seeds"]) >= stats.MIN_SEEDS


@pytest.mark.parametrize("study, name", GPU_PRESETS)
def test_every_gpu_preset_is_timed_by_the_estimate_not_by_a_claim(study, name, capsys):
    text = (REPO / "experiments" / "presets" / f"{study}_{name}.yaml").read_text()
    assert not re.search(r"(about|roughly|~) ?\d+ ?(s|seconds|minutes|min|hours|h)\b", text)
    assert f"--preset {name} --estimate" in text
    main = {"k_sweep": k_sweep.main, "induction": induction.main,
            "arithmetic": arithmetic.main}[study]
    assert main(["--preset", name, "--estimate"]) == 0
    out = capsys.readouterr().out
    tpp = f"{preset_tpp(study, name):g}"
    assert f"Tokens per parameter: {tpp} at every width" in out and "Total: " in out
    assert "989 TFLOP/s dense peak x 0.3 assumed utilisation" in out


def preset_tpp(study: str, name: str) -> float:
    """A preset's stated tokens per parameter."""
    return common.load_preset(study, name)["tokens_per_param"]


def test_no_page_or_readme_claims_a_gpu_time_the_estimate_does_not_give():
    readme = (REPO / "experiments" / "README.md").read_text()
    assert "about 10 minutes" not in readme and "--estimate" in readme


def test_a_cpu_preset_is_not_timed_as_a_gpu_one():
    for main in (k_sweep.main, induction.main, arithmetic.main):
        with pytest.raises(InputError, match="--estimate times a GPU preset; .* trains on the CPU"):
            main(["--preset", "cpu", "--estimate"])


def test_steps_and_tokens_per_parameter_exclude_each_other():
    from experiments import budget

    preset = common.load_preset("induction", "gpu") | {"steps": 100}
    with pytest.raises(InputError, match="give exactly one of steps and tokens_per_param"):
        induction.train_steps(preset, 64)
    scan = common.load_preset("k_sweep", "scan_gpu")
    scan["fit"]["trainer"]["max_steps"] = 10
    with pytest.raises(InputError, match="give tokens_per_param or fit.trainer.max_steps"):
        k_sweep.width_sweeps(scan)
    assert budget.steps_for(20, 1000, 64) == 313  # 20 000 tokens in steps of 64


_COSTS = dict(start_s=5.0, fit_run_s=2.0, synthetic_run_s=0.5, eval_run_s=0.7, step_s=0.01,
              step_block_s=0.002, forward_s=0.003, forward_block_s=0.001,
              generate_s_per_token={"induction": 1e-6, "arithmetic": 2e-6},
              bag_s_per_token=3e-6, sandbox_s=0.1)


def _blocks(model) -> int:
    from mtp.model.layers import Block

    return sum(isinstance(m, Block) for m in model.modules())


def test_the_estimate_is_flops_over_throughput_plus_the_fixed_costs():
    """A tiny induction preset, every term written out here: per run, the FLOP model's FLOPs
    per token (`flops_per_token`, itself checked against FlopCounterMode in test_flops.py)
    times the tokens trained on, plus a third of it per token scored, over the device's
    sustained FLOP/s; plus the run's setup, its steps, the tokens generated for it, its
    forwards and its floor; plus the process start once."""
    from experiments import budget
    from mtp.model.transformer import MTPTransformer

    preset = common.load_preset("induction", "cpu") | {
        "sizes": [16, 32], "ks": [1, 2], "seeds": [0, 1, 2], "seq_len": 16, "batch_size": 4,
        "tokens_per_param": 3, "probe_every": 5, "probe_seqs": 8, "eval_seqs": 16,
        "accelerator": "gpu", "precision": "bf16-mixed", "data_workers": 2}
    del preset["steps"]
    costs = budget.FixedCosts(tokeniser={}, **_COSTS)
    device = budget.Device("test", {"bf16": 4e12, "fp32": 1e12}, utilisation=0.25)
    estimate = budget.estimate(induction.estimate_plan(preset, costs), device, costs)
    total = 5.0  # the process
    for d in (16, 32):
        torch.manual_seed(0)
        k1 = MTPTransformer(induction.model_config(preset, d, 1))
        steps = math.ceil(3 * k1.num_params() / (4 * 16))
        probes = math.ceil(steps / 5)
        scored = (probes * 8 + 16) * 16
        for k in (1, 2):
            model = MTPTransformer(induction.model_config(preset, d, k))
            flops = model.flops_per_token(16) * (steps * 4 * 16 + scored / 3)
            blocks = _blocks(model)
            host = (0.5 + steps * (0.01 + 0.002 * blocks)
                    + 1e-6 * (steps * 4 * (16 + k) / 2 + scored)
                    + (probes * 1 + 1) * (0.003 + 0.001 * blocks) + 3e-6 * 16 * 16)
            run = next(r for r in estimate.plan.runs if r.label == f"d={d} K={k}")
            assert estimate.run_s(run) == pytest.approx(flops / (4e12 * 0.25) + host, rel=1e-9)
            assert run.tokens == steps * 64 and run.count == 3
            total += 3 * (flops / 1e12 + host)
    assert estimate.total_s == pytest.approx(total, rel=1e-9)
    text = estimate.text()
    assert "bf16-mixed (bf16): 4 TFLOP/s dense peak x 0.25 assumed utilisation = 1 TFLOP/s " \
        "sustained" in text and "Tokens per parameter: 3 at every width" in text


def test_the_k_sweep_estimate_counts_tokenising_decoding_and_benchmarks(tiny_corpus,
                                                                         tmp_path):
    """The K sweep's terms, written out for a tiny preset: training and evaluation FLOPs, the
    run's setup and evaluation load, steps, validation batches, decode forwards of greedy,
    self-speculation and the K = 1 model's greedy, code-benchmark forwards and programs; once
    per study the process start, the corpus's BPE and encoding, the benchmarks' references."""
    from experiments import budget
    from mtp.model.transformer import MTPTransformer

    path = tiny_preset(tiny_corpus, tmp_path, ks=[1, 2], tokens_per_param=10)
    preset = yaml.safe_load(path.read_text())
    del preset["fit"]["trainer"]["max_steps"]
    preset["fit"]["trainer"] |= {"accelerator": "gpu", "precision": "bf16-mixed"}
    preset["eval"] |= {"humaneval_limit": 3, "mbpp_limit": 5}
    path.write_text(yaml.safe_dump(preset))
    preset = common.load_preset("k_sweep", str(path))
    rates = {"bpe_s_per_byte": 1e-6, "encode_s_per_byte": 2e-6, "bytes_per_token": 3.0}
    costs = budget.FixedCosts(tokeniser={300: rates}, **_COSTS)
    device = budget.Device("test", {"bf16": 2e12, "fp32": 1e12}, utilisation=0.5)
    estimate = budget.estimate(k_sweep.estimate_plan(preset, ["block"], costs), device, costs)
    cfg = k_sweep.sweep_config(preset)
    model_cfg = {k: v for k, v in cfg["model"].items() if k in ModelConfig.__dataclass_fields__}
    k1 = MTPTransformer(ModelConfig(**model_cfg | {"n_future": 1}))
    steps = math.ceil(10 * k1.num_params() / (4 * 16))
    val_batches = steps // 2 * 1  # val_check_interval 2, limit_val_batches 1
    total = 0.0
    for k in (1, 2):
        model = MTPTransformer(ModelConfig(**model_cfg | {"n_future": k,
                                                          "matched_params": True}))
        decoders = 1 if k == 1 else 3
        spec = decoders * (1 + 2 * 2) * 6  # prompts 2, rounds 2, new tokens 6
        bench = (math.ceil(3 / 2) + math.ceil(5 / 2)) * 4  # batch 2, 4 new tokens
        scored = (val_batches * 4 + 4) * 16 + spec + bench * 2
        flops = model.flops_per_token(16) * (steps * 64 + scored / 3)
        forwards = val_batches + math.ceil(4 / 4) + spec + bench
        host = (2.0 + 0.7 + steps * (0.01 + 0.002 * _blocks(model))
                + forwards * (0.003 + 0.001 * _blocks(model)) + 8 * 0.1 / 1)
        run = next(r for r in estimate.plan.runs if r.label == f"K={k}")
        assert estimate.run_s(run) == pytest.approx(flops / 1e12 + host, rel=1e-9)
        total += flops / 1e12 + host  # one seed
    size = sum(p.stat().st_size for p in Path(tiny_corpus).iterdir())
    once = 5.0 + 1e-6 * min(size, 300_000) + 2e-6 * size + 8 * 0.1 / 1  # debug.yaml's BPE bytes
    assert estimate.total_s == pytest.approx(total + once, rel=1e-9)
    assert "passes over the" in estimate.text()
