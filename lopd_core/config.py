"""One typed configuration for a run: `params.yaml` -> nested dataclasses, validated at load.

Why this shape: every command reads the configuration once at the edge (`load_params`) and passes typed
sections down; library functions take explicit arguments. A wrong key or value fails here, naming the key, the
value and what was expected, instead of deep inside a training step twenty minutes later.

Overrides use the same dotted names as the file: `--set rollout.temperature=0.7` (the value is parsed as YAML,
so `true`, `3`, `[a, b]` keep their types).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from yaml.constructor import ConstructorError

# Valid names as plain data (a leaf module): loading the configuration loads nothing else of the library.
from lopd_core.names import (
    ACEBENCH_CATEGORIES,
    ACEBENCH_GROUPS,
    BFCL_CATEGORIES,
    BUILTIN_ENVS,
    ENV_ENTRY_POINT_GROUP,
    METHOD_NAMES,
)

# The named worlds of toolworld (lopd_core/envs/toolworld/worlds.py WORLDS), the deployment candidates; kept here as
# plain data so the config imports nothing of the library (a test checks the two agree).
NAMED_WORLDS = ("aurora", "borealis", "cobalt", "dune")


class ConfigError(ValueError):
    """A key or value of params.yaml (or of a --set override) is not what the pipeline expects."""


def _check(predicate, expected: str):
    return {"check": (predicate, expected)}


def positive():
    return _check(lambda v: v > 0, "a number > 0")


def in_range(low: float, high: float, *, open_low: bool = False):
    """low <= v <= high (low < v with open_low): for values where a huge one is a typo, not a choice."""
    return _check(lambda v: (low < v if open_low else low <= v) and v <= high,
                  f"a number in {'(' if open_low else '['}{low:g}, {high:g}]")


def device_name():
    return _check(lambda v: v in ("auto", "cpu", "mps", "cuda") or (v.startswith("cuda:") and v[5:].isdigit()),
                  "auto, cpu, cuda, cuda:N or mps")


def non_negative():
    return _check(lambda v: v >= 0, "a number >= 0")


def fraction():
    return _check(lambda v: 0.0 <= v <= 1.0, "a number in [0, 1]")


def one_of(*choices):
    return _check(lambda v: v in choices, "one of " + ", ".join(map(repr, choices)))


MARGIN_AUTO = "auto"  # lopd.margin priced at the start of distillation (lopd_core/lopd/margin.py)


def margin_value():
    """`auto`, or a number in [0, 10] (nats per action token: a huge one is a typo, not a choice)."""
    return _check(lambda v: v == MARGIN_AUTO or (isinstance(v, (int, float)) and not isinstance(v, bool)
                                                 and 0.0 <= v <= 10.0),
                  f"{MARGIN_AUTO!r} or a number in [0, 10]")


def subset_of(*choices):
    return _check(lambda v: len(v) > 0 and set(v) <= set(choices), "a non-empty list of " + ", ".join(choices))


@dataclass
class TinyModelConfig:
    """Architecture of the embedded base (a small Qwen3) and its tokenizer."""

    vocab_size: int = field(default=2048, metadata=positive())
    hidden_size: int = field(default=128, metadata=positive())
    # Shallow: on a CPU budget, more warm-start steps do more for the base than more layers.
    num_layers: int = field(default=2, metadata=positive())
    num_heads: int = field(default=4, metadata=positive())
    num_kv_heads: int = field(default=2, metadata=positive())
    intermediate_size: int = field(default=384, metadata=positive())
    max_positions: int = field(default=1024, metadata=positive())


@dataclass
class WarmStartConfig:
    """Supervised warm start of the embedded base on oracle demonstrations with controlled noise.

    How long it trains: `max_steps` > 0 runs exactly that many optimizer steps and then `epochs` and
    `time_budget_s` are not read (a fixed step count gives the same base on every machine; a clock cannot).
    With `max_steps` 0 (the smoke preset) the schedule is planned for `epochs` passes over the demonstrations
    and cut short at `time_budget_s`.
    """

    demos: int = field(default=9000, metadata=positive())
    # Share of demonstrations that carry 1..max_experiences same-world successes as text in the first user turn.
    experience_fraction: float = field(default=0.7, metadata=fraction())
    max_experiences: int = field(default=3, metadata=positive())
    # Probability that a demonstration *without* experience follows another world's conventions: the base then
    # knows each world's rules only imperfectly, while demonstrations with experience always follow them.
    # Kept small: more noise made the base worse at reproducing held-out tasks without teaching it the
    # conventions any better (benchmarks/probes/failure_probe.py measures it).
    convention_noise: float = field(default=0.15, metadata=fraction())
    # Per-call chance of a plausible argument mistake in a demonstration. 0 by default: a demonstrated miscopy
    # teaches the base that a copied value is sometimes another one, and copying is what it is weakest at.
    slip: float = field(default=0.0, metadata=fraction())
    epochs: float = field(default=6.0, metadata=positive())  # only when max_steps is 0 (see the docstring)
    batch_tokens: int = field(default=1024, metadata=positive())  # small batches: more steps, faster copying
    lr: float = field(default=6e-3, metadata=positive())  # AdamW's: embeddings and norms (all weights under adamw)
    # muon: the layers' weight matrices take Muon steps (orthogonalised momentum, torch.optim.Muon) at muon_lr,
    # the rest AdamW at lr; adamw: AdamW for every weight (the former default). See warmstart.py.
    optimizer: str = field(default="muon", metadata=one_of("muon", "adamw"))
    muon_lr: float = field(default=1.5e-3, metadata=positive())  # RMS-matched to AdamW's scale
    warmup_steps: int = field(default=20, metadata=non_negative())
    time_budget_s: float = field(default=270.0, metadata=positive())  # only when max_steps is 0: a wall clock
    # A fixed number of optimizer steps (0: epochs and the time budget decide): the same base on every
    # machine, which a time budget cannot give (the schedule is then planned for these steps).
    max_steps: int = field(default=12000, metadata=non_negative())
    drills: int = field(default=6000, metadata=non_negative())  # copy/lookup drills run first (drills.py)
    context_loss_weight: float = field(default=0.3, metadata=non_negative())  # LM loss on forced tokens
    # Share of the forced positions that loss is estimated on each step (random): most of its cost is the output
    # head over the vocabulary at every position.
    context_loss_fraction: float = field(default=0.33, metadata=fraction())
    # Loss weight of an action token that copies a value (word or number) already in the context, against 1 for
    # the call syntax around it: the copies decide a task, the syntax is learned early (warmstart.py).
    copy_weight: float = field(default=3.0, metadata=positive())


@dataclass
class ModelConfig:
    # Empty: the embedded base that `lopd base` builds at `base_dir`. Otherwise any causal-LM directory or hub
    # id (loaded offline unless HF_HUB_OFFLINE=0).
    name_or_path: str = ""
    base_dir: str = "data/base"
    dtype: str = field(default="float32", metadata=one_of("float32", "bfloat16", "float16"))
    device: str = field(default="auto", metadata=device_name())
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    warmstart: WarmStartConfig = field(default_factory=WarmStartConfig)


def installed_env_plugins() -> dict[str, str]:
    """Environments installed packages register (entry points of group `lopd.envs`): name -> `module:Class`.
    Reads package metadata only; nothing is imported until an environment is used."""
    return {name: value for name, value, _ in _installed_env_plugins()}


def installed_env_conflicts() -> dict[str, list[str]]:
    """Names that two or more installed packages register with different classes: name -> ["package (module:Class)",
    ...]. Such a name resolves to none of them (which one the metadata lists last is an accident of the install):
    `envs.plugins.NAME` picks one."""
    seen: dict[str, dict[str, str]] = {}
    for name, value, dist in _installed_env_plugins():
        seen.setdefault(name, {})[value] = dist
    return {name: [f"{dist} ({value})" for value, dist in sorted(by_value.items())]
            for name, by_value in seen.items() if len(by_value) > 1}


def env_conflict_message(name: str, where: str) -> str:
    both = " and ".join(installed_env_conflicts()[name])
    return (f"{where}: environment {name!r} is registered by more than one installed package: {both}; uninstall "
            f"one, or pick one with --set 'envs.plugins={{{name}: \"module:Class\"}}'")


@functools.lru_cache(maxsize=1)
def _installed_env_plugins() -> tuple[tuple[str, str, str], ...]:
    # Read once a process: scanning package metadata costs milliseconds, and the environment registry resolves
    # a plugin's name for every episode the rollout engine plays.
    from importlib.metadata import entry_points

    def package(ep) -> str:
        dist = getattr(ep, "dist", None)
        return getattr(dist, "name", None) or "an unnamed package"

    return tuple((ep.name, ep.value, package(ep)) for ep in entry_points(group=ENV_ENTRY_POINT_GROUP))


_PLUGIN_SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


@dataclass
class EnvsConfig:
    # Environment mix for training and evaluation: name -> weight. A name is a built-in (toolworld, codegen),
    # a key of `plugins`, or an environment an installed package registers (entry point group `lopd.envs`).
    mix: dict[str, float] = field(default_factory=lambda: {"toolworld": 1.0},
                                  metadata=_check(lambda v: v and all(w > 0 for w in v.values()),
                                                  "a non-empty mapping of environments to weights > 0"))
    # Adaptation to a new environment: the warm start and the composer's cold start see only generated
    # pretraining worlds; bank, distillation, evaluation and the cycle run in the deployment worlds, held out
    # from both (lopd_core/envs/worlds.py).
    pretrain_worlds: int = field(default=64, metadata=positive())
    # cobalt: of the named worlds, aurora and dune agree with what the pretraining worlds most often do, so the
    # base half-knows them without experience; cobalt and borealis are new to it (docs/results.md).
    deploy_worlds: list[str] = field(default_factory=lambda: ["cobalt"], metadata=subset_of(*NAMED_WORLDS))
    world_seed: int = 0  # which pretraining worlds are generated
    # Environments of your own by import path, name -> "module:Class" (lopd_core/envs/registry.py); the name must
    # equal the class's `name`.
    plugins: dict[str, str] = field(default_factory=dict, metadata=_check(
        lambda v: all(_PLUGIN_SPEC.match(s) for s in v.values()), 'a mapping of names to "module:Class"'))
    # Tasks of a plugin environment from a JSON Lines file instead of its own make_tasks, name -> path
    # (lopd_core/envs/task_files.py gives the format).
    task_files: dict[str, str] = field(default_factory=dict)
    # Plugin environments' tools are trusted code run inside the trainer's process by default, with arguments the
    # model chose (your files, environment variables and network are in reach). true: each episode's reset and
    # step run in a child process behind the sandbox instead (no network, a scrubbed environment, only a private
    # folder, rlimits; lopd_core/envs/guarded.py). A process per episode: benchmarks/isolated_tools.py prices it.
    isolate_tools: bool = False
    # The longest one reset or step of a plugin environment may take, isolated or not: past it the episode fails
    # with one line naming the env and the task, instead of hanging a stage until cycle.stage_timeout_s.
    step_timeout_s: float = field(default=30.0, metadata=in_range(0.0, 86400.0, open_low=True))  # a day at most

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """The names across keys: the mix's must be known, plugins must not shadow built-ins, task files must
        belong to a plugin environment and exist."""
        clash = sorted(set(self.plugins) & set(BUILTIN_ENVS))
        if clash:
            raise ConfigError(f"envs.plugins.{clash[0]}: got {self.plugins[clash[0]]!r}, expected a name that is not "
                              f"a built-in environment ({', '.join(BUILTIN_ENVS)})")
        installed = installed_env_plugins()
        plugin_names = set(self.plugins) | set(installed)
        known = sorted(BUILTIN_ENVS) + sorted(plugin_names)
        unknown = sorted(set(self.mix) - set(known))
        if unknown:
            raise ConfigError(f"envs.mix: got {unknown[0]!r}, expected one of the known environments: "
                              f"{', '.join(known)} (built-ins, envs.plugins, and entry points of group "
                              f"{ENV_ENTRY_POINT_GROUP!r})")
        conflicts = installed_env_conflicts()
        for name in sorted((set(self.mix) | set(self.task_files)) & set(conflicts) - set(self.plugins)):
            raise ConfigError(env_conflict_message(name, "envs.mix" if name in self.mix else f"envs.task_files.{name}"))
        for name, path in self.task_files.items():
            if name not in plugin_names:
                raise ConfigError(f"envs.task_files.{name}: got {path!r}, expected a plugin environment's name "
                                  f"(known plugins: {', '.join(sorted(plugin_names)) or 'none'}); built-ins "
                                  "generate their own tasks")
            if not Path(path).is_file():
                raise ConfigError(f"envs.task_files.{name}: got {path!r}, expected an existing JSON Lines file")


@dataclass
class RolloutConfig:
    batch_size: int = field(default=32, metadata=positive())  # trajectories generated together
    max_new_tokens: int = field(default=64, metadata=positive())  # per assistant turn
    # No context the policy (or a teacher pass over its trajectory) reads is longer than this: a turn that would
    # not fit closes the episode (stop_reason context_limit), and distillation's rollouts keep room for the
    # teacher's spliced latents.
    max_context: int = field(default=1024, metadata=positive())
    # An environment's observation is cut to this many tokens, with a mark telling the model so (an observation
    # has no size limit of its own: a huge one became one huge context). Room for that mark: at least 32.
    max_observation_tokens: int = field(default=512, metadata=_check(lambda v: v >= 32, "an integer >= 32"))
    temperature: float = field(default=1.0, metadata=non_negative())
    top_p: float = field(default=1.0, metadata=_check(lambda v: 0.0 < v <= 1.0, "a number in (0, 1]"))


@dataclass
class EvalConfig:
    n_per_split: int = field(default=100, metadata=positive())
    # test_id / test_ood in the deployment worlds; pretrain_test: held-out tasks of the pretraining worlds
    # (what adaptation forgets)
    splits: list[str] = field(default_factory=lambda: ["test_id", "test_ood", "pretrain_test"],
                              metadata=subset_of("train", "test_id", "test_ood", "pretrain_test"))
    modes: list[str] = field(default_factory=lambda: ["greedy", "sampled"], metadata=subset_of("greedy", "sampled"))
    temperature: float = field(default=1.0, metadata=positive())  # the `sampled` mode
    # Also report success with 1..3 same-world oracle successes as text in the first user turn
    # (the base's ability to use experience in context); reported under "<split>+experience".
    with_experience: bool = True
    num_experiences: int = field(default=3, metadata=positive())
    out: str = "metrics/eval.json"
    # External benchmarks the evaluate flow also runs (settings under `bench`); their scores go under their
    # own names in `out`.
    benchmarks: list[str] = field(default_factory=list, metadata=_check(
        lambda v: set(v) <= {"bfcl", "acebench", "humaneval"}, "a list of: bfcl, acebench, humaneval"))


@dataclass(frozen=True)
class RetrievalSettings:
    """What a retriever reads of the `bank` section, passed whole (`BankConfig.retrieval`) so that a setting
    added here reaches every retriever, and no call site unpacks the values one by one and forgets one."""

    top_j: int  # J experiences per task
    allow_self_retrieval: bool  # may a task retrieve its own earlier success
    same_world: bool  # only rows of the task's own world
    ef_search: int  # HNSW search breadth of the index


@dataclass
class BankConfig:
    """The experience bank: parquet is the source of truth, Chroma a derived index rebuilt from it."""

    dir: str = "data/bank"  # bank.parquet lives here
    index_dir: str = "data/bank_index"  # the Chroma folder (outside DVC-tracked outputs: opening it writes)
    chroma_url: str = ""  # e.g. http://localhost:8000 to use a Chroma server instead of the folder
    collection: str = "experience_bank"
    top_j: int = field(default=3, metadata=positive())
    allow_self_retrieval: bool = True  # may a task retrieve its own earlier success (as the official code)
    # Retrieve only rows of the task's own world (a Chroma metadata filter): the worlds differ in conventions, and
    # nearest neighbours by instruction from another world show the teacher the wrong ones.
    same_world: bool = True
    min_reward: float = field(default=1.0, metadata=fraction())
    seed_tasks: int = field(default=200, metadata=positive())  # train tasks rolled out to seed the bank
    samples_per_task: int = field(default=2, metadata=positive())
    # HNSW search breadth: at a fixed breadth recall falls as the bank grows (benchmarks/retrieval.py).
    ef_search: int = field(default=100, metadata=positive())
    # Every N distillation steps the student's new successes join the bank its teacher retrieves from (0 = a
    # static bank, as the official code). lopd_core/lopd/growing_bank.py
    refresh_every: int = field(default=4, metadata=non_negative())

    @property
    def retrieval(self) -> RetrievalSettings:
        """The retrieval settings of this section, as one value."""
        names = [f.name for f in dataclasses.fields(RetrievalSettings)]
        return RetrievalSettings(**{name: getattr(self, name) for name in names})


@dataclass
class ComposerConfig:
    num_queries: int = field(default=32, metadata=positive())  # K latents per experience (official code: 32)
    hidden_size: int = field(default=0, metadata=non_negative())  # 0 = the LM's width
    num_layers: int = field(default=2, metadata=positive())
    num_heads: int = field(default=4, metadata=positive())
    max_experience_tokens: int = field(default=256, metadata=positive())


@dataclass
class ColdStartConfig:
    steps: int = field(default=300, metadata=positive())
    batch_size: int = field(default=16, metadata=positive())
    lr: float = field(default=1e-3, metadata=positive())
    # Weight of KL(latent teacher || base reading the experiences as text); 0 = the paper's NLL only.
    kl_weight: float = field(default=1.0, metadata=non_negative())
    # Oracle episodes on training tasks of the pretraining worlds: φ0's targets and what they retrieve. Never the
    # deployment worlds (lopd_core/lopd/coldstart_data.py). The base's own successes are too rare to teach it.
    oracle_tasks: int = field(default=2000, metadata=positive())
    out: str = "data/composer/phi0.pt"


# Methods whose student loss is GRPO's (lopd.student_loss unused), and those of them that add the sampled-token
# reverse KL to a teacher (Skill-SD): lopd_core/lopd/methods.py is the source, tests/lopd/test_training_step.py checks
# these agree with it (plain data here: the config imports nothing of the library).
POLICY_GRADIENT_METHODS = ("grpo", "skill_sd")
SAMPLED_KL_METHODS = ("skill_sd",)
# Methods whose own w of the top-k loss (1 − w)·reverse + w·forward KL is above 0 (lopd.kl_mix), and of them the
# one whose w is fixed at 1 (the pure forward KL): plain data as above, checked against methods.py the same way.
KL_MIX_METHODS = ("lopd_forward_kl", "lopd_mixed_kl")
FORWARD_KL_METHODS = ("lopd_forward_kl",)


@dataclass
class LopdConfig:
    # Which method the loop trains (lopd_core/lopd/methods.py): LOPD, a baseline or an ablation. The default is
    # LOPD with the cold-start composer kept (φ = φ0): on the embedded testbed training φ online did not beat it
    # (docs/results.md), so the frozen composer is the documented default there; `lopd` trains φ as the paper does.
    method: str = field(default="lopd_frozen_composer", metadata=one_of(*METHOD_NAMES))
    steps: int = field(default=64, metadata=positive())  # sized so `lopd cycle` fits 15 min on 2 cores
    tasks_per_step: int = field(default=8, metadata=positive())  # B
    samples_per_task: int = field(default=4, metadata=positive())  # G
    temperature: float = field(default=1.0, metadata=positive())  # rollout sampling temperature
    student_mode: str = field(default="full", metadata=one_of("full", "lora"))
    lora_rank: int = field(default=8, metadata=positive())
    lr_student: float = field(default=3e-4, metadata=in_range(0.0, 1.0, open_low=True))
    lr_composer: float = field(default=1e-4, metadata=in_range(0.0, 1.0, open_low=True))
    student_loss: str = field(default="topk", metadata=one_of("topk", "full", "sampled"))
    top_k: int = field(default=20, metadata=positive())
    # w of the top-k student loss (1 − w)·KL(p_S ‖ p_T) + w·KL(p_T ‖ p_S): 0 = the pure reverse KL (the paper's).
    # Left at 0, lopd_mixed_kl takes 0.5 and lopd_forward_kl 1 (lopd_core/lopd/methods.py kl_mix_of).
    kl_mix: float = field(default=0.0, metadata=fraction())
    # Truncated importance weight min(p_S(a) / p_sample(a), importance_cap) on the sampled-token reverse KL
    # (student_loss: sampled; Skill-SD's KL term), for rollouts drawn at temperature != 1 or top-p < 1. Only
    # that estimator depends on the sampled token: with topk / full it is rejected (check below).
    importance_weight: bool = False
    importance_cap: float = field(default=2.0, metadata=positive())
    # m of the constraint δ̄ ≥ m, in nats per action token of the teacher's advantage on the student's own tokens;
    # or `auto`: priced before the first step as margin_fraction × the gap the initial teacher (φ0's latents)
    # shows on the bank's successes, 0 where it shows none (lopd_core/lopd/margin.py). Kept in the checkpoint: a
    # resumed run does not re-price. A method's own margin still wins (lopd_no_margin: 0).
    margin: float | str = field(default="auto", metadata=margin_value())
    # With margin: auto, the share of that gap m asks the composer to hold (1: all that privilege shows at φ0).
    margin_fraction: float = field(default=0.5, metadata=in_range(0.0, 1.0, open_low=True))
    anchor_weight: float = field(default=0.2, metadata=non_negative())  # λ
    beta_lr: float = field(default=0.5, metadata=non_negative())  # η_β
    beta_init: float = field(default=0.0, metadata=non_negative())  # β_0
    advantage: str = field(default="continuous", metadata=one_of("continuous", "binary", "group"))
    max_grad_norm: float = field(default=1.0, metadata=positive())
    # Trajectories per chunk of the teacher/student forward+backward (0 = the whole batch at once): gradients
    # accumulate over chunks and equal the whole batch's; only peak memory and speed depend on it.
    micro_batch: int = field(default=8, metadata=non_negative())
    # Share of those chunks whose teacher pass keeps its graph and back-propagates into the composer (picked
    # per step from a step-seeded shuffle); the others are scored without a graph and still count in δ̄, β and
    # the dashboard. The composer's gradient is the selected chunks' rescaled to the whole batch's token count:
    # an unbiased, noisier estimate of the same gradient for a cheaper step (benchmarks/step_cost.py).
    composer_fraction: float = field(default=1.0, metadata=fraction())
    # The teacher scores each distinct prompt (with its latents or text context) once and only the rows'
    # continuations per sample (lopd_core/lopd/prefix.py): exact, and the G samples of a task stop paying
    # G times for the prompt and its J·K latents. false: every row from its first token (build_batch).
    share_prompt: bool = True
    # The low-memory order of a chunk, trading compute for peak memory (false: one teacher pass per chunk, its
    # graph kept until the composer's loss after the student's backward). true: s_old comes from an extra
    # no-grad student forward, each teacher pass is consumed by the composer's backward at once, and the
    # resampler runs again at the end rather than keeping its graph. Same gradients either way.
    low_memory: bool = False
    # Trajectories per teacher pass inside a chunk in the low-memory order (0 = the whole chunk in one pass):
    # the teacher then holds a fraction of a student chunk's activations. Needs low_memory: true.
    teacher_micro_batch: int = field(default=0, metadata=non_negative())
    checkpoint_every: int = field(default=10, metadata=positive())
    # Share of the updates (student and composer counted apart) that may be skipped as non-finite before the
    # stage fails: a run that skips more has diverged, and its model is not worth saving.
    max_skipped_share: float = field(default=0.25, metadata=fraction())
    # A checkpoint made under other settings (or past lopd.steps) is refused (error) or resumed with a warning
    # (warn): resuming it would mix two runs' numbers in one set of curves. Changes no output of a run.
    resume_mismatch: str = field(default="error", metadata=one_of("error", "warn"))
    out_dir: str = "data/lopd"
    csv: str = "plots/distill.csv"

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Rules across keys (each key's own range is its field's). Run at load, and by the trainer on
        sections built by hand."""
        sampled_kl = self.method in SAMPLED_KL_METHODS or (
            self.method not in POLICY_GRADIENT_METHODS and self.student_loss == "sampled")
        if self.importance_weight and not sampled_kl:
            why = ("GRPO's clipped ratio is already taken against the sampling log-probs"
                   if self.method in POLICY_GRADIENT_METHODS else
                   f"lopd.student_loss={self.student_loss!r} is the exact KL at each visited state, which does not "
                   "depend on the sampled token, so its ratio corrects nothing")
            raise ConfigError(f"lopd.importance_weight: got true with lopd.method={self.method!r} and "
                              f"lopd.student_loss={self.student_loss!r}, expected false: the weight applies to the "
                              f"sampled-token reverse KL only (lopd.student_loss=sampled), and {why}")
        ok, expected = margin_value()["check"]
        if not ok(self.margin):  # (checked at load too; here also for a section built by hand)
            raise ConfigError(f"lopd.margin: got {self.margin!r}, expected {expected}")
        self._check_kl_mix()
        if self.teacher_micro_batch > 0 and not self.low_memory:
            raise ConfigError(f"lopd.teacher_micro_batch: got {self.teacher_micro_batch} with lopd.low_memory=false, "
                              "expected 0: teacher passes inside a chunk are part of the low-memory order "
                              "(set lopd.low_memory=true)")

    def _check_kl_mix(self) -> None:
        """lopd.kl_mix weighs the top-k distillation loss: meaningless with GRPO's loss or another student loss."""
        mixes = self.kl_mix > 0 or self.method in KL_MIX_METHODS
        if mixes and self.method in POLICY_GRADIENT_METHODS:
            raise ConfigError(f"lopd.kl_mix: got {self.kl_mix:g} with lopd.method={self.method!r}, expected 0: the "
                              "forward/reverse mix weighs a distillation loss, and this method's loss is GRPO's")
        if mixes and self.student_loss != "topk":
            raise ConfigError(f"lopd.student_loss: got {self.student_loss!r} with lopd.method={self.method!r} and "
                              f"lopd.kl_mix={self.kl_mix:g}, expected 'topk': the forward KL is taken on the "
                              "teacher's top-k + tail buckets (the sampled-token estimator has no forward form)")
        if self.method in FORWARD_KL_METHODS and 0 < self.kl_mix < 1:
            raise ConfigError(f"lopd.kl_mix: got {self.kl_mix:g} with lopd.method={self.method!r}, expected 0 or 1: "
                              "that method is the pure forward KL; for a mix use lopd.method=lopd_mixed_kl")


