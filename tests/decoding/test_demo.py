"""`mtp demo`: the race page served as a user starts it (`mtp demo --ckpt CKPT --port P`), driven
through its API with gradio_client: the streamed text is greedy's, every token carries its
origin, the counts per origin are the decode's statistics; bad input gets a clear message; Stop
ends the decoding; the racers take turns by their clocks."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from checkpoint_helpers import bpe_tokenizer
from demo_helpers import (
    assert_stopped,
    free_port,
    running_race,
    start_demo,
    stop_demo,
    trained_checkpoint,
)

from mtp.config import ModelConfig
from mtp.decoding.generation import generate
from mtp.decoding.origin import HEAD_1, LOOKUP, origin_name
from mtp.demo.cli import INSTALL, demo_main
from mtp.demo.race import Lane, live_races, race
from mtp.demo.render import TextPieces, lane_html, legend_html
from mtp.model.checkpoint import load_checkpoint, save_checkpoint
from mtp.model.transformer import MTPTransformer

gradio_client = pytest.importorskip("gradio_client", reason="the demo extra: pip install -e "
                                    "'.[demo]'")
torch.set_num_threads(1)

PROMPT = "def fib(n):"
CONTEXT = 1024


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return trained_checkpoint(tmp_path_factory.mktemp("demo") / "k4.ckpt", steps=100,
                              max_seq_len=CONTEXT)


@pytest.fixture(scope="module")
def server(ckpt):
    """`mtp demo` in a process of its own: (its address, its port)."""
    port = free_port()
    proc = start_demo(ckpt, port)
    yield f"http://127.0.0.1:{port}/", port
    stop_demo(proc)


@pytest.fixture(scope="module")
def client(server):
    return gradio_client.Client(server[0], verbose=False)


def _race(client, prompt=PROMPT, choice="heads: chain + lookup", temperature=0.0, tokens=64):
    """One race through the page's API: every frame streamed, and the last."""
    job = client.submit(prompt, choice, temperature, tokens, False, api_name="/race")
    last = job.result(timeout=300)
    return job.outputs(), last


def test_the_api_streams_greedys_text_and_every_tokens_origin(ckpt, client) -> None:
    frames, last = _race(client)
    data = last[-1]
    model, tok = load_checkpoint(ckpt)
    ids = tok.encode(PROMPT).ids
    ref, _ = generate(model, [ids], 64, decoder="greedy")
    greedy_text = tok.decode(ref[0], skip_special_tokens=True)
    spec, base = data["lanes"]["spec"], data["lanes"]["base"]
    # Streamed: each frame's text extends the one before; the last is greedy's.
    texts = [f[-1]["lanes"]["spec"]["text"] for f in frames]
    assert len(frames) >= 2 and all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert spec["text"] == base["text"] == greedy_text
    assert [t for toks, _ in spec["rounds"] for t in toks] == ref[0]
    assert data["identical_to_greedy"] is True and "identical to greedy: <b>yes</b>" in last[3]
    # Every token carries an origin, and the page shows each one.
    for toks, origins in spec["rounds"]:
        assert len(origins) == len(toks) > 0
        assert origins[-1] == HEAD_1 and all(origin_name(o) for o in origins)
    assert last[1].count("data-origin=") == len(ref[0])
    # The counts per origin are the decode's statistics.
    stats = spec["stats"]
    counts = Counter(o for _, origins in spec["rounds"] for o in origins)
    assert counts[HEAD_1] == stats["row_forwards"] == len(spec["rounds"])
    assert sum(counts.values()) == stats["tokens"] == len(ref[0])
    depths = Counter(i for _, origins in spec["rounds"] for i in range(len(origins) - 1))
    assert [depths[i] for i in range(len(stats["taken"]))] == stats["taken"]
    assert counts[2] and counts[LOOKUP], "this checkpoint's heads and lookup both draft here"
    assert {o for _, origins in base["rounds"] for o in origins} == {HEAD_1}
    # the legend counts what the lane shows
    assert f"head 2 draft</span> {counts[2]}" in last[2]


def test_sampling_races_plain_sampling(client) -> None:
    _, last = _race(client, choice="heads: tree", temperature=0.8, tokens=24)
    data = last[-1]
    assert data["lanes"]["base"]["name"] == "sample (temperature 0.8)"
    assert data["identical_to_greedy"] is None and "plain sampling's distribution" in last[3]
    assert data["lanes"]["spec"]["stats"]["tokens"] == 24


@pytest.mark.parametrize(("prompt", "choice", "temperature", "message"), [
    ("", "heads: chain", 0.0, "The prompt is empty"),
    ("   \n", "heads: chain", 0.0, "The prompt is empty"),
    ("x = 1\n" * 400, "heads: chain", 0.0,
     f"tokens but the context length (--model.max_seq_len) is {CONTEXT}: no room"),
    (PROMPT, "heads: chain + lookup", 0.7,
     "Prompt lookup is verified greedily: it takes no temperature"),
    (PROMPT, "heads: forest", 0.0, "heads: forest is not in the list of choices"),
])
def test_bad_input_gets_a_clear_message(client, prompt, choice, temperature, message) -> None:
    with pytest.raises(gradio_client.exceptions.AppError) as err:
        _race(client, prompt=prompt, choice=choice, temperature=temperature)
    assert message in str(err.value)


