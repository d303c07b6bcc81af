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
   (:class:`rota.kit.aio.Backoff`), as client-go's reflector does: an API server restart
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

Objects are decoded one by one, each nesting at most :data:`MAX_DEPTH` levels. Anyone who
may create a ResourceClaim can nest its opaque parameters a thousand levels deep in 2 KB;
decoding a whole page at once made one such claim fail every list (and a watch event
replay for ever), so one object stopped every stream that read it. Now an object that
cannot be decoded, or that ``keep`` or ``cut`` cannot read, is skipped and reported (a
warning with its namespace, name and uid where they can be recovered, once per version,
and ``on_undecodable``): it is as absent, and one the caller held is handed on as
DELETED. Only an answer whose envelope cannot be decoded fails (and is retried).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from kubernetes import client
from kubernetes.watch.watch import iter_resp_lines

from rota.kit.aio import Backoff
from rota.kit.errors import KitError

__all__ = ["MAX_DEPTH", "ListWatch", "Obj", "Undecodable", "decode", "decode_object",
           "decode_page", "report_fields"]

log = logging.getLogger(__name__)

Obj = dict[str, Any]
_GONE = 410
_FORBIDDEN = 403
_REPORTED_MAX = 10_000


MAX_DEPTH = 100
"""How deeply one API object may nest (objects and arrays) to be decoded. Kubernetes'
typed fields nest about a dozen levels; free-form ones (a claim's opaque parameters, a
device's status data) may nest as deep as their size allows, and the API server stores
thousands of levels. Python's decoder, and everything that walks what it returns, recurse
(about 1,000 levels end in RecursionError, fewer on a deeper stack): the bound keeps every
object that is handed on far from that."""

_META_KEYS = ("namespace", "name", "uid", "resourceVersion")
_STRING = re.compile(rb'"[^"\\]*+(?:\\.[^"\\]*+)*+"', re.DOTALL)
_TOKEN = re.compile(rb'"[^"\\]*+(?:\\.[^"\\]*+)*+"|[\[\]{},:]', re.DOTALL)
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
_STEP = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")


