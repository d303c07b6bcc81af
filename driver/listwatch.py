"""List-then-watch: one resource kept current from the API server, for rota's processes.

The official ``kubernetes`` client is synchronous, so :class:`ListWatch` runs in a daemon
thread and hands what it sees to the asyncio loop with ``call_soon_threadsafe``; only the
loop touches the caller's state. Objects travel as the API's JSON (dicts).

The protocol, as the API server expects it of a client that keeps a cache:

1. list, paginated (``limit`` and ``continue``), and hand the whole set to ``on_replace``;
2. watch from the list's ``resourceVersion`` with bookmarks on: each ADDED, MODIFIED or
   DELETED goes to ``on_event``; a BOOKMARK only advances the version, so a quiet watch
   can be re-opened after the server closes it (``timeout_seconds``) without a new list;
3. a 410 Gone (the version is too old) lists again at once; any other error of a watch
   (a connection reset, an API server restart, an ERROR event with another code) resumes
   the watch from the last version seen, after a pause from the one retry schedule
   (:class:`driver.aio.Backoff`), as client-go's reflector does: an API server restart
   costs one watch request per stream, not a full list. A failed list is retried as a
   list;
4. optionally list again every ``relist_s`` even when nothing failed.

Selectors (``field_selector``, ``label_selector``) narrow both the list and the watch on
the server; ``keep`` narrows what is handed on, for what no selector can express, and
``cut`` trims each object to what the caller keeps (in the thread, page by page, so a list
of a large fleet is never held whole).

A 403 (the caller may not list or watch there: RBAC narrower than what it was asked to
follow) is an error like any other unless ``on_forbidden`` is given: then the caller is
told once, on the loop, with the error (it drops what it held: it can no longer follow
it), the list is tried again on a slower schedule of its own (``forbidden_backoff``), and
the next list that succeeds replaces as usual.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from kubernetes import client
from kubernetes.watch.watch import iter_resp_lines

from driver.aio import Backoff

__all__ = ["ListWatch", "Obj"]

log = logging.getLogger(__name__)

Obj = dict[str, Any]
_GONE = 410
_FORBIDDEN = 403


class _Gone(Exception):
    """The watch's resourceVersion is too old: list again."""


