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
* ``humaneval-chat`` and ``mbpp-chat``, for instruct models: one user message rendered with the
  model's chat template (:class:`mtp.eval.chat.ChatTemplate`), and the answer runs to the
  model's end-of-text token. HumanEval's message is EvalPlus's request for "a self-contained
  Python script" around the prompt; MBPP's is the Austin et al. task text with its asserts. The
  code is the answer's first fenced block (:func:`mtp.eval.chat.extract_code`); see
  :func:`extract` for how it becomes the program that is tested.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Callable

from mtp.eval.chat import ChatTemplate, code_closed, extract_code
from mtp.eval.data import Benchmark, Task

__all__ = ["PROMPT_FORMATS", "build_prompt", "chat_request", "extract", "is_chat",
           "stop_sequences", "truncate"]

PROMPT_FORMATS = ("humaneval-0shot", "humaneval-chat", "mbpp-3shot", "mbpp-0shot", "mbpp-chat")

# Handed to the decoder so it can stop early; ``truncate`` then applies the exact rule.
_HUMANEVAL_STOP = ("\ndef ", "\nclass ", "\nif ", "\nprint(", "\n#", "\n@", "\nassert ")
_MBPP_0SHOT_STOP = ("\nassert ", '\n"""', "\nif __name__", "\nprint(", "\n```")
_MBPP_3SHOT_STOP = ("[DONE]", "\n[BEGIN]")
# A line that starts at column 0 with something other than whitespace begins a new top-level
# statement, i.e. the function body is over.
_TOP_LEVEL = re.compile(r"\n(?=\S)")
# EvalPlus's instruction for chat models (evalplus/codegen.py).
_HUMANEVAL_REQUEST = ("Please provide a self-contained Python script that solves the following "
                      "problem in a markdown code block:")


def default_format(benchmark: Benchmark) -> str:
    """The format used when none is asked for."""
    return "humaneval-0shot" if benchmark.name.startswith("humaneval") else "mbpp-3shot"


def _austin_block(task: Task) -> str:
    tests = "\n".join(task.examples)
    return (f"You are an expert Python programmer, and here is your task: {task.prompt} "
            f"Your code should pass these tests:\n\n{tests}\n")


def is_chat(fmt: str) -> bool:
    """Whether a format talks to an instruct model through its chat template."""
    return fmt.endswith("-chat")


def chat_request(task: Task) -> str:
    """The user message of the ``*-chat`` formats: EvalPlus's request around a HumanEval
    prompt, or an MBPP task's text and asserts as Austin et al. give them."""
    if task.completes_prompt:
        return f"{_HUMANEVAL_REQUEST}\n```\n{task.prompt.strip()}\n```\n"
    return _austin_block(task)


def build_prompt(task: Task, fmt: str, shots: list[Task] | None = None,
                 chat: ChatTemplate | None = None) -> str:
    """The text the model continues for a task.

    Args:
        task: The task.
        fmt: One of :data:`PROMPT_FORMATS`.
        shots: The few-shot tasks for ``mbpp-3shot`` (tasks 2, 3, 4).
        chat: The model's chat template, for the ``*-chat`` formats.

    Raises:
        ValueError: On an unknown format, a format that does not fit the task, missing shots,
            or a chat format without a template.
    """
    if fmt not in PROMPT_FORMATS:
        raise ValueError(f"unknown prompt format {fmt!r}; choose from {', '.join(PROMPT_FORMATS)}")
    if fmt.startswith("humaneval") != task.completes_prompt:
        kind = "HumanEval" if fmt.startswith("humaneval") else "MBPP"
        raise ValueError(f"{fmt} needs a {kind}-style task, got {task.task_id}")
    if is_chat(fmt):
        if chat is None:
            raise ValueError(f"{fmt} needs the model's chat template")
        return chat.render([{"role": "user", "content": chat_request(task)}],
                           add_generation_prompt=True)
    if fmt == "humaneval-0shot":
        return task.prompt
    if fmt == "mbpp-0shot":
        return f'"""\n{task.prompt}\n{task.examples[0]}\n"""\n'
    # mbpp-3shot
    if not shots or len(shots) < 3:
        raise ValueError("mbpp-3shot needs the three few-shot tasks 2, 3, 4")
    examples = "".join(f"{_austin_block(s)}[BEGIN]\n{s.canonical_solution.strip()}\n[DONE]\n"
                       for s in shots[:3])
    return f"{examples}{_austin_block(task)}[BEGIN]\n"


def stop_sequences(fmt: str) -> list[str | Callable[[str], bool]]:
    """Stops for the decoder under a prompt format: strings where the completion ends, or for a
    chat the point where its answer's code is final (:func:`mtp.eval.chat.code_closed`; the prose
    after a closed code block is never read)."""
    if is_chat(fmt):
        return [code_closed]
    return list({"humaneval-0shot": _HUMANEVAL_STOP, "mbpp-0shot": _MBPP_0SHOT_STOP,
                 "mbpp-3shot": _MBPP_3SHOT_STOP}.get(fmt, ()))


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


def extract(text: str, task: Task, fmt: str) -> str:
    """The completion a generation gives under a prompt format, in the form the harness tests
    (:meth:`mtp.eval.data.Task.program`: continuing a HumanEval prompt, or the whole MBPP
    program).

    Raw formats cut the text where the completion ends (:func:`truncate`). Chat formats take the
    answer's code (:func:`mtp.eval.chat.extract_code`). For MBPP it is the program. For HumanEval,
    code that defines the entry point at top level replaces the prompt's function: it follows
    the whole prompt, so the prompt's imports and helper functions stay defined and its
    docstring-only function is redefined. Other code is the function's body, appended to the
    prompt (indented by four spaces where its first line is not indented).
    """
    if not is_chat(fmt):
        return truncate(text, fmt)
    code = extract_code(text)
    if not task.completes_prompt:
        return code
    if re.search(rf"^(?:async[ \t]+)?def[ \t]+{re.escape(task.entry_point)}[ \t]*\(", code,
                 re.M):
        return "\n" + code
    first = next((line for line in code.splitlines() if line.strip()), "")
    return code if first[:1].isspace() else textwrap.indent(code, "    ")
