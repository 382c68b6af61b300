"""Build the tiny Qwen3 and load any causal LM (embedded base, a local directory or a hub id) the same way.

Loading is offline-friendly: with HF_HUB_OFFLINE=1 (the package default, see lopd_core/offline.py) a hub id
that is not in the local cache fails at once with a message saying what to do, instead of retrying the
network for tens of seconds.

A model with its own chat template gets the experience framing tokens on loading (`add_experience_tokens`), so
it talks through `TemplateChat` (lopd_core/model/chat/template.py) with an experience slot the teacher can find.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from lopd_core.config import ModelConfig, TinyModelConfig
from lopd_core.errors import NonFiniteWeights
from lopd_core.model.chat import EXP_END, EXP_START, is_embedded_format

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelNotFoundError(FileNotFoundError):
    """The configured model is neither a local directory nor available offline."""


def check_finite_weights(model, source: str) -> None:
    bad = [
        name
        for name, tensor in model.state_dict().items()
        if tensor.is_floating_point() and not torch.isfinite(tensor).all()
    ]
    if bad:
        raise NonFiniteWeights(
            f"model {source!r} has non-finite weights in {len(bad)} tensor(s) (first: {bad[0]}): "
            "it was saved from a diverged run; retrain it (with --fresh)"
        )


def tiny_qwen3(cfg: TinyModelConfig, tokenizer) -> Qwen3ForCausalLM:
    """A freshly initialised small Qwen3 sized by `cfg`, its vocabulary taken from the tokenizer."""
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.hidden_size // cfg.num_heads,
        max_position_embeddings=cfg.max_positions,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    return Qwen3ForCausalLM(config)


def add_experience_tokens(tokenizer, model=None) -> list[int]:
    """Give a foreign tokenizer `<|exp_start|>` and `<|exp_end|>` (as special tokens, so never split or merged)
    and `model` an embedding row for each; return the ids added (none when the tokenizer has them already).

    The rows are set to the mean of the existing tokens' rows, in the input embeddings and in an untied output
    head alike: a new token then starts as an average token, and the model's outputs barely move until training
    gives it a meaning. The matrices only ever grow (a checkpoint may already carry spare rows past its
    tokenizer's vocabulary, as Qwen's do: those are reused, not cut).
    """
    missing = [t for t in (EXP_START, EXP_END) if t not in tokenizer.get_vocab()]
    if not missing:
        return []
    known = len(tokenizer)
    tokenizer.add_tokens(missing, special_tokens=True)
    new_ids = tokenizer.convert_tokens_to_ids(missing)
    if model is None:
        return new_ids
    if max(new_ids) >= model.get_input_embeddings().weight.shape[0]:
        model.resize_token_embeddings(max(new_ids) + 1, mean_resizing=False)
    layers = [model.get_input_embeddings(), model.get_output_embeddings()]
    with torch.no_grad():
        for weight in {id(m.weight): m.weight for m in layers if m is not None}.values():
            mean = weight[: min(known, weight.shape[0])].float().mean(dim=0)
            weight[new_ids] = mean.to(weight.dtype)
    return new_ids


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def model_path(cfg: ModelConfig) -> str:
    """Where the policy comes from: the configured name, else the embedded base directory."""
    return cfg.name_or_path or cfg.base_dir


def pin_threads(cfg: ModelConfig) -> None:
    """Every stage's CPU threads at `model.threads` (0: torch's default): a float reduction split over threads
    rounds differently with their number, so the same numbers come out on every machine only at one count."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)


def load_policy(cfg: ModelConfig, device: torch.device | None = None):
    """Return (model, tokenizer) in eval mode on `device`; a clear error when the model is missing."""
    pin_threads(cfg)
    source = model_path(cfg)
    local = Path(source)
    if not cfg.name_or_path and not (local / "config.json").exists():
        raise ModelNotFoundError(
            f"no embedded base at {source!r}: build it with `lopd base` (or set model.name_or_path)"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=DTYPES[cfg.dtype])
    except OSError as exc:
        hint = (
            " (offline mode: HF_HUB_OFFLINE=1; download it once with HF_HUB_OFFLINE=0 or point"
            " model.name_or_path at a local directory)"
            if os.environ.get("HF_HUB_OFFLINE") == "1" and not local.exists()
            else ""
        )
        raise ModelNotFoundError(f"cannot load model {source!r}{hint}: {exc}") from None
    check_finite_weights(model, source)
    if not is_embedded_format(tokenizer):
        add_experience_tokens(tokenizer, model)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    from lopd_core.model.chat.template import check_chat_format

    check_chat_format(tokenizer, source)  # the template probed once, with a tool round trip: one line if unusable
    model.to(device or resolve_device(cfg.device)).eval()
    return model, tokenizer
