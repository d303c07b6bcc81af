"""The layering rules of DESIGN.md, checked on the source: pure modules import no I/O
library; the processes (``driver``: the DRA kubelet plugin; ``controller``: the lease
controller, the gateway and the guard) never import each other; what they share lives in
``rota`` (the contracts in ``rota/api``, the runtime kit in ``rota/kit``, the generated
messages in ``rota/pb``), which imports no process; and the contracts import nothing but
the standard library, pydantic and each other."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
IO_LIBRARIES = {"kubernetes", "grpc", "aiohttp", "pynvml", "torch"}
PURE = ["driver/claims.py", "driver/budget.py",
        "driver/slices.py", "driver/devices.py", "driver/cdi.py", "driver/ledger.py",
        "driver/cgroups.py", "driver/nvml/api.py", "controller/claimants.py",
        "driver/control_tokens.py", "controller/lease/reconcile.py", "rota/kit/aio.py",
        "driver/startgate.py",
        *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "rota" / "api").rglob("*.py"))]
PROCESS_PACKAGES = {"driver", "controller"}
"""The top-level packages that are processes; ``rota`` is what they share."""


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


@pytest.mark.parametrize("module", PURE)
def test_pure_modules_do_no_io(module: str) -> None:
    heavy = {name for name in _imports(ROOT / module) if name.split(".")[0] in IO_LIBRARIES}
    assert not heavy, f"{module} imports {sorted(heavy)}"


def test_the_driver_never_imports_the_controller() -> None:
    offenders = {str(p.relative_to(ROOT)) for p in (ROOT / "driver").rglob("*.py")
                 if any(n.split(".")[0] == "controller" for n in _imports(p))}
    assert not offenders


API_MAY_IMPORT = {"rota.api", "pydantic"}
"""Besides the standard library: the contracts' own package and pydantic. Never a process:
``controller.lease``, ``controller.gateway``, ``controller.guard``."""


def test_the_contracts_import_no_process() -> None:
    paths = list((ROOT / "rota" / "api").rglob("*.py"))
    assert paths
    found: dict[str, set[str]] = {}
    for path in paths:
        for name in _imports(path):
            if name.split(".")[0] in sys.stdlib_module_names or name == "rota":
                continue  # ``from rota import api`` is judged by its module
            if not any(name == allowed or name.startswith(f"{allowed}.")
                       for allowed in API_MAY_IMPORT):
                found.setdefault(str(path.relative_to(ROOT)), set()).add(name)
    assert not found, found


def _importers_of(package: str, folder: str) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in (ROOT / folder).rglob("*.py"):
        for name in _imports(path):
            if name.split(".")[0] == package:
                found.setdefault(str(path.relative_to(ROOT)), set()).add(name)
    return found


def test_the_controller_never_imports_the_driver() -> None:
    """What both need is in ``rota``: a change to the kubelet plugin touches one process."""
    assert _importers_of("driver", "controller") == {}


@pytest.mark.parametrize("process", sorted(PROCESS_PACKAGES))
def test_the_shared_packages_import_no_process(process: str) -> None:
    assert _importers_of(process, "rota") == {}


SHARED_IN_CONTROLLER = {"controller.credentials", "controller.claimants", "controller.urls"}
"""What rota's processes under ``controller/`` share besides ``rota``: a few pure helpers.
Everything else belongs to one process, in its folder."""
PROCESSES = {"lease", "gateway", "guard"}
ENTRY_POINTS = {"controller.__init__", "controller.__main__", "controller.engine_gate",
                "controller.kubectl_rota"}
"""Top-level modules that are no process's: the package, the entry point that picks a
process, the start gate (it runs in the engine's image) and the CLI."""


def _module(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def _process_of(name: str) -> str | None:
    """The process (folder) a ``controller`` module belongs to; None: shared or not ours."""
    parts = name.split(".")
    if parts[0] != "controller" or len(parts) < 2:
        return None
    return parts[1] if parts[1] in PROCESSES else None


def test_every_controller_module_is_a_process_s_or_shared() -> None:
    """A folder per process: a module beside them is a contract, a shared helper or an
    entry point, never a process's module left behind."""
    loose = {_module(path) for path in (ROOT / "controller").glob("*.py")}
    shared = {name.removeprefix("controller.") for name in SHARED_IN_CONTROLLER}
    assert {m for m in loose if m not in ENTRY_POINTS
            and m.removeprefix("controller.") not in shared} == set()
    folders = {p.name for p in (ROOT / "controller").iterdir()
               if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == PROCESSES


def test_the_lease_controller_the_gateway_and_the_guard_never_import_each_other() -> None:
    crossing: dict[str, set[str]] = {}
    for path in (ROOT / "controller").rglob("*.py"):
        module = _module(path)
        mine = _process_of(module)
        if mine is None:
            continue
        for name in _imports(path):
            theirs = _process_of(name)
            if theirs is not None and theirs != mine:
                crossing.setdefault(module, set()).add(name)
    assert not crossing, crossing


KUBERNETES_IMPORTERS = {
    "rota/kit/kube.py",  # the one client facade and its errors
    "rota/kit/listwatch.py",  # the one list-then-watch
    "controller/lease/kube.py",  # the lease controller's client, Leases and Events
    "controller/lease/cache.py",  # the lease controller's watches of claims and pods
    "controller/lease/visible_state_writer.py",  # claim status conditions
    "controller/gateway/kube_source.py",  # the gateway's watches
    "controller/gateway/engine_keys.py",  # engines' API key Secrets, read by the gateway
    "controller/kubectl_rota.py",  # the CLI reads what the processes write
}
"""The only modules that may import the official ``kubernetes`` client: everything else
takes typed values from them (DESIGN.md's map names them too)."""


def test_only_the_named_modules_import_the_kubernetes_client() -> None:
    found = {str(path.relative_to(ROOT)) for folder in ("driver", "controller", "rota")
             for path in (ROOT / folder).rglob("*.py")
             if any(name.split(".")[0] == "kubernetes" for name in _imports(path))}
    assert found == KUBERNETES_IMPORTERS


def _exception_classes(package: str) -> list[type[BaseException]]:
    """The exception classes defined in ``package``'s modules (private ones included)."""
    import importlib
    import inspect
    import pkgutil

    root = importlib.import_module(package)
    found: list[type[BaseException]] = []
    for info in pkgutil.walk_packages(root.__path__, f"{package}."):
        module = importlib.import_module(info.name)
        found += [cls for _, cls in inspect.getmembers(module, inspect.isclass)
                  if issubclass(cls, BaseException) and cls.__module__ == info.name]
    return found


@pytest.mark.parametrize(("package", "root_name", "exempt"), [
    ("controller.lease", "controller.lease.errors.LeaseControllerError", set()),
    ("controller.gateway", "controller.gateway.errors.RotaGatewayError", set()),
    # The fake NVML backend stands for a CUDA allocation failing inside an engine, not
    # for an error of the driver; a list-watch's 410 never leaves its thread.
    ("driver", "driver.errors.RotaDriverError", {"driver.nvml.fake.GpuMemoryExhausted"}),
    ("rota.kit", "rota.kit.errors.KitError", {"rota.kit.listwatch._Gone"}),
    ("rota.api", "rota.api.errors.ContractError", set()),
])
def test_each_process_has_one_error_root(package: str, root_name: str, exempt: set[str]
                                         ) -> None:
    import importlib

    module, _, name = root_name.rpartition(".")
    root = getattr(importlib.import_module(module), name)
    strays = sorted(f"{cls.__module__}.{cls.__qualname__}" for cls in _exception_classes(package)
                    if not issubclass(cls, root)
                    and f"{cls.__module__}.{cls.__qualname__}" not in exempt)
    assert strays == [], f"errors of {package} outside {root_name}"