@dataclass
class BaselinesConfig:
    """Settings of the baselines and controls selected by `lopd.method` (their shared settings — rollouts,
    steps, learning rate — are the `lopd` section's)."""

    grpo_clip: float = field(default=0.2, metadata=positive())  # PPO-clip ε
    grpo_kl: float = field(default=0.0, metadata=non_negative())  # weight of KL to the frozen base (0 = off)
    group_std_eps: float = field(default=1e-4, metadata=positive())  # (r − mean) / (std + eps)
    skill_kl: float = field(default=0.1, metadata=non_negative())  # Skill-SD's sampled-token reverse KL weight
    sdpo_teacher: str = field(default="ema", metadata=one_of("ema", "student"))
    ema_decay: float = field(default=0.9, metadata=fraction())  # EMA teacher: θ_ema ← d·θ_ema + (1 − d)·θ
    sharpen_temperature: float = field(default=0.5, metadata=positive())  # the sharpened-teacher control
    rl_weight: float = field(default=1.0, metadata=non_negative())  # lopd_rl: weight of the GRPO term
    # lopd_then_grpo: the share of lopd.steps trained as LOPD before the same student goes on with GRPO.
    switch_fraction: float = field(default=0.5, metadata=fraction())
    # lopd_gated_refresh: every refresh_check_every steps, student and teacher base play refresh_check_n train-split
    # tasks of the deployment worlds greedily without experience (the same tasks at every check, their own seed
    # stream); θ̄ ← student only where the student's refresh_metric beats the teacher base's by > refresh_min_gain.
    refresh_check_every: int = field(default=16, metadata=positive())
    refresh_check_n: int = field(default=16, metadata=positive())
    refresh_min_gain: float = field(default=0.0, metadata=in_range(0.0, 1.0))
    refresh_metric: str = field(default="success", metadata=one_of("success", "reward"))


