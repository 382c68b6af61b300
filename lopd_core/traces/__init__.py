"""Traces of served conversations (`lopd serve`): the append-only store and the trace table's schema."""

from lopd_core.traces.errors import DiskFull, StoreFull, StoreLocked, TraceStoreError
from lopd_core.traces.schema import TRACE_SCHEMA, traces_as_trajectories, validate_traces
from lopd_core.traces.source import as_trajectories, load_traces, trace_table
from lopd_core.traces.store import TraceStore, read_records, read_traces, snapshot

__all__ = [
    "TRACE_SCHEMA",
    "DiskFull",
    "StoreFull",
    "StoreLocked",
    "TraceStore",
    "TraceStoreError",
    "as_trajectories",
    "load_traces",
    "read_records",
    "read_traces",
    "snapshot",
    "trace_table",
    "traces_as_trajectories",
    "validate_traces",
]
