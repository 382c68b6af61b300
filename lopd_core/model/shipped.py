"""The shipped base: the embedded base every published figure rests on, versioned with the code.

Why it ships instead of being built on each machine: the warm start is thousands of optimizer steps of float
sums whose rounding depends on the CPU's kernels, so the same code at the same thread count builds different
weights on different CPUs (DESIGN §3 "One base for everyone"). Every figure downstream — the bank, φ, each
student, each comparison — inherits that difference. So `lopd cycle`, `lopd compare` and DVC's `base` stage
install this folder (a few MB: weights, tokenizer, build report) into `model.base_dir`, checking each file's
sha256 against `SHIPPED.json`; `lopd base` rebuilds from the code and says whether the rebuild matches.

The shipped base answers to one set of build settings (`BUILD_SETTINGS`, recorded in the manifest). Settings
that differ (another tiny model, another warm start, other pretraining worlds) or `model.base_source: build`
build from the code, as before; so does a manifest that does not match the files (a corrupted checkout fails
with the file named, never silently builds something else).
"""

from __future__ import annotations

import hashlib
import json
import platform
import shutil
from pathlib import Path

from lopd_core.config import Params
from lopd_core.errors import StateError

SHIPPED_DIR = Path(__file__).parent / "embedded_base"
MANIFEST = "SHIPPED.json"
WEIGHTS = "model.safetensors"
# The settings `lopd base` reads that shape the weights (model.threads shapes only their last bits on one CPU:
# the shipped base is the one for every thread count, so it is not among them).
BUILD_SETTINGS = ("seed", "model.tiny", "model.warmstart", "envs.mix", "envs.pretrain_worlds", "envs.world_seed")
# What a base folder holds that is the base itself (not a cycle's stage summary or cache key).
SHIPPED_FILES = (
    "config.json",
    "generation_config.json",
    WEIGHTS,
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "build_report.json",
)


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def weights_sha256(folder: str | Path) -> str:
    """The base's identity in every report: the sha256 of its weights file."""
    return sha256_of(Path(folder) / WEIGHTS)


def base_identity(folder: str | Path) -> str:
    """What a report names a base by: its weights' sha256, shortened (a folder without one weights file, a
    sharded checkpoint of the user's, by the hash of its files' content)."""
    if (Path(folder) / WEIGHTS).is_file():
        return weights_sha256(folder)[:16]
    h = hashlib.sha256()
    for path in sorted(p for p in Path(folder).rglob("*") if p.is_file()):
        h.update(path.relative_to(folder).as_posix().encode() + b"\0" + sha256_of(path).encode())
    return h.hexdigest()[:16]


def build_settings(params: Params) -> dict:
    """The values of BUILD_SETTINGS, JSON-normalised (dataclasses as dicts), so two params compare as data."""
    flat = params.to_dict()
    out = {}
    for key in BUILD_SETTINGS:
        value = flat
        for part in key.split("."):
            value = value[part]
        out[key] = value
    return json.loads(json.dumps(out, sort_keys=True, default=str))


def shipped_manifest(folder: Path = SHIPPED_DIR) -> dict | None:
    """The manifest of the shipped base, or None where this checkout ships none."""
    path = folder / MANIFEST
    return json.loads(path.read_text()) if path.exists() else None


def shipped_for(params: Params, folder: Path = SHIPPED_DIR) -> dict | None:
    """The shipped base's manifest when it answers to these settings and `model.base_source` asks for it."""
    manifest = shipped_manifest(folder)
    if params.model.base_source != "shipped" or manifest is None:
        return None
    return manifest if manifest["settings"] == build_settings(params) else None


def check_shipped(folder: Path = SHIPPED_DIR) -> dict:
    """The manifest, after checking every file it names against its sha256 (StateError naming the file)."""
    manifest = shipped_manifest(folder)
    if manifest is None:
        raise StateError(f"no shipped base in {folder} ({MANIFEST} missing)")
    for name, digest in manifest["files"].items():
        path = folder / name
        if not path.exists():
            raise StateError(f"the shipped base lacks {path}: restore it from git (git checkout -- {path})")
        if sha256_of(path) != digest:
            raise StateError(
                f"the shipped base's {path} does not match {MANIFEST} (sha256 {sha256_of(path)[:12]}… against "
                f"{digest[:12]}…): restore it from git, or set model.base_source=build"
            )
    return manifest


def install_shipped(out_dir: str | Path, folder: Path = SHIPPED_DIR) -> dict:
    """Copy the checked shipped base into `out_dir` (swapped in whole, as a built base is); its manifest."""
    from lopd_core.model.base_build import BASE_MARKER, _earlier_base
    from lopd_core.outputs import publish_folder

    manifest = check_shipped(folder)

    def fill(staging: Path) -> None:
        for name in manifest["files"]:
            shutil.copy2(folder / name, staging / name)
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))

    publish_folder(out_dir, BASE_MARKER, "a base", fill, _earlier_base)
    return manifest


def rebuild_verdict(built: str | Path, folder: Path = SHIPPED_DIR) -> str:
    """One line: whether a freshly built base's weights equal the shipped base's, and what a difference means."""
    manifest = shipped_manifest(folder)
    ours = weights_sha256(built)
    if manifest is None:
        return f"weights sha256 {ours[:16]}…; this checkout ships no base to compare with"
    theirs = manifest["files"][WEIGHTS]
    if ours == theirs:
        return f"weights sha256 {ours[:16]}… — the rebuild matches the shipped base"
    return (
        f"weights sha256 {ours[:16]}… differ from the shipped base's {theirs[:16]}… (built on "
        f"{manifest.get('cpu', 'another CPU')}): the same code rounds differently on another CPU's kernels, so the "
        "published figures rest on the shipped base, which the default installs"
    )


def write_manifest(folder: str | Path, params: Params, commit: str) -> dict:
    """Record a built base as the one to ship (scripts/ship_base.py): its files' hashes, settings, commit, CPU."""
    folder = Path(folder)
    report = json.loads((folder / "build_report.json").read_text())
    manifest = {
        "files": {name: sha256_of(folder / name) for name in SHIPPED_FILES if (folder / name).exists()},
        "settings": build_settings(params),
        "threads": params.model.threads,
        "commit": commit,
        "cpu": cpu_name(),
        "final_loss": report.get("final_loss"),
        "steps": report.get("steps"),
    }
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
    return manifest


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
