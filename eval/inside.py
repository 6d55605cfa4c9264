"""The programs that run inside the sandbox, first thing in each fresh interpreter.

:mod:`mtp.eval.sandbox.processes` starts ``python -I -S -B`` on a program compiled from the text
of :mod:`mtp.eval.wire`, then this module, then a call of one of the three entry points below
with ``WORKDIR``. They are trusted code: each reads its orders from ``WORKDIR/.orders`` (and
deletes it), sets the resource limits, drops to the sample's uid, and only then touches
untrusted code. Verdicts go to the harness as :mod:`mtp.eval.wire` messages on a pipe of their
own.

* `serve_candidate`: runs the completion as module ``candidate``, then answers requests that
  arrive on a pipe, one at a time, with plain data (:mod:`mtp.eval.wire`): calls of the names
  the tests take from it, and the attributes of the objects the tests hold by reference (the
  instances of its classes that the tests build, such as MBPP 367's ``Node`` tree). It never
  sees the tests.
* `run_tests`: runs a benchmark's tests in a namespace where the names they take from the
  completion are proxies that call across that pipe (a constant the completion defines
  crosses as data). It never runs completion code, only the benchmark's own (the tests, and for
  HumanEval the prompt's helper functions); every value it gets back is a fresh object of its
  own, and an object held by reference is a handle whose equality is its identity. It writes
  its verdict on its own result pipe, then waits to be killed, so that the completion's
  process, which ends when the tests' does, is still there while the harness counts what it
  left running.

Standard library only: ``mtp`` is not importable in the sandbox.
"""

import os
import resource
import sys

if __name__ != "__main__":  # imported as part of mtp; in the sandbox wire's source comes first
    from mtp.eval.wire import NotPlainData, ProtocolError, decode, encode, recv, send


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


def _report(fd, status, detail, hold=0.0, **extra):
    """Send the verdict to the harness, wait up to `hold` seconds for the harness to kill this
    process, and end it."""
    send(fd, {"status": status, "detail": detail[-2000:], **extra})
    if hold > 0:
        import time

        time.sleep(hold)
    os._exit(0 if status == "passed" else 1)


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
    """Load the completion, report whether it loaded and what the tests' names are in it, then
    answer requests until the pipe closes."""
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
    namespace = vars(module)
    objects, numbers = [], {}  # the objects the tests hold by reference, and their numbers
    names = [n for n in spec["proxied"] if n in namespace]
    classes = tuple(namespace[n] for n in names if isinstance(namespace[n], type))

    def ref(obj):
        """The reference number of an instance of a class the tests name."""
        number = numbers.get(id(obj))
        if number is None and classes and isinstance(obj, classes):
            number = numbers[id(obj)] = len(objects)
            objects.append(obj)
        return number

    def reply(value):
        try:
            send(replies, {"value": value}, ref)
        except BaseException as e:  # NotPlainData, or a __len__/__iter__ that raises
            send(replies, {"not_plain": str(e) if isinstance(e, NotPlainData)
                           else f"{type(e).__name__} while encoding the result"})

    values, missing = {}, [n for n in spec["proxied"] if n not in namespace]
    for name in names:
        if not callable(namespace[name]):
            values[name] = namespace[name]
    try:
        send(replies, {"loaded": {"missing": missing, "values": values}}, ref)
    except BaseException as e:
        send(replies, {"not_plain": str(e) if isinstance(e, NotPlainData)
                       else f"{type(e).__name__} while encoding a value"})
        os._exit(1)
    while True:
        try:
            message = recv(calls, objects.__getitem__)
        except ProtocolError:
            os._exit(1)
        if message is None:
            os._exit(0)
        if "finish" in message:
            send(replies, {"done": {"cpu": _cpu_seconds()}})
            continue
        try:
            if "call" in message:
                fn = namespace.get(message["call"])
                if not callable(fn):
                    send(replies, {"missing": message["call"]})
                    continue
                result = fn(*message["args"], **message["kwargs"])
            elif "getattr" in message:
                result = getattr(objects[message["getattr"]], message["name"])
            else:
                setattr(objects[message["setattr"]], message["name"], message["value"])
                result = None
        except BaseException as e:
            send(replies, {"raised": _describe(e)})
            continue
        reply(result)


class _Broken(BaseException):
    """The call channel failed; the sample fails whatever the tests do with the exception."""


