"""Settings of the policy: which model, and how the embedded base is built (`model`, `model.tiny`,
`model.warmstart`)."""

from __future__ import annotations

from dataclasses import dataclass

from lopd_core.settings.checks import device_name, fraction, non_negative, one_of, positive
from lopd_core.settings.fields import Section, setting


@dataclass(frozen=True)
class TinyModelConfig(Section):
    """Architecture of the embedded base (a small Qwen3) and its tokenizer."""

    SECTION = "model.tiny"

    vocab_size: int = setting(2048, help="BPE vocabulary of the embedded tokenizer", check=positive())
    hidden_size: int = setting(128, help="model width", check=positive())
    num_layers: int = setting(
        2,
        help="decoder layers: shallow, since on a CPU budget more warm-start steps do "
        "more for the base than more layers",
        check=positive(),
    )
    num_heads: int = setting(4, help="attention heads", check=positive())
    num_kv_heads: int = setting(2, help="key/value heads (grouped-query attention)", check=positive())
    intermediate_size: int = setting(384, help="MLP width", check=positive())
    max_positions: int = setting(1024, help="longest sequence the base takes", check=positive())


@dataclass(frozen=True)
class WarmStartConfig(Section):
    """Supervised warm start of the embedded base on oracle demonstrations with controlled noise.

    How long it trains: `max_steps` > 0 runs exactly that many optimizer steps and then `epochs` and
    `time_budget_s` are not read (a fixed step count gives the same base on every machine; a clock cannot).
    With `max_steps` 0 (the smoke preset) the schedule is planned for `epochs` passes over the demonstrations
    and cut short at `time_budget_s`.
    """

    SECTION = "model.warmstart"

    demos: int = setting(9000, help="oracle demonstrations in the pretraining worlds", check=positive())
    experience_fraction: float = setting(
        0.7,
        help="share of demonstrations that read 1..max_experiences same-world successes as text in the first "
        "user turn: the base learns to read conventions from experience",
        check=fraction(),
    )
    max_experiences: int = setting(3, help="most same-world successes one demonstration reads", check=positive())
    # Kept small: more noise made the base worse at reproducing held-out tasks without teaching it the conventions
    # any better (probes/failure_probe.py measures it).
    convention_noise: float = setting(
        0.15,
        help="chance that a demonstration without experience follows another world's conventions: the base "
        "then knows each world's rules only imperfectly",
        check=fraction(),
    )
    slip: float = setting(
        0.0,
        help="per-call chance of a plausible argument mistake in a demonstration; 0: a demonstrated miscopy "
        "teaches that a copied value is sometimes another one, and copying is what the base is weakest at",
        check=fraction(),
    )
    epochs: float = setting(
        6.0,
        help="only when max_steps is 0: passes over the demonstrations the schedule is planned for",
        check=positive(),
    )
    batch_tokens: int = setting(
        1024, help="tokens per batch (small batches: more steps, faster copying)", check=positive()
    )
    lr: float = setting(
        6e-3, help="AdamW's learning rate: embeddings and norms (every weight under optimizer: adamw)", check=positive()
    )
    optimizer: str = setting(
        "muon",
        help="muon: the layers' weight matrices take Muon steps at muon_lr, the rest "
        "AdamW at lr; adamw: AdamW for every weight",
        check=one_of("muon", "adamw"),
    )
    muon_lr: float = setting(1.5e-3, help="Muon's learning rate, RMS-matched to AdamW's scale", check=positive())
    warmup_steps: int = setting(20, help="linear warm-up of the learning rate", check=non_negative())
    time_budget_s: float = setting(
        270.0, help="only when max_steps is 0: the wall clock the schedule is fitted to", check=positive()
    )
    max_steps: int = setting(
        12000,
        help="> 0: exactly this many optimizer steps, the same base on every machine; "
        "0: epochs and time_budget_s decide",
        check=non_negative(),
    )
    drills: int = setting(
        6000,
        help="copy/lookup drills and first-action cuts mixed into the demonstrations (drills.py)",
        check=non_negative(),
    )
    context_loss_weight: float = setting(
        0.3, help="weight of the auxiliary LM loss on forced (context) tokens", check=non_negative()
    )
    context_loss_fraction: float = setting(
        0.33,
        help="share of the forced positions that loss is estimated on each step, picked at random: most of "
        "its cost is the output head at every position",
        check=fraction(),
    )
    copy_weight: float = setting(
        3.0,
        help="loss weight of an action token that copies a value from the context, against 1 for the call "
        "syntax around it: the copies decide a task",
        check=positive(),
    )


@dataclass(frozen=True)
class ModelConfig(Section):
    """The policy: the embedded base or any causal LM."""

    SECTION = "model"

    name_or_path: str = setting(
        "",
        help="empty: the embedded base that `lopd base` builds at base_dir; else a "
        "causal-LM folder or hub id (offline unless HF_HUB_OFFLINE=0)",
    )
    base_dir: str = setting("data/base", help="where `lopd base` writes the embedded base")
    base_source: str = setting(
        "shipped",
        help="shipped: the embedded base installs the copy versioned with the code (lopd_core/model/embedded_base, "
        "the base every published figure rests on) where the build settings are its own; build: built from the "
        "code on this machine (another CPU rounds differently)",
        check=one_of("shipped", "build"),
    )
    dtype: str = setting("float32", help="weights' dtype", check=one_of("float32", "bfloat16", "float16"))
    device: str = setting("auto", help="auto | cpu | cuda | cuda:N | mps", check=device_name())
    threads: int = setting(
        2,
        help="CPU threads of every stage's torch ops (0: torch's default, the machine's cores): a float sum split "
        "over threads rounds differently with their number, so a base or a run is the same on every machine only "
        "at one count",
        check=non_negative(),
    )
    tiny: TinyModelConfig = setting(
        factory=TinyModelConfig, help="the embedded base: a small Qwen3 and its BPE tokenizer"
    )
    warmstart: WarmStartConfig = setting(
        factory=WarmStartConfig, help="supervised warm start of the embedded base on noisy oracle demonstrations"
    )
