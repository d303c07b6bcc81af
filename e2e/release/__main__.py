"""``python -m e2e.release``: the command ``make release``, ``make push`` and ``make verify``
run (:mod:`e2e.release.artifacts`)."""

from __future__ import annotations

import sys

from e2e.release.artifacts import main

sys.exit(main())
