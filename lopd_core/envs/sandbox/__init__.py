"""The sandbox: the only place model-written code runs (see runner.py for what it covers and what it does not).

runner.py starts one isolated child per run and judges it; child.py is the script the child runs, with the
kernel layers in guard.py and the audit-hook fallback in audit.py (both standard library only, imported by
the child as plain files); supervise.py reads the child's output and report within bounds. env_child.py is the
long-lived child of an isolated plugin environment (envs.isolate_tools: ../isolated.py), behind the same layers.
"""

from .runner import STATUSES, SandboxLimits, SandboxPool, SandboxResult, run_calls, run_job, run_program
from .supervise import NO_RESULT

__all__ = [
    "NO_RESULT",
    "STATUSES",
    "SandboxLimits",
    "SandboxPool",
    "SandboxResult",
    "run_calls",
    "run_job",
    "run_program",
]