def test_a_port_in_use_is_refused_before_the_model_loads(server, ckpt, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        demo_main(["--ckpt", "no-such-file.ckpt", "--port", str(server[1])])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"--port {server[1]} is in use" in err and f"--port {server[1] + 1}" in err


def test_without_gradio_mtp_demo_says_how_to_install_it(monkeypatch, capsys) -> None:
    import importlib.util

    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "gradio" else find(name, *a))
    assert demo_main(["--ckpt", "any.ckpt"]) == 2
    assert INSTALL in capsys.readouterr().err and 'pip install -e ".[demo]"' in INSTALL


def _in_process(model, tok, source="k.ckpt"):
    """The page served from this process (so the test sees its races): (page, client)."""
    from mtp.demo.page import build_page, serve

    page = build_page(model, tok, source=source)
    url = serve(page, "127.0.0.1", free_port(), block=False)
    return page, gradio_client.Client(url, verbose=False)


def test_a_single_head_checkpoint_is_refused_for_the_heads(tmp_path, capsys) -> None:
    torch.manual_seed(0)
    cfg = ModelConfig.from_name("debug", vocab_size=320, n_future=1, max_seq_len=64)
    path = tmp_path / "k1.ckpt"
    save_checkpoint(path, MTPTransformer(cfg).eval(), bpe_tokenizer())
    model, tok = load_checkpoint(path)
    page, client = _in_process(model, tok, str(path))
    try:
        with pytest.raises(gradio_client.exceptions.AppError, match=r"single head "
                           r"\(--model.n_future 1\).*\(on this page: prompt lookup\)"):
            _race(client, choice="heads: chain", tokens=8)
        _, last = _race(client, choice="prompt lookup", tokens=8)  # what it can race
        assert last[-1]["lanes"]["spec"]["stats"]["tokens"] == 8
    finally:
        page.close()


def test_stop_ends_the_decoding(ckpt) -> None:
    """Stop (as a closed tab does: Gradio closes the event's generator) ends both racers at their
    next round, long before their max new tokens."""
    model, tok = load_checkpoint(ckpt)
    page, client = _in_process(model, tok)
    try:
        job = client.submit(PROMPT, "heads: chain", 0.0, CONTEXT - 10, False, api_name="/race")
        running = running_race(timeout=60)
        job.cancel()
        assert_stopped(running, timeout=30, max_new_tokens=CONTEXT - 10)
    finally:
        page.close()


def test_the_racers_take_turns_by_their_clocks(ckpt) -> None:
    """Each round heard was the turn of the lane whose clock was behind (or whose rival had
    finished); the outputs are each decoder's own."""
    model, tok = load_checkpoint(ckpt)
    ids = tok.encode(PROMPT).ids
    lanes = [Lane("chain", {"decoder": "self-spec"}), Lane("greedy", {"decoder": "greedy"})]
    r = race(model, ids, 48, lanes)
    assert lanes[0].tokens == lanes[1].tokens == generate(model, [ids], 48)[0][0]
    clocks, heard = [0.0, 0.0], [0, 0]
    for i in r.order:
        other = 1 - i
        rival_done = heard[other] == len(lanes[other].rounds)
        assert clocks[i] <= clocks[other] or rival_done, (i, clocks)
        clocks[i] = lanes[i].round_clocks[heard[i]]
        heard[i] += 1
    assert heard == [len(lane.rounds) for lane in lanes] and not live_races()


def test_the_lanes_html_joins_to_the_text_and_escapes_it() -> None:
    """Byte-level tokens that split a character: the pieces still join to the text; a token's
    text is escaped."""
    vocab = {1: b"<a", 2: "\u00e9".encode()[:1], 3: "\u00e9".encode()[1:], 4: b">"}

    def decode(ids: list[int]) -> str:
        return b"".join(vocab[i] for i in ids).decode("utf-8", errors="replace")

    pieces = TextPieces(decode)
    assert pieces.sync([1, 2]) == ["<a", "\ufffd"]  # held back so far, shown as it is
    assert pieces.sync([1, 2, 3, 4]) == ["<a", "", "\u00e9", ">"]
    lane = Lane("chain", {}, rounds=[([1], [HEAD_1]), ([2, 3, 4], [2, LOOKUP, HEAD_1])],
                clock=0.5)
    page = lane_html(lane, TextPieces(decode))
    assert "&lt;a" in page and "<a<" not in page and "8.0 tokens/s" in page
    assert "round 1: 3 tokens, 2 from accepted drafts (head 2, lookup, head 1)" in page
    assert "L 2.00 tokens/forward" in page
    assert 'mtp-o-lookup">lookup draft</span> 1' in legend_html([HEAD_1, LOOKUP],
                                                                 Counter([LOOKUP]))
