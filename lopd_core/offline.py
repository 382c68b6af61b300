"""Offline-by-default switches, set by the package rather than left to the user (DESIGN §6).

Without them model loading and MLflow's transformers flavour retry the hub for tens of seconds, and several
libraries phone home. `setdefault` keeps any value the user exported deliberately (e.g. HF_HUB_OFFLINE=0 to
download a real checkpoint once).
"""

import os

OFFLINE_DEFAULTS = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "DO_NOT_TRACK": "true",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DVC_NO_ANALYTICS": "1",
    "ANONYMIZED_TELEMETRY": "False",
    "TOKENIZERS_PARALLELISM": "false",
}


def apply_offline_defaults() -> None:
    for key, value in OFFLINE_DEFAULTS.items():
        os.environ.setdefault(key, value)
