"""The sections of params.yaml, one small module per theme; `lopd_core.config` loads them and re-exports them.

checks.py  the checks a setting can carry and ConfigError      fields.py  `setting(...)`, `Section`, type checks
model.py   model, model.tiny, model.warmstart                  envs.py    envs, and installed environment plugins
rollout.py rollout (the sampling of training), bank, composer, coldstart
lopd.py    lopd, baselines                                     run.py     eval, tracking, cycle, bench
compare.py compare and its presets                  serve.py   serve (`lopd serve`)
                             params.py  Params, every section
render.py  params.yaml and the --help listing, from the definitions

Imports nothing of the library but lopd_core.names (plain data), so reading a configuration loads no model code.
"""