class ListWatch:
    """Keeps one resource (in one namespace or all) current; see the module docstring.

    Args:
        name: what is watched, for logs (``"resourceclaims"``).
        list_fn: the client's list function (``CoreV1Api.list_namespaced_pod``, ...).
        args: its positional arguments (namespace, group, version, plural...).
        loop: the loop that receives ``on_replace`` and ``on_event``.
        on_replace: called with every item of a fresh list (the caller's state is
            replaced by it).
        on_event: called with ``("ADDED" | "MODIFIED" | "DELETED", object)``.
        keep: only objects for which it is true are handed on; an object that stops
            matching is handed on as DELETED.
        selectors: ``field_selector`` / ``label_selector`` for list and watch.
        page_size: items per list page.
        watch_timeout_s: the server closes each watch after this long; it is re-opened.
        api_timeout_s: bound of each list call and of the silence within a watch beyond
            ``watch_timeout_s``.
        relist_s: list again this often (None: only after errors and 410s).
        backoff: pauses after errors (unbounded: the watch is meant to last; default
            0.5 s growing to 30 s), reset by every successful list.
        on_error: told of each error that made it list again (a metric).
        cut: what of each kept object is handed on (default: the object).
        on_forbidden: makes a 403 skippable (see the module docstring); called on the loop
            with the error.
        forbidden_backoff: pauses between lists while they are refused (default 1 s
            growing to 60 s: a 403 lasts until an admin changes RBAC).
    """

    def __init__(self, name: str, list_fn: Callable[..., Any], *args: Any,
                 loop: asyncio.AbstractEventLoop, on_replace: Callable[[list[Obj]], None],
                 on_event: Callable[[str, Obj], None],
                 keep: Callable[[Obj], bool] | None = None,
                 field_selector: str | None = None, label_selector: str | None = None,
                 page_size: int = 500, watch_timeout_s: int = 300, api_timeout_s: float = 10.0,
                 relist_s: float | None = None,
                 backoff: Backoff | None = None,
                 on_error: Callable[[BaseException], None] | None = None,
                 cut: Callable[[Obj], Obj] | None = None,
                 on_forbidden: Callable[[str], None] | None = None,
                 forbidden_backoff: Backoff | None = None) -> None:
        self.name = name
        self._list_fn = list_fn
        self._args = args
        self._loop = loop
        self._on_replace = on_replace
        self._on_event = on_event
        self._keep = keep
        self._selectors = {k: v for k, v in (("field_selector", field_selector),
                                             ("label_selector", label_selector)) if v}
        self._page_size = page_size
        self._watch_timeout_s = watch_timeout_s
        self._api_timeout_s = api_timeout_s
        self._relist_s = relist_s
        self._backoff = backoff or Backoff(first_s=0.5, max_s=30.0)
        self._on_error = on_error
        self._cut = cut or (lambda obj: obj)
        self._on_forbidden = on_forbidden
        self._forbidden_backoff = forbidden_backoff or Backoff(first_s=1.0, max_s=60.0)
        self._kept: set[str] = set()
        self._version = ""
        """The last resourceVersion seen; empty: list first."""
        self.stopping = threading.Event()
        self.listed = asyncio.Event()
        """Set (on the loop) once the first list has been handed on."""
        self.lists = 0
        self.watches = 0
        """How many lists and watch requests were made (for tests and benchmarks)."""
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"watch-{name}")

    # -- control ---------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop soon: at the next event or when the open request returns (it is bounded
        by ``watch_timeout_s``; nothing is handed on after this call)."""
        self.stopping.set()

    # -- delivery to the loop --------------------------------------------------------

    def _deliver(self, fn: Callable[..., None], *args: Any) -> None:
        if self.stopping.is_set():
            return

        def run() -> None:
            if not self.stopping.is_set():
                fn(*args)

        try:
            self._loop.call_soon_threadsafe(run)
        except RuntimeError:  # the loop is closed: nobody listens any more
            self.stopping.set()

    def _replaced(self, items: list[Obj]) -> None:
        self._on_replace(items)
        self.listed.set()

    @staticmethod
    def _uid(obj: Obj) -> str:
        meta = obj.get("metadata") or {}
        return str(meta.get("uid") or f"{meta.get('namespace')}/{meta.get('name')}")

    # -- the protocol ----------------------------------------------------------------

    def _list(self) -> tuple[list[Obj], str]:
        items: list[Obj] = []
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {**self._selectors, "limit": self._page_size}
            if token:
                kwargs["_continue"] = token
            resp = self._list_fn(*self._args, **kwargs, _preload_content=False,
                                 _request_timeout=self._api_timeout_s)
            body = json.loads(resp.data)
            self.lists += 1
            page = body.get("items") or []
            items.extend(self._cut(o) for o in page if self._keep is None or self._keep(o))
            meta = body.get("metadata") or {}
            token = meta.get("continue")
            if not token:
                return items, str(meta.get("resourceVersion") or "")

    def _events(self, version: str) -> Iterator[tuple[str, Obj]]:
        resp = self._list_fn(*self._args, **self._selectors, watch=True,
                             resource_version=version, allow_watch_bookmarks=True,
                             timeout_seconds=self._watch_timeout_s, _preload_content=False,
                             _request_timeout=(self._api_timeout_s,
                                               self._watch_timeout_s + self._api_timeout_s))
        self.watches += 1
        try:
            for line in iter_resp_lines(resp):
                if self.stopping.is_set():
                    return
                if not line:
                    continue
                event = json.loads(line)
                kind, obj = str(event.get("type")), dict(event.get("object") or {})
                if kind == "ERROR":
                    if obj.get("code") == _GONE:
                        raise _Gone(str(obj.get("message", "")))
                    raise client.ApiException(status=obj.get("code"),
                                              reason=str(obj.get("message", "")))
                yield kind, obj
        finally:
            resp.close()
            resp.release_conn()

    def _watch(self, listed_at: float) -> None:
        """Watch from :attr:`_version` until it is time to list again (returns) or an
        error; every event moves :attr:`_version`, so a watch that fails resumes there."""
        while not self.stopping.is_set():
            if self._relist_s is not None and time.monotonic() - listed_at >= self._relist_s:
                return
            for kind, obj in self._events(self._version):
                self._version = str((obj.get("metadata") or {}).get("resourceVersion")
                                    or self._version)
                if kind == "BOOKMARK" or kind not in ("ADDED", "MODIFIED", "DELETED"):
                    continue
                uid = self._uid(obj)
                if kind != "DELETED" and self._keep is not None and not self._keep(obj):
                    if uid not in self._kept:
                        continue
                    kind = "DELETED"  # it no longer matches: gone from the caller's view
                if kind == "DELETED":
                    self._kept.discard(uid)
                else:
                    self._kept.add(uid)
                self._deliver(self._on_event, kind, self._cut(obj))
            self._backoff.reset()  # a watch the server ended in time: the link is good

    def _run(self) -> None:
        listed_at = 0.0
        while not self.stopping.is_set():
            try:
                if not self._version:
                    items, self._version = self._list()
                    listed_at = time.monotonic()
                    self._kept = {self._uid(o) for o in items}
                    self._deliver(self._replaced, items)
                    self._backoff.reset()
                    self._forbidden_backoff.reset()
                self._watch(listed_at)
                self._version = ""  # time to list again (relist_s)
            except _Gone:
                self._version = ""
                log.info("watch expired; listing again", extra={"resource": self.name})
            except Exception as exc:
                if self.stopping.is_set():
                    return
                if isinstance(exc, client.ApiException) and exc.status == _GONE:
                    self._version = ""
                    log.info("watch expired; listing again", extra={"resource": self.name})
                    continue
                if (isinstance(exc, client.ApiException) and exc.status == _FORBIDDEN
                        and self._on_forbidden is not None):
                    self._version = ""  # what was followed is lost: list when allowed
                    self._deliver(self._on_forbidden,
                                  f"{exc.status} {exc.reason or 'Forbidden'}")
                    self._forbidden_backoff.wait(self.stopping)
                    continue
                if self._on_error is not None:
                    self._on_error(exc)
                log.warning("list or watch failed; resuming after a pause", extra={
                    "resource": self.name, "error": repr(exc)[:300],
                    "from_version": self._version or None})
                self._backoff.wait(self.stopping)
