"""Overrides that shrink every stage of a cycle (base, bank, cold start, distill, evaluate) to about a minute of
compute: shared by the tests that run whole cycles, in-process or through a Prefect worker."""

TINY_CYCLE = [
    "model.tiny.hidden_size=32", "model.tiny.num_layers=2", "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1",
    "model.tiny.intermediate_size=64", "model.tiny.vocab_size=700", "model.warmstart.demos=150",
    "model.warmstart.time_budget_s=8", "model.warmstart.max_steps=0", "bank.seed_tasks=6", "bank.samples_per_task=1",
    "coldstart.oracle_tasks=8", "envs.pretrain_worlds=2",
    "composer.num_queries=2", "composer.num_layers=1", "composer.num_heads=2", "coldstart.steps=2",
    "coldstart.batch_size=4", "lopd.steps=2", "lopd.tasks_per_step=2", "lopd.samples_per_task=2",
    "rollout.max_new_tokens=24", "eval.n_per_split=3", "eval.with_experience=false", "eval.modes=[greedy]",
]