class Undecodable(KitError):
    """An API object (or a whole answer) that is not decoded: not JSON, not an object,
    nested deeper than :data:`MAX_DEPTH`, or of a shape its reader cannot read.

    ``meta`` is what could be recovered of its metadata (``namespace``, ``name``, ``uid``,
    ``resourceVersion``), so that it can be reported and, in a watch, passed.
    ``malformed``: the text is no JSON at all (a broken answer, never an object the API
    server stored: a list page holding one fails as a whole)."""

    def __init__(self, reason: str, meta: Obj | None = None, *,
                 malformed: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.meta: Obj = dict(meta or {})
        self.malformed = malformed


def nesting(data: bytes) -> int:
    """How deeply the JSON ``data`` nests, without decoding it: the brackets outside
    strings (in UTF-8 no other character holds their bytes), counted in C."""
    brackets = _STRING.sub(b"", data).translate(None, _NOT_BRACKET).translate(_STEP)
    return max(itertools.accumulate(memoryview(brackets).cast("b")), default=0)


def decode(data: bytes | str, *, depth: int = MAX_DEPTH) -> Any:
    """``data`` decoded, when it nests at most ``depth`` levels.

    Raises:
        Undecodable: it nests deeper, it is not JSON, or it holds what Python does not
            decode (a number of more than 4,300 digits, bytes that are not UTF-8): nothing
            else escapes."""
    try:
        raw = data.encode() if isinstance(data, str) else bytes(data)
        if nesting(raw) > depth:
            raise Undecodable(f"nested deeper than {depth} levels")
        return json.loads(raw)
    except Undecodable:
        raise
    except json.JSONDecodeError as exc:
        raise Undecodable(f"not JSON: {exc}"[:200], malformed=True) from None
    except (ValueError, RecursionError) as exc:  # UnicodeError, int digits limit
        raise Undecodable(f"cannot be decoded: {exc}"[:200]) from None


def _members(data: bytes) -> Iterator[tuple[str | None, bytes]]:
    """The members of the JSON object or array ``data`` holds, undecoded: each as its key
    (None in an array) and its text. One pass over the tokens, at any depth.

    Raises:
        Undecodable: ``data`` holds no object or array, or it does not end."""
    depth = 0
    in_object = False
    key: str | None = None
    start = 0
    for token in _TOKEN.finditer(data):
        text = token.group()
        if text in (b"{", b"["):
            depth += 1
            if depth == 1:
                in_object, start = text == b"{", token.end()
            continue
        if depth == 0:
            break  # something before the first bracket
        if text in (b"}", b"]"):
            depth -= 1
            if depth == 0:
                if data[start:token.start()].strip():
                    yield key, data[start:token.start()]
                return
        elif depth > 1:
            continue
        elif text == b",":
            yield key, data[start:token.start()]
            key, start = None, token.end()
        elif text == b":":
            start = token.end()
        elif in_object and key is None:
            key = str(decode(text))
    raise Undecodable("not a whole JSON object or array")


def report_fields(bad: Undecodable) -> dict[str, str | None]:
    """The log fields that say which object was skipped and why (``name`` is taken by
    the log record itself: the object's is ``object``)."""
    return {"reason": bad.reason, "namespace": bad.meta.get("namespace"),
            "object": bad.meta.get("name"), "uid": bad.meta.get("uid"),
            "resource_version": bad.meta.get("resourceVersion")}


def _meta_of(obj: Any) -> Obj:
    """The identity of a decoded object, as far as it has one (for reports)."""
    meta = obj.get("metadata") if isinstance(obj, dict) else None
    if not isinstance(meta, dict):
        return {}
    return {k: meta[k] for k in _META_KEYS if isinstance(meta.get(k), str)}


def _recover_meta(data: bytes) -> Obj:
    """What can be read of an undecodable object's metadata (its other members may nest
    at any depth: only ``metadata`` is decoded)."""
    try:
        for key, text in _members(data):
            if key == "metadata":
                return _meta_of({"metadata": decode(text)})
    except Undecodable:
        pass
    return {}


def decode_object(data: bytes | str) -> Obj:
    """One API object (a JSON object nesting at most :data:`MAX_DEPTH` levels).

    Raises:
        Undecodable: with what could be recovered of its metadata."""
    raw = data.encode(errors="replace") if isinstance(data, str) else bytes(data)
    try:
        obj = decode(raw)
    except Undecodable as exc:
        raise Undecodable(exc.reason, _recover_meta(raw), malformed=exc.malformed) from None
    if not isinstance(obj, dict):
        raise Undecodable(f"not an object but {type(obj).__name__}")
    return obj


class Page(NamedTuple):
    """One list answer: its items (each decoded, or why not) and its list metadata."""

    items: list[Obj | Undecodable]
    meta: Obj


def decode_page(data: bytes) -> Page:
    """A list answer, its items decoded one by one: one that cannot be decoded is an
    :class:`Undecodable` among them, never a failed page.

    Raises:
        Undecodable: the answer's envelope (all but its items) cannot be decoded, or some
            of it is no JSON at all (its items cannot be told apart with certainty)."""
    try:  # the usual answer: decoded at once
        body = decode(data, depth=MAX_DEPTH + 2)
        if isinstance(body, dict) and isinstance(body.get("items") or [], list):
            items = [o if isinstance(o, dict) else Undecodable(
                f"not an object but {type(o).__name__}") for o in body.get("items") or []]
            return Page(items, _as_meta(body.get("metadata")))
    except Undecodable:
        pass
    return _decode_page_by_item(data)


def _as_meta(meta: Any) -> Obj:
    if meta is not None and not isinstance(meta, dict):
        raise Undecodable("the list's metadata is not an object")
    return meta or {}


def _decode_page_by_item(data: bytes) -> Page:
    if not data.lstrip().startswith(b"{"):
        raise Undecodable("a list answer that is not an object")
    items: list[Obj | Undecodable] = []
    meta: Obj = {}
    for key, text in _members(data):
        if key == "items":
            for _, item in _members(text) if text.strip() != b"null" else ():
                try:
                    items.append(decode_object(item))
                except Undecodable as exc:
                    if exc.malformed:
                        raise Undecodable("the list answer is not JSON", malformed=True) from exc
                    items.append(exc)
        elif key == "metadata":
            meta = _as_meta(decode(text))
    return Page(items, meta)


class _Event(NamedTuple):
    """One line of a watch: its type and object, or why it cannot be read."""

    kind: str
    obj: Obj
    error: Undecodable | None = None


def decode_event(line: bytes | str) -> _Event:
    """One watch event; an undecodable one carries its :class:`Undecodable` (and the
    recovered metadata of its object, so that the watch can go past it)."""
    raw = line.encode(errors="replace") if isinstance(line, str) else bytes(line)
    try:
        event = decode(raw, depth=MAX_DEPTH + 1)
        if not isinstance(event, dict) or not isinstance(event.get("object") or {}, dict):
            raise Undecodable("not a watch event")
        return _Event(str(event.get("type")), dict(event.get("object") or {}))
    except Undecodable as exc:
        kind, error = "", exc
        try:
            for key, text in _members(raw):
                if key == "type":
                    kind = str(decode(text))
                elif key == "object":
                    decode_object(text)
        except Undecodable as bad:
            error = bad if bad.meta else error
        return _Event(kind, {"metadata": error.meta}, error)


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
        on_undecodable: told (in the thread) of each object skipped because it could not
            be decoded or read, every time a list or watch brings it (a metric).
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
                 forbidden_backoff: Backoff | None = None,
                 on_undecodable: Callable[[Undecodable], None] | None = None) -> None:
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
        self._on_undecodable = on_undecodable
        self._reported: set[tuple[str, ...]] = set()
        """Undecodable objects already logged (by identity and version): logged once."""
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
        meta = _meta_of(obj)
        return str(meta.get("uid") or f"{meta.get('namespace')}/{meta.get('name')}")

    # -- one object --------------------------------------------------------------------

    def _sift(self, obj: Obj) -> Obj | None:
        """``obj`` as handed on (cut), or None when ``keep`` drops it.

        Raises:
            Undecodable: ``keep`` or ``cut`` cannot read it (a shape they do not expect:
                nothing one object holds may stop the stream)."""
        try:
            if self._keep is not None and not self._keep(obj):
                return None
            return self._cut(obj)
        except Exception as exc:
            raise Undecodable(f"unreadable: {exc!r}"[:200], _meta_of(obj)) from exc

    def _gone(self, obj: Obj) -> Obj:
        """What is handed on as DELETED for ``obj``: its cut, or its identity alone."""
        try:
            return self._cut(obj)
        except Exception:
            return {"metadata": _meta_of(obj)}

    def _skip(self, bad: Undecodable) -> None:
        """Report an object that is skipped: counted each time, logged once a version."""
        if self._on_undecodable is not None:
            self._on_undecodable(bad)
        key = (bad.reason, *(str(bad.meta.get(k, "")) for k in _META_KEYS))
        if key in self._reported:
            return
        if len(self._reported) >= _REPORTED_MAX:
            self._reported.clear()
        self._reported.add(key)
        log.warning("skipped an object that cannot be decoded or read",
                    extra={"resource": self.name, **report_fields(bad)})

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
            page = decode_page(resp.data)
            self.lists += 1
            items.extend(self._take(page.items))
            token = page.meta.get("continue")
            if not token:
                return items, str(page.meta.get("resourceVersion") or "")

    def _take(self, page: list[Obj | Undecodable]) -> Iterator[Obj]:
        """What is handed on of one page: the kept objects, cut; the others reported."""
        for item in page:
            try:
                if isinstance(item, Undecodable):
                    raise item
                handed = self._sift(item)
            except Undecodable as bad:
                self._skip(bad)
                continue
            if handed is not None:
                yield handed

    def _events(self, version: str) -> Iterator[_Event]:
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
                event = decode_event(line)
                kind, obj = event.kind, event.obj
                if kind == "ERROR" and event.error is None:
                    if obj.get("code") == _GONE:
                        raise _Gone(str(obj.get("message", "")))
                    raise client.ApiException(status=obj.get("code"),
                                              reason=str(obj.get("message", "")))
                yield event
        finally:
            resp.close()
            resp.release_conn()

    def _watch(self, listed_at: float) -> None:
        """Watch from :attr:`_version` until it is time to list again (returns) or an
        error; every event moves :attr:`_version`, so a watch that fails resumes there."""
        while not self.stopping.is_set():
            if self._relist_s is not None and time.monotonic() - listed_at >= self._relist_s:
                return
            for event in self._events(self._version):
                self._version = str(_meta_of(event.obj).get("resourceVersion")
                                    or self._version)
                if event.kind in ("ADDED", "MODIFIED", "DELETED"):
                    self._hand_on(event)
                elif event.error is not None:
                    self._skip(event.error)
            self._backoff.reset()  # a watch the server ended in time: the link is good

    def _hand_over(self, items: list[Obj]) -> None:
        """A whole list, which replaces the caller's state."""
        self._kept = {self._uid(o) for o in items}
        self._deliver(self._replaced, items)

    def _hand_on(self, event: _Event) -> None:
        """One change, as the caller sees it: an object that stops matching ``keep``, or
        that can no longer be decoded or read, is gone from its view (DELETED)."""
        kind, obj = event.kind, event.obj
        uid = self._uid(obj)
        handed: Obj | None = None
        try:
            if event.error is not None:
                raise event.error
            if kind != "DELETED":
                handed = self._sift(obj)
        except Undecodable as bad:
            self._skip(bad)
        if handed is None:
            if (kind != "DELETED" or event.error is not None) and uid not in self._kept:
                return  # never handed on: nothing to take back
            self._kept.discard(uid)
            self._deliver(self._on_event, "DELETED", self._gone(obj))
            return
        self._kept.add(uid)
        self._deliver(self._on_event, kind, handed)

    def _run(self) -> None:
        listed_at = 0.0
        while not self.stopping.is_set():
            try:
                if not self._version:
                    items, self._version = self._list()
                    listed_at = time.monotonic()
                    self._hand_over(items)
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
