"""`lopd sandbox run FILE [--timeout S] [--memory-mb M]`: run a Python file in the sandbox, print the result.

For debugging and for operators: the JSON shows status (ok | error | timeout | killed), why the run stopped,
the exit code, duration, the (truncated) stdout and stderr, the exception that stopped the program, and which
isolation layers this machine actually gave the run. Exit code 0 iff the status is "ok".
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def cmd_sandbox_run(params, args) -> int:
    from lopd_core.envs.sandbox import SandboxLimits, run_program

    source = Path(args.file).read_text(encoding="utf-8", errors="replace")  # FileNotFoundError: clear CLI error
    limits = SandboxLimits(timeout_s=args.timeout, cpu_s=args.timeout, memory_mb=args.memory_mb)
    result = run_program(source, limits)
    print(json.dumps(result.to_dict(), indent=2))
    return 0 if result.status == "ok" else 1


def _positive(kind):
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
        return value

    return parse


def add_sandbox_parser(sub, add_common) -> None:
    sandbox = sub.add_parser("sandbox", help="run untrusted Python in the execution sandbox")
    actions = sandbox.add_subparsers(dest="sandbox_action", required=True)
    run = actions.add_parser("run", help="run a Python file in the sandbox and print the result as JSON")
    add_common(run)
    run.add_argument("file", help="the Python file to run")
    run.add_argument("--timeout", type=_positive(float), default=10.0, help="wall-clock and CPU seconds (10)")
    run.add_argument("--memory-mb", type=_positive(int), default=512, help="address-space limit in MiB (512)")
    run.set_defaults(func=cmd_sandbox_run)