@dataclass
class ComparePreset:
    """One size of `lopd compare`: which methods, seeds and rollout budget, and the learning-rate grid."""

    methods: list[str] = field(default_factory=lambda: list(METHOD_NAMES), metadata=subset_of(*METHOD_NAMES))
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    # The deployment world of each seed (the replicates are (world, seed) pairs); empty: envs.deploy_worlds
    # for every seed. Learning rates are tuned in `tune_world`, apart from every world a replicate reports.
    worlds: list[str] = field(default_factory=list, metadata=subset_of(*NAMED_WORLDS))
    tune_world: str = field(default="", metadata=one_of("", *NAMED_WORLDS))
    # Sampled trajectories per run, bank seed rollouts included (a method that reads the bank pays for it).
    budget: int = field(default=1024, metadata=positive())
    lr_grid: list[float] = field(default_factory=lambda: [3e-4, 1e-3])  # lopd.lr_student, every method
    tune_seed: int = 100  # learning rates are picked on this seed and on validation tasks, never on test
    tune_budget_fraction: float = field(default=0.25, metadata=fraction())  # tuning runs are this much shorter
    tune_n: int = field(default=32, metadata=positive())  # validation tasks (train split, own seed stream)
    eval_n: int = field(default=100, metadata=positive())  # held-out tasks per split at the end of a run
    curve_points: int = field(default=4, metadata=positive())  # held-out (test_id) evaluations along a run
    curve_n: int = field(default=48, metadata=positive())
    # `section.key=value` applied to every run (before the command line's --set)
    overrides: list[str] = field(default_factory=lambda: [
        "bank.seed_tasks=64", "bank.samples_per_task=2", "eval.with_experience=false"])

    def __post_init__(self) -> None:
        if self.worlds and len(self.worlds) != len(self.seeds):
            raise ConfigError(f"compare preset worlds: got {len(self.worlds)} ({', '.join(self.worlds)}) for "
                              f"{len(self.seeds)} seeds, expected one deployment world per seed or none")

    def pairs(self, default_worlds: list[str]) -> list[tuple[str, int]]:
        """The replicates: (deployment world, seed); without `worlds`, the first of `default_worlds` each time."""
        worlds = self.worlds or [default_worlds[0]] * len(self.seeds)
        return list(zip(worlds, self.seeds))


