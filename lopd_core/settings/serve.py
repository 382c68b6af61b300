"""Settings of `lopd serve` (the `serve` section): what is served, where, and every limit a request meets.

The registry it serves from is the `tracking` section's (mlflow_uri, registered_model, champion_alias) and its
sampling seed the run's `seed`, so one params.yaml names the champion for training and serving alike. The
command line's flags override these keys (lopd_serve/config.py)."""

from __future__ import annotations

from dataclasses import dataclass

from lopd_core.settings.checks import ConfigError, at_least, device_name, non_negative, one_of, positive
from lopd_core.settings.fields import Section, setting


@dataclass(frozen=True)
class ServeConfig(Section):
    """`lopd serve`: the champion (or a folder) on an OpenAI-compatible endpoint, every conversation recorded."""

    SECTION = "serve"

    model: str = setting("", help="a checkpoint folder; empty: the registry's champion (tracking section)")
    host: str = setting("127.0.0.1", help="bind address; any but loopback needs an API key in api_key_env")
    port: int = setting(8000, help="TCP port", check=positive())
    api_key_env: str = setting(
        "LOPD_API_KEY", help="the environment variable holding the API key (a key is never written in a file)"
    )
    reload_key_env: str = setting(
        "LOPD_RELOAD_KEY",
        help="the environment variable holding the key POST /admin/reload needs (it also serves the API); unset: "
        "reload is off behind an API key, open on a keyless loopback server",
    )
    reload_roots: list[str] = setting(
        factory=list,
        help="folders /admin/reload may load a checkpoint from (a trainer's rollout.sync_dir belongs here); "
        "empty: model_cache_dir, the served model folder's parent and a trainer's default sync folder "
        "(<temp>/lopd-sync)",
    )
    allowed_hosts: list[str] = setting(
        factory=list,
        help="Host header values a keyless server answers besides localhost, 127.0.0.1 and [::1] (a web page "
        "that rebinds its own name to 127.0.0.1 sends its name: refused)",
    )
    keep_alive_s: float = setting(5.0, help="an idle kept-alive connection is closed after this", check=positive())
    stop_grace_s: float = setting(
        30.0,
        help="after SIGTERM or SIGINT, the seconds the server has to finish (requests in flight get the first "
        "part of it, at most 5 s) before the process exits anyway; a second signal exits at once",
        check=positive(),
    )
    body_timeout_s: float = setting(
        30.0, help="a request body that does not arrive within this is refused (408)", check=positive()
    )
    store_dir: str = setting("data/traces", help="the trace store (append-only segments)")
    store_segment_bytes: int = setting(
        64 * 2**20, help="a segment is closed at this size and the next one opened", check=positive()
    )
    store_max_bytes: int = setting(
        2**30, help="the store's bound: beyond it requests get 503 until it is cleared", check=positive()
    )
    store_feedback_bytes: int = setting(
        16 * 2**20,
        help="room past store_max_bytes kept for feedback, so conversations already answered can still be labeled",
        check=at_least(0),
    )
    batch_window_ms: float = setting(
        10.0, help="how long the first request of a batch waits for others to join", check=non_negative()
    )
    max_batch: int = setting(16, help="requests decoded together", check=positive())
    max_queue: int = setting(
        64,
        help="requests that may wait for a row beyond the max_batch decoding; beyond, 429 with Retry-After at once",
        check=at_least(0),
    )
    request_timeout_s: float = setting(
        300.0,
        help="a request's deadline for its session's turn and in the decoder (waiting included); past it, 503 with "
        "Retry-After, never an unbounded wait",
        check=positive(),
    )
    engine_heartbeat_s: float = setting(
        1.0, help="how often the server pings its engine process (engine: process)", check=positive()
    )
    engine_timeout_s: float = setting(
        30.0,
        help="an engine process silent this long (a model load aside) is killed and replaced; meanwhile requests get "
        "503 with Retry-After",
        check=positive(),
    )
    engine: str = setting(
        "process",
        help="where the decoder runs: process (its own, so the HTTP layer's Python never holds up decoding; "
        "vLLM's layout) or thread (in the server's process: starts faster, shares its interpreter lock)",
        check=one_of("process", "thread"),
    )
    max_body_bytes: int = setting(2**20, help="largest request body (413 beyond)", check=positive())
    max_messages: int = setting(64, help="messages in one chat request", check=positive())
    max_tokens_limit: int = setting(512, help="the largest max_tokens a request may ask for", check=positive())
    default_max_tokens: int = setting(128, help="max_tokens of a request that names none", check=positive())
    max_context: int = setting(
        1024, help="prompt + max_tokens must fit; at most the model's positions (checked at start)", check=positive()
    )
    max_sessions: int = setting(1024, help="sessions held in memory; beyond it new sessions get 429", check=positive())
    max_sessions_per_client: int = setting(
        256,
        help="sessions one client address may hold; beyond it its own least recently used idle one is closed",
        check=positive(),
    )
    max_top_logprobs: int = setting(
        20, help="the most top_logprobs / prompt_logprobs a request may ask for", check=at_least(0)
    )
    poll_s: float = setting(
        30.0, help="seconds between checks of the registry alias for a new champion (0: never)", check=non_negative()
    )
    model_cache_dir: str = setting("data/serve/models", help="registry versions are downloaded here")
    device: str = setting("auto", help="auto (cuda when available), cpu, cuda, cuda:N or mps", check=device_name())

    def check(self) -> None:
        if self.default_max_tokens > self.max_tokens_limit:
            raise ConfigError(
                f"serve.default_max_tokens: got {self.default_max_tokens}, expected at most "
                f"serve.max_tokens_limit ({self.max_tokens_limit})"
            )
