"""One LOPD update (DESIGN §3, steps 2-5): read reference.py first, update.py is the same update optimised. Its
typed inputs (inputs.py) and the state it advances (state.py), the batch (batch.py, replay.py, anneal.py), the
teacher's context and what one update shares (parts.py), φ's side of it (composer_step.py), the step's pieces
(step.py), the margin (margin.py, margin_pricing.py) and the step's dashboard row (dashboard.py)."""
