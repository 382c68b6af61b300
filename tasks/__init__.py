"""Thin orchestration wrappers over lopd_core (Prefect tasks come with the pipeline stage)."""
