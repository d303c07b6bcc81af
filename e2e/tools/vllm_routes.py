"""vLLM's HTTP route table, read from a vLLM wheel: what the gateway must route or refuse.

The gateway routes each model-bearing route of the vLLM release rota supports and answers
every other one with a 404 that names the route and why
(:mod:`controller.gateway.surface`). What vLLM serves is read here from the wheel itself,
never from memory or docs::

    pip download vllm==0.26.0 --no-deps -d "$DIR"
    python -m e2e.tools.vllm_routes "$DIR"/*.whl --write controller/gateway/vllm_routes.json
    python -m e2e.tools.vllm_routes "$DIR"/*.whl --check controller/gateway/vllm_routes.json

The wheel is not imported (it needs CUDA and half of PyPI): its ``vllm/entrypoints``
sources are parsed. A route is a function decorated ``@<router>.<method>("<path>", ...)``
(``get``, ``post``, ``put``, ``delete``, ``patch``, ``websocket``). Its body is read from the
handler's parameters: a pydantic request class (``json``), one declared with ``Form()``
(``form``, a multipart upload), none (``none`` for GET and websockets) or the raw request
(``raw``, when the handler builds its request class itself, e.g. ``X(**await
raw_request.json())``). ``model`` says whether that request class (through its bases and
``A | B`` aliases) declares a ``model`` field: ``yes``, ``no`` or ``unknown`` (no class
found). The committed table (``--write``) is what ``tests/gateway/test_vllm_routes.py``
checks the gateway against; ``--check`` fails (exit 1) when a wheel's table differs from
it, listing the difference.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
import sys
import zipfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Literal

from controller.lease.engines.surfaces import (
    CONTROL_PATHS,
    Control,
    Engine,
    Param,
    Reply,
    Route,
    RouteTable,
    Surface,
)

__all__ = ["SUPPORTED", "Route", "RouteTable", "compare", "compare_surfaces", "extract",
           "extract_surface", "fetch", "main"]

_METHODS = frozenset({"get", "post", "put", "delete", "patch", "websocket"})
_PLAIN = frozenset({"Request", "WebSocket", "Response"})
_WHEEL_VERSION = re.compile(r"^vllm(?:[-_]omni)?-([^-]+)-")
_PACKAGES: dict[Engine, str] = {"vllm": "vllm", "vllm-omni": "vllm_omni"}

Body = Literal["json", "form", "raw", "none"]
HasModel = Literal["yes", "no", "unknown"]

SUPPORTED = ("vllm==0.26.0", "vllm==0.27.1", "vllm==0.28.0", "vllm==0.29.0", "vllm==0.30.0",
             "vllm==0.31.0", "vllm==0.32.0", "vllm==0.33.0", "vllm==0.34.0",
             "vllm-omni==0.30.0")
"""The releases rota supports: the latest patch of each minor PyPI served when their
surfaces were extracted (``controller/lease/engines/vllm_surfaces/``)."""


def _name(node: ast.expr | None) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.rsplit(".", 1)[-1]
    return None


def _names_in(node: ast.expr | None) -> list[str]:
    """Class names a type expression may stand for (``A | B``, ``Union[A, B]``, ...)."""
    if node is None:
        return []
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _names_in(node.left) + _names_in(node.right)
    if isinstance(node, ast.Subscript):
        outer = _name(node.value)
        inner = node.slice
        items = list(inner.elts) if isinstance(inner, ast.Tuple) else [inner]
        if outer == "Annotated":
            return _names_in(items[0])
        if outer in ("Union", "Optional"):
            return [n for item in items for n in _names_in(item)]
        return []
    name = _name(node)
    return [name] if name else []


class _Classes:
    """Every class and type alias of the parsed sources, by name."""

    def __init__(self) -> None:
        self.bases: dict[str, list[str]] = {}
        self.fields: dict[str, set[str]] = {}
        self.aliases: dict[str, list[str]] = {}
        self.field_defs: dict[str, list[ast.AnnAssign]] = {}
        self.literals: dict[str, tuple[str, ...]] = {}

    def add(self, tree: ast.Module) -> None:
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                self.bases.setdefault(node.name, [n for b in node.bases for n in _names_in(b)])
                defs = [item for item in node.body if isinstance(item, ast.AnnAssign)
                        and isinstance(item.target, ast.Name)]
                self.fields.setdefault(node.name, {
                    d.target.id for d in defs if isinstance(d.target, ast.Name)})
                self.field_defs.setdefault(node.name, defs)
            elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(
                    node.targets[0], ast.Name):
                self._alias(node.targets[0].id, node.value)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and (
                    _name(node.annotation) == "TypeAlias"):
                self._alias(node.target.id, node.value)

    def _alias(self, name: str, value: ast.expr | None) -> None:
        """``X = A | B`` or ``X: TypeAlias = Annotated[A | B, ...]``; ``X = Literal[...]``."""
        literal = _literal_values(value)
        if literal:
            self.literals.setdefault(name, literal)
            return
        names = _names_in(value)
        if names and isinstance(value, (ast.BinOp, ast.Subscript)):
            self.aliases.setdefault(name, names)

    def is_request(self, name: str) -> bool:
        """Is ``name`` a request body: a class (or alias of classes) named ``*Request``?"""
        return name.endswith("Request") and (name in self.fields or name in self.aliases)

    def has_field(self, name: str, field: str, seen: set[str] | None = None) -> HasModel:
        seen = seen if seen is not None else set()
        if name in seen:
            return "no"
        seen.add(name)
        if name in self.aliases:
            answers = {self.has_field(n, field, seen) for n in self.aliases[name]}
        elif name in self.fields:
            if field in self.fields[name]:
                return "yes"
            answers = {self.has_field(b, field, seen) for b in self.bases[name]
                       if b in self.fields or b in self.aliases}
        else:
            return "unknown"
        if "yes" in answers:
            return "yes"
        return "unknown" if "unknown" in answers else "no"


def _literal_values(node: ast.expr | None) -> tuple[str, ...]:
    """The string values of ``Literal["a", "b"]``, else ()."""
    if not (isinstance(node, ast.Subscript) and _name(node.value) == "Literal"):
        return ()
    items = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
    return tuple(str(i.value) for i in items if isinstance(i, ast.Constant))


def _decorated_routes(tree: ast.Module) -> Iterator[tuple[str, str, ast.AsyncFunctionDef
                                                           | ast.FunctionDef]]:
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for deco in node.decorator_list:
            if not (isinstance(deco, ast.Call) and isinstance(deco.func, ast.Attribute)
                    and deco.func.attr in _METHODS and deco.args):
                continue
            path = deco.args[0]
            if isinstance(path, ast.Constant) and isinstance(path.value, str):
                yield deco.func.attr.upper(), path.value, node


def _built_class(func: ast.FunctionDef | ast.AsyncFunctionDef, classes: _Classes) -> str | None:
    """A request class the handler builds from the raw body (``X(**body)``,
    ``X.model_validate(body)``)."""
    for node in ast.walk(func):
        if not isinstance(node, ast.Call):
            continue
        target = node.func
        if isinstance(target, ast.Attribute) and target.attr.startswith("model_validate"):
            target = target.value
        name = _name(target)
        if name and name.endswith("Request") and (name in classes.fields
                                                  or name in classes.aliases):
            return name
    return None


def _body(method: str, path: str, func: ast.FunctionDef | ast.AsyncFunctionDef,
          classes: _Classes) -> tuple[Body, str | None]:
    params = set(re.findall(r"{(\w+)", path))
    for arg in func.args.args + func.args.kwonlyargs:
        if arg.arg in params or arg.annotation is None:
            continue
        names = [n for n in _names_in(arg.annotation) if n not in _PLAIN]
        if not (names and classes.is_request(names[0])):
            continue  # a query parameter (``stream: bool``, an enum, ...)
        form = "Form(" in ast.unparse(arg.annotation)
        return ("form" if form else "json"), names[0]
    if method in ("GET", "WEBSOCKET"):
        return "none", None
    built = _built_class(func, classes)
    return ("json" if built else "raw"), built


def _sources(wheel: zipfile.ZipFile, package: str = "vllm"
             ) -> Iterator[tuple[str, ast.Module]]:
    """The parsed entry points of ``package``, and every other module of it that defines a
    ``Literal`` alias (``PauseMode`` lives in ``vllm/v1/engine``)."""
    for name in sorted(wheel.namelist()):
        if not (name.startswith(f"{package}/") and name.endswith(".py")):
            continue
        text = wheel.read(name)
        if name.startswith(f"{package}/entrypoints/") or b"= Literal[" in text \
                or b"class OmniACK" in text:
            try:
                yield name, ast.parse(wheel.read(name).decode("utf-8"), filename=name)
            except (SyntaxError, UnicodeDecodeError):
                continue


def _version(wheel_path: Path, wheel: zipfile.ZipFile) -> str:
    found = _WHEEL_VERSION.match(wheel_path.name)
    if found:
        return found.group(1)
    for name in wheel.namelist():
        if name.endswith(".dist-info/METADATA"):
            for line in wheel.read(name).decode("utf-8", "replace").splitlines():
                if line.startswith("Version:"):
                    return line.split(":", 1)[1].strip()
    return "unknown"


def _engine(wheel_path: Path) -> Engine:
    return "vllm-omni" if wheel_path.name.startswith(("vllm_omni-", "vllm-omni-")) else "vllm"


def extract(wheel_path: Path) -> RouteTable:
    """The route table of the vLLM wheel at ``wheel_path``.

    Raises:
        ValueError: the file is not a wheel with vLLM's entry points.
    """
    return extract_surface(wheel_path).table()


def extract_surface(wheel_path: Path) -> Surface:
    """The route table and the control handlers of the vLLM (or vLLM-Omni) wheel at
    ``wheel_path``. vLLM-Omni's table is its own routes (it serves vLLM's too, from the
    vLLM it runs on).

    Raises:
        ValueError: the file is not a wheel with vLLM's entry points.
    """
    engine = _engine(wheel_path)
    package = _PACKAGES[engine]
    try:
        wheel = zipfile.ZipFile(wheel_path)
    except (OSError, zipfile.BadZipFile) as exc:
        raise ValueError(f"{wheel_path}: not a wheel ({exc})") from None
    with wheel:
        classes = _Classes()
        trees = list(_sources(wheel, package))
        for _, tree in trees:
            classes.add(tree)
        routes: dict[tuple[str, str], Route] = {}
        controls: dict[tuple[str, str], Control] = {}
        for name, tree in trees:
            if not name.startswith(f"{package}/entrypoints/"):
                continue
            for method, path, func in _decorated_routes(tree):
                body, cls = _body(method, path, func, classes)
                model: HasModel = "no" if body == "none" else (
                    classes.has_field(cls, "model") if cls else "unknown")
                route = Route(method=method, path=path, body=body, request_class=cls,
                              model=model, source=f"{name}:{func.name}")
                routes.setdefault(route.key, route)
                if path in CONTROL_PATHS:
                    controls.setdefault(route.key, Control(
                        method=method, path=path, params=_params(path, func, cls, classes),
                        replies=_replies(func), source=route.source))
        version = _version(wheel_path, wheel)
    if not routes:
        raise ValueError(f"{wheel_path}: no routes under {package}/entrypoints")
    return Surface(engine=engine, version=version,
                   routes=tuple(sorted(routes.values(), key=lambda r: (r.path, r.method))),
                   controls=tuple(sorted(controls.values(), key=lambda c: (c.path, c.method))),
                   ack_fields=tuple(sorted(classes.fields.get("OmniACK", ()))))


# -- the control handlers: their parameters and answers -----------------------------------

_BOUNDS = ("ge", "gt", "le", "lt")


def _query_call(node: ast.expr | None) -> ast.Call | None:
    """``Query(...)`` (a default or inside ``Annotated``), else None."""
    if isinstance(node, ast.Call) and _name(node.func) == "Query":
        return node
    return None


def _annotated(annotation: ast.expr) -> tuple[ast.expr, ast.Call | None]:
    """The type of ``Annotated[T, Query(...)]`` and its Query call; else (annotation, None)."""
    if isinstance(annotation, ast.Subscript) and _name(annotation.value) == "Annotated" \
            and isinstance(annotation.slice, ast.Tuple):
        first, *rest = annotation.slice.elts
        return first, next((q for q in map(_query_call, rest) if q is not None), None)
    return annotation, None


def _query_param(arg: ast.arg, default: ast.expr | None, classes: _Classes) -> Param:
    assert arg.annotation is not None
    kind, query = _annotated(arg.annotation)
    query = query or _query_call(default)
    if _query_call(default) is not None:
        call = _query_call(default)
        assert call is not None
        default = call.args[0] if call.args else next(
            (k.value for k in call.keywords if k.arg == "default"), None)
    bounds = " ".join(f"{k.arg}={ast.unparse(k.value)}" for k in (query.keywords if query
                                                                   else ())
                      if k.arg in _BOUNDS)
    type_name = ast.unparse(kind)
    return Param(name=arg.arg, where="query", type=type_name,
                 default=None if default is None else ast.unparse(default),
                 bounds=bounds or None,
                 values=_literal_values(kind) or classes.literals.get(type_name, ()))


def _body_params(cls: str, classes: _Classes) -> list[Param]:
    return [Param(name=d.target.id, where="body", type=ast.unparse(d.annotation),
                  default=None if d.value is None else ast.unparse(d.value))
            for d in classes.field_defs.get(cls, []) if isinstance(d.target, ast.Name)]


def _raw_params(func: ast.FunctionDef | ast.AsyncFunctionDef) -> list[Param]:
    """``request.query_params.get("level", "1")``, ``.getlist("tags")`` and
    ``body.get("method")`` of a body read with ``await request.json()``."""
    bodies = {t.id for node in ast.walk(func) if isinstance(node, ast.Assign)
              and isinstance(node.value, ast.Await) and isinstance(node.value.value, ast.Call)
              and _name(node.value.value.func) == "json"
              for t in node.targets if isinstance(t, ast.Name)}
    found: list[Param] = []
    for node in ast.walk(func):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("get", "getlist") and node.args
                and isinstance(node.args[0], ast.Constant)):
            continue
        owner = node.func.value
        name = str(node.args[0].value)
        default = ast.unparse(node.args[1]) if len(node.args) > 1 else None
        if _name(owner) == "query_params":
            found.append(Param(name=name, where="query", default=default,
                               type="list[str]" if node.func.attr == "getlist" else "str"))
        elif isinstance(owner, ast.Name) and owner.id in bodies:
            found.append(Param(name=name, where="body", type="json", default=default))
    return found


def _params(path: str, func: ast.FunctionDef | ast.AsyncFunctionDef, cls: str | None,
            classes: _Classes) -> tuple[Param, ...]:
    found: list[Param] = _body_params(cls, classes) if cls else []
    args = func.args.args + func.args.kwonlyargs
    defaults: list[ast.expr | None] = [None] * (len(func.args.args) - len(
        func.args.defaults)) + list(func.args.defaults) + list(func.args.kw_defaults)
    in_path = set(re.findall(r"{(\w+)", path))
    for arg, default in zip(args, defaults, strict=True):
        if arg.annotation is None or arg.arg in in_path:
            continue
        names = _names_in(arg.annotation)
        if any(n in _PLAIN for n in names) or (names and names[0] == cls):
            continue
        found.append(_query_param(arg, default, classes))
    found += _raw_params(func)
    return tuple(found)


def _value_forms(node: ast.expr) -> tuple[str, ...]:
    """What a reply field may hold: JSON constants, or the expression as written."""
    if isinstance(node, ast.IfExp):
        return _value_forms(node.body) + _value_forms(node.orelse)
    if isinstance(node, ast.Constant):
        return (json.dumps(node.value),)
    return (ast.unparse(node),)


def _dict_reply(node: ast.Dict) -> Reply:
    fields = {str(k.value): _value_forms(v) for k, v in zip(node.keys, node.values, strict=True)
              if isinstance(k, ast.Constant)}
    return Reply(body="json", fields=fields)


def _is_success(call: ast.Call) -> bool:
    status = next((k.value for k in call.keywords if k.arg == "status_code"), None)
    return status is None or ast.unparse(status) in ("200", "HTTPStatus.OK.value",
                                                     "HTTPStatus.OK")


def _replies(func: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[Reply, ...]:
    """The success answers of a handler: ``Response(status_code=200)`` (empty),
    ``JSONResponse(content={...})`` or a returned dict."""
    assigned = {t.id: node.value for node in ast.walk(func) if isinstance(node, ast.Assign)
                for t in node.targets if isinstance(t, ast.Name)}
    replies: list[Reply] = []
    for node in ast.walk(func):
        if not (isinstance(node, ast.Return) and node.value is not None):
            continue
        value = node.value
        if isinstance(value, ast.Dict):
            replies.append(_dict_reply(value))
        elif isinstance(value, ast.Call) and _is_success(value):
            kind = _name(value.func)
            content = next((k.value for k in value.keywords if k.arg == "content"),
                           value.args[0] if value.args else None)
            if isinstance(content, ast.Name):
                content = assigned.get(content.id, content)
            if kind == "Response" and content is None:
                replies.append(Reply(body="empty"))
            elif kind == "JSONResponse" and isinstance(content, ast.Dict):
                replies.append(_dict_reply(content))
    unique: list[Reply] = []
    for reply in replies:
        if reply not in unique:
            unique.append(reply)
    return tuple(unique)


def load(path: Path) -> RouteTable:
    """A committed table."""
    return RouteTable.model_validate_json(path.read_text(encoding="utf-8"))


def render(table: RouteTable | Surface) -> str:
    return json.dumps(table.model_dump(mode="json"), indent=1) + "\n"


def surface_file(surface: Surface) -> str:
    """The file name of a surface under ``vllm_surfaces/``: ``<engine>-<version>.json``."""
    return f"{surface.engine}-{surface.version}.json"


def compare(committed: RouteTable, found: RouteTable) -> list[str]:
    """What differs between two tables, one line each (empty: the same)."""
    lines = []
    if committed.vllm != found.vllm:
        lines.append(f"version: committed {committed.vllm}, wheel {found.vllm}")
    old, new = committed.by_key(), found.by_key()
    for key in sorted(new.keys() - old.keys()):
        lines.append(f"new route: {' '.join(key)} ({new[key].source})")
    for key in sorted(old.keys() - new.keys()):
        lines.append(f"route gone: {' '.join(key)}")
    for key in sorted(old.keys() & new.keys()):
        if old[key] != new[key]:
            lines.append(f"route changed: {' '.join(key)}: {old[key].model_dump()} -> "
                         f"{new[key].model_dump()}")
    return lines


def compare_surfaces(committed: Surface, found: Surface) -> list[str]:
    """What differs between two surfaces: routes, then control handlers."""
    lines = compare(committed.table(), found.table())
    old = {(c.method, c.path): c for c in committed.controls}
    new = {(c.method, c.path): c for c in found.controls}
    for key in sorted(old.keys() | new.keys()):
        if old.get(key) != new.get(key):
            lines.append(f"control changed: {' '.join(key)}: "
                         f"{old[key].model_dump() if key in old else None} -> "
                         f"{new[key].model_dump() if key in new else None}")
    if committed.ack_fields != found.ack_fields:
        lines.append(f"OmniACK fields: {committed.ack_fields} -> {found.ack_fields}")
    return lines


def fetch(spec: str, cache: Path) -> Path:
    """The wheel of ``spec`` (``vllm==0.31.0``) in ``cache``, downloaded with pip when it is
    not there yet (``--no-deps``: only the wheel; never imported)."""
    name, _, version = spec.partition("==")
    stem = name.replace("-", "_")
    cached = sorted(cache.glob(f"{stem}-{version}-*.whl"))
    if cached:
        return cached[0]
    cache.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", spec, "--no-deps",
                    "--only-binary", ":all:", "-d", str(cache)], check=True)
    cached = sorted(cache.glob(f"{stem}-{version}-*.whl"))
    if not cached:
        raise ValueError(f"pip download {spec} left no wheel in {cache}")
    return cached[0]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m e2e.tools.vllm_routes",
        description="Read vLLM's HTTP route table (and its control handlers) from vLLM "
                    "wheels (not imported: their sources are parsed) and write it, compare "
                    "it with a committed table, or print it.")
    parser.add_argument("wheel", type=Path, nargs="*", help="vLLM wheel files (pip download "
                        "vllm==<version> --no-deps -d <dir>)")
    parser.add_argument("--fetch", action="append", default=[], metavar="SPEC",
                        help="download SPEC (vllm==0.31.0; repeatable; 'supported': every "
                        "release rota supports) into --cache and read it too")
    parser.add_argument("--cache", type=Path, default=Path("~/.cache/rota/vllm-wheels"),
                        help="where --fetch keeps wheels (default: %(default)s)")
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--write", type=Path, metavar="TABLE",
                        help="write the (one) wheel's route table as JSON to TABLE")
    action.add_argument("--check", type=Path, metavar="TABLE",
                        help="compare with the committed TABLE; exit 1 when they differ")
    action.add_argument("--write-surfaces", type=Path, metavar="DIR",
                        help="write each wheel's surface to DIR/<engine>-<version>.json")
    action.add_argument("--check-surfaces", type=Path, metavar="DIR",
                        help="compare each wheel's surface with DIR's; exit 1 on a difference")
    return parser


def _print(routes: Iterable[Route]) -> None:
    for route in routes:
        print(f"{route.method:9} {route.path:42} body={route.body:4} model={route.model:7} "
              f"{route.request_class or '-'}")


def _wheels(args: argparse.Namespace) -> list[Path]:
    specs = [s for spec in args.fetch for s in (SUPPORTED if spec == "supported" else (spec,))]
    cache = args.cache.expanduser()
    return list(args.wheel) + [fetch(spec, cache) for spec in specs]


def _surfaces(wheels: Sequence[Path], write: Path | None, check: Path | None) -> int:
    failed = 0
    for wheel in wheels:
        surface = extract_surface(wheel)
        name = surface_file(surface)
        if write is not None:
            (write / name).write_text(render(surface), encoding="utf-8")
            print(f"{name}: {len(surface.routes)} routes, {len(surface.controls)} controls")
            continue
        assert check is not None
        committed = check / name
        if not committed.exists():
            print(f"{name}: not committed in {check}")
            failed = 1
            continue
        differences = compare_surfaces(Surface.model_validate_json(
            committed.read_text(encoding="utf-8")), surface)
        for line in differences:
            print(f"{name}: {line}")
        failed |= bool(differences)
        if not differences:
            print(f"{name} matches its wheel")
    return failed


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        wheels = _wheels(args)
        if not wheels:
            print("error: no wheel given (a path, or --fetch)", file=sys.stderr)
            return 2
        if args.write_surfaces is not None or args.check_surfaces is not None:
            return _surfaces(wheels, args.write_surfaces, args.check_surfaces)
        table = extract(wheels[0])
    except (ValueError, subprocess.CalledProcessError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.write is not None:
        args.write.write_text(render(table), encoding="utf-8")
        print(f"{len(table.routes)} routes of vLLM {table.vllm} written to {args.write}")
        return 0
    if args.check is not None:
        differences = compare(load(args.check), table)
        for line in differences:
            print(line)
        if differences:
            return 1
        print(f"{args.check} matches vLLM {table.vllm} ({len(table.routes)} routes)")
        return 0
    _print(table.routes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
