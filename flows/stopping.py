"""A stopped flow run shows as Cancelled, not Crashed (lopd_core/stopping.py, issue #47).

When SIGTERM or SIGINT stops `lopd cycle` or `lopd compare`, the exception unwinds through every running flow and
Prefect marks each one Crashed, which reads as a bug. `cancel_if_stopped` is an `on_crashed` hook: Prefect calls
it right after it recorded the crash, and when the crash is a stop the user asked for, it moves the run on to
Cancelled. It needs the Prefect API: when the signal also killed the temporary server (Ctrl-C and `timeout`
signal the whole process group), Prefect could not record the crash either, and the hook is never called.
"""

from __future__ import annotations

import signal

from lopd_core.stopping import stop_requested


def cancel_if_stopped(flow, flow_run, state) -> None:
    """Prefect `on_crashed` hook: Cancelled (forced: Crashed is final) when a stop signal caused the crash."""
    signum = stop_requested()
    if signum is None:
        return
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelled

    with get_client(sync_client=True) as client:
        client.set_flow_run_state(
            flow_run.id, Cancelled(message=f"stopped by {signal.Signals(signum).name}"), force=True
        )


STOP_HOOKS = {"on_crashed": [cancel_if_stopped]}
