"""Completion and tests in separate processes: what crosses, what cannot, and who decides.

The attacks here beat a harness that runs the tests beside the completion (each is shown to pass
with ``shared=True`` or a naive in-process run, so these tests can fail); across the pipe they
fail, with a result that says why.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from mtp.eval.data import load_benchmark
from mtp.eval.execution import TimePolicy, calibrate, plan, prepare
from mtp.eval.harness import evaluate_completions
from mtp.eval.sandbox import Limits, detect_isolation, run_program

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the sandbox needs Linux")

DATA = Path(os.environ.get("MTP_SHARED_DATA", Path(__file__).parents[1].parent / "shared" / "data"))
LIMITS = Limits(timeout=10.0)
EQUALS_THREE = "def check(candidate):\n    assert candidate() == 3\n\ncheck(f)\n"


def _run(candidate: str, test: str = EQUALS_THREE, **kw):
    return run_program(textwrap.dedent(candidate), test, entry_point="f",
                       limits=kw.pop("limits", LIMITS), **kw)


def _naive(candidate: str, test: str = EQUALS_THREE) -> int:
    """Exit status of completion and tests exec'd in one namespace, pass = status 0."""
    program = f"ns = {{}}\nexec({textwrap.dedent(candidate)!r}, ns)\nexec({test!r}, ns)\n"
    return subprocess.run([sys.executable, "-c", program], capture_output=True,
                          timeout=30).returncode


LIARS = {
    "object": """
        class Anything:
            def __eq__(self, other):
                return True
        def f():
            return Anything()
    """,
    "int subclass": """
        class Three(int):
            def __eq__(self, other):
                return True
            __hash__ = int.__hash__
        def f():
            return Three(0)
    """,
    "str subclass": """
        class S(str):
            __eq__ = lambda self, other: True
            __hash__ = str.__hash__
        def f():
            return S("not three")
    """,
    "inside a list": """
        class Anything:
            __eq__ = lambda self, other: True
        def f():
            return [Anything()]
    """,
}


@pytest.mark.parametrize("kind", LIARS)
def test_values_that_lie_about_equality_fail_with_their_type_named(kind):
    test = EQUALS_THREE.replace("candidate() == 3", "candidate() == ([3] if 'list' in "
                                f"{kind!r} else 3)")
    assert _naive(LIARS[kind], test) == 0  # beside the tests, the lie passes
    assert _run(LIARS[kind], test, shared=True).passed
    result = _run(LIARS[kind], test)
    assert not result.passed and result.outcome == "failed"
    name = {"object": "Anything", "int subclass": "Three", "str subclass": "S",
            "inside a list": "Anything"}[kind]
    assert f"f returned a candidate.{name} (not plain data)" in result.error, result.error


def test_a_refusal_is_final_even_where_the_tests_catch_everything():
    test = ("def check(candidate):\n    try:\n        candidate()\n    except BaseException:\n"
            "        pass\n\ncheck(f)\n")
    result = _run(LIARS["object"], test)
    assert not result.passed and "not plain data" in result.error


FRAME_WALK = """
    import gc, os, sys

    send = sys.modules["__main__"].send  # the harness's own message writer
    PASSED = {"status": "passed", "detail": "", "cpu": 0.0}

    def f():
        return 0

    def forge(namespace):
        if "token" in namespace and "fd" in namespace:  # the verdict channel of the harness
            send(namespace["fd"], {**PASSED, "token": namespace["token"]})
            os._exit(0)

    frame = sys._getframe()
    while frame is not None:
        forge(frame.f_locals)
        frame = frame.f_back
    for obj in gc.get_objects():
        if isinstance(obj, dict):
            forge(obj)
    # Nothing of the harness here: forge a verdict on every descriptor.
    for fd in range(3, 256):
        try:
            send(fd, PASSED)
            os.write(fd, b"PASS\\n")
        except OSError:
            pass
    os._exit(0)
"""