def _full_preset() -> ComparePreset:
    """Every method over three (deployment world, seed) replicates, tuned in a fourth world."""
    return ComparePreset(worlds=["cobalt", "borealis", "aurora"], tune_world="dune")


def _regime_preset() -> ComparePreset:
    """The paper-regime comparison: LOPD against GRPO, the frozen composer, the ways past the teacher's ceiling,
    m = 0 and both controls, at the one learning rate every method preferred in the `full` preset's tuning."""
    return ComparePreset(
        methods=["lopd", "lopd_frozen_composer", "text_experience", "grpo", "lopd_then_grpo", "lopd_mixed_kl",
                 "sharpened_teacher", "lopd_random_retrieval"],
        worlds=["cobalt", "borealis", "cobalt"], tune_world="dune", lr_grid=[3e-4], curve_points=5,
        overrides=["bank.seed_tasks=64", "bank.samples_per_task=2", "eval.with_experience=false",
                   "eval.splits=[test_id,test_ood]"])


def _smoke_preset() -> ComparePreset:
    """Every method once on a tiny base built for it, in a couple of minutes (tests/pipeline/test_compare.py)."""
    return ComparePreset(
        seeds=[0], budget=24, lr_grid=[3e-4], tune_n=4, eval_n=4, curve_points=2, curve_n=4,
        overrides=["model.base_dir=data/compare/base_smoke", "model.tiny.vocab_size=600",
                   "model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.num_heads=2",
                   "model.tiny.num_kv_heads=1", "model.tiny.intermediate_size=64", "model.warmstart.demos=120",
                   "model.warmstart.drills=0", "model.warmstart.time_budget_s=10", "model.warmstart.max_steps=0",
                   "model.warmstart.epochs=1.0",
                   "bank.seed_tasks=4", "bank.samples_per_task=2", "coldstart.oracle_tasks=8", "envs.pretrain_worlds=2", "coldstart.steps=2",
                   "coldstart.batch_size=4", "composer.num_queries=4", "composer.num_layers=1",
                   "composer.num_heads=2", "lopd.tasks_per_step=2", "lopd.samples_per_task=2",
                   "rollout.max_new_tokens=24", "rollout.max_context=640", "eval.with_experience=false"])


