"""The coldstart stage's driver: φ0, the composer's cold start, trained on oracle successes of the pretraining
worlds read by the frozen policy (never the deployment bank: lopd_core/distill/composer/coldstart_data.py). Writes
coldstart.out and, beside lopd.csv, coldstart.csv.
"""

from __future__ import annotations

from pathlib import Path

from lopd_core import distributed as D
from lopd_core.config import Params
from lopd_core.distill.composer.coldstart import train_coldstart
from lopd_core.distill.composer.coldstart_data import pretraining_retriever, pretraining_successes
from lopd_core.distill.composer.composer import Composer, build_composer, load_weights, save_composer
from lopd_core.errors import StateError
from lopd_core.model.chat import make_chat
from lopd_core.model.loading import load_policy


def new_composer(params: Params, model) -> Composer:
    """A fresh φ of the composer section's shape for `model`."""
    return build_composer(params.composer, model)


def load_phi(params: Params, model, path: str | Path, *, refit: bool = False) -> Composer:
    """The composer saved at `path` (`lopd coldstart`, `lopd fit`), built to the `composer` section for `model`; a
    file that is no such composer is one line naming it, not a traceback. `refit`: the start of `lopd fit`, which
    may read another way than it was fitted (composer.load_weights)."""
    import pickle

    composer = new_composer(params, model)
    try:
        load_weights(composer, path, refit=refit)
    except (RuntimeError, ValueError, EOFError, IsADirectoryError, pickle.UnpicklingError) as exc:
        # (torch's unpickling message suggests loading untrusted files unsafely: never repeated here)
        unpickled = isinstance(exc, pickle.UnpicklingError) or not str(exc).strip()
        reason = "not a saved state dict" if unpickled else str(exc).strip().splitlines()[0]
        raise StateError(
            f"{path}: not a composer of this model under the composer settings ({reason}); "
            "write one with `lopd coldstart` / `lopd fit`"
        ) from None
    return composer


def run_coldstart(params: Params, log=print) -> dict:
    import torch

    D.setup()  # before loading: under `accelerate launch` on GPUs each rank must land on its own device
    model, tokenizer = load_policy(params.model)
    cs = params.coldstart
    trajectories, successes = pretraining_successes(params, make_chat(tokenizer))
    log(f"coldstart: {len(successes)} oracle successes in {params.envs.pretrain_worlds} pretraining worlds")
    torch.manual_seed(params.seed)
    composer = new_composer(params, model)
    with pretraining_retriever(params, trajectories) as retriever:
        run = train_coldstart(
            model,
            tokenizer,
            composer,
            successes,
            retriever,
            steps=cs.steps,
            batch_size=cs.batch_size,
            lr=cs.lr,
            kl_weight=cs.kl_weight,
            seed=params.seed,
            csv_path=Path(params.lopd.csv).with_name("coldstart.csv"),
            max_experience_tokens=params.composer.max_experience_tokens,
            sharding=params.lopd.sharding,
            log=log,
        )
    out = Path(cs.out)
    if D.is_main():  # every rank holds the same φ0: one copy on disk
        save_composer(composer, out)
    D.barrier()
    return {
        "successes": len(successes),
        "first": run.rows[0],
        "last": run.rows[-1],
        "skipped_updates": run.skipped_updates,
        "out": str(out),
    }
