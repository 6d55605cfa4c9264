"""`--model mtp` in lm-evaluation-harness: the same log-likelihoods and generations as lm-eval's
own `hf` model on `mtp export hf` of the same checkpoint, and self-speculative generations equal
to greedy's. The tasks are built from local JSON files, so nothing is downloaded."""

from __future__ import annotations

import json
import math

import pytest
import torch

pytest.importorskip("lm_eval")
pytest.importorskip("transformers")

import lm_eval  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from mtp.cli import main  # noqa: E402
from mtp.config import ModelConfig  # noqa: E402
from mtp.data.bpe import train_tokenizer  # noqa: E402
from mtp.interop.hf_export import export  # noqa: E402
from mtp.interop.lm_eval_model import MTPLM  # noqa: E402
from mtp.model.checkpoint import save_checkpoint  # noqa: E402
from mtp.model.transformer import MTPTransformer  # noqa: E402

TEXTS = ["def add(a, b):\n    return a + b\n", "for i in range(10):\n    print(i)\n",
         "class Point:\n    def __init__(self, x, y):\n        self.x, self.y = x, y\n"] * 20
TASKS = ["mtp_local_mc", "mtp_local_gen", "mtp_local_ppl"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lmeval")
    tok = train_tokenizer(TEXTS, 300, 1 << 20)
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=320, d_model=64, n_layers=2, n_attn_heads=4, n_future=3,
                      max_seq_len=96)
    model = MTPTransformer(cfg).eval()
    for head in model.heads[1:]:  # heads that agree with head 1 where its greedy text repeats
        head.load_state_dict(model.heads[0].state_dict())
    save_checkpoint(root / "m.ckpt", model, tok)
    export(model, tok, root / "hf")
    docs = [{"question": "def add(a, b):", "choices": ["\n    return a + b", "\n    print(i)"],
             "answer": 0, "text": TEXTS[0] * 3},
            {"question": "for i in range(", "choices": ["10):", "x, y"], "answer": 0,
             "text": TEXTS[1] + TEXTS[2]},
            {"question": "class Point:\n    def", "choices": [" __init__", " add"], "answer": 0,
             "text": TEXTS[2] * 5}]  # longer than the window: the rolling windows are used
    data = root / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    common = (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
              "test_split: test\n")
    (root / "tasks").mkdir()
    (root / "tasks" / "mc.yaml").write_text(
        f"task: mtp_local_mc\n{common}output_type: multiple_choice\n"
        "doc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\ndoc_to_target: answer\n"
        "metric_list:\n  - metric: acc\n")
    (root / "tasks" / "gen.yaml").write_text(
        f"task: mtp_local_gen\n{common}output_type: generate_until\n"
        "doc_to_text: '{{question}}'\ndoc_to_target: '{{choices[0]}}'\n"
        "generation_kwargs:\n  until: ['\\n\\n']\n  max_gen_toks: 24\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n")
    (root / "tasks" / "ppl.yaml").write_text(
        f"task: mtp_local_ppl\n{common}output_type: loglikelihood_rolling\n"
        "doc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: word_perplexity\n")
    return root


def _responses(model, setup, **kw) -> dict[str, list]:
    out = lm_eval.simple_evaluate(model=model, tasks=TASKS, log_samples=True,
                                  task_manager=TaskManager(include_path=str(setup / "tasks")),
                                  **kw)
    return {t: [s["resps"] for s in sorted(out["samples"][t], key=lambda s: s["doc_id"])]
            for t in TASKS}


def _scores(resps) -> list[float]:
    """Every log-likelihood in a task's responses, flattened."""
    flat = []
    for doc in resps:
        for r in doc:
            v = r[0]
            flat.append(v[0] if isinstance(v, (list, tuple)) else v)
    return flat


def test_mtp_and_hf_agree_and_self_speculation_generates_greedys_text(setup):
    mtp_greedy = _responses(MTPLM(ckpt=str(setup / "m.ckpt"), batch_size=2), setup)
    hf = _responses("hf", setup, model_args=f"pretrained={setup / 'hf'},dtype=float32,"
                    "device=cpu", batch_size=1)
    for task in ("mtp_local_mc", "mtp_local_ppl"):
        ours, theirs = _scores(mtp_greedy[task]), _scores(hf[task])
        assert len(ours) == len(theirs) > 0
        assert all(math.isfinite(a) and abs(a - b) <= 1e-4 * max(1.0, abs(b))
                   for a, b in zip(ours, theirs)), (task, ours, theirs)
    gen = mtp_greedy["mtp_local_gen"]
    assert gen == hf["mtp_local_gen"] and any(r[0] for r in gen)  # same, non-empty text
    spec = MTPLM(ckpt=str(setup / "hf"), decoder="self-spec", heads=3)  # the export loads too
    assert _responses(spec, setup)["mtp_local_gen"] == gen


def test_the_command_line_runs_the_mtp_model(setup, tmp_path, capsys):
    code = main(["lm-eval", "--model", "mtp", "--model_args",
                 f"ckpt={setup / 'm.ckpt'},decoder=self-spec", "--tasks", "mtp_local_mc",
                 "--include_path", str(setup / "tasks"), "--output_path", str(tmp_path)])
    assert code == 0
    assert "mtp_local_mc" in capsys.readouterr().out
    with pytest.raises(ValueError, match="decoder='nope'"):
        MTPLM(ckpt=str(setup / "m.ckpt"), decoder="nope")