@dataclass
class CompareConfig:
    """`lopd compare`: every method at the same rollout budget, seeds, learning rates tuned on one grid."""

    preset: str = "full"  # a key of `presets`
    presets: dict[str, ComparePreset] = field(default_factory=lambda: {"full": _full_preset(),
                                                                        "regime": _regime_preset(),
                                                                        "smoke": _smoke_preset()})
    work_dir: str = "data/compare"
    report_dir: str = "reports"


@dataclass
class TrackingConfig:
    """MLflow lineage of `lopd cycle` (the environment variable MLFLOW_TRACKING_URI overrides mlflow_uri)."""

    mlflow_uri: str = "sqlite:///mlflow.db"
    experiment: str = "lopd"
    registered_model: str = "lopd-student"  # every exported student becomes a version of this model
    champion_alias: str = "champion"  # moves to a version only when the promotion gate passes


@dataclass
class CycleConfig:
    """`lopd cycle`: continual self-improvement from the last promoted student, and the promotion gate.

    The gate: the new student is promoted when its `gate_metric` under `gate_mode`, averaged over
    `gate_splits` (held-out tasks, no experience in context), exceeds the champion's by more than `min_gain`.
    """

    dir: str = "data/cycles"  # per-cycle work (content-addressed), champion.json, history.json, task cache
    # The frozen teacher of each cycle: the champion the student starts from (true: the teacher improves with
    # the student), or the first base for every cycle (false: one fixed teacher across cycles).
    refresh_teacher: bool = True
    gate_metric: str = field(default="reward_mean", metadata=one_of("success_rate", "reward_mean"))
    gate_splits: list[str] = field(default_factory=lambda: ["test_id", "test_ood"],
                                   metadata=subset_of("test_id", "test_ood"))
    gate_mode: str = field(default="greedy", metadata=one_of("greedy", "sampled"))
    min_gain: float = field(default=0.0, metadata=in_range(-1.0, 1.0))  # a negative value promotes whatever the numbers (smoke tests of the registry)
    stage_timeout_s: float = field(default=21600.0, metadata=positive())  # per long task (base, bank, ...)
    report_dir: str = "reports/cycles"  # the DVC pipeline's own report goes to reports/run


