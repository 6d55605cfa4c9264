"""`mtp demo` in a real browser: headless Chromium from Debian's package, driven by Playwright
with that system browser (Playwright downloads none). The page loads, races a prompt on a small
checkpoint, shows coloured tokens and "identical to greedy: yes", and is saved as a screenshot;
a closed tab stops its decoding.

`MTP_DEMO_CKPT=CKPT` races on that checkpoint instead (the README's picture: the recipe's
SmolLM2 heads, its HumanEval example), and `MTP_DEMO_SCREENSHOT=PATH` saves the picture there.
Skipped, saying why, where Chromium or Playwright is not installed (`.ci/run` installs both).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from demo_helpers import assert_stopped, free_port, running_race, trained_checkpoint

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
if not Path(CHROMIUM).exists():
    pytest.skip("no Chromium installed (Debian: apt-get install -y chromium; .ci/run installs it)",
                allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright is not installed "
                               "(pip install playwright; .ci/run installs it)")
pytest.importorskip("gradio", reason="the demo extra: pip install -e '.[demo]'")

from mtp.demo.page import build_page, serve, warm_up  # noqa: E402  (after the skips: Gradio)
from mtp.model.checkpoint import load_checkpoint  # noqa: E402

torch.set_num_threads(1)
#: The system browser's flags: no sandbox (root), no GPU, and nothing that reaches the network.
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
CONTEXT = 4096
VERDICT = "#mtp-verdict .mtp-verdict"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The page of a small K = 4 checkpoint (or of MTP_DEMO_CKPT), served from this process so
    the test sees its races: (its address, whether it is the given checkpoint)."""
    given = os.environ.get("MTP_DEMO_CKPT")
    ckpt = Path(given) if given else trained_checkpoint(
        tmp_path_factory.mktemp("demo") / "k4.ckpt", steps=100, max_seq_len=CONTEXT)
    model, tok = load_checkpoint(ckpt)
    warm_up(model, tok)  # as `mtp demo` does before it serves
    page = build_page(model, tok, source=str(ckpt), max_new_tokens=128 if given else 96)
    url = serve(page, "127.0.0.1", free_port(), block=False)
    yield url, given is not None
    page.close()


@pytest.fixture
def browser(tmp_path):
    with sync_api.sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(tmp_path / "profile"), executable_path=CHROMIUM, args=FLAGS, headless=True,
            viewport={"width": 1280, "height": 900})
        yield context
        context.close()


def _open(browser, url: str):
    page = browser.new_page()
    page.goto(url)
    page.wait_for_selector("#mtp-prompt textarea", timeout=120_000)
    return page


def _choose(page, decoder: str) -> None:
    page.click("#mtp-decoder input")
    page.get_by_role("option", name=decoder, exact=True).click()


def test_the_page_races_a_prompt_and_shows_who_drafted_each_token(served, browser, tmp_path):
    url, given = served
    page = _open(browser, url)
    if given:  # the real model: the HumanEval example, as `mtp eval` asks an instruct model
        page.get_by_role("button", name=re.compile("^Please provide a self-contained")).click()
        sync_api.expect(page.locator("#mtp-prompt textarea")).to_have_value(
            re.compile("truncate_number"), timeout=30_000)
    else:
        page.fill("#mtp-prompt textarea", "def fib(n):")
    _choose(page, "heads: chain + lookup")
    page.click("#mtp-race")
    page.wait_for_selector(f"{VERDICT}:has-text('identical to greedy')", timeout=600_000)
    assert "identical to greedy: yes" in page.inner_text(VERDICT)
    spec = page.locator("#mtp-spec")
    # coloured tokens: drafts of the heads and of lookup, beside head 1's own
    heads = spec.locator(".mtp-o-h2, .mtp-o-h3, .mtp-o-h4").count()
    lookup = spec.locator(".mtp-o-lookup").count()
    assert heads > 0 and lookup > 0
    colour = spec.locator(".mtp-o-h2").first.evaluate("e => getComputedStyle(e).backgroundColor")
    assert colour not in ("rgba(0, 0, 0, 0)", "transparent")
    assert page.locator("#mtp-base .mtp-o-h2").count() == 0  # greedy drafts nothing
    assert spec.locator(".mtp-round").count() > 1  # round marks
    assert "head 2 draft" in page.inner_text("#mtp-legend")
    assert page.locator("#mtp-chart .mtp-bar").count() >= 3  # the acceptance chart
    shot = Path(os.environ.get("MTP_DEMO_SCREENSHOT", tmp_path / "demo.png"))
    shot.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000
    # the figures of the run, for a note beside `mtp bench decode`'s (pytest -s shows them)
    print(f"screenshot: {shot}\n{page.inner_text('#mtp-base .mtp-head')}\n"
          f"{page.inner_text('#mtp-spec .mtp-head')}\n{page.inner_text(VERDICT)}")


def test_a_closed_tab_stops_its_decoding(served, browser):
    url, given = served
    if given:
        pytest.skip("needs the small checkpoint's long context")
    page = _open(browser, url)
    page.fill("#mtp-prompt textarea", "def fib(n):")
    number = page.locator("#mtp-new-tokens input[type=number]")
    number.fill(str(CONTEXT - 10))
    number.press("Enter")
    _choose(page, "heads: chain")
    page.click("#mtp-race")
    running = running_race(timeout=120)
    page.close()
    assert_stopped(running, timeout=60, max_new_tokens=CONTEXT - 10)
