"""What a sandboxed interpreter does first, before it reads its orders or runs code it was given:
make the host read-only for a completion, and give up what could undo that.

Only under ``unshare`` and ``process`` (bubblewrap builds the whole view itself); what each step
is for is told in :mod:`mtp.eval.sandbox`:

* ``mount`` (``unshare``: each interpreter has a mount namespace of its own): the completion's
  folder is bound at ``/tmp``, a fresh tmpfs is mounted at ``/dev/shm``, and every other mount
  it can reach is remounted read-only. That is the recursive read-only bind of ``/``, done mount
  by mount from ``/proc/self/mountinfo`` because ``mount_setattr`` needs Linux 5.12; a mount
  covered by another is out of reach and left as it is.
* ``landlock`` (``process``: no namespace): a Landlock ruleset (Linux 5.13) under which the
  completion may write beneath its own folder and to ``/dev/null``, nowhere else.
* ``reach`` (``unshare`` as root, for both interpreters): the directories that hide the
  interpreter from the sample's uid (a Python under ``/root``, mode 0700) are covered with an
  empty tmpfs in which the interpreter's own directories are bound back, as bubblewrap does.

Then ``no_new_privs`` for every interpreter, and no capability for a completion that runs as
uid 0 (root of a user namespace, or root allowed): without CAP_SYS_ADMIN it cannot remount what
was made read-only. One that drops to the sample's uid next keeps them until then (its orders
are read and removed as root) and loses them all in the drop. A step that fails ends the
interpreter with `CONFINE_FAILED` before any completion code has run.

Standard library only, and no name shared with :mod:`mtp.eval.wire` or :mod:`mtp.eval.inside`:
the three are compiled into one program (:mod:`mtp.eval.sandbox.processes`). ctypes is loaded
only when a step needs it (`_libc`): bubblewrap's samples never pay for it. Its orders are a
literal in that program (:func:`mtp.eval.sandbox.isolation.confine_orders`).
"""

import os

CONFINE_FAILED = 97
"""The exit status of an interpreter that could not be confined (its stderr says why)."""

# <linux/mount.h>
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_NOSYMFOLLOW, _MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 256, 32, 4096, 16384, 1 << 18
# Kept as they are by a read-only remount: the kernel refuses to clear those that a user
# namespace locked, and keeps the access-time flags of a remount that names none.
_KEPT_FLAGS = {b"nosuid": _MS_NOSUID, b"nodev": _MS_NODEV, b"noexec": _MS_NOEXEC,
               b"nosymfollow": _MS_NOSYMFOLLOW}
# Syscall numbers from 424 on are the same on every architecture but alpha.
_LANDLOCK_CREATE_RULESET, _LANDLOCK_ADD_RULE, _LANDLOCK_RESTRICT_SELF = 444, 445, 446
# <linux/landlock.h>: write a file, remove a folder or a file, make any kind of node, then
# (ABI 2) move a file between folders and (ABI 3) truncate one.
_LANDLOCK_WRITE = 1 << 1 | sum(1 << bit for bit in range(4, 13))
_LANDLOCK_REFER, _LANDLOCK_TRUNCATE = 1 << 13, 1 << 14
# <linux/prctl.h>, <linux/capability.h>
_PR_CAPBSET_DROP, _PR_SET_NO_NEW_PRIVS, _PR_CAP_AMBIENT = 24, 38, 47
_CAP_SETPCAP = 8


def confine(workdir: str, orders: dict | None) -> str:
    """Apply `orders` (None under bubblewrap) and return the folder to work in (``/tmp`` once
    ``mount`` has bound the completion's folder there); end the process if a step fails."""
    if not orders:
        return workdir
    try:
        return _confine_steps(workdir, orders)
    except Exception as e:
        os.write(2, f"mtp sandbox: could not confine this interpreter: {e}\n".encode())
        os._exit(CONFINE_FAILED)