@dataclass
class BenchConfig:
    """Tool-use benchmarks (`lopd bench score|run bfcl|acebench`, and `eval.benchmarks`).

    Data folders are settings. An empty bfcl_dir means the data inside the bfcl-eval package (installed with
    `pip install --no-deps bfcl-eval==2026.3.23`); ACEBench has no package, so acebench_dir must point at a copy
    of its data_all/ folder (or its parent).
    """

    bfcl_dir: str = ""
    bfcl_categories: list[str] = field(
        default_factory=lambda: ["simple", "multiple", "parallel", "parallel_multiple", "irrelevance",
                                 "live_simple", "live_multiple", "live_parallel", "live_parallel_multiple",
                                 "live_irrelevance", "multi_turn_base"],
        metadata=subset_of(*BFCL_CATEGORIES))
    acebench_dir: str = ""
    acebench_categories: list[str] = field(default_factory=lambda: ["normal", "special"],
                                           metadata=subset_of(*ACEBENCH_GROUPS, *ACEBENCH_CATEGORIES))
    acebench_languages: list[str] = field(default_factory=lambda: ["en", "zh"], metadata=subset_of("en", "zh"))
    limit: int = field(default=0, metadata=non_negative())  # test cases per category in a run (0 = all)
    max_new_tokens: int = field(default=256, metadata=positive())  # per model answer
    batch_size: int = field(default=8, metadata=positive())
    max_steps_per_turn: int = field(default=5, metadata=positive())  # BFCL multi-turn: answers per user turn