def test_walking_frames_and_the_heap_forges_nothing():
    # Beside the tests the walk finds the verdict channel and its token, and forges a pass.
    assert _run(FRAME_WALK, shared=True).passed
    result = _run(FRAME_WALK)
    assert not result.passed
    assert "the completion's process" in result.error, result.error


def test_exceptions_cross_as_exceptions():
    candidate = """
        class Custom(ValueError):
            pass
        def f(kind):
            if kind == "value":
                raise Custom("bad value")
            if kind == "key":
                raise KeyError("k", 2)
            if kind == "exit":
                raise SystemExit(0)
            return kind
    """
    test = textwrap.dedent("""
        def check(candidate):
            try:
                candidate("value")
            except ValueError as e:
                assert str(e) == "bad value"
            else:
                raise AssertionError("no ValueError")
            try:
                candidate("key")
            except KeyError as e:
                assert e.args == ("k", 2)
            assert candidate("ok") == "ok"

        check(f)
    """)
    assert _run(candidate, test).passed
    exiting = test.replace('candidate("ok") == "ok"', 'candidate("exit")')
    result = _run(candidate, exiting)
    assert not result.passed and "SystemExit" in result.error


def test_arguments_and_keywords_cross_and_mutation_does_not():
    candidate = "def f(xs, *, key):\n    xs.append(key)\n    return xs\n"
    test = ("data = [1, 2]\nassert f(data, key=(3, {4: b'x'})) == [1, 2, (3, {4: b'x'})]\n"
            "assert data == [1, 2]  # the completion got a copy\n")
    assert _run(candidate, test).passed


def test_an_argument_that_cannot_cross_is_an_error_of_the_task():
    result = _run("def f(g):\n    return 3\n", "assert f(lambda: 1) == 3\n")
    assert not result.passed and result.outcome == "error"
    assert "argument that cannot cross: a function (not plain data)" in result.error


@pytest.mark.parametrize("candidate, why", [
    ("import os\ndef f():\n    os._exit(0)\n", "ended during a call to f"),
    ("import os\ndef f():\n    os.read(0, 1)\n    os.close(0)\n    return 3\n", ""),
    ("raise ImportError('no numpy')\n", "ImportError: no numpy"),
    ("def g():\n    return 3\n", "name 'f' is not defined by the completion"),
    ("f = 3\n", "name 'f' is not defined by the completion"),
])
def test_a_completion_that_breaks_the_channel_fails(candidate, why):
    result = _run(candidate)
    if why:
        assert not result.passed and why in result.error, result
    else:
        assert result.passed  # reading its own stdin is harmless


def test_cpu_limit_ends_a_busy_completion_and_says_so():
    result = _run("def f():\n    while True:\n        pass\n",
                  limits=Limits(timeout=20.0, cpu_seconds=1))
    assert result.outcome == "timeout" and result.error == "used more than 1 s of CPU"
    assert result.duration < 10  # well before the wall clock's 20 s


def test_memory_limit_covers_the_whole_sample():
    """Four processes of 300 MiB each: every one is under the per-process limit, together they
    are over the sample's (a cgroup's, where one can be made; `Isolation.memory_cgroup` says
    whether it could)."""
    candidate = """
        import os
        def f():
            children = []
            for _ in range(4):
                pid = os.fork()
                if pid == 0:
                    block = bytearray(300 << 20)
                    for i in range(0, len(block), 4096):
                        block[i] = 1
                    import time
                    time.sleep(1)  # all four hold their blocks at once
                    os._exit(0)
                children.append(pid)
            ok = all(os.waitpid(pid, 0)[1] == 0 for pid in children)
            return 3 if ok else 0
    """
    together = _run(candidate, limits=Limits(timeout=20.0, memory_bytes=768 << 20))
    if detect_isolation().memory_cgroup:
        assert not together.passed
    else:  # no cgroup can be made: the per-process limit alone holds, and each process fits
        assert together.passed
    assert _run(candidate, limits=Limits(timeout=20.0, memory_bytes=2 << 30)).passed


