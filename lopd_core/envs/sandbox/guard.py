"""Isolation layers the sandbox child applies to itself before any untrusted code runs.

Standard library only: the child runs as `python -I -S child.py WORKDIR` and imports this file as a
plain top-level module (never through lopd_core). Each layer reports what it did, so a run records which
protections it actually had (`SandboxResult.isolation`). Layers, in the order they are applied:

1. drop_privileges   as root, become an unprivileged uid/gid (65534 by default) and lose every capability.
                     Fail-closed: if it does not work the run does not start. Why: a root child could load
                     kernel modules, signal any process and write any root-owned file no matter what else.
2. isolate_network   unshare a new user + network + pid namespace: the child sees only a downed loopback, no
                     route anywhere. The new user namespace also makes RLIMIT_NPROC count only this run's
                     processes. Best effort (containers often forbid user namespaces); the fallbacks are 3 and 5.
2b. enter_pid_namespace  why: a process that calls setsid() (after a double fork) leaves the run's process
                     group, so the parent's group kill misses it and it outlives the run. With a pid namespace
                     the untrusted code runs as a child of a trusted init (pid 1 of the namespace) that stays in
                     the group; when that init dies — the run ended or the parent killed the group — the kernel
                     kills every process in the namespace, however it re-parented or re-grouped itself, and
                     nothing inside can signal the init or see any process outside. Where pid namespaces are
                     refused, only the audit hook stops the escape (it refuses fork).
3. restrict_files    Landlock (Linux >= 5.13): the kernel lets the child read the standard library and system
                     libraries, read and write its private directory, and nothing else; no execve at all; with
                     ABI >= 4 no TCP bind/connect, with ABI >= 6 no signals to processes outside the sandbox.
                     Best effort, reported.
4. apply_rlimits     CPU seconds, address space, processes, file size, open files, no core dumps.
5. audit hook        (installed last, see `make_audit_hook`) turns process creation, signals, sockets,
                     ctypes, environment changes and file access outside the private directory into
                     PermissionError. In-process hooks are not a security boundary on their own (CPython says
                     so); they give clear errors and cover kernels where 2-3 are unavailable.
"""

from __future__ import annotations

import os
import resource
import sys

try:  # loaded now: after dropping root privileges the standard library may no longer be readable
    import ctypes
except ImportError:  # a Python built without ctypes: the namespace and Landlock layers report unavailable
    ctypes = None

LANDLOCK_CREATE_RULESET, LANDLOCK_ADD_RULE, LANDLOCK_RESTRICT_SELF = 444, 445, 446  # same on every arch
LANDLOCK_CREATE_RULESET_VERSION = 1
LANDLOCK_RULE_PATH_BENEATH = 1
PR_SET_NO_NEW_PRIVS = 38
CLONE_NEWUSER, CLONE_NEWNET, CLONE_NEWPID = 0x10000000, 0x40000000, 0x20000000

# Landlock filesystem rights (uapi/linux/landlock.h)
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FS_REMOVE_DIR, FS_REMOVE_FILE, FS_MAKE_CHAR, FS_MAKE_DIR = 1 << 4, 1 << 5, 1 << 6, 1 << 7
FS_MAKE_REG, FS_MAKE_SOCK, FS_MAKE_FIFO, FS_MAKE_BLOCK = 1 << 8, 1 << 9, 1 << 10, 1 << 11
FS_MAKE_SYM, FS_REFER, FS_TRUNCATE, FS_IOCTL_DEV = 1 << 12, 1 << 13, 1 << 14, 1 << 15
FILE_RIGHTS = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1

# Extra system directories a child may read (shared libraries behind lazily imported extension modules).
SYSTEM_LIB_DIRS = ("/lib", "/lib64", "/usr/lib", "/usr/lib64", "/usr/local/lib")
DEVICE_FILES = ("/dev/null", "/dev/urandom", "/dev/zero")


def _libc():
    if ctypes is None:
        raise OSError("ctypes unavailable")
    return ctypes, ctypes.CDLL(None, use_errno=True)


def drop_privileges(uid: int, gid: int) -> dict:
    if os.geteuid() != 0:
        return {"uid": os.getuid(), "dropped": False}
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    if os.geteuid() == 0 or os.getuid() == 0:
        raise RuntimeError("could not drop root privileges")
    return {"uid": uid, "dropped": True}


def _unshare(flags: int) -> None:
    if hasattr(os, "unshare"):  # Python >= 3.12
        os.unshare(flags)
        return
    _, libc = _libc()
    if libc.unshare(flags) != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))


def isolate_network() -> dict:
    """New user + network (+ pid) namespace; {"netns": False, "why": ...} where the system refuses.

    The pid namespace applies to the processes this one creates next (see `enter_pid_namespace`)."""
    try:
        _unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWPID)
        return {"netns": True, "pidns": True}
    except OSError as pid_exc:
        try:
            _unshare(CLONE_NEWUSER | CLONE_NEWNET)
        except OSError as exc:
            return {"netns": False, "pidns": False, "why": f"unshare: {exc.strerror or exc}"}
        return {"netns": True, "pidns": False, "why": f"unshare pid: {pid_exc.strerror or pid_exc}"}


