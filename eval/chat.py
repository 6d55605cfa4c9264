"""Chat prompts for instruct models: render a model's own chat template, read the code back out.

An instruct model asked to continue a raw HumanEval prompt tends to open a code fence and explain
in prose. The ``*-chat`` formats of :mod:`mtp.eval.prompts` instead send one user message through
the model's chat template (``ModelConfig.chat_template``, read from the pretrained tokenizer's
metadata) and take the code from the answer (:func:`extract_code`), as bigcode-evaluation-harness's
instruct tasks and EvalPlus do.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache

__all__ = ["ChatTemplate", "code_closed", "extract_code"]


def _raise_exception(message: str):
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes HTML characters; transformers replaces it with plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=8)
def _compile(template: str):
    """The template in the environment transformers' ``apply_chat_template`` renders it in."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` marks the assistant's tokens for training
        masks (transformers' AssistantTracker); rendering keeps its body as it is."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body
                                          ).set_lineno(lineno)

        def _body(self, caller) -> str:
            return caller()

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


@dataclass(frozen=True)
class ChatTemplate:
    """A model's Jinja chat template and the special tokens it may name."""

    template: str
    """The Jinja source (``ModelConfig.chat_template``)."""
    eos_token: str | None = None
    """Passed as ``eos_token`` (the model's end-of-text token, ``ModelConfig.eot_token``)."""
    bos_token: str | None = None
    """Passed as ``bos_token``; None leaves it undefined, which renders as nothing."""

    def render(self, messages: list[dict], *, add_generation_prompt: bool = True) -> str:
        """The conversation as text, as transformers' ``apply_chat_template(messages,
        tokenize=False, add_generation_prompt=...)`` renders it with these special tokens.

        Raises:
            jinja2.TemplateError: If the template raises (``raise_exception``) or does not parse.
        """
        # NOTE: an mtp checkpoint keeps only its end-of-text token, so a template's
        # `{{ bos_token }}` renders empty; a tokenizer that adds its BOS itself then still
        # encodes a single one (transformers encodes rendered chats without special tokens).
        tokens = {k: v for k, v in (("bos_token", self.bos_token), ("eos_token", self.eos_token))
                  if v is not None}
        return _compile(self.template).render(
            messages=[dict(m) for m in messages], tools=None, documents=None,
            add_generation_prompt=add_generation_prompt, **tokens)


# A fence line: three or more backticks, then an info string whose first word is the language.
_FENCE = re.compile(r"^([ \t]*)```+[ \t]*([^\s`]*)[^`]*$")
_PYTHON = ("", "python", "python3", "py")


def extract_code(answer: str) -> str:
    """The code of a chat answer: the first fenced block in Python or without a language (the
    rest of the answer where its closing fence is missing), else the whole answer.

    A fence indented by n spaces (inside a list item) has up to n spaces taken off each of its
    lines, as Markdown reads it.
    """
    code, _ = _first_block(answer)
    return answer if code is None else code


def code_closed(answer: str) -> bool:
    """Whether the answer's code is final: its first fenced Python block has closed, so no later
    text changes what :func:`extract_code` returns. The chat formats stop decoding there."""
    return _first_block(answer)[1]


def _first_block(answer: str) -> tuple[str | None, bool]:
    """(code of the first Python or language-less fenced block, whether its fence closed);
    (None, False) where no such block opened."""
    lines = answer.splitlines(keepends=True)
    opened: tuple[int, str, int] | None = None  # (line, language, indent) of an open fence
    for i, line in enumerate(lines):
        m = _FENCE.match(line.rstrip("\r\n"))
        if m is None:
            continue
        if opened is None:
            opened = (i, m.group(2).lower(), len(m.group(1).expandtabs(4)))
            continue
        start, language, indent = opened
        if language in _PYTHON:
            # A closing fence on the last line is final only once its line has ended.
            return _unindent(lines[start + 1 : i], indent), line.endswith("\n")
        opened = None
    if opened is not None and opened[1] in _PYTHON:
        return _unindent(lines[opened[0] + 1 :], opened[2]), False
    return None, False


def _unindent(lines: list[str], n: int) -> str:
    if n:
        lines = [re.sub(rf"^ {{0,{n}}}", "", line) for line in lines]
    return "".join(lines)
