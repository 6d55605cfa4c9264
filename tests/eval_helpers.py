"""What the sandbox tests share: the benchmark data, a default sample run, and the naive
harness the attacks are shown to beat."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from mtp.eval.sandbox import ExecResult, Limits, run_program

DATA = Path(os.environ.get("MTP_SHARED_DATA", Path(__file__).parents[1].parent / "shared" / "data"))
LIMITS = Limits(timeout=10.0)
EQUALS_THREE = "def check(candidate):\n    assert candidate() == 3\n\ncheck(f)\n"


def run_sample(candidate: str, test: str = EQUALS_THREE, **kw) -> ExecResult:
    """One sample of entry point ``f`` (`LIMITS` unless given)."""
    return run_program(textwrap.dedent(candidate), test, entry_point="f",
                       limits=kw.pop("limits", LIMITS), **kw)


def naive(candidate: str, test: str = EQUALS_THREE) -> int:
    """Exit status of completion and tests exec'd in one namespace, pass = status 0."""
    program = f"ns = {{}}\nexec({textwrap.dedent(candidate)!r}, ns)\nexec({test!r}, ns)\n"
    return subprocess.run([sys.executable, "-c", program], capture_output=True,
                          timeout=30).returncode
