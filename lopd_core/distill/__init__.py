"""The LOPD step and what trains around it, in five parts, bottom to top; a part imports only the ones below it
(tests/test_architecture.py): `scoring/` the passes and the formulas, `composer/` φ and its fits, `teacher/` what
the teacher reads and how it plays, `update/` one update (reference.py is read first), `loop/` the run."""
