"""The passes and the formulas every part scores with: the student's and teacher's weights (models.py), the latent
teacher's splice and its passes over a batch (teacher.py), scoring with each shared prompt run once (prefix.py),
and the losses on those scores as pure functions (losses.py, pg_losses.py). Imports no other part of distill/."""
