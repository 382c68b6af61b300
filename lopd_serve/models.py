"""The served model: loaded from a checkpoint folder or from the registry's champion, swapped while serving.

Why a holder: a promotion moves the registry alias while requests are being answered. `ModelHolder.reload`
loads the new version in a worker thread (requests go on meanwhile), smoke-tests it (`smoke_test`: ids within
its embeddings, positions covering serve.max_context, finite logits; config.json matching its weights is
checked as it loads), then replaces the reference in one assignment. A request keeps the `LoadedModel` it was
rendered with until it is answered, so a swap never changes the tokenizer or the weights under a request, and
every trace names the version that sampled it.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lopd_core.model.chat import is_embedded_format
from lopd_core.model.chat.template import check_chat_format
from lopd_core.model.loading import add_experience_tokens
from lopd_core.traces.fingerprint import tokenizer_fingerprint


@dataclass(frozen=True)
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    chat: object  # ChatFormat (lopd_core/model/chat/codec.py)
    version: str  # `<registered model>/<version>` from the registry, `path:<folder>#<stamp of its files>` for a folder
    name: str  # the model name /v1/models reports
    tokenizer_fingerprint: str = ""  # every trace records it (lopd_core/traces/fingerprint.py)
    folder: str = ""  # where it was loaded from: the engine process loads the same files (engine_process.py)


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


SEARCH_DEPTH = 3  # an MLflow artifact nests its files two or three folders down (model/, components/tokenizer/)
SEARCH_FOLDERS = 2000  # folders looked at before giving up: a reload must not walk a whole disk


def _folder_with(root: Path, filename: str) -> Path:
    """The one folder under `root` (itself, or at most SEARCH_DEPTH levels down) holding `filename` (an MLflow
    transformers artifact keeps the weights in `model/` and the tokenizer in `components/tokenizer/`; a plain
    export keeps both at its top). Two candidates is an error, not a choice: a folder of several checkpoints
    is not a model folder, and serving one of them would record the wrong version in every trace."""
    if (root / filename).is_file():
        return root
    found, level, seen = [], [root], 0
    for _ in range(SEARCH_DEPTH):
        below = []
        for folder in level:
            try:
                children = sorted(p for p in folder.iterdir() if p.is_dir() and not p.is_symlink())
            except OSError:
                continue
            seen += len(children)
            if seen > SEARCH_FOLDERS:
                raise FileNotFoundError(f"{root}: not a model folder (no {filename} near its top)")
            found += [c for c in children if (c / filename).is_file()]
            below += children
        level = below
    if not found:
        raise FileNotFoundError(f"no {filename} under {root}: not a Hugging Face checkpoint")
    if len(found) > 1:
        shown = ", ".join(str(f.relative_to(root)) for f in found[:3])
        raise ValueError(f"{root} holds more than one checkpoint ({shown}, ...): name the checkpoint's own folder")
    return found[0]


def _stamp(*folders: Path) -> str:
    """What tells two saves into one folder apart: the name, size and modification time of each file. A trainer
    syncing a server saves every update into the same folder (rollout.sync_dir), so the path alone would label
    different weights as one version: their traces could not be told apart, and a session crossing the update
    would go on in one trajectory with another model's log-probs."""
    digest = hashlib.sha256()
    for folder in folders:
        for path in sorted(p for p in folder.iterdir() if p.is_file()):
            info = path.stat()
            digest.update(f"{path.name}\0{info.st_size}\0{info.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:12]


def load_checkpoint(
    folder: str | Path, *, version: str | None = None, name: str | None = None, device: str = "auto"
) -> LoadedModel:
    """A checkpoint in eval mode with the chat format its tokenizer speaks (probed as `load_policy` does)."""
    root = Path(folder)
    if not root.is_dir():
        raise FileNotFoundError(f"no model folder at {root}")
    weights = _folder_with(root, "config.json")
    tokenizer_dir = _folder_with(root, "tokenizer_config.json")
    stamp = _stamp(weights, tokenizer_dir)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    model, info = AutoModelForCausalLM.from_pretrained(weights, dtype="auto", output_loading_info=True)
    unloaded = [*info.get("missing_keys", ()), *info.get("mismatched_keys", ()), *info.get("unexpected_keys", ())]
    if unloaded:  # a config that does not describe its weights: some tensors would be random or dropped
        shown = ", ".join(str(k if isinstance(k, str) else k[0]) for k in sorted(unloaded, key=str)[:3])
        raise Unservable(f"{weights}: config.json does not match the weights ({len(unloaded)} tensors: {shown}, ...)")
    if not is_embedded_format(tokenizer):
        add_experience_tokens(tokenizer, model)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    chat = check_chat_format(tokenizer, str(root))
    model.to(_device(device)).eval()
    version = version or f"path:{root.resolve()}#{stamp}"
    return LoadedModel(
        model, tokenizer, chat, version, name or root.name, tokenizer_fingerprint(tokenizer), str(root.resolve())
    )


class Unservable(ValueError):
    """A checkpoint that loads but cannot serve: refused before it is swapped in (or before the server starts)."""


def check_positions(loaded: LoadedModel, max_context: int) -> None:
    positions = getattr(loaded.model.config, "max_position_embeddings", None)
    if positions is not None and positions < max_context:
        raise Unservable(
            f"serve.max_context={max_context} exceeds the model's {positions} positions "
            "(max_position_embeddings): lower serve.max_context"
        )


@torch.no_grad()
def smoke_test(loaded: LoadedModel, max_context: int) -> None:
    """What a candidate must pass before it serves: every id its tokenizer can produce has an embedding row (else
    a request holding one fails, and with it every request batched beside it), its positions cover
    serve.max_context, and one short chat prompt gives finite logits over the whole vocabulary."""
    rows = loaded.model.get_input_embeddings().weight.shape[0]
    vocab = len(loaded.tokenizer)
    if vocab > rows:
        raise Unservable(f"the tokenizer has {vocab} ids but the embeddings only {rows} rows")
    check_positions(loaded, max_context)
    ids = loaded.chat.start("", "hello").token_ids
    device = next(loaded.model.parameters()).device
    logits = loaded.model(input_ids=torch.tensor([ids], device=device)).logits[0, -1]
    if logits.shape[-1] < vocab or not bool(torch.isfinite(logits.float()).all()):
        raise Unservable(f"a forward on a short prompt gives {logits.shape[-1]} logits, not {vocab} finite ones")


class Registry:
    """The champion of an MLflow registry: which version holds the alias, and its files on disk."""

    def __init__(self, tracking_uri: str, registered_model: str, alias: str, cache_dir: str | Path):
        from mlflow import MlflowClient

        self.client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
        self.tracking_uri = tracking_uri
        self.registered_model = registered_model
        self.alias = alias
        self.cache_dir = Path(cache_dir)

    def champion(self) -> str:
        """The version number holding the alias (MlflowException when there is none)."""
        return str(self.client.get_model_version_by_alias(self.registered_model, self.alias).version)

    def version_label(self, number: str) -> str:
        return f"{self.registered_model}/{number}"

    def download(self, number: str) -> Path:
        import mlflow.artifacts

        out = self.cache_dir / self.registered_model / number
        if not (out / ".complete").exists():  # a download cut short is fetched again
            out.mkdir(parents=True, exist_ok=True)
            # the version's storage location, asked of this client: a `models:/` URI would be resolved against
            # the process-wide registry URI instead of this one
            source = self.client.get_model_version_download_uri(self.registered_model, number)
            mlflow.artifacts.download_artifacts(artifact_uri=source, dst_path=str(out), tracking_uri=self.tracking_uri)
            (out / ".complete").write_text(number)
        return out


class ModelHolder:
    """The model requests are rendered for; replaced whole by `reload`, never mutated."""

    def __init__(
        self, current: LoadedModel, *, registry: Registry | None = None, device: str = "auto", max_context: int = 0
    ):
        self.current = current
        self.registry = registry
        self.device = device
        self.max_context = max_context  # serve.max_context: a candidate's positions must cover it
        self._loading = threading.Lock()  # one load at a time; requests never wait on it
        # called with a candidate that passed its smoke test, before it is swapped in: the engine process loads
        # it then, so the first request after the swap does not wait for a load (app.py sets it)
        self.before_swap: Callable[[LoadedModel], None] | None = None

    def reload(self, model_path: str | None = None) -> tuple[str, bool]:
        """Load `model_path`, or the registry's champion when none is given, and swap it in if it is another
        version. Blocking (run it off the event loop); returns (serving version, whether it changed)."""
        with self._loading:
            if model_path:
                loaded = load_checkpoint(model_path, device=self.device)
            elif self.registry is not None:
                number = self.registry.champion()
                label = self.registry.version_label(number)
                if label == self.current.version:
                    return label, False
                loaded = load_checkpoint(
                    self.registry.download(number),
                    version=label,
                    name=self.registry.registered_model,
                    device=self.device,
                )
            else:
                raise ValueError("this server serves a folder: name the model folder to reload from")
            smoke_test(loaded, self.max_context)  # raises Unservable: the current model stays
            if self.before_swap is not None:
                self.before_swap(loaded)
            changed = loaded.version != self.current.version
            self.current = loaded  # one assignment: a request sees the old model or the new, never a mix
            return loaded.version, changed


def initial_model(model_path: str, registry: Registry | None, device: str) -> LoadedModel:
    if model_path:
        return load_checkpoint(model_path, device=device)
    if registry is None:
        raise ValueError("no model: give a folder (serve.model / --model) or a registry")
    number = registry.champion()
    return load_checkpoint(
        registry.download(number), version=registry.version_label(number), name=registry.registered_model, device=device
    )
