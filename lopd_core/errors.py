"""Errors the command line reports as one line and exit status 1, without a traceback.

Why classes of their own: a corrupt checkpoint, a checkpoint made under other settings, an unreadable bank file,
a diverged run or a model of NaNs is not a bug in the code but a state the user has to act on (start over,
restore a file, change a setting). The message names the file or key and that action; a traceback would only
bury it. Imports nothing, so the command line can catch these without loading the library.
"""

from __future__ import annotations


class StateError(Exception):
    """A file a run depends on (checkpoint, bank) cannot be used as it is; the message names it and the fix."""


class TrainingDiverged(StateError, RuntimeError):
    """More updates were skipped as non-finite than lopd.max_skipped_share allows."""


class NonFiniteWeights(StateError, ValueError):
    """A model file holds NaN or infinite weights (saved from a diverged run): its evaluations would be noise."""


class EnvironmentFault(StateError, ValueError):
    """An environment handed the pipeline something the contract forbids (a reward outside [0, 1], a task that
    cannot be played): the message names the environment and the task, so the plugin's author knows where."""


class ChatTemplateError(StateError, ValueError):
    """A model folder's chat template cannot be used (none, it raises, it cannot render a tool turn): the
    message names the folder."""


class TrackingUnavailable(StateError):
    """The MLflow tracking store cannot be used (unreachable, read-only, corrupt): the message names the URI and
    the way out (--no-mlflow)."""


class EnvironmentStepFailed(StateError):
    """A plugin environment's reset or step did not come back: it ran past `envs.step_timeout_s`, or its isolated
    process died. The message names the environment, the task and the setting."""
