"""The release tools' binaries (helm and promtool, crane, cosign): a directory an
environment variable names, else the one its build script in ``e2e/toolchain`` builds
(cached after the first build) and prints as its last line."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def tool_dir(env: str, script: Path, *, error: type[Exception],
             timeout_s: float = 3600.0) -> Path:
    """The directory ``env`` names, else the one ``script`` builds; ``error`` (with the
    script's stderr) where the build fails."""
    given = os.environ.get(env)
    if given:
        return Path(given)
    done = subprocess.run(["bash", str(script)], capture_output=True, text=True,
                          check=False, timeout=timeout_s)
    if done.returncode != 0:
        raise error(f"{script.name} failed:\n{done.stderr[-4000:]}")
    return Path(done.stdout.strip().splitlines()[-1])
