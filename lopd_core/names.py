"""The names a configuration may use, as plain data: BFCL categories, ACEBench categories and groups, the
built-in environments and the entry-point group of plugin environments.

Why a module of its own: the settings (lopd_core/settings/run.py, settings/envs.py) validate these names at load
time, and the configuration must stay near the bottom of the layers — importing the benchmark loaders or the
environment registry to learn a list of strings would make every command that reads params.yaml load most of
the library. The modules that use the names import them from here: bench/bfcl/data.py, bench/acebench/data.py
and envs/registry.py, one list each. The method names are not here: lopd_core/methods.py defines them and
imports nothing of the package, so the settings read its table directly.

Imports nothing.
"""

# BFCL's categories (lopd_core/bench/bfcl/data.py reads them): single-turn, then multi-turn
BFCL_CATEGORIES = (
    "simple",
    "multiple",
    "parallel",
    "parallel_multiple",
    "irrelevance",
    "live_simple",
    "live_multiple",
    "live_parallel",
    "live_parallel_multiple",
    "live_irrelevance",
    "live_relevance",
    "multi_turn_base",
    "multi_turn_miss_func",
    "multi_turn_miss_param",
    "multi_turn_long_context",
)

# ACEBench's groups and categories (lopd_core/bench/acebench/data.py reads them; the agent group is not supported)
ACEBENCH_GROUPS = {
    "normal": (
        "normal_single_turn_single_function",
        "normal_single_turn_parallel_function",
        "normal_multi_turn_user_adjust",
        "normal_multi_turn_user_switch",
        "normal_similar_api",
        "normal_preference",
        "normal_atom_bool",
        "normal_atom_enum",
        "normal_atom_number",
        "normal_atom_list",
        "normal_atom_object_deep",
        "normal_atom_object_short",
    ),
    "special": ("special_incomplete", "special_error_param", "special_irrelevant"),
}
ACEBENCH_CATEGORIES = ACEBENCH_GROUPS["normal"] + ACEBENCH_GROUPS["special"]

# The built-in environments, the ones with pretraining worlds and an oracle (lopd_core/envs/registry.py resolves
# them), and the entry-point group third-party packages register theirs under.
BUILTIN_ENVS = ("toolworld", "codegen")
ENV_ENTRY_POINT_GROUP = "lopd.envs"