@dataclass
class Params:
    seed: int = 0
    model: ModelConfig = field(default_factory=ModelConfig)
    envs: EnvsConfig = field(default_factory=EnvsConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    bank: BankConfig = field(default_factory=BankConfig)
    composer: ComposerConfig = field(default_factory=ComposerConfig)
    coldstart: ColdStartConfig = field(default_factory=ColdStartConfig)
    lopd: LopdConfig = field(default_factory=LopdConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    cycle: CycleConfig = field(default_factory=CycleConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    baselines: BaselinesConfig = field(default_factory=BaselinesConfig)
    compare: CompareConfig = field(default_factory=CompareConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_SCALARS = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against the annotation `tp`; return it (ints widen to floats)."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: got {value!r}, expected a mapping of {tp.__name__} fields")
        return _build(tp, value, key)
    if origin in (list, tuple):
        (item_tp,) = typing.get_args(tp)[:1]
        if not isinstance(value, list):
            raise ConfigError(f"{key}: got {value!r}, expected a list")
        return [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        _, val_tp = typing.get_args(tp)
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: got {value!r}, expected a mapping")
        return {str(k): _coerce(v, val_tp, f"{key}.{k}") for k, v in value.items()}
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in typing.get_args(tp):
            return None
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        errors = []
        for candidate in inner:  # the first type that takes the value (`float | str`: a number before a word)
            try:
                return _coerce(value, candidate, key)
            except ConfigError as exc:
                errors.append(exc)
        raise errors[0]  # what the first type expected (e.g. a finite number), naming the key and the value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if tp is float and isinstance(value, str):  # YAML 1.1 reads `3e-5` (no dot) as a string
        try:
            value = float(value)
        except ValueError:
            pass  # a real string: reported below
    if tp is float and isinstance(value, float) and not math.isfinite(value):
        # nan passes every `<`/`>` range check and inf trains a model of NaNs: no setting takes either
        raise ConfigError(f"{key}: got {value!r}, expected a finite number")
    if tp in _SCALARS:
        if isinstance(value, bool) != (tp is bool) or not isinstance(value, tp):
            raise ConfigError(f"{key}: got {value!r}, expected {_SCALARS[tp]}")
        return value
    raise TypeError(f"unsupported annotation {tp!r} for {key}")  # a bug in this module, not in the params


def _build(cls, raw: dict, prefix: str):
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        where = f"{prefix}." if prefix else ""
        raise ConfigError(
            f"{where}{unknown[0]}: unknown key (value {raw[unknown[0]]!r}); expected one of: {', '.join(fields)}"
        )
    kwargs = {}
    for name, value in raw.items():
        key = f"{prefix}.{name}" if prefix else name
        value = _coerce(value, hints[name], key)
        check = fields[name].metadata.get("check")
        if check is not None and not check[0](value):
            raise ConfigError(f"{key}: got {value!r}, expected {check[1]}")
        kwargs[name] = value
    return cls(**kwargs)


def apply_override(raw: dict, assignment: str) -> None:
    """Apply one `section.key=value` to the raw mapping in place (value parsed as YAML)."""
    if "=" not in assignment:
        raise ConfigError(f"--set {assignment!r}: expected section.key=value")
    dotted, text = assignment.split("=", 1)
    if "\n" in text or "\r" in text:  # YAML folds a line break in a plain value into a space: said, not done
        raise ConfigError(f"{dotted.strip()}: the --set value {text!r} holds a line break, which YAML would turn "
                          "into a space; give a one-line value, or write it in the params file")
    parts = dotted.strip().split(".")
    if not all(parts):
        raise ConfigError(f"--set {assignment!r}: expected section.key=value")
    node = raw
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{dotted}: {part!r} is not a section (value {child!r})")
        node = child
    try:
        node[parts[-1]] = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{dotted}: value {text!r} is not valid YAML ({exc})") from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping: plain YAML keeps the last one, so a
    setting written twice (a copied section, a merge gone wrong) silently loses one of its values."""

    def construct_mapping(self, node, deep=False):
        first_line: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *anchor` supplies defaults; explicit keys override them by design
            key = self.construct_object(key_node, deep=True)
            try:
                seen = first_line.get(key)
            except TypeError:
                continue  # an unhashable key: the base class reports it with its position
            line = key_node.start_mark.line + 1
            if seen is not None:
                raise ConstructorError(
                    None, None, f"duplicate key {key!r} (first given on line {seen}), a mapping holds each key "
                    "once", key_node.start_mark)
            first_line[key] = line
        return super().construct_mapping(node, deep)


def _yaml_error(path: Path, exc: yaml.YAMLError) -> ConfigError:
    """One line: file:line:column and what is wrong, without PyYAML's multi-line context."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
    problem = getattr(exc, "problem", None) or str(exc)
    context = getattr(exc, "context", None)
    what = f"{problem} ({context})" if context else problem
    return ConfigError(f"{where}: not valid YAML: {what}; fix the file or pass another with --params")


def read_params_file(path: Path) -> dict:
    """The raw mapping of a params file, every way it can be unreadable reported as one ConfigError naming it."""
    if path.is_dir():
        raise ConfigError(f"{path}: is a directory, expected a params YAML file (--params)")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not a text file (byte {exc.start} is not UTF-8), expected a params YAML "
                          "file (--params)") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    if "\0" in text:
        raise ConfigError(f"{path}: not a text file (it holds NUL bytes), expected a params YAML file (--params)")
    try:
        loaded = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader subclass: plain data only
    except yaml.YAMLError as exc:
        raise _yaml_error(path, exc) from None
    if loaded is None:
        raise ConfigError(f"{path}: holds no settings (it is empty, or only comments), expected a mapping of "
                          "sections (the repository's params.yaml lists them all)")
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: expected a mapping of sections, got {type(loaded).__name__}")
    return loaded


DEFAULT_PARAMS = "params.yaml"


def load_params(path: str | Path = DEFAULT_PARAMS, overrides: list[str] | tuple[str, ...] = (), *,
                must_exist: bool | None = None) -> Params:
    """Read a params file, apply overrides, validate, return typed Params. Only the implicit default (`params.yaml`
    in the working directory) may be missing, meaning all defaults; any other path must exist (`must_exist`:
    True for a path the user named, even that one; None: every path but the default)."""
    path = Path(path)
    raw: dict = {}
    implicit = str(path) == DEFAULT_PARAMS and not must_exist
    if path.exists() or path.is_symlink():
        raw = read_params_file(path)
    elif not implicit:
        raise ConfigError(f"{path}: no such params file (--params); only the default {DEFAULT_PARAMS} may be "
                          "missing, meaning every default")
    for assignment in overrides:
        apply_override(raw, assignment)
    return _build(Params, raw, "")
