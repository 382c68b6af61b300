"""`lopd serve`, `lopd serve client`, `lopd serve snapshot`: the subcommands, registered by lopd_cli/main.py.

    lopd serve [--model DIR] [--host H] [--port P] [--store DIR]    the champion (or DIR) on /v1
    lopd serve client [--url URL] [--n N] [--concurrency C] [--split S]   play toolworld through the endpoint
    lopd serve snapshot --out FILE [--store DIR] [--as-trajectories]      the store as one parquet (a DVC out)
    lopd serve store check|repair [DIR]           list the lines readers refuse; quarantine them
    lopd serve store rotate [DIR] [--url URL]     ask the running server to move its segments into an archive

Settings come from params.yaml's `serve` section (lopd_core/settings/serve.py; `--set serve.KEY=VALUE` like every
command) and the flags, which override it; the API key from the environment variable `serve.api_key_env`
(LOPD_API_KEY).
"""

from __future__ import annotations

import json
import sys


def _config(params, args):
    """params.yaml's `serve` section (already loaded with --params and --set), the flags on top."""
    from lopd_serve.config import ServeConfig

    return ServeConfig.from_params(
        params,
        model=getattr(args, "model", None),
        host=getattr(args, "host", None),
        port=getattr(args, "port", None),
        store_dir=getattr(args, "store", None),
        poll_s=getattr(args, "poll_s", None),
        device=getattr(args, "device", None),
    )


def cmd_serve(params, args) -> int:
    from lopd_core.traces import TraceStoreError
    from lopd_serve.config import ServeConfigError
    from lopd_serve.server import run

    try:
        cfg = _config(params, args)
        cfg.check_exposure()
    except ServeConfigError as exc:
        print(f"lopd serve: {exc}", file=sys.stderr)
        return 2
    from lopd_core.stopping import stop_on_signals

    try:  # SIGTERM, SIGINT: uvicorn drains the requests in flight, then the process exits 143 / 130 within the grace
        with stop_on_signals("lopd serve", cfg.stop_grace_s):
            run(cfg)
    except (TraceStoreError, ServeConfigError) as exc:  # the store could not be opened, the model does not fit
        print(f"lopd serve: {exc}", file=sys.stderr)
        return 1
    return 0


def cmd_client(params, args) -> int:
    import openai

    from lopd_core.envs import make_tasks
    from lopd_core.envs.toolworld.worlds import WorldSplit
    from lopd_serve.client import run_client

    cfg = _config(params, args)
    worlds = WorldSplit.from_config(params.envs).for_split(args.split)
    tasks = make_tasks("toolworld", args.split, args.n, args.seed, worlds)
    url = args.url or f"http://127.0.0.1:{cfg.port}/v1"
    try:
        summary = run_client(
            url,
            tasks,
            concurrency=args.concurrency,
            api_key=cfg.api_key() or "none",
            temperature=args.temperature,
            max_tokens=args.max_tokens,
            seed=args.seed,
        )
    except openai.APIConnectionError:  # before any session: the server's model could not be listed
        print(f"lopd serve client: no server answers at {url}: start `lopd serve` or pass --url", file=sys.stderr)
        return 1
    episodes = summary.pop("episodes")
    print(json.dumps(summary, indent=2))
    if args.verbose:
        print(json.dumps(episodes, indent=2))
    return 1 if summary["failed"] else 0


def cmd_snapshot(params, args) -> int:
    from lopd_core.traces import read_traces, snapshot, traces_as_trajectories

    store = args.store or _config(params, args).store_dir
    if args.as_trajectories:
        from lopd_core.rollout.table import write_trajectories

        frame = traces_as_trajectories(read_traces(store), labeled_only=not args.include_unlabeled)
        path = write_trajectories(frame, args.out)
        print(f"{len(frame)} labeled trajectories -> {path}")
    else:
        path = snapshot(store, args.out)
        print(f"trace table of {store} -> {path}")
    return 0


def cmd_store(params, args) -> int:
    """`check` lists every bad line (exit 1 if any); `repair` quarantines them with a report (repair.py)."""
    from pathlib import Path

    from lopd_core.traces import TraceStoreError
    from lopd_core.traces.repair import check_store, repair_store

    if args.action == "rotate":
        return cmd_rotate(params, args)
    store = Path(args.dir or _config(params, args).store_dir)
    if not store.is_dir():
        print(f"lopd serve store: no trace store at {store} (a folder that `lopd serve` writes)", file=sys.stderr)
        return 2
    if args.action == "check":
        problems = check_store(store)
    else:
        try:
            problems, report = repair_store(store)
        except TraceStoreError as exc:  # a server holds the store
            print(f"lopd serve store repair: {exc}", file=sys.stderr)
            return 1
    for p in problems:
        kept = f" (the whole record after it, {p.kept_bytes} bytes, kept)" if p.kept_bytes else ""
        print(f"{store / p.segment}:{p.line} (byte {p.offset}, {p.bytes} bytes): {p.why}{kept}")
    if args.action == "check":
        print(
            f"{len(problems)} bad lines" + (f": `lopd serve store repair {store}` quarantines them" if problems else "")
        )
        return 1 if problems else 0
    print(f"{len(problems)} lines quarantined" + (f"; report: {report}" if problems else ": the store was clean"))
    return 0


