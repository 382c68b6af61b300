"""`lopd compare`: every method in the same loop at one rollout budget (run.py), and its report (report.py)."""