def _confine_steps(workdir: str, orders: dict) -> str:
    if orders["reach"] or orders["read_only"] == "mount":
        # Every mount below changes this namespace only: never the harness's, and nothing
        # propagates back to it.
        if os.readlink("/proc/self/ns/mnt") == orders["host_mount_ns"]:
            raise OSError("it shares the harness's mount namespace")
        _mount(None, b"/", None, _MS_REC | _MS_PRIVATE)
        _reach(orders["reach"])
    if orders["read_only"] == "mount":
        _mount(os.fsencode(workdir), b"/tmp", None, _MS_BIND)
        keep = {_mount_id(b"/tmp")}
        if os.path.isdir("/dev/shm"):
            size = f"mode=1777,size={orders['shm_bytes']}".encode()
            _mount(b"tmpfs", b"/dev/shm", b"tmpfs", _MS_NOSUID | _MS_NODEV, size)
            keep.add(_mount_id(b"/dev/shm"))
        for _, point, flags in _writable_mounts(keep):
            _mount(None, point, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | flags)
        left = _writable_mounts(keep)
        if left:
            raise OSError(f"mounts still writable: {[point for _, point, _ in left]}")
        workdir = "/tmp"
        os.chdir(workdir)
        os.environ.update(HOME=workdir, TMPDIR=workdir)
    _call("prctl", "no_new_privs", _PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    if orders["read_only"] == "landlock":
        _landlock(workdir)
    if orders["read_only"] and os.geteuid() == 0 and not orders["uid_follows"]:
        _drop_capabilities()
    return workdir


_LIBC = []


def _libc():
    """The C library through ctypes, loaded on first use."""
    if not _LIBC:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        _LIBC.append(libc)
    return _LIBC[0]


def _call(name: str, what: str, *args: object) -> int:
    """Call the libc function `name`, which returns -1 and sets errno on failure; its result.
    Integers pass as C longs (``syscall`` and ``prctl`` take variadic longs)."""
    import ctypes

    result = getattr(_libc(), name)(*(ctypes.c_long(a) if isinstance(a, int) else a
                                      for a in args))
    if result == -1:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


def _mount(source: bytes | None, target: bytes, fstype: bytes | None, flags: int,
           data: bytes | None = None) -> None:
    import ctypes

    if _libc().mount(source, target, fstype, ctypes.c_ulong(flags), data) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {target.decode(errors='replace')}: {os.strerror(err)}")


def _mount_id(path: bytes) -> int | None:
    """The id of the mount that `path` leads to (None if it leads nowhere)."""
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        with open(f"/proc/self/fdinfo/{fd}", "rb") as f:
            for line in f:
                if line.startswith(b"mnt_id:"):
                    return int(line.split()[1])
    finally:
        os.close(fd)
    return None


def _unescape(field: bytes) -> bytes:
    """A path of /proc/self/mountinfo, whose space, tab, newline and backslash are octal."""
    parts = field.split(b"\\")
    return parts[0] + b"".join(bytes([int(p[:3], 8)]) + p[3:] for p in parts[1:])


def _writable_mounts(keep: set[int | None]) -> list[tuple[int, bytes, int]]:
    """The mounts this process can reach that are writable and not in `keep` (ids): their
    ids, mount points and the flags a remount must keep. A mount whose mount point leads to
    another mount is covered by it, so out of reach."""
    found = []
    with open("/proc/self/mountinfo", "rb") as f:
        lines = f.read().splitlines()
    for line in lines:
        fields = line.split()
        mount_id, point, options = int(fields[0]), _unescape(fields[4]), fields[5].split(b",")
        if mount_id in keep or b"ro" in options or _mount_id(point) != mount_id:
            continue
        found.append((mount_id, point, sum(_KEPT_FLAGS.get(o, 0) for o in options)))
    return found


def _reach(masks: list[list]) -> None:
    """Cover each mask with an empty tmpfs and bind the interpreter's directories back into
    it, read from the host before the cover hides them."""
    old = os.umask(0o022)
    try:
        for mask, dirs in masks:
            sources = [os.open(d, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC) for d in dirs]
            _mount(b"tmpfs", os.fsencode(mask), b"tmpfs", _MS_NOSUID | _MS_NODEV,
                   b"mode=0755,size=64k")
            for d, fd in zip(dirs, sources):
                os.makedirs(d, mode=0o755, exist_ok=True)
                _mount(f"/proc/self/fd/{fd}".encode(), os.fsencode(d), None,
                       _MS_BIND | _MS_REC)
                os.close(fd)
    finally:
        os.umask(old)


def _landlock(workdir: str) -> None:
    """Allow writes beneath `workdir` and to /dev/null only, for this process and all it
    starts; reads and execution stay as they were."""
    import ctypes

    abi = _call("syscall", "Landlock", _LANDLOCK_CREATE_RULESET, None, 0, 1)
    handled = _LANDLOCK_WRITE | (_LANDLOCK_REFER if abi >= 2 else 0)
    file_rights = 1 << 1 | (_LANDLOCK_TRUNCATE if abi >= 3 else 0)
    handled |= file_rights

    class PathBeneath(ctypes.Structure):
        _pack_ = 1
        _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]

    attr = ctypes.c_uint64(handled)
    ruleset = _call("syscall", "Landlock ruleset", _LANDLOCK_CREATE_RULESET,
                    ctypes.byref(attr), ctypes.sizeof(attr), 0)
    try:
        for path, rights in ((workdir, handled), ("/dev/null", file_rights)):
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            try:
                rule = PathBeneath(rights, fd)
                _call("syscall", f"Landlock rule for {path}", _LANDLOCK_ADD_RULE, ruleset, 1,
                      ctypes.byref(rule), 0)
            finally:
                os.close(fd)
        _call("syscall", "Landlock restriction", _LANDLOCK_RESTRICT_SELF, ruleset, 0)
    finally:
        os.close(ruleset)


def _drop_capabilities() -> None:
    """Leave this process, and every program it runs, no capability."""
    import ctypes

    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            last = int(f.read())
    except (OSError, ValueError):
        last = 40
    # CAP_SETPCAP last: dropping from the bounding set needs it.
    for cap in [c for c in range(last + 1) if c != _CAP_SETPCAP] + [_CAP_SETPCAP]:
        _call("prctl", f"dropping capability {cap}", _PR_CAPBSET_DROP, cap, 0, 0, 0)
    try:
        _call("prctl", "clearing the ambient capabilities", _PR_CAP_AMBIENT, 4, 0, 0, 0)
    except OSError:  # none before Linux 4.3
        pass

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                    ("inheritable", ctypes.c_uint32)]

    data = (Data * 2)(Data(0, 0, 0), Data(0, 0, 0))
    _call("capset", "capset", ctypes.byref(Header(0x20080522, 0)), data)
