"""The programs that run inside the sandbox, first thing in each fresh interpreter.

:mod:`mtp.eval.sandbox.processes` starts ``python -I -S -B`` on a program compiled from the text
of :mod:`mtp.eval.wire`, then this module, then a call of one of the three entry points below
with ``WORKDIR``. They are trusted code: each reads its orders from ``WORKDIR/.orders`` (and
deletes it), sets the resource limits, drops to the sample's uid, and only then touches
untrusted code. Verdicts go to the harness as :mod:`mtp.eval.wire` messages on a pipe of their
own.

* `serve_candidate`: runs the completion as module ``candidate``, then answers calls that arrive
  on a pipe, one at a time, with plain data (:mod:`mtp.eval.wire`). It never sees the tests.
* `run_tests`: runs a benchmark's tests in a namespace where the names they take from the
  completion are proxies that call across that pipe. It never runs completion code, only the
  benchmark's own (the tests, and for HumanEval the prompt's helper functions); every value it
  gets back is a fresh builtin object. It writes its verdict on its own result pipe.
* `run_shared`: completion and tests in one interpreter, for tasks whose tests need more than
  calls (a class the completion defines, say); guarded against the tricks listed in
  :mod:`mtp.eval.sandbox`, which this design cannot close fully.

Standard library only: ``mtp`` is not importable in the sandbox.
"""

import os
import resource
import sys

if __name__ != "__main__":  # imported as part of mtp; in the sandbox wire's source comes first
    from mtp.eval.wire import NotPlainData, decode, encode, recv, send


def _setup(workdir):
    """Read the orders, set the limits, drop privileges, enter the working directory."""
    spec_path = os.path.join(workdir, ".orders")
    with open(spec_path, "rb") as f:
        spec = decode(f.read())
    os.unlink(spec_path)
    for name, (soft, hard) in spec["rlimits"].items():
        resource.setrlimit(getattr(resource, name), (soft, hard))
    if spec["uid"] is not None:
        os.setgroups([])
        os.setgid(spec["uid"])
        os.setuid(spec["uid"])
        if os.getuid() == 0 or os.geteuid() == 0:
            if "result_fd" not in spec:
                os._exit(1)
            _report(spec["result_fd"], "error", "could not drop root")
    os.chdir(workdir)
    return spec


def _cpu_seconds(usage=resource.getrusage, me=resource.RUSAGE_SELF,
                 children=resource.RUSAGE_CHILDREN):
    """CPU seconds of this process and its reaped children, in microseconds of resolution:
    ``os.times`` counts 10 ms clock ticks, and a short reference solution can finish inside one."""
    a, b = usage(me), usage(children)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime


def _report(fd, status, detail, **extra):
    """Send the verdict to the harness and end the process."""
    send(fd, {"status": status, "detail": detail[-2000:], **extra})
    os._exit(0 if status == "passed" else 1)


def _reap(scope):
    """Kill and count this sample's other live processes (``all`` in a PID namespace, else those
    of its ``uid`` or its session)."""
    me, found = os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in (me, 1):
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read().rsplit(")", 1)[1].split()
            uid = os.stat(f"/proc/{entry}").st_uid
        except OSError:
            continue
        ppid, sid = int(stat[1]), int(stat[3])
        mine = (scope == "all" or ppid == me or sid == os.getsid(0)
                or (scope == "uid" and uid == os.getuid()))
        if mine and stat[0] not in "ZX":
            found.append(int(entry))
            try:
                os.kill(int(entry), 9)
            except OSError:
                pass
    return len(found)


def _describe(exc):
    """An exception as plain data: its nearest builtin class, its type, message and args."""
    import builtins

    base = "Exception"
    for cls in type(exc).__mro__:
        if getattr(builtins, cls.__name__, None) is cls:
            base = cls.__name__
            break
    try:
        message = str(exc)[:1000]
    except BaseException:
        message = "<unprintable>"
    args = tuple(exc.args) if type(exc.args) is tuple else ()
    try:
        encode(args)
    except BaseException:
        args = None
    return {"base": base, "type": getattr(type(exc), "__qualname__", "?"), "message": message,
            "args": args}


