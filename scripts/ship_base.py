"""Record a built base as the shipped one: copy its files into lopd_core/model/embedded_base/ with SHIPPED.json
(every file's sha256, the build settings it answers to, the commit and the CPU it was built on).

    python scripts/ship_base.py data/base            # after `lopd base` on the machine the figures come from

A maintainer's step, run when the warm start changes; the new weights' hash then goes into docs/results.md with
every figure rebuilt on it (lopd_core/model/shipped.py says why a base ships at all).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lopd_core.config import load_params
from lopd_core.model.shipped import MANIFEST, SHIPPED_DIR, SHIPPED_FILES, write_manifest


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("built", help="a folder `lopd base` built")
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    args = ap.parse_args()
    params = load_params(args.params, args.overrides)
    built = Path(args.built)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    if SHIPPED_DIR.exists():
        shutil.rmtree(SHIPPED_DIR)
    SHIPPED_DIR.mkdir(parents=True)
    for name in SHIPPED_FILES:
        if (built / name).exists():
            shutil.copy2(built / name, SHIPPED_DIR / name)
    manifest = write_manifest(SHIPPED_DIR, params, commit)
    print(
        f"shipped {len(manifest['files'])} files to {SHIPPED_DIR}; weights sha256 "
        f"{manifest['files']['model.safetensors']} ({MANIFEST})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
