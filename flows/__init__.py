"""Entry points of the pipeline: the `lopd` command line (and, with the pipeline issue, the Prefect flows)."""
