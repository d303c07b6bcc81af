"""``python -m e2e.release.chart_readme``: write ``charts/rota/README.md`` from the chart's values.

The README is what ``helm show readme`` prints: the chart's description, how to install it,
and one table row per value, in ``values.yaml``'s order, with its type (from
``values.schema.json``, the checked source of types), its default (from ``values.yaml``)
and its description (the comment block right above the key in ``values.yaml``). A comment
above a section (a key holding a mapping) describes the section and is a row of its own.
A commented-out example right under a key whose default is empty (``models: {}`` then
``#  org/llama-70b: [prod]``) belongs to that key, not to the key after it: the
description is what a key's own comments say, wherever they stand.
``--check`` exits 1, writing nothing, when the README is not what the values make
(``tests/chart/test_chart_readme.py`` runs it in CI); ``make chart-readme`` writes it.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "rota"
KEY_LINE = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z_][A-Za-z0-9_.-]*):(?:\s|$)")
EMPTY_DEFAULT = re.compile(r":\s*(\{\}|\[\])\s*(#.*)?$")
"""A key line whose default is an empty mapping or list: comments right under it show
what goes in it."""


@dataclass(frozen=True)
class Value:
    """One key of values.yaml: its dotted path, comment, default and type."""

    path: tuple[str, ...]
    comment: str
    default: Any
    type: str

    @property
    def section(self) -> bool:
        return isinstance(self.default, dict) and bool(self.default)


@dataclass
class _Described:
    """A key's comment lines while the file is read: the block above it and the
    commented-out example under it."""

    path: tuple[str, ...]
    indent: int
    above: list[str]
    example: list[str] = field(default_factory=list)

    def takes(self, line: str) -> bool:
        """A comment line is part of this key's example when it is commented-out YAML
        (``#`` then two spaces or more) at the key's own indentation or deeper; a comment
        less indented, or prose, begins the next key's description."""
        column = len(line) - len(line.lstrip())
        return column >= self.indent and line.lstrip().startswith("#  ")

    def text(self) -> str:
        shown = "\n".join(f"`{line.strip()}`" for line in self.example if line.strip())
        parts = ["\n".join(self.above)] if self.above else []
        return "\n".join([*parts, f"Example:\n{shown}"] if shown else parts)


def _comments_and_order(text: str) -> list[tuple[tuple[str, ...], str]]:
    """Every mapping key's path, in file order, with its comment: the block above it, and
    the commented-out example right under it when its default is empty."""
    stack: list[tuple[int, str]] = []
    comment: list[str] = []
    found: list[_Described] = []
    example_of: _Described | None = None  # the key just above, when its default is empty
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped:
            comment, example_of = [], None
            continue
        if stripped.startswith("#"):
            body = stripped[1:].removeprefix(" ") if stripped != "#" else ""
            if example_of is not None and example_of.takes(line):
                example_of.example.append(body)
            else:
                example_of = None
                comment.append(body)
            continue
        example_of = None
        match = KEY_LINE.match(line)
        if match is None or stripped.startswith("-"):
            comment = []
            continue
        indent = len(match.group("indent"))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, match.group("key")))
        found.append(_Described(tuple(key for _, key in stack), indent, comment))
        comment = []
        if EMPTY_DEFAULT.search(line):
            example_of = found[-1]
    return [(described.path, described.text()) for described in found]


def _resolved(schema: Mapping[str, Any], node: Mapping[str, Any]) -> Mapping[str, Any]:
    """``node``, or what its local ``$ref`` (``#/$defs/<name>``) points at."""
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/$defs/"):
        return _resolved(schema, schema["$defs"][ref.removeprefix("#/$defs/")])
    return node


def _schema_at(schema: Mapping[str, Any], path: Sequence[str]) -> Mapping[str, Any]:
    node: Mapping[str, Any] = schema
    for key in path:
        node = _resolved(schema, node)
        props = node.get("properties", {})
        if key in props:
            node = props[key]
        elif isinstance(node.get("additionalProperties"), dict):
            node = node["additionalProperties"]
        else:
            return {}
    return _resolved(schema, node)