def test_humaneval_helpers_come_from_the_prompt_not_the_completion():
    task = load_benchmark("humaneval").by_id()["HumanEval/32"]
    p = plan(task)
    assert not p.shared and p.proxied == ("find_zero",) and "def poly" in p.helpers
    # The completion replaces the prompt's poly by one that makes any answer a root.
    completion = "    return 0.0\n\n\ndef poly(xs, x):\n    return 0.0\n"
    program = task.program(completion)
    assert run_program(program, task.test, entry_point=task.entry_point, shared=True,
                       limits=LIMITS).passed
    result = run_program(program, task.test, entry_point=task.entry_point, proxied=p.proxied,
                         helpers=p.helpers, limits=LIMITS)
    assert not result.passed and "AssertionError" in result.error


def test_plans_of_the_benchmarks():
    humaneval = load_benchmark("humaneval")
    mbpp = load_benchmark("mbpp", DATA / "mbpp" / "mbpp.jsonl")
    shared = {t.task_id: plan(t).reason for t in humaneval.tasks + mbpp.tasks if plan(t).shared}
    assert list(shared) == ["Mbpp/367"]
    assert "Node" in shared["Mbpp/367"]
    with_helpers = sorted(t.task_id for t in humaneval.tasks if plan(t).helpers)
    assert with_helpers == ["HumanEval/32", "HumanEval/38", "HumanEval/50"]


def test_calibration_is_cached_per_machine_and_moves_counter_answers_to_shared(tmp_path):
    mbpp = load_benchmark("mbpp", DATA / "mbpp" / "mbpp.jsonl").by_id()
    tasks = [mbpp[i] for i in ("Mbpp/40", "Mbpp/11", "Mbpp/367")]
    cache = tmp_path / "ref.json"
    ran = []
    iso = detect_isolation()
    cal = calibrate(tasks, isolation=iso, workers=2, cache=cache,
                    on_result=lambda t, r: ran.append((t.task_id, r.passed)))
    assert sorted(ran) == [("Mbpp/11", True), ("Mbpp/367", True), ("Mbpp/40", True)]
    assert all(0 < cal.cpu[t.task_id] < 5 for t in tasks)
    assert list(cal.shared) == ["Mbpp/40"] and "collections.Counter" in cal.shared["Mbpp/40"]
    assert cal.plan(mbpp["Mbpp/40"]).shared and not cal.plan(mbpp["Mbpp/11"]).shared
    ran.clear()
    again = calibrate(tasks, isolation=iso, workers=2, cache=cache,
                      on_result=lambda t, r: ran.append(t.task_id))
    assert ran == [] and again.cpu == cal.cpu and again.shared == cal.shared
    # Another machine's numbers, or a damaged file, are measured again (and the file rewritten).
    for content in (json.dumps({"machine": "elsewhere", "tasks": json.loads(
            cache.read_text())["tasks"]}), "{not json"):
        cache.write_text(content)
        calibrate(tasks[1:2], isolation=iso, workers=1, cache=cache,
                  on_result=lambda t, r: ran.append(t.task_id))
        assert json.loads(cache.read_text())["machine"] != "elsewhere"
    assert ran == ["Mbpp/11", "Mbpp/11"]


