"""Errors the command line reports as one line and exit status 1, without a traceback.

Kept in a module that imports nothing heavy, so `lopd` can catch them without loading torch first."""

from __future__ import annotations


class TrainingDiverged(RuntimeError):
    """More updates were skipped as non-finite than lopd.max_skipped_share allows."""


class NonFiniteWeights(ValueError):
    """A model file holds NaN or infinite weights (saved from a diverged run): its evaluations would be noise."""
