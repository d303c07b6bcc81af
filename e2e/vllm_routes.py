"""vLLM's HTTP route table, read from a vLLM wheel: what the gateway must route or refuse.

The gateway routes each model-bearing route of the vLLM release rota supports and answers
every other one with a 404 that names the route and why
(:mod:`controller.gateway.surface`). What vLLM serves is read here from the wheel itself,
never from memory or docs::

    pip download vllm==0.26.0 --no-deps -d "$DIR"
    python -m e2e.vllm_routes "$DIR"/vllm-0.26.0-*.whl --write controller/gateway/vllm_routes.json
    python -m e2e.vllm_routes "$DIR"/vllm-0.26.0-*.whl --check controller/gateway/vllm_routes.json

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
import sys
import zipfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

__all__ = ["Route", "RouteTable", "compare", "extract", "main"]

_METHODS = frozenset({"get", "post", "put", "delete", "patch", "websocket"})
_PLAIN = frozenset({"Request", "WebSocket", "Response"})
_WHEEL_VERSION = re.compile(r"^vllm-([^-]+)-")

Body = Literal["json", "form", "raw", "none"]
HasModel = Literal["yes", "no", "unknown"]


class Route(BaseModel):
    """One route of vLLM's server."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: str
    """``GET``, ``POST``, ... or ``WEBSOCKET``."""
    path: str
    """As declared, path parameters included (``/v1/responses/{response_id}``)."""
    body: Body
    request_class: str | None
    model: HasModel
    source: str
    """``<file inside the wheel>:<handler>``."""

    @property
    def key(self) -> tuple[str, str]:
        return self.method, self.path


class RouteTable(BaseModel):
    """Every route of one vLLM release."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    vllm: str
    routes: tuple[Route, ...]

    def by_key(self) -> dict[tuple[str, str], Route]:
        return {route.key: route for route in self.routes}


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

    def add(self, tree: ast.Module) -> None:
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                self.bases.setdefault(node.name, [n for b in node.bases for n in _names_in(b)])
                self.fields.setdefault(node.name, {
                    item.target.id for item in node.body
                    if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)})
            elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(
                    node.targets[0], ast.Name):
                self._alias(node.targets[0].id, node.value)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and (
                    _name(node.annotation) == "TypeAlias"):
                self._alias(node.target.id, node.value)

    def _alias(self, name: str, value: ast.expr | None) -> None:
        """``X = A | B`` or ``X: TypeAlias = Annotated[A | B, ...]``."""
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


def _sources(wheel: zipfile.ZipFile) -> Iterator[tuple[str, ast.Module]]:
    for name in sorted(wheel.namelist()):
        if name.startswith("vllm/entrypoints/") and name.endswith(".py"):
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


def extract(wheel_path: Path) -> RouteTable:
    """The route table of the vLLM wheel at ``wheel_path``.

    Raises:
        ValueError: the file is not a wheel with vLLM's entry points.
    """
    try:
        wheel = zipfile.ZipFile(wheel_path)
    except (OSError, zipfile.BadZipFile) as exc:
        raise ValueError(f"{wheel_path}: not a wheel ({exc})") from None
    with wheel:
        classes = _Classes()
        trees = list(_sources(wheel))
        for _, tree in trees:
            classes.add(tree)
        routes: dict[tuple[str, str], Route] = {}
        for name, tree in trees:
            if not name.startswith("vllm/entrypoints/"):
                continue
            for method, path, func in _decorated_routes(tree):
                body, cls = _body(method, path, func, classes)
                model: HasModel = "no" if body == "none" else (
                    classes.has_field(cls, "model") if cls else "unknown")
                route = Route(method=method, path=path, body=body, request_class=cls,
                              model=model, source=f"{name}:{func.name}")
                routes.setdefault(route.key, route)
        version = _version(wheel_path, wheel)
    if not routes:
        raise ValueError(f"{wheel_path}: no routes under vllm/entrypoints")
    return RouteTable(vllm=version, routes=tuple(sorted(routes.values(),
                                                        key=lambda r: (r.path, r.method))))


def load(path: Path) -> RouteTable:
    """A committed table."""
    return RouteTable.model_validate_json(path.read_text(encoding="utf-8"))


def render(table: RouteTable) -> str:
    return json.dumps(table.model_dump(mode="json"), indent=1) + "\n"


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


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m e2e.vllm_routes",
        description="Read vLLM's HTTP route table from a vLLM wheel (not imported: its "
                    "sources are parsed) and write it, compare it with a committed table, or "
                    "print it.")
    parser.add_argument("wheel", type=Path, help="a vLLM wheel file (pip download "
                        "vllm==<version> --no-deps -d <dir>)")
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--write", type=Path, metavar="TABLE",
                        help="write the table as JSON to TABLE")
    action.add_argument("--check", type=Path, metavar="TABLE",
                        help="compare with the committed TABLE; exit 1 when they differ")
    return parser


def _print(routes: Iterable[Route]) -> None:
    for route in routes:
        print(f"{route.method:9} {route.path:42} body={route.body:4} model={route.model:7} "
              f"{route.request_class or '-'}")


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        table = extract(args.wheel)
    except ValueError as exc:
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