def serve_candidate(workdir):
    """Load the completion, report whether it loaded, then answer calls until the pipe closes."""
    import types

    spec = _setup(workdir)
    calls, replies = spec["calls_fd"], spec["replies_fd"]
    module = types.ModuleType("candidate")
    module.__file__ = os.path.join(workdir, "candidate.py")
    sys.modules["candidate"] = module
    try:
        with open("candidate.py") as f:
            code = compile(f.read(), "candidate.py", "exec", dont_inherit=True, optimize=0)
        exec(code, vars(module))
    except BaseException as e:
        send(replies, {"raised": _describe(e)})
        os._exit(1)
    send(replies, {"loaded": True})
    namespace = vars(module)
    while True:
        message = recv(calls)
        if message is None:
            os._exit(0)
        if "finish" in message:
            send(replies, {"done": {"left": _reap(spec["proc_scope"]),
                                    "cpu": _cpu_seconds()}})
            continue
        fn = namespace.get(message["call"])
        if not callable(fn):
            send(replies, {"missing": message["call"]})
            continue
        try:
            result = fn(*message["args"], **message["kwargs"])
        except BaseException as e:
            send(replies, {"raised": _describe(e)})
            continue
        try:
            send(replies, {"value": result})
        except BaseException as e:  # NotPlainData, or a __len__/__iter__ that raises
            send(replies, {"not_plain": str(e) if isinstance(e, NotPlainData)
                           else f"{type(e).__name__} while encoding the result"})


class _Broken(BaseException):
    """The call channel failed; the sample fails whatever the tests do with the exception."""


def run_tests(workdir):
    """Run the tests against proxies of the completion's functions; report the verdict."""
    import builtins

    spec = _setup(workdir)
    calls, replies, result_fd = spec["calls_fd"], spec["replies_fd"], spec["result_fd"]
    with open("test.py") as f:
        test_code = compile(f.read(), "test.py", "exec", dont_inherit=True, optimize=0)
    with open("helpers.py") as f:
        helpers_code = compile(f.read(), "prompt.py", "exec", dont_inherit=True, optimize=0)
    broken = []  # the verdict of the first failure of the channel: (status, detail, extras)

    def fail(detail, status="failed", **extra):
        if not broken:
            broken.append((status, detail, extra))
        raise _Broken(detail)

    def receive(what, expected):
        """The next reply: a dict with one of the `expected` keys, each with a value of its
        type; anything else breaks the channel."""
        try:
            reply = recv(replies)
        except Exception as e:  # ProtocolError, OSError
            fail(f"the completion's process sent a bad reply {what}: {e}")
        if reply is None:  # `ended`: the harness then waits to learn how it ended
            fail(f"the completion's process ended {what}", ended=True)
        if len(reply) != 1 or not all(k in expected and (expected[k] is None
                                                         or type(v) is expected[k])
                                      for k, v in reply.items()):
            fail(f"the completion's process sent an unknown reply {what}")
        return reply

    def rebuild(raised):
        """The exception a reply describes, of the builtin class it names."""
        fields = ("base", "type", "message")
        if not all(type(raised.get(f)) is str for f in fields) or raised.keys() - {*fields,
                                                                                   "args"}:
            fail("the completion's process described an exception badly")
        cls = getattr(builtins, raised["base"], None)
        if not (isinstance(cls, type) and issubclass(cls, BaseException)):
            cls = Exception
        try:
            args = raised.get("args")
            return cls(*args) if type(args) is tuple else cls(raised["message"])
        except BaseException:
            return Exception(f"{raised['type']}: {raised['message']}")

    call_replies = {"value": None, "raised": dict, "missing": str, "not_plain": str}

    def proxy(name):
        def call(*args, **kwargs):
            if broken:
                raise _Broken(broken[0][1])
            try:
                send(calls, {"call": name, "args": args, "kwargs": kwargs})
            except NotPlainData as e:  # the task's doing, not the completion's
                fail(f"the tests pass {name} an argument that cannot cross: {e}", "error")
            except OSError:
                fail(f"the completion's process ended before a call to {name}", ended=True)
            reply = receive(f"during a call to {name}", call_replies)
            if "value" in reply:
                return reply["value"]
            if "raised" in reply:
                raise rebuild(reply["raised"])
            if "missing" in reply:
                raise NameError(f"name {name!r} is not defined by the completion")
            fail(f"{name} returned {reply['not_plain']}")

        call.__name__ = call.__qualname__ = name
        return call

    try:
        loaded = receive("while loading the completion", {"loaded": bool, "raised": dict})
        if "raised" in loaded:
            raised = loaded["raised"]
            rebuild(raised)  # checks its fields
            _report(result_fd, "failed", f"{raised['type']}: {raised['message']}")
    except _Broken:
        _report(result_fd, broken[0][0], broken[0][1], **broken[0][2])
    namespace = {"__name__": "__test__"}
    try:
        exec(helpers_code, namespace)
    except BaseException as e:
        _report(result_fd, "error", f"the task's own helper code raised {type(e).__name__}: {e}")
    for name in spec["proxied"]:
        namespace[name] = proxy(name)
    try:
        exec(test_code, namespace)
    except _Broken:
        pass
    except BaseException as e:
        if not broken:
            _report(result_fd, "failed", f"{type(e).__name__}: {e}")
    if broken:
        _report(result_fd, broken[0][0], broken[0][1], **broken[0][2])
    try:
        send(calls, {"finish": True})
        done = receive("after the tests", {"done": dict})["done"]
    except (_Broken, OSError):
        status, detail, extra = broken[0] if broken else (
            "failed", "the completion's process ended", {"ended": True})
        _report(result_fd, status, detail, **extra)
    if done.get("left"):
        _report(result_fd, "failed", f"left {done['left']} process(es) running")
    cpu = done.get("cpu")
    _report(result_fd, "passed", "", cpu=cpu if type(cpu) is float else None)


