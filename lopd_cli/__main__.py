"""`python -m lopd_cli ...` is `lopd ...` (what `accelerate launch -m lopd_cli` and the DVC stages run)."""

import sys

from lopd_cli.main import main

sys.exit(main())
