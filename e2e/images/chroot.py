"""Run a command inside an image's root filesystem, recording what it changes as a layer.

The lower layers are stacked read-only with overlayfs and the command's changes land in an
upper directory, which is then the new layer's tree. The mounts are made in a mount
namespace of their own (``unshare --mount --propagation private``): they disappear with
the command and the machine's mount table never sees them. ``/proc`` and ``/dev`` are
mounted for the command; ``binds`` adds read-only directories (wheels, say). The command
gets a clean environment.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

SCRIPT = r"""
set -eu
merged=$1; shift
lower=$1; shift
upper=$1; shift
work=$1; shift
if [ -n "$upper" ]; then
  mount -t overlay overlay -o "lowerdir=$lower,upperdir=$upper,workdir=$work" "$merged"
else
  mount --bind "$lower" "$merged"
fi
mount -t proc proc "$merged/proc"
mount --rbind /dev "$merged/dev"
while [ "$1" != "--" ]; do
  mkdir -p "$merged$2"
  mount --bind -o ro "$1" "$merged$2"
  shift 2
done
shift
exec env -i "$@"
"""


class ChrootError(RuntimeError):
    """The command failed; the message carries its output."""


def run(lowers: Sequence[Path], upper: Path | None, argv: Sequence[str], *,
        scratch: Path, binds: Mapping[Path, str] | None = None,
        env: Mapping[str, str] | None = None) -> str:
    """Run ``argv`` in the stacked ``lowers`` (topmost first) and return its output.

    With ``upper`` None the single lower directory is changed in place.
    """
    if upper is None and len(lowers) != 1:
        raise ValueError("changing in place needs exactly one directory")
    merged, work = scratch / "merged", scratch / "work"
    shutil.rmtree(work, ignore_errors=True)
    for path in (merged, work, *([upper] if upper else [])):
        path.mkdir(parents=True, exist_ok=True)
    clean_env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                 "HOME": "/root", "LANG": "C.UTF-8", **(env or {})}
    bind_args: list[str] = []
    for source, target in (binds or {}).items():
        bind_args += [str(source), target]
    command = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", SCRIPT,
               "chroot-run", str(merged), ":".join(str(p) for p in lowers),
               str(upper) if upper else "", str(work), *bind_args, "--",
               *[f"{k}={v}" for k, v in clean_env.items()], "chroot", str(merged), *argv]
    proc = subprocess.run(command, capture_output=True, text=True, check=False)
    shutil.rmtree(work, ignore_errors=True)
    if proc.returncode != 0:
        raise ChrootError(f"{shlex.join(argv)} failed ({proc.returncode}):\n"
                          f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return proc.stdout
