"""Which settings a distillation checkpoint must agree with to be resumed, as plain data.

Why a module of its own that imports nothing: the distill stage's reads (tasks/stage_params.py) are these
settings and where the policy is, and the command line lists them in `--help`; neither should load torch to
learn a list of names.
"""

# What a checkpoint must agree with to be resumed: the settings that shape a run's numbers. The distill stage's
# reads (tasks/stage_params.py) are these and where the policy is, so the two cannot drift apart.
# Free to change on a resume: lopd.steps (a longer run continues a shorter one; a checkpoint past it is refused
# apart), where outputs go, how often checkpoints are written, the memory schedule of a chunk (the same gradients
# either way) and resume_mismatch itself; where a plugin's tools run and how long a step may take (the same
# episodes either way).
RESUME_SETTINGS = (
    "seed",
    "model.dtype",
    "model.threads",
    "lopd",
    "baselines",
    "rollout",
    "composer",
    "coldstart.fit_steps",  # 0: distillation starts from φ0 itself, else from the φ fitted in the world
    "envs",
    "bank.top_j",
    "bank.allow_self_retrieval",
    "bank.same_world",
    "bank.ef_search",
    "bank.refresh_every",
    "bank.min_reward",
)
RESUME_FREE = frozenset(
    {
        "lopd.steps",
        "lopd.out_dir",
        "lopd.csv",
        "lopd.checkpoint_every",
        "lopd.resume_mismatch",
        "lopd.max_skipped_share",
        "lopd.low_memory",
        "lopd.teacher_micro_batch",
        "lopd.share_prompt",
        "lopd.sharding",
        "envs.isolate_tools",
        "envs.step_timeout_s",
    }
)
