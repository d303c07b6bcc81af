"""``rota-engine-gate``: hold an engine's start until its node grants a start slot.

    rota-engine-gate [--max-wait-s S] [--if-configured] -- <engine command and arguments>
    rota-engine-gate --install DIR

Put it in front of the engine in the container's command (``command: [rota-engine-gate,
--, vllm, serve]``). It asks the node's lease controller for a start slot and, once
granted, replaces itself with the engine (``exec``: same process, same environment, so
the engine's GPU memory is attributed to its claim as before). The controller grants the
slot when the engine may initialise on the GPU without running out of memory beside the
awake engine: after it put that engine to sleep (start-up admission, see
``controller.lease.admission``). A container that restarts goes through the gate again.

It reads what the driver's CDI spec put in the container:

- ``ROTA_START_SOCKET``: the controller's unix socket (mounted from the host);
- ``ROTA_START_TOKEN``: this claim's token (removed from the engine's environment);
- ``ROTA_CLAIM_UID``: the claim.

The question is a long poll (``POST /v1/start``, answered within the controller's hold
time); between questions, and after errors (the controller restarting), it pauses on
rota's one retry schedule (bounded, jittered). After ``--max-wait-s`` without a grant it
exits 75 (EX_TEMPFAIL) and the kubelet restarts the container with its own back-off; a
refused token or a missing environment exits 78 (EX_CONFIG). With ``--if-configured`` an
environment without ``ROTA_START_SOCKET`` (rota's start gate switched off) starts the
engine at once instead.

``--install DIR`` writes a self-contained copy (a Python zip application, standard
library only) to ``DIR/rota-engine-gate``: an init container of rota's image copies it into
an ``emptyDir`` for engine images that do not contain rota. This module imports nothing
but the standard library and :mod:`rota.kit.aio`.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import shutil
import socket
import sys
import tempfile
import time
import zipapp
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from rota.api.start_contract import CLAIM_UID_ENV, PATH, SOCKET_ENV, TOKEN_ENV, StartQuestion
from rota.kit.aio import Backoff

__all__ = ["EX_CONFIG", "EX_TEMPFAIL", "GateError", "ask", "install", "main", "wait_for_slot"]

EX_TEMPFAIL = 75
EX_CONFIG = 78

VERSION: str | None = None
"""Set by the ``__main__`` of an ``--install``-ed copy, which has no package metadata."""

HELP = """\
Hold an engine's start until its node's lease controller grants a start slot, then
replace this process with the engine (exec: same process, same environment).

  rota-engine-gate [--max-wait-s S] [--if-configured] -- <engine command and arguments>
  rota-engine-gate --install DIR

