"""One driver per pipeline stage: the plain function that `lopd <stage>`, the Prefect task of the stage and
`lopd compare` all call, so that each stage's work is defined once.

    base       drivers/base.py       run_base             the embedded base policy
    bank       drivers/bank.py       run_bank             the policy's rollouts, its successes into the bank
    coldstart  drivers/coldstart.py  run_coldstart        φ0, the composer's cold start
    fit        drivers/fit.py        run_fit              φ fitted in the deployment world
    teacher    drivers/teacher.py    run_teacher_in_play  the frozen teacher in play: alone, reading text, latents
    distill    drivers/distill.py    run_lopd             LOPD (or a baseline) training of a student
    evaluate   drivers/evaluate.py   run_evaluate         held-out success -> eval.json
    export     drivers/export.py     run_export           the clean Hugging Face checkpoint (registry: tasks/)
    report     drivers/report.py     run_report           the offline HTML dashboard

Beside them, no stage of their own: what `lopd cycle` keeps of its stages (drivers/cycle_record.py: the champion,
the lineage, the record; drivers/cycle_summary.py: the lines it ends with, the report's inputs), and the
time-stamped progress line every command prints (drivers/progress.py). The table above is checked against
tasks/stage_params.py's stages and this folder's files (tests/pipeline/test_stage_params.py).

One small module per stage, and this file imports none of them: the source a stage runs is what its module
imports, which tasks/stage_params.py lists as the stage's code (DVC deps and the cache key), and a test walks
those imports to check the list. A package that imported every driver would make every stage depend on all.
"""
