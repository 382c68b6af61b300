"""The sandbox's child process: isolate itself, run the untrusted code, report builtin values (stdlib only).

Run by runner.py as `python -I -S child.py WORKDIR` in a fresh session, with WORKDIR/job.json:

    {"mode": "program", "source": ...}                                  run a whole program
    {"mode": "calls", "source": ..., "function": name, "inputs": [[arg, ...], ...]}
                                                                         define `name`, call it on each input

Nothing the parent knows about the expected answers is ever sent here: the child reports what the code
*returned*, as JSON (so only builtin values: an object whose `==` always answers true cannot be serialized and
proves nothing), and the parent compares. Reports go to WORKDIR/report.jsonl, one line per event, written as
they happen so that a run killed halfway still shows the calls it finished:

    {"event": "setup", "isolation": {...}}        which layers this run actually has
    {"event": "call", "i": 0, "value": ...}       or {"event": "call", "i": 0, "error": "ValueError: ..."}
    {"event": "load_error", "error": ...}         the source did not define what was asked
    {"event": "done", "error": null}              the harness reached its end (error: what stopped it)
"""

import builtins
import contextlib
import json
import os
import sys

# Modules untrusted code commonly imports, loaded while the standard library is still readable (a child that
# dropped root privileges may not be able to read it afterwards).
PRELOAD = (
    "math",
    "cmath",
    "re",
    "string",
    "collections",
    "collections.abc",
    "itertools",
    "functools",
    "heapq",
    "bisect",
    "typing",
    "fractions",
    "decimal",
    "statistics",
    "copy",
    "operator",
    "datetime",
    "random",
    "hashlib",
    "dataclasses",
    "enum",
    "textwrap",
    "unicodedata",
    "array",
    "numbers",
    "time",
    "struct",
    "abc",
    "io",
    "calendar",
    "signal",
)
GUARD_ONLY_MODULES = ("ctypes", "_ctypes", "ctypes._endian", "resource", "guard", "audit")
MAX_REPORT_LINE = 1_000_000  # bytes; a bigger result is reported as an error
MAX_ERROR_CHARS = 500


def describe(exc: BaseException) -> str:
    """`Type: message`, even for exceptions whose name or str() misbehave."""
    try:
        name = type(exc).__name__
        if type(name) is not str:
            name = "Exception"
    except BaseException:  # noqa: BLE001  a metaclass can make even this raise
        name = "Exception"
    try:
        message = str(exc)
        if type(message) is not str:
            message = "<unprintable>"
    except BaseException:  # noqa: BLE001
        message = "<unprintable>"
    text = f"{name}: {message}" if message else name
    return text[:MAX_ERROR_CHARS]


class Reporter:
    """Appends JSON lines to the report through a descriptor opened before the untrusted code ran."""

    def __init__(self, path: str):
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        self._write, self._dumps = os.write, json.dumps

    def emit(self, record: dict) -> None:
        self._write(self._fd, (self._dumps(record) + "\n").encode())

    def emit_value(self, i: int, value) -> None:
        def reject(obj):
            try:
                kind = type(obj).__name__
            except BaseException:  # noqa: BLE001
                kind = "object"
            raise TypeError(f"returned a {kind}, not a builtin value (None, bool, int, float, str, list, dict)")

        try:
            line = self._dumps({"event": "call", "i": i, "value": value}, default=reject)
            if len(line) > MAX_REPORT_LINE:
                raise ValueError(f"result too large ({len(line)} bytes serialized)")
        except BaseException as exc:  # noqa: BLE001  serialization runs user code (dict subclasses, ...)
            line = self._dumps({"event": "call", "i": i, "error": describe(exc)})
        self._write(self._fd, (line + "\n").encode())


def isolate(job: dict, workdir: str) -> dict:
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    import audit as sandbox_audit
    import guard as sandbox_guard

    sys.path.remove(here)
    for name in PRELOAD:
        with contextlib.suppress(ImportError):
            __import__(name)
    read_dirs = sandbox_guard.read_only_dirs()
    isolation = sandbox_guard.drop_privileges(job["uid"], job["gid"])
    isolation.update(sandbox_guard.isolate_network())
    if isolation["pidns"]:
        sandbox_guard.enter_pid_namespace()  # from here on: the worker, pid 2 under a trusted init
    isolation.update(sandbox_guard.restrict_files(workdir, read_dirs))
    # RLIMIT_NPROC counts per user namespace: the init and the worker are already two of the run's processes.
    own = (2 if isolation["pidns"] else 0) if isolation["netns"] else sandbox_guard.count_own_processes()
    isolation["rlimits"] = sandbox_guard.apply_rlimits(job["limits"], own_process_count=own)
    if job.get("audit_hook", True):
        sandbox_audit.install(workdir, read_dirs)
    isolation["audit_hook"] = job.get("audit_hook", True)
    for name in GUARD_ONLY_MODULES:  # so that importing them again goes through the audit hook
        sys.modules.pop(name, None)
    return isolation


def run(job: dict, reporter: Reporter) -> int:
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    try:
        code = compile(job["source"], "<sandbox>", "exec")
        exec(code, namespace)  # noqa: S102  this is the sandbox: untrusted code runs here and only here
    except BaseException as exc:  # noqa: BLE001  SystemExit and KeyboardInterrupt are failures too
        reporter.emit({"event": "load_error" if job["mode"] == "calls" else "done", "error": describe(exc)})
        return 1
    if job["mode"] == "program":
        reporter.emit({"event": "done", "error": None})
        return 0
    function = namespace.get(job["function"])
    if not callable(function):
        reporter.emit({"event": "load_error", "error": f"NameError: no function named {job['function']!r}"})
        return 1
    for i, args in enumerate(job["inputs"]):
        try:
            value = function(*args)
        except BaseException as exc:  # noqa: BLE001
            reporter.emit({"event": "call", "i": i, "error": describe(exc)})
            continue
        reporter.emit_value(i, value)
    reporter.emit({"event": "done", "error": None})
    return 0


def main() -> None:
    workdir = sys.argv[1]
    os.chdir(workdir)
    with open("job.json") as f:
        job = json.load(f)
    os.remove("job.json")
    reporter = Reporter(os.path.join(workdir, "report.jsonl"))
    try:
        reporter.emit({"event": "setup", "isolation": isolate(job, workdir)})
    except BaseException as exc:  # noqa: BLE001  fail closed: no untrusted code without the layers
        reporter.emit({"event": "setup_error", "error": describe(exc)})
        os._exit(3)
    status = run(job, reporter)
    for stream in (sys.stdout, sys.stderr):
        # Plain try: by now the untrusted code may have patched any module, contextlib included.
        try:  # noqa: SIM105
            stream.flush()
        except BaseException:  # noqa: BLE001  the code may have replaced or closed them
            pass
    os._exit(status)  # at once: no interpreter shutdown, no waiting for threads the code left running


if __name__ == "__main__":
    main()
