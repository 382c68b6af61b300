"""The run around the update: the models built from the settings (build.py), the `Distiller` that steps
(trainer.py) and its loop (loop.py), the checkpoints and when a resume is refused (checkpoints.py,
sharded_checkpoint.py, resume.py), and what changes between steps: the gated teacher refresh (teacher_refresh.py),
served traces as trajectories (trace_source.py), the growing bank (growing_bank.py)."""
