"""Prompt formats and truncation."""

from __future__ import annotations

import pytest
from eval_helpers import DATA
from mtp.eval.data import load_benchmark
from mtp.eval.prompts import build_prompt, stop_sequences, truncate

MBPP_FILE = DATA / "mbpp" / "mbpp.jsonl"


@pytest.fixture(scope="module")
def mbpp():
    return load_benchmark("mbpp", MBPP_FILE)


def test_humaneval_prompt_is_the_prompt_as_given():
    task = load_benchmark("humaneval").tasks[0]
    assert build_prompt(task, "humaneval-0shot") == task.prompt


def test_humaneval_truncation_at_next_top_level_statement():
    body = "    x = 1\n\n    return x\n"
    for tail in ("def g():\n    pass\n", "if __name__ == '__main__':\n    f()\n",
                 "print(f())\n", "# tests\n", "class A:\n    pass\n", "assert f()\n",
                 "x = f()\n"):
        assert truncate(body + tail, "humaneval-0shot") == body[:-1]  # stops take the "\n"
    assert truncate(body, "humaneval-0shot") == body
    assert "\ndef " in stop_sequences("humaneval-0shot")


def test_mbpp_three_shot_austin_format(mbpp):
    task = mbpp.tasks[0]
    prompt = build_prompt(task, "mbpp-3shot", mbpp.shots)
    assert [s.task_id for s in mbpp.shots] == ["Mbpp/2", "Mbpp/3", "Mbpp/4"]
    assert prompt.count("[BEGIN]") == 4 and prompt.count("[DONE]") == 3
    assert prompt.endswith("[BEGIN]\n")
    assert prompt.startswith("You are an expert Python programmer, and here is your task: "
                             "Write a function to find the similar elements")
    for shot in mbpp.shots:
        assert shot.canonical_solution.strip() in prompt
        assert all(t in prompt for t in shot.examples)
    assert task.prompt in prompt and all(t in prompt for t in task.examples)
    assert truncate("def f():\n    return 1\n[DONE]\nYou are", "mbpp-3shot") == \
        "def f():\n    return 1\n"


def test_mbpp_zero_shot_format(mbpp):
    task = mbpp.tasks[0]
    prompt = build_prompt(task, "mbpp-0shot")
    assert prompt == f'"""\n{task.prompt}\n{task.examples[0]}\n"""\n'
    code = "import re\ndef f():\n    return 1\n\ndef g():\n    return f()\n"
    assert truncate(code + "assert g() == 1\n", "mbpp-0shot") == code[:-1]


def test_format_errors(mbpp):
    with pytest.raises(ValueError, match="unknown prompt format"):
        build_prompt(mbpp.tasks[0], "5shot")
    with pytest.raises(ValueError, match="few-shot"):
        build_prompt(mbpp.tasks[0], "mbpp-3shot", [])
    with pytest.raises(ValueError):
        build_prompt(mbpp.tasks[0], "humaneval-0shot")
