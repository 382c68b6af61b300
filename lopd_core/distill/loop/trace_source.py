"""A step's trajectories from served traffic (`lopd.trajectories: traces | both`) instead of fresh rollouts.

The teacher scores the served tokens as they were recorded (ids, action mask, the server's sampling log-probs):
nothing is re-tokenized or replayed. Which traces a step reads is a function of (seed, step), as the rollout
stream's tasks are: the labeled traces, sorted by trajectory id, are dealt in passes, pass e in the order of a
permutation seeded by (seed, e); step s takes the next `count` of that endless stream from position s·count.
A resumed run therefore reads what an uninterrupted one does, and a store that grows changes the order (its
content hash is an input of the stage's cache key).

Why labeled traces only: the student's loss needs no reward, but the composer's δ weighs every trajectory by
A = 2r − 1, and an unlabeled trace's reward 0 would count a conversation nobody judged as a failure.

Why each trace is its own task (a group of one): a served conversation has no siblings sampled from the same
prompt, so the step runs with samples_per_task = 1 (no shared prompt, no group advantage; the settings refuse
`lopd.advantage: group` and the policy-gradient methods with traces). With `both`, the first ⌈B/2⌉ tasks of the
step's slice are rolled out G times each and the rest of the batch, (B − ⌈B/2⌉)·G trajectories, comes from the
traces; the whole batch is then read as groups of one (an exact view for distillation: a group only shares the
teacher's prompt pass and defines GRPO's advantage, neither of which the distillation loss needs).

Why the tokenizer is checked: a trace is token ids only; ids of another tokenizer (another model's, or the same
size with other merges) would train on nonsense or fail in an embedding lookup. Each trace records its
tokenizer's fingerprint (lopd_core/traces/fingerprint.py) and the first step refuses, in one line, labeled traces
whose fingerprint is not the student's (traces from before fingerprints were kept are let through with a warning).

Importance weight: `lopd.importance_weight` with `lopd.student_loss: sampled` weighs each token by
min(p_S / p_sample, cap) with p_sample the recorded log-prob, i.e. the served champion's, an older policy.
"""

from __future__ import annotations

import random
import warnings

from lopd_core.rollout.engine import Trajectory
from lopd_core.settings.checks import ConfigError
from lopd_core.traces.fingerprint import tokenizer_fingerprint
from lopd_core.traces.schema import traces_as_trajectories
from lopd_core.traces.source import as_trajectories, load_traces


class TraceStream:
    """The labeled traces at `path`, dealt to steps in a seeded, resumable order."""

    def __init__(self, path: str, seed: int, *, max_tokens: int):
        traces = load_traces(path)
        labeled = traces[traces["labeled"]]
        self.path = path
        self.tokenizers = dict(labeled["tokenizer"].value_counts())  # fingerprint -> labeled traces
        self._checked = False
        frame = traces_as_trajectories(traces, labeled_only=True)
        frame = frame.sort_values("task_id", kind="stable").reset_index(drop=True)
        # the teacher splices its latents into the trajectory: a trace longer than the room a rollout keeps
        # (rollout.max_context minus the splice) cannot be scored, and is left out (counted in `too_long`)
        fits = frame["token_ids"].map(len) <= max_tokens
        self.too_long = int((~fits).sum())
        self.frame = frame[fits].reset_index(drop=True)
        if self.frame.empty:
            raise ConfigError(
                f"lopd.traces: no labeled trace of at most {max_tokens} tokens at {path} "
                f"({self.too_long} longer): post feedback for the served conversations (`lopd serve "
                "client` does) or train on rollouts"
            )
        self.seed = seed
        self._passes: dict[int, list[int]] = {}

    def check_tokenizer(self, tokenizer) -> None:
        """ConfigError (one line) when a labeled trace was recorded with another tokenizer than `tokenizer`."""
        if self._checked:
            return
        mine = tokenizer_fingerprint(tokenizer)
        other = {fp: n for fp, n in self.tokenizers.items() if fp not in (mine, "")}
        if other:
            fp, n = max(other.items(), key=lambda item: item[1])
            raise ConfigError(
                f"lopd.traces: {sum(other.values())} labeled traces at {self.path} were recorded with another "
                f"tokenizer ({n} with {fp}; the student's is {mine}): train the model that served them, or "
                "leave them out of lopd.traces"
            )
        if self.tokenizers.get("", 0):
            warnings.warn(
                f"lopd.traces: {self.tokenizers['']} traces at {self.path} predate tokenizer fingerprints: "
                "assumed to be the student's tokenizer's",
                stacklevel=2,
            )
        self._checked = True

    def __len__(self) -> int:
        return len(self.frame)

    def _pass(self, e: int) -> list[int]:
        if e not in self._passes:
            order = list(range(len(self.frame)))
            random.Random(self.seed * 1_000_003 + 7919 * e + 1).shuffle(order)
            self._passes[e] = order
        return self._passes[e]

    def rows(self, step: int, count: int) -> list[int]:
        """Positions in `frame` of step `step`'s `count` traces (0-based step)."""
        n = len(self.frame)
        return [self._pass(p // n)[p % n] for p in range(step * count, (step + 1) * count)]

    def take(self, step: int, count: int) -> list[Trajectory]:
        return as_trajectories(self.frame.iloc[self.rows(step, count)])


def trace_count(tasks_per_step: int, samples_per_task: int, mode: str) -> int:
    """How many of a step's B×G trajectories come from traces."""
    if mode == "traces":
        return tasks_per_step * samples_per_task
    if mode == "both":
        return (tasks_per_step - (tasks_per_step + 1) // 2) * samples_per_task
    return 0
