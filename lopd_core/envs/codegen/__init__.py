"""codegen: TACO-style Python function-writing tasks with execution feedback, graded in the sandbox.

39 problem families (arithmetic, conditionals, loops, strings, dicts, lists, small algorithms; 32 for
`train`/`test_id`, 7 held out for `test_ood`), each a generator of statement, function name, tests and a
reference solution at difficulty levels 1..3. Multi-turn: up to `task.max_turns` attempts, each answered
with the first failing test and its error; reward = fraction of tests passed. Model code runs only in
lopd_core/envs/sandbox/.
"""

from .env import SYSTEM_PROMPT, CodegenEnv
from .grading import CODEGEN_LIMITS, extract_code, grade, same_value
from .oracle import oracle_action, run_codegen_oracle
from .tasks import DEFAULT_ATTEMPTS, FAMILIES, families_for, make_codegen_tasks

__all__ = [
    "CODEGEN_LIMITS",
    "DEFAULT_ATTEMPTS",
    "FAMILIES",
    "SYSTEM_PROMPT",
    "CodegenEnv",
    "extract_code",
    "families_for",
    "grade",
    "make_codegen_tasks",
    "oracle_action",
    "run_codegen_oracle",
    "same_value",
]
