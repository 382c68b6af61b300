"""lopd_core: the compute library of the LOPD pipeline (environments, model, rollout, evaluation).

It knows nothing of Prefect or MLflow: it takes typed config, returns typed results and writes files only where
told. Importing it applies the offline defaults (no hub look-ups, no telemetry).
"""

from lopd_core.offline import apply_offline_defaults

apply_offline_defaults()