def _type_of(node: Mapping[str, Any]) -> str:
    if "enum" in node:
        return " | ".join(json.dumps(v) for v in node["enum"])
    kind = node.get("type")
    if isinstance(kind, list):
        return " | ".join(str(k) for k in kind)
    if kind == "array" and isinstance(node.get("items"), dict) and "type" in node["items"]:
        return f"array of {node['items']['type']}"
    if kind:
        return str(kind)
    for combo in ("oneOf", "anyOf"):
        if combo in node:
            return " | ".join(_type_of(option) for option in node[combo])
    return "any"


def values_of(chart: Path) -> list[Value]:
    text = (chart / "values.yaml").read_text()
    defaults = yaml.safe_load(text) or {}
    schema = json.loads((chart / "values.schema.json").read_text())
    found: list[Value] = []
    for path, comment in _comments_and_order(text):
        default: Any = defaults
        for key in path:
            default = default[key]
        found.append(Value(path=path, comment=comment, default=default,
                           type=_type_of(_schema_at(schema, path))))
    return found


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", "<br>")


def _default(value: Any) -> str:
    return f"`{json.dumps(value, separators=(', ', ': '))}`"


def render(chart: Path = CHART) -> str:
    meta = yaml.safe_load((chart / "Chart.yaml").read_text())
    lines = [
        f"# {meta['name']}",
        "",
        "<!-- Generated by `make chart-readme` (e2e/release/chart_readme.py) from values.yaml and",
        "     values.schema.json; edit those, not this file. -->",
        "",
        " ".join(str(meta.get("description", "")).split()),
        "",
        f"Kubernetes `{meta.get('kubeVersion', '')}` with Dynamic Resource Allocation. "
        "See the project's README and docs/ for what rota does and docs/upgrade.md for "
        "upgrades.",
        "",
        "## Install",
        "",
        "```sh",
        "kubectl label node <gpu-node> gpu.rota.dev/enabled=true",
        "helm install rota oci://<your registry>/charts/rota --version <version> \\",
        "  --namespace rota-system --create-namespace \\",
        "  --set image.repository=<your registry>/rota \\",
        "  --set engineNamespaces='{<namespace of your engines>}' \\",
        "  --set gateway.modelBinding.namespaces='{<namespace of your engines>}'",
        "```",
        "",
        "`<your registry>` is where `make push REGISTRY=<your registry>` put the chart and its "
        "image (the chart pins the image's digest; `make verify` checks both before you "
        "install; `--plain-http` for a registry without TLS). A packaged chart, "
        "`./rota-<version>.tgz` in place of the `oci://` reference and `--version`, takes the "
        "same values; without `image.repository` the image comes from "
        "`ghcr.io/rota-dev/rota`.",
        "",
        "`gateway.modelBinding` says which namespaces may serve models: with it empty the "
        "gateway routes to no claimant (every request is 404 `model_not_found`). The line "
        "above lets the engine namespace serve any model name, as the project's quick start "
        "does.",
        "",
        "`helm show values` prints every value with its comment; the schema "
        "(`values.schema.json`) refuses unknown keys and wrong types.",
        "",
        "## Values",
        "",
        "| Key | Type | Default | Description |",
        "|---|---|---|---|",
    ]
    for value in values_of(chart):
        key = ".".join(value.path)
        default = "" if value.section else _default(value.default)
        kind = "object" if value.section else value.type
        if value.section and not value.comment:
            continue
        lines.append(f"| `{key}` | {_cell(kind)} | {_cell(default)} | {_cell(value.comment)} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.release.chart_readme", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chart", type=Path, default=CHART)
    parser.add_argument("--check", action="store_true",
                        help="exit 1 when README.md is not current; write nothing")
    args = parser.parse_args(argv)
    readme = args.chart / "README.md"
    wanted = render(args.chart)
    if args.check:
        current = readme.read_text() if readme.exists() else ""
        if current != wanted:
            print(f"{readme} is not current: run make chart-readme", file=sys.stderr)
            return 1
        return 0
    readme.write_text(wanted)
    print(readme)
    return 0


if __name__ == "__main__":
    sys.exit(main())
