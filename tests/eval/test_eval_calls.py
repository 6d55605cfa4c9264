"""Completion and tests in separate processes: what crosses, what cannot, and who decides.

The attacks here beat a harness that runs the tests beside the completion (each is shown to pass
a naive in-process run, so these tests can fail); across the pipe they fail, with a result that
says why.
"""

from __future__ import annotations

import gzip
import json
import sys
import textwrap

import pytest
from eval_helpers import DATA, EQUALS_THREE, LIMITS, naive, run_sample
from mtp.eval.data import load_benchmark
from mtp.eval.execution import TimePolicy, calibrate, plan, prepare, run_task
from mtp.eval.harness import evaluate_completions
from mtp.eval.sandbox import Limits, detect_isolation, run_program

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the sandbox needs Linux")


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
    assert naive(LIARS[kind], test) == 0  # beside the tests, the lie passes
    result = run_sample(LIARS[kind], test)
    assert not result.passed and result.outcome == "failed"
    name = {"object": "Anything", "int subclass": "Three", "str subclass": "S",
            "inside a list": "Anything"}[kind]
    assert f"f returned a candidate.{name} (not plain data)" in result.error, result.error


# Rewrites the int object 3 in place with ctypes (its size field to 0: CPython 3.11's layout), so
# that every 3 of the interpreter equals 0.
CTYPES_SLOT = """
    import ctypes
    three = 3
    ctypes.c_ssize_t.from_address(id(three) + 16).value = 0
    def f():
        return 0
"""


def test_a_ctypes_overwrite_changes_the_completions_interpreter_only():
    if sys.version_info[:2] == (3, 11):  # the layout the attack writes
        assert naive(CTYPES_SLOT) == 0  # beside the tests, 0 == 3
    result = run_sample(CTYPES_SLOT)
    assert not result.passed and "AssertionError" in result.error, result


def test_a_refusal_is_final_even_where_the_tests_catch_everything():
    test = ("def check(candidate):\n    try:\n        candidate()\n    except BaseException:\n"
            "        pass\n\ncheck(f)\n")
    result = run_sample(LIARS["object"], test)
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
    result = run_sample(FRAME_WALK)
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
    assert run_sample(candidate, test).passed
    exiting = test.replace('candidate("ok") == "ok"', 'candidate("exit")')
    result = run_sample(candidate, exiting)
    assert not result.passed and "SystemExit" in result.error


def test_arguments_and_keywords_cross_and_mutation_does_not():
    candidate = "def f(xs, *, key):\n    xs.append(key)\n    return xs\n"
    test = ("data = [1, 2]\nassert f(data, key=(3, {4: b'x'})) == [1, 2, (3, {4: b'x'})]\n"
            "assert data == [1, 2]  # the completion got a copy\n")
    assert run_sample(candidate, test).passed


def test_an_argument_that_cannot_cross_is_an_error_of_the_task():
    result = run_sample("def f(g):\n    return 3\n", "assert f(lambda: 1) == 3\n")
    assert not result.passed and result.outcome == "error"
    assert "argument that cannot cross while calling f: a function (not plain data)" \
        in result.error


@pytest.mark.parametrize("candidate, why", [
    ("import os\ndef f():\n    os._exit(0)\n", "ended while calling f"),
    ("import os\ndef f():\n    os.read(0, 1)\n    os.close(0)\n    return 3\n", ""),
    ("raise ImportError('no numpy')\n", "ImportError: no numpy"),
    ("def g():\n    return 3\n", "NameError: name 'f' is not defined"),
    ("f = 3\n", "TypeError: 'int' object is not callable"),
    ("import re\nf = re.compile('x')\n", "a name the tests use is a re.Pattern (not plain"),
])
def test_a_completion_that_breaks_the_channel_fails(candidate, why):
    result = run_sample(candidate)
    if why:
        assert not result.passed and why in result.error, result
    else:
        assert result.passed  # reading its own stdin is harmless


def test_cpu_limit_ends_a_busy_completion_and_says_so():
    result = run_sample("def f():\n    while True:\n        pass\n",
                  limits=Limits(timeout=20.0, cpu_seconds=1))
    assert result.outcome == "timeout" and result.error == "used more than 1 s of CPU"


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
    together = run_sample(candidate, limits=Limits(timeout=20.0, memory_bytes=768 << 20))
    if detect_isolation().memory_cgroup:
        assert not together.passed
    else:  # no cgroup can be made: the per-process limit alone holds, and each process fits
        assert together.passed
    assert run_sample(candidate, limits=Limits(timeout=20.0, memory_bytes=2 << 30)).passed


def test_humaneval_helpers_come_from_the_prompt_not_the_completion():
    task = load_benchmark("humaneval").by_id()["HumanEval/32"]
    p = plan(task)
    assert p.proxied == ("find_zero",) and "def poly" in p.helpers
    # The completion replaces the prompt's poly by one that makes any answer a root.
    completion = "    return 0.0\n\n\ndef poly(xs, x):\n    return 0.0\n"
    program = task.program(completion)
    assert naive(program, task.test + f"\ncheck({task.entry_point})\n") == 0
    result = run_program(program, task.test, entry_point=task.entry_point, proxied=p.proxied,
                         helpers=p.helpers, limits=LIMITS)
    assert not result.passed and "AssertionError" in result.error