def test_task_limits_follow_the_reference_and_land_in_the_summary(tmp_path):
    mbpp = load_benchmark("mbpp", DATA / "mbpp" / "mbpp.jsonl")
    mbpp.tasks = [t for t in mbpp.tasks if t.task_id in ("Mbpp/11", "Mbpp/12")]
    cache, iso = tmp_path / "ref.json", detect_isolation()
    floor = prepare(mbpp.tasks, base=Limits(), policy=TimePolicy(), isolation=iso, workers=2,
                    cache=cache)
    assert floor.limits("Mbpp/11").cpu_seconds == TimePolicy().floor  # references: 50 ms
    policy = TimePolicy(factor=4.0, floor=0.01)
    scaled = prepare(mbpp.tasks, base=Limits(), policy=policy, isolation=iso, workers=2,
                     cache=cache)
    ref = scaled.calibration.cpu["Mbpp/11"]
    assert scaled.limits("Mbpp/11").cpu_seconds == pytest.approx(4 * ref)
    assert scaled.limits("Mbpp/11").timeout == Limits().timeout  # the floor of the backstop
    fixed = prepare(mbpp.tasks, base=Limits(cpu_seconds=3), policy=policy, isolation=iso,
                    workers=2, cache=cache)
    assert fixed.calibration is None and fixed.limits("Mbpp/11").cpu_seconds == 3
    completions = [{"task_id": t.task_id, "sample": 0, "completion": t.canonical_solution}
                   for t in mbpp.tasks]
    summary = evaluate_completions(mbpp, completions=completions, output_dir=tmp_path / "out",
                                   policy=policy, calibration_cache=cache)
    assert summary["n_passed"] == 2
    limits = summary["execution"]["limits"]
    assert limits["cpu_seconds"]["Mbpp/11"] == round(4 * ref, 3)
    assert limits["policy"] == {"factor": 4.0, "floor": 0.01, "wall_factor": 3.0}
    assert summary["execution"]["modes"] == {"calls": 2, "shared": {}}
    assert summary["isolation"]["memory_cgroup"] == iso.memory_cgroup
    rows = [json.loads(line) for line in (tmp_path / "out" / "samples.jsonl").open()]
    assert {r["mode"] for r in rows} == {"calls"}


def test_a_completion_cannot_look_its_answer_up_in_the_benchmark_data(tmp_path):
    bench = load_benchmark("mbpp", DATA / "mbpp" / "mbpp.jsonl")
    bench.tasks = [bench.by_id()["Mbpp/11"]]
    task = bench.tasks[0]
    data = str((DATA / "mbpp" / "mbpp.jsonl").resolve())
    # Reads the benchmark's own file and runs the reference solution as its own.
    completion = (f"import json\nfor _line in open({data!r}):\n    _row = json.loads(_line)\n"
                  f"    if _row['task_id'] == 11:\n        exec(_row['code'], globals())\n")
    if not data.startswith("/tmp/"):  # (a sample's /tmp is its own: such data is out of sight)
        assert run_program(completion, task.test, entry_point=task.entry_point,
                           limits=LIMITS).passed  # with the data in sight, the lookup works
    summary = evaluate_completions(
        bench, completions=[{"task_id": task.task_id, "sample": 0, "completion": completion}],
        limits=LIMITS, policy=None, output_dir=tmp_path)
    [result] = map(json.loads, (tmp_path / "samples.jsonl").open())
    hidden = summary["execution"]["hidden_from_completions"]
    if detect_isolation().method == "bwrap":
        assert any(data.startswith(d + "/") for d in hidden)
        assert not result["passed"] and "FileNotFoundError" in result["error"], result
    else:  # nothing can be hidden, and the summary claims nothing is
        assert hidden == [] and (result["passed"] or data.startswith("/tmp/"))


def test_sandbox_cpu_time_resolves_below_a_clock_tick():
    """The CPU seconds a sandboxed process reports follow the kernel's own per-process clock to a
    millisecond; a 10 ms clock-tick count (os.times) reads a 3 ms burst as 0 or 10 ms."""
    import time

    from mtp.eval.inside import _cpu_seconds

    errors = []
    for _ in range(5):
        a, pa = _cpu_seconds(), time.process_time()
        while time.process_time() - pa < 0.003:
            pass
        b, pb = _cpu_seconds(), time.process_time()
        errors.append(abs((b - a) - (pb - pa)))
    assert min(errors) < 0.001, errors