def run_tests(workdir):
    """Run the tests against proxies of the completion's names; report the verdict."""
    import builtins

    spec = _setup(workdir)
    calls, replies, result_fd = spec["calls_fd"], spec["replies_fd"], spec["result_fd"]
    with open("test.py") as f:
        test_code = compile(f.read(), "test.py", "exec", dont_inherit=True, optimize=0)
    with open("helpers.py") as f:
        helpers_code = compile(f.read(), "prompt.py", "exec", dont_inherit=True, optimize=0)
    os.unlink("test.py")
    broken = []  # the verdict of the first failure of the channel: (status, detail, extras)
    handles = {}  # reference number -> the tests' handle of that object

    def report(status, detail, **extra):
        _report(result_fd, status, detail, hold=spec["hold_seconds"], **extra)

    def fail(detail, status="failed", **extra):
        if not broken:
            broken.append((status, detail, extra))
        raise _Broken(detail)

    class Remote:
        """An object of the completion's, held by reference: its attributes are read and set
        across the pipe; equality and hashing are its identity."""

        __slots__ = ("_number",)

        def __getattr__(self, name):
            return request({"getattr": object.__getattribute__(self, "_number"), "name": name},
                           f"reading .{name}", f".{name} is")

        def __setattr__(self, name, value):
            request({"setattr": object.__getattribute__(self, "_number"), "name": name,
                     "value": value}, f"setting .{name}", f"setting .{name} gave")

        def __repr__(self):
            return f"<the completion's object #{object.__getattribute__(self, '_number')}>"

    def resolve(number):
        if number not in handles:
            handle = object.__new__(Remote)
            object.__setattr__(handle, "_number", number)
            handles[number] = handle
        return handles[number]

    def ref(obj):
        return object.__getattribute__(obj, "_number") if type(obj) is Remote else None

    def receive(what, expected):
        """The next reply: a dict with one of the `expected` keys, each with a value of its
        type; anything else breaks the channel."""
        try:
            reply = recv(replies, resolve)
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

    replies_of = {"value": None, "raised": dict, "missing": str, "not_plain": str}

    def request(message, what, returned):
        """Send one request and return its value (or raise the completion's exception)."""
        if broken:
            raise _Broken(broken[0][1])
        try:
            send(calls, message, ref)
        except NotPlainData as e:  # the task's doing, not the completion's
            fail(f"the tests pass an argument that cannot cross while {what}: {e}", "error")
        except OSError:
            fail(f"the completion's process ended before {what}", ended=True)
        reply = receive(f"while {what}", replies_of)
        if "value" in reply:
            return reply["value"]
        if "raised" in reply:
            raise rebuild(reply["raised"])
        if "missing" in reply:
            raise NameError(f"name {reply['missing']!r} is not defined by the completion")
        fail(f"{returned} {reply['not_plain']}")

    def proxy(name):
        def call(*args, **kwargs):
            return request({"call": name, "args": args, "kwargs": kwargs}, f"calling {name}",
                           f"{name} returned")

        call.__name__ = call.__qualname__ = name
        return call

    try:
        loaded = receive("while loading the completion",
                         {"loaded": dict, "raised": dict, "not_plain": str})
        if "raised" in loaded:
            raised = loaded["raised"]
            rebuild(raised)  # checks its fields
            report("failed", f"{raised['type']}: {raised['message']}")
        if "not_plain" in loaded:
            report("failed", f"a name the tests use is {loaded['not_plain']}")
        missing, values = loaded["loaded"].get("missing"), loaded["loaded"].get("values")
        if type(missing) is not list or type(values) is not dict:
            fail("the completion's process described its names badly")
    except _Broken:
        report(broken[0][0], broken[0][1], **broken[0][2])
    namespace = {"__name__": "__test__"}
    try:
        exec(helpers_code, namespace)
    except BaseException as e:
        report("error", f"the task's own helper code raised {type(e).__name__}: {e}")
    for name in spec["proxied"]:
        if name in values:
            namespace[name] = values[name]
        elif name not in missing:
            namespace[name] = proxy(name)
    try:
        exec(test_code, namespace)
    except _Broken:
        pass
    except BaseException as e:
        if not broken:
            report("failed", f"{type(e).__name__}: {e}")
    if broken:
        report(broken[0][0], broken[0][1], **broken[0][2])
    try:
        send(calls, {"finish": True})
        done = receive("after the tests", {"done": dict})["done"]
    except (_Broken, OSError):
        status, detail, extra = broken[0] if broken else (
            "failed", "the completion's process ended", {"ended": True})
        report(status, detail, **extra)
    cpu = done.get("cpu")
    report("passed", "", cpu=cpu if type(cpu) is float else None)