Put it in front of the engine in the container's command
(command: [rota-engine-gate, --, vllm, serve]). It reads ROTA_START_SOCKET (the
controller's unix socket), ROTA_START_TOKEN (this claim's token, removed from the
engine's environment) and ROTA_CLAIM_UID from what the driver's CDI spec put in the
container. Exit 75 (EX_TEMPFAIL) after --max-wait-s without a grant (the kubelet
restarts the container); 78 (EX_CONFIG) for a refused token or a missing environment.
--install DIR writes a self-contained copy (standard library only) to
DIR/rota-engine-gate, for engine images that do not contain rota."""
"""The ``--help`` text: plain words, not the module docstring's markup."""


def version() -> str:
    """The installed package's version, or the one an ``--install``-ed copy was made of."""
    if VERSION is not None:
        return VERSION
    from importlib import metadata

    try:
        return metadata.version("rota")
    except metadata.PackageNotFoundError:
        return "0.0.0+unknown"


def _error_pauses() -> Backoff:
    """Pauses after a failed question (no socket, no answer)."""
    return Backoff(first_s=0.5, max_s=10.0, jitter=0.5)


def _repoll_pauses() -> Backoff:
    """Pauses between "not yet" answers that ask for none (the long poll holds anyway)."""
    return Backoff(first_s=0.2, max_s=2.0, jitter=0.5)


class GateError(Exception):
    """The gate cannot go on: ``code`` is the exit status."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self._path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


def ask(socket_path: str, body: StartQuestion, *, timeout_s: float
        ) -> tuple[int, dict[str, Any]]:
    """One question to the controller; its status and JSON answer (a
    :class:`~rota.api.start_contract.StartAnswer` from a controller that speaks the contract;
    read key by key, as anything may answer on a socket)."""
    conn = _UnixConnection(socket_path, timeout_s)
    try:
        conn.request("POST", PATH, body=json.dumps(body),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read(65536)
    finally:
        conn.close()
    try:
        answer = json.loads(raw or b"{}")
    except ValueError:
        answer = {}
    return resp.status, answer if isinstance(answer, dict) else {}


def _say(event: str, **fields: Any) -> None:
    print(json.dumps({"logger": "rota-engine-gate", "event": event, **fields}),
          file=sys.stderr, flush=True)


def wait_for_slot(environ: dict[str, str], *, max_wait_s: float, question_timeout_s: float = 90,
                  clock: Callable[[], float] = time.monotonic,
                  pause: Callable[[float], None] = time.sleep) -> None:
    """Return once the controller granted this claim a start slot.

    Raises:
        GateError: no grant within ``max_wait_s`` (EX_TEMPFAIL), or a refused token or a
            missing environment (EX_CONFIG).
    """
    socket_path = environ.get(SOCKET_ENV, "")
    token = environ.get(TOKEN_ENV, "")
    claim_uid = environ.get(CLAIM_UID_ENV, "")
    if not (socket_path and token and claim_uid):
        raise GateError(f"{SOCKET_ENV}, {TOKEN_ENV} and {CLAIM_UID_ENV} must be set "
                        "(they come from rota's CDI spec of the claim)", EX_CONFIG)
    deadline = clock() + max_wait_s
    errors = _error_pauses()
    repolls = _repoll_pauses()
    attempt = 0
    while True:
        left = deadline - clock()
        if left <= 0:
            raise GateError(f"no start slot within {max_wait_s:.0f} s", EX_TEMPFAIL)
        try:
            status, answer = ask(socket_path, StartQuestion(claim_uid=claim_uid, token=token,
                                                            attempt=attempt),
                                 timeout_s=min(question_timeout_s, max(left, 1.0)))
        except (OSError, http.client.HTTPException) as exc:
            wait = errors.next_delay()
            _say("the lease controller did not answer; asking again", error=repr(exc)[:200],
                 pause_s=round(wait, 3))
            pause(min(wait, max(0.0, deadline - clock())))
            attempt += 1
            continue
        attempt += 1
        errors.reset()
        if status == 200 and answer.get("granted") is True:
            _say("start slot granted", claim=claim_uid, attempts=attempt)
            return
        if status in (400, 401, 403):
            raise GateError(f"the lease controller refused the question ({status}): "
                            f"{answer.get('message', '')}", EX_CONFIG)
        retry = answer.get("retry_after_s")
        wait = float(retry) if isinstance(retry, int | float) and retry > 0 else \
            repolls.next_delay()
        if attempt == 1 or attempt % 10 == 0:
            _say("waiting for a start slot", claim=claim_uid, reason=answer.get("reason"),
                 attempts=attempt)
        pause(min(wait, max(0.0, deadline - clock())))


def install(directory: Path) -> Path:
    """Write the self-contained gate to ``directory/rota-engine-gate``."""
    here = Path(__file__).resolve()
    top = here.parent.parent
    sources = {"controller/__init__.py": here.parent / "__init__.py",
               "controller/engine_gate.py": here,
               **{name: top / name for name in (
                   "rota/__init__.py", "rota/kit/__init__.py", "rota/kit/aio.py",
                   "rota/api/__init__.py", "rota/api/start_contract.py")}}
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / "rota-engine-gate"
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "app"
        for name, source in sources.items():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, root / name)
        (root / "__main__.py").write_text(
            "import sys\nfrom controller import engine_gate\n"
            f"engine_gate.VERSION = {version()!r}\nsys.exit(engine_gate.main())\n")
        staged = Path(tmp) / "rota-engine-gate"
        zipapp.create_archive(root, staged, interpreter="/usr/bin/env python3")
        staged.chmod(0o755)
        shutil.move(str(staged), target)
    return target


def _exec(command: Sequence[str], environ: dict[str, str]) -> NoReturn:
    env = {k: v for k, v in environ.items() if k != TOKEN_ENV}
    try:
        os.execvpe(command[0], list(command), env)
    except OSError as exc:
        raise GateError(f"cannot start {command[0]!r}: {exc}", 127) from exc


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if "--" in args:
        split = args.index("--")
        args, command = args[:split], args[split + 1:]
    parser = argparse.ArgumentParser(
        prog="rota-engine-gate", description=HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"rota-engine-gate {version()}")
    parser.add_argument("--max-wait-s", type=float, default=3600.0,
                        help="give up (exit 75) after this long without a slot (3600)")
    parser.add_argument("--if-configured", action="store_true",
                        help="start at once when ROTA_START_SOCKET is not set")
    parser.add_argument("--install", type=Path, metavar="DIR",
                        help="write a self-contained copy to DIR/rota-engine-gate and exit")
    options = parser.parse_args(args)
    if options.install is not None:
        print(install(options.install))
        return 0
    if not command:
        parser.error("the engine command goes after --")
    environ = dict(os.environ)
    try:
        if options.if_configured and not environ.get(SOCKET_ENV):
            _say("no start gate configured; starting at once")
        else:
            wait_for_slot(environ, max_wait_s=options.max_wait_s)
        _exec(command, environ)
    except GateError as exc:
        _say("not starting", error=str(exc), exit_code=exc.code)
        return exc.code


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
