"""toolworld: six stateful tool domains under worlds whose conventions differ (EnvScaler-style).

env.py is the Environment (declared tools only, validated arguments, data checks on the final state);
tools.py the tool-call syntax and schemas; domains/ the stateful tool classes; worlds.py the convention knobs,
the named worlds and the generated pretraining / held-out deployment worlds; templates/ the task generators
with their checks; tasks.py the deterministic task sets; oracle.py the scripted solver the warm start and the
cold start learn from (never used in a deployment world).
"""

from .domains import DOMAINS, tool_schemas
from .env import ToolWorldEnv
from .oracle import OraclePolicy, oracle_actions, run_oracle
from .templates import TEMPLATES
from .tools import format_call, parse_action
from .worlds import KNOBS, WORLDS

__all__ = [
    "DOMAINS",
    "KNOBS",
    "TEMPLATES",
    "WORLDS",
    "OraclePolicy",
    "ToolWorldEnv",
    "format_call",
    "oracle_actions",
    "parse_action",
    "run_oracle",
    "tool_schemas",
]