def enter_pid_namespace() -> None:
    """After `isolate_network` made a pid namespace: fork its init, which forks the worker. Returns in the
    worker only; this process and the init exit with the worker's exit status (or die by its signal).

    Three processes: this one (outside the namespace, in the run's process group, only waits), the init (pid
    1 inside, in the same group, never runs untrusted code, reaps orphans until the worker ends, then exits —
    which makes the kernel kill everything left in the namespace), and the worker (pid 2, which goes on to
    the remaining layers and the untrusted code). The worker cannot signal the init (the kernel ignores
    signals to a namespace's init from inside it) nor see this process; the parent's group kill reaches both.
    """
    status_r, status_w = os.pipe()
    init = os.fork()
    if init == 0:
        worker = os.fork()
        if worker == 0:
            os.close(status_r)
            os.close(status_w)
            return
        while True:  # pid 1: adopted orphans are reaped here until the worker itself ends
            pid, status = os.waitpid(-1, 0)
            if pid == worker:
                os.write(status_w, str(status).encode())
                os._exit(0)  # the kernel now kills every process left in the namespace
    os.close(status_w)
    os.waitpid(init, 0)
    reported = os.read(status_r, 64)
    code = os.waitstatus_to_exitcode(int(reported)) if reported else 1
    if code < 0:  # die by the worker's signal, so the parent's verdict (cpu limit, crash) stays the same
        import signal

        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


def restrict_files(workdir: str, read_dirs: list[str]) -> dict:
    """Landlock: full access below `workdir`, read-only below `read_dirs`, nothing else; no execve."""
    if not sys.platform.startswith("linux") or ctypes is None:
        return {"landlock": 0, "why": "not Linux" if ctypes else "ctypes unavailable"}
    _, libc = _libc()
    libc.syscall.restype = ctypes.c_long
    abi = libc.syscall(LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), LANDLOCK_CREATE_RULESET_VERSION)
    if abi < 1:
        return {"landlock": 0, "why": f"unavailable: {os.strerror(ctypes.get_errno())}"}

    class RulesetAttr(ctypes.Structure):
        _fields_ = (("fs", ctypes.c_uint64), ("net", ctypes.c_uint64), ("scoped", ctypes.c_uint64))

    class PathBeneath(ctypes.Structure):
        _pack_ = 1
        _fields_ = (("allowed", ctypes.c_uint64), ("parent_fd", ctypes.c_int32))

    handled = (1 << 13) - 1  # ABI 1: EXECUTE .. MAKE_SYM
    handled |= FS_REFER if abi >= 2 else 0
    handled |= FS_TRUNCATE if abi >= 3 else 0
    handled |= FS_IOCTL_DEV if abi >= 5 else 0
    attr = RulesetAttr(
        handled,
        (NET_BIND_TCP | NET_CONNECT_TCP) if abi >= 4 else 0,
        (SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL) if abi >= 6 else 0,
    )
    size = 24 if abi >= 6 else 16 if abi >= 4 else 8
    ruleset = libc.syscall(LANDLOCK_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), 0)
    if ruleset < 0:
        return {"landlock": 0, "why": f"create_ruleset: {os.strerror(ctypes.get_errno())}"}
    read_only = FS_READ_FILE | FS_READ_DIR
    workdir_rights = handled & ~(FS_EXECUTE | FS_MAKE_CHAR | FS_MAKE_BLOCK | FS_IOCTL_DEV)
    rules = [(workdir, workdir_rights)] + [(d, read_only) for d in read_dirs]
    rules += [(f, FS_READ_FILE | FS_WRITE_FILE) for f in DEVICE_FILES]
    try:
        for path, rights in rules:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue  # a directory this system does not have
            if not os.path.isdir(path):
                rights &= FILE_RIGHTS
            rule = PathBeneath(rights & handled, fd)
            ok = libc.syscall(LANDLOCK_ADD_RULE, ruleset, LANDLOCK_RULE_PATH_BENEATH, ctypes.byref(rule), 0)
            os.close(fd)
            if ok != 0:
                return {"landlock": 0, "why": f"add_rule {path}: {os.strerror(ctypes.get_errno())}"}
        if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            return {"landlock": 0, "why": "prctl(NO_NEW_PRIVS) failed"}
        if libc.syscall(LANDLOCK_RESTRICT_SELF, ruleset, 0) != 0:
            return {"landlock": 0, "why": f"restrict_self: {os.strerror(ctypes.get_errno())}"}
    finally:
        os.close(ruleset)
    return {"landlock": abi}


def count_own_processes() -> int:
    uid = os.getuid()
    count = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    count += 1
            except OSError:
                pass
    return count


def apply_rlimits(limits: dict, *, own_process_count: int) -> dict:
    """Hard limits (the child cannot raise them again). RLIMIT_NPROC counts every process of the uid in the
    user namespace, so it is offset by the processes the uid already has where no fresh namespace isolates it."""
    cpu = max(1, int(limits["cpu_s"] + 0.999))
    memory = int(limits["memory_mb"]) * 1024 * 1024
    nproc = own_process_count + int(limits["max_processes"])
    settings = {
        resource.RLIMIT_CPU: (cpu, cpu + 1),  # SIGXCPU at the soft limit, SIGKILL one second later
        resource.RLIMIT_AS: (memory, memory),
        resource.RLIMIT_NPROC: (nproc, nproc),
        resource.RLIMIT_FSIZE: (int(limits["max_file_mb"] * 1024 * 1024),) * 2,
        resource.RLIMIT_NOFILE: (int(limits["max_open_files"]),) * 2,
        resource.RLIMIT_CORE: (0, 0),
    }
    for which, value in settings.items():
        resource.setrlimit(which, value)
    return {
        "cpu_s": cpu,
        "memory_mb": limits["memory_mb"],
        "nproc": nproc,
        "max_file_mb": limits["max_file_mb"],
        "max_open_files": limits["max_open_files"],
    }


def read_only_dirs() -> list[str]:
    stdlib = os.path.dirname(os.__file__)
    return [stdlib] + [d for d in SYSTEM_LIB_DIRS if os.path.isdir(d) and not stdlib.startswith(d + "/")]
