"""The `lopd` command line: argument parsing and one-line errors over the stage drivers (lopd_core.drivers)
and the Prefect flows (flows/). `main.py` builds the parser; each other module adds one command group."""
