"""A root filesystem from Debian's packages, without debootstrap and without running any
package script.

apt resolves the packages and everything they depend on as if nothing were installed (an
empty dpkg status file), downloads them into the cache, and ``dpkg-deb -x`` unpacks each.
Nothing a package's scripts would do happens, so the few files an image needs from them
(``/etc/passwd``, ``/etc/group``, ``/tmp``) are written by :func:`finish_rootfs`. The
machine's own apt lists are used; when they are missing, ``apt-get update`` runs once.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)

_URI = re.compile(r"^'(?P<uri>[^']+)' (?P<file>\S+\.deb) (?P<size>\d+) ")


class PackageError(RuntimeError):
    """apt could not resolve or fetch the packages."""


def _apt_options(workdir: Path, archives: str) -> list[str]:
    status = workdir / "empty-status"
    status.parent.mkdir(parents=True, exist_ok=True)
    status.touch()
    (workdir / archives / "partial").mkdir(parents=True, exist_ok=True)
    return ["-o", f"Dir::State::status={status}", "-o", f"Dir::Cache={workdir}",
            "-o", f"Dir::Cache::archives={workdir / archives}", "-o", "Debug::NoLocking=1",
            "-o", "APT::Install-Recommends=false", "-o", "APT::Install-Suggests=false"]


def _apt(workdir: Path, *args: str, archives: str = "archives"
         ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["apt-get", "-q", *_apt_options(workdir, archives), *args],
                          capture_output=True, text=True, check=False,
                          env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})


def resolve(packages: Sequence[str], workdir: Path) -> list[str]:
    """The .deb file names (name_version_arch) of ``packages`` and all they depend on.

    apt prints the files it would fetch; an archive directory that stays empty makes it
    print all of them, cached or not.
    """
    proc = _apt(workdir, "install", "--print-uris", "-qq", "-y", *packages, archives="resolve")
    if proc.returncode != 0 and os.geteuid() == 0:
        log.info("apt could not resolve; updating its lists once",
                 extra={"error": proc.stderr[-300:]})
        subprocess.run(["apt-get", "update", "-q"], capture_output=True, check=False)
        proc = _apt(workdir, "install", "--print-uris", "-qq", "-y", *packages,
                    archives="resolve")
    if proc.returncode != 0:
        raise PackageError(f"apt-get could not resolve {' '.join(packages)}:\n{proc.stderr}")
    files = sorted(m["file"] for line in proc.stdout.splitlines() if (m := _URI.match(line)))
    if not files:
        raise PackageError(f"apt-get resolved no packages for {' '.join(packages)}")
    return files


def download(packages: Sequence[str], workdir: Path) -> list[Path]:
    """Download (or find cached) every package of the closure; their paths."""
    proc = _apt(workdir, "install", "--download-only", "-y", *packages)
    if proc.returncode != 0:
        raise PackageError(f"apt-get could not download {' '.join(packages)}:\n{proc.stderr}")
    archives = workdir / "archives"
    return [archives / name for name in resolve(packages, workdir)]


def extract(debs: Sequence[Path], root: Path) -> None:
    """Unpack each package's files into ``root`` (no package scripts run)."""
    root.mkdir(parents=True, exist_ok=True)
    for deb in debs:
        subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True,
                       capture_output=True)


def finish_rootfs(root: Path) -> None:
    """What package scripts and a base system would have provided, and nothing more; also
    drops documentation, manual pages and translations."""
    etc = root / "etc"
    etc.mkdir(exist_ok=True)
    (etc / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n"
                                "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n")
    (etc / "group").write_text("root:x:0:\nnogroup:x:65534:\n")
    (etc / "hostname").write_text("rota\n")
    for name in ("root", "tmp", "proc", "sys", "dev", "run", "var/tmp"):
        (root / name).mkdir(parents=True, exist_ok=True)
    (root / "tmp").chmod(0o1777)
    (root / "var/tmp").chmod(0o1777)
    (root / "root").chmod(0o700)
    for name in ("usr/share/doc", "usr/share/man", "usr/share/locale", "usr/share/info",
                 "usr/share/lintian"):
        shutil.rmtree(root / name, ignore_errors=True)
