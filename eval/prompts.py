"""Prompt formats and stop-sequence truncation.

Formats (``summary.json`` records which one produced a number):

* ``humaneval-0shot``: the HumanEval prompt exactly as given; the completion is the function
  body and ends at the next top-level statement.
* ``mbpp-3shot``: Austin et al. (2021): tasks 2, 3, 4 as examples, each as
  "You are an expert Python programmer, and here is your task: {text} Your code should pass
  these tests:\\n\\n{asserts}\\n[BEGIN]\\n{code}\\n[DONE]", then the task itself up to
  ``[BEGIN]``; the completion is the whole program and ends at ``[DONE]``.
* ``mbpp-0shot``: the docstring format of InCoder / bigcode-evaluation-harness / EvalPlus:
  ``\"\"\"\\n{text}\\n{first assert}\\n\"\"\"\\n``; the completion is the whole program.
"""

from __future__ import annotations

import re

from mtp.eval.data import Benchmark, Task

__all__ = ["PROMPT_FORMATS", "build_prompt", "stop_sequences", "truncate"]

PROMPT_FORMATS = ("humaneval-0shot", "mbpp-3shot", "mbpp-0shot")

# Handed to the decoder so it can stop early; ``truncate`` then applies the exact rule.
_HUMANEVAL_STOP = ("\ndef ", "\nclass ", "\nif ", "\nprint(", "\n#", "\n@", "\nassert ")
_MBPP_0SHOT_STOP = ("\nassert ", '\n"""', "\nif __name__", "\nprint(", "\n```")
_MBPP_3SHOT_STOP = ("[DONE]", "\n[BEGIN]")
# A line that starts at column 0 with something other than whitespace begins a new top-level
# statement, i.e. the function body is over.
_TOP_LEVEL = re.compile(r"\n(?=\S)")


def default_format(benchmark: Benchmark) -> str:
    """The format used when none is asked for."""
    return "humaneval-0shot" if benchmark.name.startswith("humaneval") else "mbpp-3shot"


def _austin_block(task: Task) -> str:
    tests = "\n".join(task.examples)
    return (f"You are an expert Python programmer, and here is your task: {task.prompt} "
            f"Your code should pass these tests:\n\n{tests}\n")


def build_prompt(task: Task, fmt: str, shots: list[Task] | None = None) -> str:
    """The text the model continues for a task.

    Args:
        task: The task.
        fmt: One of :data:`PROMPT_FORMATS`.
        shots: The few-shot tasks for ``mbpp-3shot`` (tasks 2, 3, 4).

    Raises:
        ValueError: On an unknown format, a format that does not fit the task, or missing shots.
    """
    if fmt == "humaneval-0shot":
        if not task.completes_prompt:
            raise ValueError(f"{fmt} needs a HumanEval-style task, got {task.task_id}")
        return task.prompt
    if task.completes_prompt:
        raise ValueError(f"{fmt} needs an MBPP-style task, got {task.task_id}")
    if fmt == "mbpp-0shot":
        return f'"""\n{task.prompt}\n{task.examples[0]}\n"""\n'
    if fmt == "mbpp-3shot":
        if not shots or len(shots) < 3:
            raise ValueError("mbpp-3shot needs the three few-shot tasks 2, 3, 4")
        examples = "".join(f"{_austin_block(s)}[BEGIN]\n{s.canonical_solution.strip()}\n[DONE]\n"
                           for s in shots[:3])
        return f"{examples}{_austin_block(task)}[BEGIN]\n"
    raise ValueError(f"unknown prompt format {fmt!r}; choose from {', '.join(PROMPT_FORMATS)}")


def stop_sequences(fmt: str) -> list[str]:
    """Stop strings for the decoder under a prompt format."""
    return list({"humaneval-0shot": _HUMANEVAL_STOP, "mbpp-0shot": _MBPP_0SHOT_STOP,
                 "mbpp-3shot": _MBPP_3SHOT_STOP}[fmt])


def truncate(text: str, fmt: str) -> str:
    """Cut a raw generation where the completion ends under a prompt format."""
    cut = len(text)
    for stop in stop_sequences(fmt):
        i = text.find(stop)
        if i != -1:
            cut = min(cut, i)
    if fmt == "humaneval-0shot":
        m = _TOP_LEVEL.search(text)
        if m:
            cut = min(cut, m.start())
    return text[:cut]
