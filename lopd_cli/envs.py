"""`lopd envs list` and `lopd envs check NAME`: which environments resolve, and whether one keeps the contract.

`check` runs the contract checker (lopd_core/envs/contract.py) on a few tasks of each split the environment
has, built exactly as the pipeline builds them (built-ins in the run's worlds; plugins from their task file or
their own make_tasks), and prints every failure (exit 1) or one OK line (exit 0), then one line on where the
environment's tools run (the trust boundary: lopd_core/envs/guarded.py). With `envs.isolate_tools` the checked
episodes run isolated, as a run's would. Plugins resolve as in a run: built-ins, then `envs.plugins` of
--params/--set, then installed entry points of group `lopd.envs`.

`lopd envs fingerprint --out FILE` writes the content hashes of the files the mix's plugin environments read
(task files, package sources: registry.plugin_files), the file dvc.yaml's bank, distill and evaluate depend on.
"""

from __future__ import annotations


def cmd_envs_list(params, args) -> int:
    from lopd_core.envs import registry

    registry.use_config(params.envs)
    for name, source in registry.known_envs().items():
        print(f"{name:<16} {source}")
    return 0


def _check_split(name: str, split: str, n: int, seed: int, worlds) -> int:
    from lopd_core.envs import check_env_contract, make_env, make_tasks

    tasks = make_tasks(name, split, n, seed, worlds)
    if not tasks:
        raise AssertionError(f"[env contract] make_tasks({name!r}, {split!r}, {n}, {seed}) returned no tasks")
    return check_env_contract(lambda: make_env(name), tasks)


def cmd_envs_check(params, args) -> int:
    from lopd_core.envs import registry
    from lopd_core.envs.toolworld.worlds import WorldSplit

    registry.use_config(params.envs)
    name = args.name
    try:
        registry.env_class(name)
        splits = registry.env_splits(name)
    except Exception as exc:  # noqa: BLE001  an unloadable plugin is a failed check, reported as such
        print(f"FAIL {name}: {type(exc).__name__}: {exc}")
        return 1
    world_split = WorldSplit.from_config(params.envs)
    checked: dict[str, int] = {}
    failures: list[str] = []
    for split in splits:
        try:
            checked[split] = _check_split(name, split, args.n, args.seed, world_split.for_split(split))
        except AssertionError as exc:
            failures.append(f"FAIL {name} {split}: {exc}")
        except Exception as exc:  # noqa: BLE001  a crash in reset/step/make_tasks is a contract failure too
            failures.append(f"FAIL {name} {split}: {type(exc).__name__}: {exc}")
    if failures:
        print("\n".join(failures))
        print(f"note: {registry.isolation_note(name)}")
        return 1
    per_split = ", ".join(f"{split} {k}" for split, k in checked.items())
    print(
        f"OK {name}: the contract holds on {sum(checked.values())} tasks ({per_split}); {registry.known_envs()[name]}"
    )
    print(f"note: {registry.isolation_note(name)}")
    return 0


def cmd_envs_fingerprint(params, args) -> int:
    import json

    from lopd_core.outputs import write_file
    from tasks.caching import plugin_fingerprint

    write_file(args.out, json.dumps(plugin_fingerprint(params.envs), indent=2, sort_keys=True) + "\n")
    return 0


def _at_least_one(text: str) -> int:
    """--n: a whole number >= 1 (with 0 there is nothing to check, and the environment was blamed for it)."""
    import argparse

    # the upper bound: a typo of a few more digits must not build a list of millions of tasks
    if not text.strip().isdigit() or not 1 <= int(text) <= 10_000:
        raise argparse.ArgumentTypeError(f"got {text!r}, expected a whole number from 1 to 10000")
    return int(text)


def add_envs_parser(sub, add_common) -> None:
    envs = sub.add_parser("envs", help="list environments, or check one against the environment contract")
    actions = envs.add_subparsers(dest="envs_action", required=True)
    listing = actions.add_parser("list", help="every environment name that resolves, and where it comes from")
    add_common(listing)
    listing.set_defaults(func=cmd_envs_list)
    check = actions.add_parser("check", help="run the contract checker on an environment's tasks of each split")
    add_common(check)
    check.add_argument("name", help="an environment name: built-in, envs.plugins or an installed entry point")
    check.add_argument("--n", type=_at_least_one, default=3, help="tasks per split (default %(default)s)")
    check.add_argument("--seed", type=int, default=0, help="task seed (default %(default)s)")
    check.set_defaults(func=cmd_envs_check)
    fingerprint = actions.add_parser(
        "fingerprint",
        help="hash the files the mix's plugin environments read (task files, package sources) into one file for DVC",
    )
    add_common(fingerprint)
    fingerprint.add_argument("--out", default="data/plugins.json", help="where (default %(default)s)")
    fingerprint.set_defaults(func=cmd_envs_fingerprint)
