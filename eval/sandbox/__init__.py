"""Run untrusted completions: completion and tests in separate sandboxed interpreters.

**Two processes per sample.** The completion runs in one fresh ``python -I -S``; the benchmark's
tests run in another that never executes completion code. The tests reach the functions they call
(the entry point) through proxies: each call crosses a pipe as a message, is answered by the
completion's process, and its result crosses back (:mod:`mtp.eval.inside`, :mod:`mtp.eval.wire`).
Arguments and results cross as plain data only (None, bool, int, float, complex, str, bytes, and
lists, tuples, dicts, sets and frozensets of them, matched by exact type), rebuilt on arrival as
fresh builtin objects; anything else fails the sample with its type named. Exceptions the
completion raises reach the tests as exceptions of the nearest builtin class, with their args.
The tests' process reports to the harness on a pipe of its own, which the completion never
holds; the harness decides with both processes' exit statuses. So none of these can pass:

* a value that lies about equality (an object whose ``__eq__`` is always true, or a subclass of
  ``int`` or ``str`` with one): it cannot cross;
* reading or rewriting the harness's memory, walking frames or the heap: the harness is not in
  the completion's process, and the verdict channel is not among its descriptors;
* patching builtins or modules, a trace function that skips ``assert``: they change the
  completion's interpreter only;
* exiting early (``os._exit(0)``), writing fake verdicts on every descriptor, or printing a
  marker: the tests see a broken channel, and a broken channel fails the sample whatever the
  tests do with the exception (``except BaseException`` included);
* leaving a background process: the completion's process counts and kills the others at the end
  (the PID namespace or the per-sample uid kills them in any case).

Tasks whose tests need more than calls (MBPP task 367 builds its inputs from the completion's
``Node`` class) run with ``shared=True``: completion, then tests, in one interpreter, with a
random token the verdict must carry, the builtins and the tests' modules snapshotted and
compared, and an audit hook on trace functions. That design does not close the two holes above
(a completion that walks frames finds the token); :mod:`mtp.eval.execution` decides which tasks
need it, and the results mark them.

**Layers**, outermost first (``bwrap`` mode), for each of the two interpreters:

* bubblewrap: read-only bind of ``/``; ``/root``, ``/home``, ``/run`` ... hidden under read-only
  tmpfs (the Python installation is bound back when it lives there); a private working directory
  mounted at ``/tmp``; fresh ``/dev`` and ``/proc``; new PID, network, IPC, UTS and cgroup
  namespaces (so there is no network, and everything the sample starts dies with it);
  ``--die-with-parent``, ``--new-session``, ``--clearenv`` and ``no_new_privs``.
* A fresh uid per interpreter when the harness runs as root (a random unprivileged uid, dropped
  to before any untrusted code runs). The kernel exempts root from ``RLIMIT_NPROC``, so this is
  what lets that limit bound a fork bomb (without root, bwrap's fresh user namespace does, since
  its process count starts from zero); it also means the sample can signal nothing but its own
  processes, and cannot reach the tests' process, which is in another PID namespace too.
* Resource limits: address space, CPU time (``Limits.cpu_seconds``, per task from
  :mod:`mtp.eval.execution`), file size, open files, processes, no core dumps; a memory cgroup
  for all the completion's processes together where one can be made (``Isolation.memory_cgroup``:
  cgroup v2, else the v1 memory hierarchy); plus a wall-clock backstop enforced from outside and
  capped captured output.

Where bubblewrap is missing or refused, :func:`detect_isolation` falls back to ``unshare`` (new
PID + network namespaces), then to a bare process in its own session; it warns once and the
result says which isolation held. In the ``process`` fallback without a fresh uid the
completion runs as the harness's user and could reach the tests' process (and the host).

Limits of the isolation: without a memory cgroup, memory is bounded per process (address
space), so a fork bomb that also allocates can reach ``processes x memory_bytes``; disk use in
the private directory is bounded per file, not in total; in the weakest fallback (``process``,
no PID namespace, no fresh uid) a double-forked process that calls ``setsid`` and ``exec``
escapes the clean-up. The completion's sandbox sees the read-only root, benchmark files
included, except the directories `run_program` is told to hide: the harness hides the
benchmark's own data (:func:`mtp.eval.execution.data_paths`), so a completion cannot look its
answers up there.

**Modules.** :mod:`~mtp.eval.sandbox.isolation` finds which isolation holds and builds the
bubblewrap and unshare command lines; :mod:`~mtp.eval.sandbox.limits` holds the resource limits
and the memory cgroups; :mod:`~mtp.eval.sandbox.processes` starts one sandboxed interpreter and
kills everything it started; :mod:`~mtp.eval.sandbox.run` runs a sample in them and reads its
verdict. The rest of ``mtp`` imports only what this package's ``__all__`` names.
"""

from mtp.eval.sandbox.isolation import Isolation, detect_isolation
from mtp.eval.sandbox.limits import Limits
from mtp.eval.sandbox.run import ExecResult, run_program

__all__ = ["ExecResult", "Isolation", "Limits", "detect_isolation", "run_program"]