def run_shared(workdir):
    """Completion, then tests, in this one interpreter (the tasks that need more than calls)."""
    import ast
    import builtins
    import importlib
    import types

    spec = _setup(workdir)
    fd, token, entry_point = spec["result_fd"], spec["token"], spec["entry_point"]

    def finish(status, detail):
        try:
            _reap(spec["proc_scope"])
        finally:
            _report(fd, status, detail)

    with open("candidate.py") as f:
        candidate_src = f.read()
    with open("test.py") as f:
        test_src = f.read()
    os.unlink("test.py")
    test_code = compile(test_src, "test.py", "exec", dont_inherit=True, optimize=0)
    try:
        candidate_code = compile(candidate_src, "candidate.py", "exec", dont_inherit=True,
                                 optimize=0)
    except BaseException as e:
        finish("failed", f"{type(e).__name__}: {e}")

    # The modules the tests import, loaded now so a snapshot can prove them untouched later.
    guarded = {"builtins": builtins}
    for node in ast.walk(ast.parse(test_src)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module]
        else:
            continue
        for name in names:
            try:
                importlib.import_module(name)
            except BaseException:
                continue  # the test will fail on it in its own words
            parts = name.split(".")
            for i in range(1, len(parts) + 1):
                sub = ".".join(parts[:i])
                if sub != "sys" and sub in sys.modules:
                    guarded[sub] = sys.modules[sub]
    snapshot = {name: dict(vars(mod)) for name, mod in guarded.items()}

    def tampering():
        for name, mod in guarded.items():
            if sys.modules.get(name) is not mod:
                return f"replaced module {name!r}"
            now = vars(mod)
            for key, value in snapshot[name].items():
                if now.get(key, tampering) is not value:
                    return f"changed {name}.{key}"
        return ""

    hooked = []

    def audit(event, args):
        if event in ("sys.settrace", "sys.setprofile"):
            hooked.append(event)

    sys.addaudithook(audit)

    module = types.ModuleType("candidate")
    module.__file__ = os.path.join(workdir, "candidate.py")
    sys.modules["candidate"] = module
    try:
        exec(candidate_code, vars(module))
    except BaseException as e:
        finish("failed", f"{type(e).__name__}: {e}")

    pristine = snapshot["builtins"]
    ns = {k: v for k, v in vars(module).items()
          if not k.startswith("__") and (k not in pristine or k == entry_point)}
    ns.update(__builtins__=dict(pristine), __name__="__test__")
    try:
        exec(test_code, ns)
    except BaseException as e:
        finish("failed", f"{type(e).__name__}: {e}")

    if hooked:
        finish("failed", f"the completion called {hooked[0]}")
    problem = tampering()
    if problem:
        finish("failed", f"the completion tampered with the test environment: {problem}")
    left = _reap(spec["proc_scope"])
    if left:
        finish("failed", f"left {left} process(es) running")
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            stream.flush()
        except BaseException:
            pass
    _report(fd, "passed", "", token=token, cpu=_cpu_seconds())
