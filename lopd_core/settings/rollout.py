"""Settings of sampling and of the experience the teacher reads: `rollout` (the one sampling section of the
training rollouts, bank seeding included), `bank`, `composer`, `coldstart`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from lopd_core.settings.checks import Check, ConfigError, at_least, fraction, non_negative, one_of, positive
from lopd_core.settings.fields import Section, setting


@dataclass(frozen=True)
class RolloutConfig(Section):
    """How the policy samples when it rolls out: bank seeding, distillation's rollouts, the exported
    generation config. (Evaluation's sampled mode has its own eval.temperature.)"""

    SECTION = "rollout"

    batch_size: int = setting(32, help="trajectories generated together", check=positive())
    max_new_tokens: int = setting(64, help="tokens per assistant turn", check=positive())
    max_context: int = setting(
        1024,
        check=positive(),
        help="no context the policy (or a teacher pass over its trajectory) reads is longer: a turn that would not "
        "fit closes the episode (stop_reason context_limit); distillation keeps room for the teacher's latents",
    )
    max_observation_tokens: int = setting(
        512,
        check=at_least(32),
        help="an environment's observation is cut to this many tokens, with a mark telling the model so (at "
        "least 32: room for that mark)",
    )
    temperature: float = setting(
        1.0, help="sampling temperature of every training rollout (0: greedy)", check=non_negative()
    )
    top_p: float = setting(
        1.0,
        help="nucleus sampling: the smallest set of tokens holding this much probability",
        check=Check(lambda v: 0.0 < v <= 1.0, "a number in (0, 1]"),
    )
    backend: str = setting(
        "local",
        check=one_of("local", "openai"),
        help="who generates the training rollouts: local (the in-process engine) or openai (the servers below, "
        "over the OpenAI completions API with token ids and log-probs; environments stay in this process)",
    )
    servers: list[str] = setting(
        factory=list,
        help="with backend openai: base URLs (http://HOST:PORT/v1) of lopd serve, vLLM or SGLang "
        "servers; each takes a slice of a step's tasks",
    )
    sync: str = setting(
        "reload",
        check=one_of("reload", "none"),
        help="with backend openai: how the servers get each update: reload (the student saved to sync_dir, then POST "
        "/admin/reload on each server: lopd serve) or none (the servers are kept current by other means, e.g. "
        "vLLM's weight-transfer API; docs/scaling.md)",
    )
    sync_dir: str = setting(
        "",
        help="with backend openai: where the student is saved for the servers to reload after each update (a "
        "folder they can read; empty: a temporary folder, for servers on this machine)",
    )
    api_key_env: str = setting(
        "LOPD_API_KEY",
        help="with backend openai: the environment variable holding the servers' API key (unset: none sent)",
    )

    def check(self) -> None:
        if self.backend == "openai" and not self.servers:
            raise ConfigError("rollout.servers: got [], expected at least one base URL with rollout.backend openai")


@dataclass(frozen=True)
class RetrievalSettings:
    """What a retriever reads of the `bank` section, passed whole (`BankConfig.retrieval`) so that a setting
    added here reaches every retriever, and no call site unpacks the values one by one and forgets one."""

    top_j: int  # J experiences per task
    allow_self_retrieval: bool  # may a task retrieve its own earlier success
    same_world: bool  # only rows of the task's own world
    ef_search: int  # HNSW search breadth of the index


@dataclass(frozen=True)
class BankConfig(Section):
    """The experience bank: parquet is the source of truth, Chroma a derived index rebuilt from it."""

    SECTION = "bank"

    dir: str = setting("data/bank", help="the bank's parquet files")
    index_dir: str = setting(
        "data/bank_index", help="the Chroma folder (outside DVC-tracked outputs: opening it writes)"
    )
    chroma_url: str = setting("", help="e.g. http://localhost:8000 to use a Chroma server instead of the folder")
    collection: str = setting("experience_bank", help="the Chroma collection")
    top_j: int = setting(3, help="J experiences retrieved per task", check=positive())
    allow_self_retrieval: bool = setting(
        True, help="may a task retrieve its own earlier success (as the official code)"
    )
    same_world: bool = setting(
        True,
        help="retrieve only rows of the task's own world: nearest neighbours from "
        "another world show the teacher the wrong conventions",
    )
    min_reward: float = setting(1.0, help="a rollout joins the bank at this reward or above", check=fraction())
    seed_tasks: int = setting(200, help="train tasks rolled out to seed the bank", check=positive())
    samples_per_task: int = setting(2, help="rollouts per seed task", check=positive())
    ef_search: int = setting(
        100,
        help="HNSW search breadth: at a fixed breadth recall falls as the bank grows (benchmarks/retrieval.py)",
        check=positive(),
    )
    refresh_every: int = setting(
        4,
        help="every N distillation steps the student's new successes join the bank "
        "(0: a static bank, as the official code)",
        check=non_negative(),
    )

    @property
    def retrieval(self) -> RetrievalSettings:
        """The retrieval settings of this section, as one value."""
        names = [f.name for f in dataclasses.fields(RetrievalSettings)]
        return RetrievalSettings(**{name: getattr(self, name) for name in names})


@dataclass(frozen=True)
class ComposerConfig(Section):
    """The Perceiver resampler: K learned queries per experience."""

    SECTION = "composer"

    num_queries: int = setting(32, help="K latents per experience (the official code's)", check=positive())
    hidden_size: int = setting(0, help="0: the LM's width", check=non_negative())
    num_layers: int = setting(2, help="resampler layers", check=positive())
    num_heads: int = setting(4, help="resampler attention heads", check=positive())
    max_experience_tokens: int = setting(
        256, help="an experience is cut to this many tokens before encoding", check=positive()
    )
    # Two of the official composer's choices, measured as options (docs/composer.md).
    query_conditioned: bool = setting(
        False, help="encode each experience with the current task's instruction in front of it (the official code's)"
    )
    encoder_lora_rank: int = setting(
        0,
        help="rank of a LoRA of the base that φ's encoder reads with, fitted with φ, fixed during distillation "
        "(the official code's: 8); 0: the frozen base's states",
        check=non_negative(),
    )


@dataclass(frozen=True)
class ColdStartConfig(Section):
    """φ0: NLL of pretraining-world successes plus KL to the base reading them as text."""

    SECTION = "coldstart"

    steps: int = setting(300, help="optimizer steps", check=positive())
    batch_size: int = setting(16, help="target trajectories per step", check=positive())
    lr: float = setting(1e-3, help="learning rate", check=positive())
    kl_weight: float = setting(
        1.0,
        help="weight of KL(latent teacher || base reading the experiences as text); 0: the paper's NLL only",
        check=non_negative(),
    )
    oracle_tasks: int = setting(
        2000,
        check=positive(),
        help="oracle episodes on training tasks of the pretraining worlds: φ0's targets and what they retrieve; "
        "never a deployment world (the base's own successes are too rare to teach it)",
    )
    max_experiences: int = setting(
        0,
        help="φ0's cold start and the in-world fit read 1..max_experiences retrieved rows per target, drawn "
        "uniformly each time, so that φ reads any number of rows; 0: bank.top_j every time, as distillation does",
        check=non_negative(),
    )
    out: str = setting("data/composer/phi0.pt", help="where φ0 is written")
    # The in-world fit (lopd_core/distill/composer/world_fit.py): φ0 does not transfer to a new world, so before
    # distillation φ is fitted in the deployment world by KL to the base reading the same retrieved rows as text.
    fit_steps: int = setting(
        300,
        help="in-world fit of φ (`lopd fit`): optimizer steps of KL(base reading the bank rows as text || base "
        "reading φ's latents of them) on the deployment world's own sampled trajectories; 0: φ0 serves as it is",
        check=non_negative(),
    )
    fit_batch_size: int = setting(16, help="in-world fit: target trajectories per step", check=positive())
    fit_lr: float = setting(1e-3, help="in-world fit: learning rate", check=positive())
    online_rollouts: int = setting(
        0,
        help="in-world fit: fresh rollouts of the text teacher (the base reading its retrieved bank rows as text) "
        "on training tasks, added to the bank's seed rollouts as targets; charged as rollouts",
        check=non_negative(),
    )
    fit_out: str = setting("data/composer_fit/phi.pt", help="where the fitted φ is written")