def test_plans_of_the_benchmarks():
    humaneval = load_benchmark("humaneval")
    mbpp = load_benchmark("mbpp", DATA / "mbpp" / "mbpp.jsonl")
    more = {t.task_id: plan(t).proxied for t in humaneval.tasks + mbpp.tasks
            if len(plan(t).proxied) > 1}
    assert more == {"Mbpp/367": ("is_tree_balanced", "Node")}
    with_helpers = sorted(t.task_id for t in humaneval.tasks if plan(t).helpers)
    assert with_helpers == ["HumanEval/32", "HumanEval/38", "HumanEval/50"]


def _mbpp(*ids: str):
    bench = load_benchmark("mbpp", DATA / "mbpp" / "mbpp.jsonl").by_id()
    return [bench[i] for i in ids]


def _mbpp_plus(*ids: str):
    bench = load_benchmark("mbpp+", DATA / "evalplus" / "MbppPlus-OriginFmt.jsonl.gz")
    return bench, [bench.by_id()[i] for i in ids]


def _score(task, completion: str):
    return run_task(task, completion, LIMITS, detect_isolation())


def test_a_tree_of_the_completions_own_class_is_built_by_the_tests_across_the_pipe():
    """MBPP 367's tests build trees from the completion's Node class: the nodes stay in the
    completion's process, the tests hold handles; right answers pass, wrong ones fail."""
    [task] = _mbpp("Mbpp/367")
    assert _score(task, task.canonical_solution).passed
    renamed = task.canonical_solution.replace("self.data", "self.value")  # its own attributes
    assert _score(task, renamed).passed
    always = task.canonical_solution + "\ndef is_tree_balanced(root):\n    return True\n"
    result = _score(task, always)
    assert not result.passed and "AssertionError" in result.error
    # A node that claims to equal anything stays a handle: the tests compare identities.
    liar = task.canonical_solution + textwrap.dedent("""
        Node.__eq__ = lambda self, other: True
        Node.__hash__ = object.__hash__
        def f(root):
            return root
    """)
    identity = ("a = Node(1)\nb = Node(2)\nassert f(a) is a\nassert f(a) != b\n"
                "a.left = b\nassert a.left is b and a.left.data == 2\n")
    assert run_program(liar, identity, entry_point="f", proxied=["f", "Node"],
                       limits=LIMITS).passed
    leak = task.canonical_solution + "\ndef f(root):\n    return [root, object()]\n"
    result = run_program(leak, "f(Node(1))\n", entry_point="f", proxied=["f", "Node"],
                         limits=LIMITS)
    assert not result.passed and "f returned a object (not plain data)" in result.error


@pytest.mark.parametrize("task_id", ["Mbpp/40", "Mbpp/88"])
def test_a_counter_answer_crosses_as_a_counter_and_a_lying_one_does_not(task_id):
    [task] = _mbpp(task_id)
    assert _score(task, task.canonical_solution).passed
    lie = textwrap.dedent(f"""
        import collections
        class Tally(collections.Counter):
            def __eq__(self, other):
                return True
        def {task.entry_point}(*args):
            return Tally()
    """)
    patched = textwrap.dedent(f"""
        import collections
        collections.Counter.__eq__ = lambda self, other: True
        def {task.entry_point}(*args):
            return collections.Counter()
    """)
    for completion in (lie, patched):
        assert naive(completion, task.test) == 0  # beside the tests the lie passes
        assert not _score(task, completion).passed


def test_mbpp_plus_tests_that_never_asserted_now_do():
    """MbppPlus-OriginFmt's `assertion` for tasks 737, 787 and 794 computes `exact_match` and
    asserts nothing: any answer passed. Loaded, they assert it; the references (which return
    an re.Match, crossing as a Match) still pass, and an answer that is always wrong fails."""
    ids = ("Mbpp/737", "Mbpp/787", "Mbpp/794")
    bench, tasks = _mbpp_plus(*ids)
    assert sorted(bench.repairs) == sorted(ids)
    assert all("assert exact_match" in bench.repairs[i] for i in ids)
    raw = {json.loads(line)["task_id"]: json.loads(line)["test"] for line in gzip.open(
        DATA / "evalplus" / "MbppPlus-OriginFmt.jsonl.gz", "rt")}
    for task in tasks:
        wrong = f"def {task.entry_point}(text):\n    return None\n"
        assert naive(wrong, raw[int(task.task_id.split("/")[1])]) == 0  # as shipped
        assert _score(task, task.canonical_solution).passed, task.task_id
        result = _score(task, wrong)
        assert not result.passed and "AssertionError" in result.error


def test_calibration_is_cached_per_machine(tmp_path):
    tasks = _mbpp("Mbpp/40", "Mbpp/11", "Mbpp/367")
    cache = tmp_path / "ref.json"
    ran = []
    iso = detect_isolation()
    cal = calibrate(tasks, isolation=iso, workers=2, cache=cache,
                    on_result=lambda t, r: ran.append((t.task_id, r.passed)))
    assert sorted(ran) == [("Mbpp/11", True), ("Mbpp/367", True), ("Mbpp/40", True)]
    assert all(0 < cal.cpu[t.task_id] < 5 for t in tasks)
    ran.clear()
    again = calibrate(tasks, isolation=iso, workers=2, cache=cache,
                      on_result=lambda t, r: ran.append(t.task_id))
    assert ran == [] and again.cpu == cal.cpu
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
