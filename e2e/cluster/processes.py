"""Child processes of the local cluster: started with a death signal, stopped by pid.

Every process is started so that it dies with the Python process that started it (the
parent-death signal, set by util-linux's ``setpriv --pdeathsig`` before it execs the
binary), so a crashed or killed test run leaves nothing behind. No Python code runs in the
forked child: that is unsafe while other threads (gRPC's, for one) hold locks. A clean
stop sends SIGTERM to exactly the pid that was started, waits, then SIGKILLs.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

SETPRIV = shutil.which("setpriv")


@dataclass
class ManagedProcess:
    """One started binary with its log file."""

    name: str
    argv: Sequence[str]
    log_path: Path
    env: Mapping[str, str] | None = None
    popen: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    exe: str = ""
    """The binary the process ends up running (its argv may start with wrappers)."""
    death_signal: str = "KILL"
    """Sent to the process when the thread that started it dies."""
    pass_fds: Sequence[int] = ()

    def __post_init__(self) -> None:
        self.exe = self.exe or str(self.argv[0])

    @property
    def pid(self) -> int:
        assert self.popen is not None, f"{self.name} was not started"
        return self.popen.pid

    def start(self, *, die_with_parent: bool = True) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as logf:
            # PDEATHSIG fires when the *thread* that forked exits; only trust it on the
            # main thread (pytest fixtures and the CLI both start from there).
            on_main = threading.current_thread() is threading.main_thread()
            argv = list(self.argv)
            if die_with_parent and on_main and SETPRIV:
                argv = [SETPRIV, "--pdeathsig", self.death_signal, "--", *argv]
            self.popen = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=subprocess.STDOUT,
                env=dict(self.env) if self.env is not None else None,
                start_new_session=True,
                pass_fds=tuple(self.pass_fds),
            )
        log.info("process started", extra={"component": self.name, "pid": self.popen.pid,
                                            "log": str(self.log_path)})

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout_s: float = 15.0) -> None:
        if self.popen is None or self.popen.poll() is not None:
            return
        self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("process ignored SIGTERM; killing", extra={"component": self.name,
                                                                  "pid": self.popen.pid})
            self.popen.kill()
            self.popen.wait(timeout=timeout_s)


def wait_gone(proc: ManagedProcess, timeout_s: float) -> None:
    """Wait for a process that was asked to stop; SIGKILL it when it takes too long."""
    if proc.popen is None:
        return
    try:
        proc.popen.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        log.warning("process did not stop in time; killing",
                    extra={"component": proc.name, "pid": proc.popen.pid})
        proc.popen.kill()
        proc.popen.wait(timeout=timeout_s)


def stop_pid(pid: int, *, expected_exe: str | None, timeout_s: float = 15.0) -> bool:
    """Stop a process that another invocation started, by pid.

    ``expected_exe`` (the basename of the binary) guards against a recycled pid: the
    process is only signalled when ``/proc/<pid>/exe`` still names that binary.
    Returns True when the process is gone afterwards.
    """
    if expected_exe is not None:
        try:
            exe = os.readlink(f"/proc/{pid}/exe")
        except OSError:
            return True  # already gone
        if os.path.basename(exe).removesuffix(" (deleted)") != expected_exe:
            log.warning("pid now belongs to another program; not signalling",
                        extra={"pid": pid, "exe": exe, "expected": expected_exe})
            return True
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return True
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not Path(f"/proc/{pid}").exists() or _is_zombie(pid):
            return True
        time.sleep(0.05)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return True
    return False


def _is_zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[0] == "Z"