def cmd_rotate(params, args) -> int:
    """Ask the running server (loopback, serve.port, or --url) to rotate its store: only the store's writer can move
    its segments without a reader seeing a turn whose turn 0 left (lopd_core/traces/store.py). With DIR, the
    server's store must be that folder (its /health names it), so a rotation never lands on another server's."""
    from pathlib import Path

    import httpx

    cfg = _config(params, args)
    root = (args.url or f"http://127.0.0.1:{cfg.port}").rstrip("/").removesuffix("/v1")
    key = cfg.reload_key() or cfg.api_key()
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        health = httpx.get(root + "/health", headers=headers, timeout=10).json()
        served = (health.get("store") or {}).get("dir")
        if args.dir and served and Path(served).resolve() != Path(args.dir).resolve():
            print(f"lopd serve store rotate: the server at {root} writes {served}, not {args.dir}", file=sys.stderr)
            return 2
        answer = httpx.post(root + "/admin/store/rotate", headers=headers, timeout=120)
    except (httpx.HTTPError, ValueError):  # nothing listens there, or something that is not `lopd serve`
        print(
            f"lopd serve store rotate: no server answers at {root}: a rotation is done by the running server "
            "(`lopd serve`; or pass --url); with none running nothing writes the store, and its segments may be "
            "moved away whole",
            file=sys.stderr,
        )
        return 1
    body = answer.json()
    if answer.status_code != 200:
        print(f"lopd serve store rotate: {answer.status_code} {body.get('error', {}).get('message')}", file=sys.stderr)
        return 1
    if body["archive"] is None:
        print(f"{body['store']}: no record since the last rotation, nothing moved")
    else:
        print(
            f"{body['store']}: {len(body['segments'])} segments ({body['bytes']} bytes) -> {body['archive']}; "
            f"{body['sessions_carried_on']} open sessions go on in trajectories that carry their history"
        )
    return 0


def add_serve_parsers(sub, add_common) -> None:
    serve = sub.add_parser(
        "serve",
        help="serve the champion on an OpenAI-compatible endpoint, recording traces",
        description="Serve the registry's champion (or --model DIR) at /v1/chat/completions; "
        "every conversation is recorded in serve.store_dir. See docs/serving.md.",
    )
    add_common(serve)
    serve.add_argument("--model", default=None, help="a checkpoint folder instead of the registry's champion")
    serve.add_argument("--host", default=None, help="bind address (default 127.0.0.1; any other needs a key)")
    serve.add_argument("--port", type=int, default=None)
    serve.add_argument("--store", default=None, help="trace store folder (default serve.store_dir)")
    serve.add_argument(
        "--poll-s",
        dest="poll_s",
        type=float,
        default=None,
        help="seconds between checks of the registry alias (0: never)",
    )
    serve.add_argument("--device", default=None, help="auto (cuda when available), cpu, cuda, cuda:1, ...")
    serve.set_defaults(func=cmd_serve, resolve_envs=False)
    inner = serve.add_subparsers(dest="serve_command")

    client = inner.add_parser("client", help="play toolworld tasks through the endpoint (openai client)")
    add_common(client)
    client.add_argument("--url", default=None, help="base URL (default http://127.0.0.1:PORT/v1)")
    client.add_argument("--n", type=int, default=8, help="sessions (tasks) to play")
    client.add_argument("--concurrency", type=int, default=4)
    client.add_argument("--split", default="test_id")
    client.add_argument("--temperature", type=float, default=1.0)
    client.add_argument("--max-tokens", dest="max_tokens", type=int, default=64)
    client.add_argument("--seed", type=int, default=0)
    client.add_argument("--verbose", action="store_true", help="print every episode too")
    client.set_defaults(func=cmd_client, resolve_envs=False)

    snap = inner.add_parser("snapshot", help="write the trace store as one parquet file (to version with DVC)")
    add_common(snap)
    snap.add_argument("--out", required=True)
    snap.add_argument("--store", default=None)
    snap.add_argument(
        "--as-trajectories",
        action="store_true",
        help="write the rollout table's columns (labeled traces only) instead of the trace table",
    )
    snap.add_argument(
        "--include-unlabeled",
        action="store_true",
        help="with --as-trajectories: unlabeled traces too, as reward 0, never successes",
    )
    snap.set_defaults(func=cmd_snapshot, resolve_envs=False)

    _add_store_parser(inner, add_common)


def _add_store_parser(inner, add_common) -> None:
    store = inner.add_parser(
        "store",
        help="check a trace store for bad lines, quarantine them (repair), or rotate a running server's store",
    )
    add_common(store)
    store.add_argument("action", choices=("check", "repair", "rotate"))
    store.add_argument("dir", nargs="?", default=None, help="the store folder (default serve.store_dir)")
    store.add_argument(
        "--url", default=None, help="rotate: the running server (default http://127.0.0.1:PORT, serve.port)"
    )
    store.set_defaults(func=cmd_store, resolve_envs=False)
