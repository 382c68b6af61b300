"""The oracle-distillation probe (probes/oracle_distill_probe.py) feeds the trainer exactly the oracle's actions."""

from lopd_core.envs import make_tasks, run_oracle
from lopd_core.model.chat import ChatCodec
from probes.oracle_distill_probe import oracle_trajectories


def test_oracle_trajectories_carry_the_oracles_actions_as_successes(tiny_tokenizer):
    codec = ChatCodec(tiny_tokenizer)
    tasks = make_tasks("toolworld", "train", 3, 5)
    for task, traj in zip(tasks, oracle_trajectories(tasks, codec)):
        assert traj.success and traj.reward == 1.0
        assert len(traj.token_ids) == len(traj.action_mask)
        actions = tiny_tokenizer.decode([t for t, m in zip(traj.token_ids, traj.action_mask) if m])
        _, _, env = run_oracle(task)  # the oracle's episode, played again: its calls, in order
        names = [step["call"]["name"] for step in env.episode if step.get("call")]
        assert names
        at = 0
        for name in names:
            at = actions.index(name, at) + len(name)  # raises if a call is missing or out of order
