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
