"""The sandbox child's audit hook: the last, in-process layer (standard library only).

CPython raises an audit event inside the C implementation of every sensitive operation (`os.fork`,
`os.kill`, `socket.connect`, `open`, `ctypes.dlopen`, ...), so the hook sees them however the function was
reached: through `os`, a reloaded `os`, `posix` directly, or a saved reference. It cannot be removed once
installed. It is *not* a security boundary by itself — a determined program with a memory-corruption bug in
CPython can step around it — which is why the kernel layers in guard.py come first. What it adds:
clear `PermissionError`s instead of odd failures, and protection where the kernel layers are unavailable
(no user namespaces, no Landlock).

The hook never calls back into user code: arguments are inspected by exact type only (`type(x) is str`), so
an object with a custom `__fspath__`, `__eq__` or `__class__` cannot run code inside it.
"""

from __future__ import annotations

import os
import sys

DENIED_EVENTS = frozenset(
    {
        # new processes: fork bombs, shell escapes
        "os.fork",
        "os.forkpty",
        "os.system",
        "os.exec",
        "os.posix_spawn",
        "os.spawn",
        "subprocess.Popen",
        # signals: the parent, other runs, the host
        "os.kill",
        "os.killpg",
        "signal.pthread_kill",
        # the environment the parent scrubbed
        "os.putenv",
        "os.unsetenv",
        # finding and patching the harness or this hook
        "gc.get_objects",
        "gc.get_referrers",
        "gc.get_referents",
        "sys._current_frames",
        # limits stay as set
        "resource.setrlimit",
        "resource.prlimit",
        # links out of the private directory
        "os.link",
        "os.symlink",
    }
)
DENIED_PREFIXES = ("socket.", "ctypes.", "_winapi.", "winreg.", "msvcrt.", "syslog.")
DENIED_IMPORTS = frozenset(
    {
        "ctypes",
        "_ctypes",
        "subprocess",
        "_posixsubprocess",
        "socket",
        "_socket",
        "ssl",
        "_ssl",
        "select",
        "selectors",
        "multiprocessing",
        "_multiprocessing",
        "pty",
        "resource",
        "asyncio",
        "urllib.request",
        "http.client",
        "ftplib",
        "smtplib",
        "telnetlib",
    }
)
# event -> positions of path arguments that must stay inside the private directory
WRITE_PATH_EVENTS = {
    "os.remove": (0,),
    "os.rmdir": (0,),
    "os.rename": (0, 1),
    "os.mkdir": (0,),
    "os.chmod": (0,),
    "os.chown": (0,),
    "os.truncate": (0,),
    "os.utime": (0,),
    "os.chdir": (0,),
    "shutil.rmtree": (0,),
    "shutil.copyfile": (1,),
    "shutil.copytree": (1,),
    "shutil.move": (1,),
    "shutil.make_archive": (0,),
}
READ_PATH_EVENTS = {"os.listdir": (0,), "os.scandir": (0,)}
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def make_audit_hook(workdir: str, read_dirs: list[str]):
    """Build the hook. Its settings live in tuples captured at creation; nothing refers to it afterwards."""
    workdir = os.path.realpath(workdir)
    writable = (workdir,)
    readable = tuple(os.path.realpath(d) for d in read_dirs) + writable + ("/dev/null", "/dev/urandom")
    denied, prefixes, imports = DENIED_EVENTS, DENIED_PREFIXES, DENIED_IMPORTS
    write_events, read_events, write_flags = dict(WRITE_PATH_EVENTS), dict(READ_PATH_EVENTS), WRITE_FLAGS
    getcwd, join, normpath, fsdecode = os.getcwd, os.path.join, os.path.normpath, os.fsdecode

    def inside(path, roots) -> bool:
        if type(path) is int:  # an already-open descriptor: how it was opened was checked then
            return True
        if type(path) is bytes:
            path = fsdecode(path)
        if type(path) is not str:
            return False  # PathLike and str subclasses could run code here; refuse them
        full = normpath(join(getcwd(), path))
        return any(full == root or full.startswith(root + "/") for root in roots)

    def hook(event: str, args: tuple) -> None:
        if event in denied or event.startswith(prefixes):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "import":
            name = args[0]
            if type(name) is str and (name in imports or name.split(".")[0] in imports):
                raise PermissionError(f"sandbox: import of {name} is not allowed")
        elif event == "open":
            path, mode, flags = args[0], args[1], args[2]
            writing = (type(mode) is str and any(c in mode for c in "wax+")) or (
                type(flags) is int and flags & write_flags
            )
            if path is not None and not inside(path, writable if writing else readable):
                raise PermissionError(
                    f"sandbox: opening {path!r} is not allowed"
                    if type(path) is str
                    else "sandbox: opening this path is not allowed"
                )
        elif event in write_events:
            for i in write_events[event]:
                if i < len(args) and not inside(args[i], writable):
                    raise PermissionError(f"sandbox: {event} outside the private directory is not allowed")
        elif event in read_events:
            for i in read_events[event]:
                if i < len(args) and not inside(args[i], readable):
                    raise PermissionError(f"sandbox: {event} outside the allowed directories is not allowed")
        elif event == "object.__setattr__" and len(args) > 1 and args[1] in ("__code__", "__globals__"):
            raise PermissionError("sandbox: replacing code objects is not allowed")

    return hook


def install(workdir: str, read_dirs: list[str]) -> None:
    sys.addaudithook(make_audit_hook(workdir, read_dirs))
