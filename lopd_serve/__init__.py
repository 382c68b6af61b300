"""`lopd serve`: the champion behind an OpenAI-compatible endpoint, every conversation recorded as a trajectory.

Above lopd_core (it imports FastAPI, uvicorn, MLflow); lopd_core/traces holds the store it writes. See
docs/serving.md.
"""
