"""`Params`: every section of a run, as params.yaml lays them out."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from lopd_core.settings.compare import CompareConfig
from lopd_core.settings.envs import EnvsConfig
from lopd_core.settings.fields import Section, setting
from lopd_core.settings.lopd import BaselinesConfig, LopdConfig
from lopd_core.settings.model import ModelConfig
from lopd_core.settings.rollout import BankConfig, ColdStartConfig, ComposerConfig, RolloutConfig
from lopd_core.settings.run import BenchConfig, CycleConfig, EvalConfig, TrackingConfig
from lopd_core.settings.serve import ServeConfig


# Not frozen, unlike its sections: a caller derives a variant run by swapping a whole section
# (`params.lopd = dataclasses.replace(params.lopd, steps=1)`), and the new section is checked as it is built.
@dataclass
class Params(Section):
    """The one configuration of a run. Every `lopd` command reads it (--params PATH) and takes repeatable overrides:
    --set section.key=value. Unknown keys and bad values fail at load."""

    seed: int = setting(0, help="seeds every sampling stream, task set and initialisation of a run")
    model: ModelConfig = setting(factory=ModelConfig, help=ModelConfig.__doc__)
    envs: EnvsConfig = setting(
        factory=EnvsConfig, help="environments: pretraining worlds and held-out deployment worlds"
    )
    rollout: RolloutConfig = setting(
        factory=RolloutConfig, help="sampling of every training rollout (bank seeding and distillation)"
    )
    bank: BankConfig = setting(factory=BankConfig, help="experience bank: parquet source of truth + Chroma index")
    composer: ComposerConfig = setting(factory=ComposerConfig, help=ComposerConfig.__doc__)
    coldstart: ColdStartConfig = setting(factory=ColdStartConfig, help=ColdStartConfig.__doc__)
    lopd: LopdConfig = setting(factory=LopdConfig, help="distillation: student θ, composer φ, dual ascent of β")
    eval: EvalConfig = setting(factory=EvalConfig, help=EvalConfig.__doc__)
    tracking: TrackingConfig = setting(factory=TrackingConfig, help=TrackingConfig.__doc__)
    cycle: CycleConfig = setting(
        factory=CycleConfig, help="`lopd cycle`: start from the champion, refresh the bank, train, evaluate, gate"
    )
    bench: BenchConfig = setting(
        factory=BenchConfig, help="tool-use benchmarks: `lopd bench score|run bfcl|acebench`, and eval.benchmarks"
    )
    baselines: BaselinesConfig = setting(
        factory=BaselinesConfig, help="knobs of the baselines and controls lopd.method selects (lopd_core/methods.py)"
    )
    compare: CompareConfig = setting(factory=CompareConfig, help=CompareConfig.__doc__)
    serve: ServeConfig = setting(factory=ServeConfig, help=ServeConfig.__doc__)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
