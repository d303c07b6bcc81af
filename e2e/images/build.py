"""Build rota's images from the repository, layer by layer, cached by content.

Three images come out of one OCI archive:

- the **pause** image: the static program of ``pause.c``, the container runtime's
  sandbox image;
- **rota** (what ``Dockerfile`` describes): driver, lease controller, gateway and engine
  simulator in a virtualenv at ``/opt/rota`` on Debian's Python;
- the **engine simulator**: the same layers, started as ``python -m e2e.engine_simulator``
  and listening on every address of its pod.

The rota layers, bottom up, and what each one's key is made of:

1. ``base``: Debian's ``python3`` and everything it depends on (the resolved package file
   names, so a Debian update rebuilds it), with the standard library compiled;
2. ``deps``: the virtualenv with rota's dependencies (the base key and the dependency list
   of ``pyproject.toml``), installed from wheels downloaded for the image's Python;
3. ``source``: rota itself (the deps key and the bytes of the source tree), a few MB, so a
   change to rota's code rebuilds only this layer and the archive; the wheel holds the
   runtime only (``driver``, ``controller``);
4. ``harness``: the test harness (``e2e/``, for the engine simulator) copied into the
   virtualenv's site-packages, in the test images only (the source key and the bytes of
   ``e2e/``). A released image (:func:`build_release_image`) has layers 1-3, with rota's
   release wheel as the source layer and OCI labels.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable, Sequence
from pathlib import Path

from pydantic import BaseModel

from e2e.images import chroot, debian
from e2e.images.cache import cache_root, content_key, locked, tree_key
from e2e.images.layer import LayerInfo, file_digest, tar_directory
from e2e.images.oci import ImageSpec, manifest_digest, write_archive

log = logging.getLogger(__name__)

RECIPE = 1
"""Raise when the way any layer is built changes; every key then changes."""

BASE_PACKAGES = ("python3", "libstdc++6")
"""Debian's Python, and the C++ runtime grpcio's extension needs."""
SMOKE_IMPORTS = ("driver.app", "controller.lease.app", "controller.gateway.app", "uvloop")
"""Imported in the finished image, so a missing shared library fails the build."""
HARNESS_SMOKE_IMPORTS = ("e2e.engine_simulator.app",)
"""Imported in a test image once the harness layer is on top."""
SOURCES = ("pyproject.toml", "README.md", "driver", "controller", "rota")
"""What the rota wheel is built from (``Dockerfile`` copies the same)."""
HARNESS = "e2e"
"""The harness package that the test images carry on top of rota (the engine simulator)."""
VENV = "/opt/rota"
IMAGE_PATH = f"{VENV}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
PAUSE_SOURCE = Path(__file__).with_name("pause.c")
_MANYLINUX = [f"manylinux_2_{minor}_x86_64" for minor in range(17, 37)] + [
    "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64"]


class BuildError(RuntimeError):
    """A layer could not be built; the message says which step failed."""


class BuiltImages(BaseModel):
    """The archive to import and what is in it."""

    archive: Path
    pause: str
    rota: list[str]
    simulator: list[str]
    layers: dict[str, LayerInfo]
    built: list[str]
    """Layers built by this call (the others came from the cache)."""
    seconds: dict[str, float]

    @property
    def size_bytes(self) -> int:
        return sum(layer.size for layer in self.layers.values())


def _run(argv: Sequence[str], what: str, **kwargs: object) -> str:
    proc = subprocess.run(list(argv), capture_output=True, text=True, check=False,
                          **kwargs)  # type: ignore[call-overload]
    if proc.returncode != 0:
        raise BuildError(f"{what} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n"
                         f"{proc.stderr[-4000:]}")
    return str(proc.stdout)


class _Layers:
    """The cache's ``layers/<key>/`` entries (the tar and its facts), and the trees of
    this build in a scratch directory (a layer used below another is unpacked there)."""

    def __init__(self, root: Path, scratch: Path) -> None:
        self.root = root / "layers"
        self.scratch = scratch
        self.built: list[str] = []
        self.seconds: dict[str, float] = {}

    def tree(self, key: str) -> Path:
        tree = self.scratch / "trees" / key
        if not tree.is_dir():
            tar = self.root / key / "layer.tar"
            tree.mkdir(parents=True)
            _run(["tar", "-xpf", str(tar), "-C", str(tree)], f"unpacking {tar}")
            if any(tree.rglob(".wh.*")):
                raise BuildError(f"{tar} deletes files; it cannot be a lower layer")
        return tree

    def get(self, name: str, key: str, build: Callable[[Path], None]) -> LayerInfo:
        entry = self.root / key
        facts = entry / "layer.json"
        if facts.exists():
            os.utime(facts)
            return LayerInfo.model_validate_json(facts.read_text())
        started = time.monotonic()
        shutil.rmtree(entry, ignore_errors=True)
        entry.mkdir(parents=True)
        tree = self.scratch / "trees" / key
        shutil.rmtree(tree, ignore_errors=True)
        try:
            build(tree)
            info = tar_directory(tree, entry / "layer.tar")
        except BaseException:
            shutil.rmtree(entry, ignore_errors=True)
            shutil.rmtree(tree, ignore_errors=True)
            raise
        facts.write_text(info.model_dump_json())
        self.built.append(name)
        self.seconds[name] = round(time.monotonic() - started, 2)
        log.info("layer built", extra={"layer": name, "key": key[:12], "bytes": info.size,
                                       "seconds": self.seconds[name]})
        return info


def _python_version(debs: Sequence[str]) -> str:
    for name in debs:
        match = re.match(r"python(3\.\d+)_", name)
        if match:
            return match.group(1)
    raise BuildError(f"no Python interpreter among the base packages: {debs}")


def _dependencies(repo: Path) -> list[str]:
    project = tomllib.loads((repo / "pyproject.toml").read_text())["project"]
    return sorted(str(d) for d in project["dependencies"])


def _download_wheels(dest: Path, python: str, requirements: Sequence[str]) -> None:
    tag = python.replace(".", "")
    argv = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check",
            "--only-binary=:all:", "--python-version", python, "--implementation", "cp",
            "--abi", f"cp{tag}", "--abi", "abi3", "--abi", "none", "-d", str(dest)]
    for platform in _MANYLINUX:
        argv += ["--platform", platform]
    _run([*argv, "pip", *requirements], "downloading wheels")


def _pip_wheel(wheels: Path) -> str:
    found = sorted(wheels.glob("pip-*.whl"))
    if not found:
        raise BuildError(f"no pip wheel in {wheels}")
    return f"/wheels/{found[-1].name}/pip"


class _Runtime(BaseModel):
    """The base and deps layers, their keys, and where the deps' wheels are."""

    debs: list[str]
    python: str
    base_key: str
    base: LayerInfo
    deps_key: str
    deps: LayerInfo
    wheels: Path


def _runtime_layers(repo: Path, root: Path, layers: _Layers, scratch: Path) -> _Runtime:
    apt_dir = root / "apt"
    debs = debian.resolve(BASE_PACKAGES, apt_dir)
    python = _python_version(debs)
    base_key = content_key("base", RECIPE, debs)
    base = layers.get("base", base_key, lambda tree: _build_base(tree, apt_dir, python, scratch))
    requirements = _dependencies(repo)
    deps_key = content_key("deps", RECIPE, base_key, requirements)
    wheels = root / "wheels" / deps_key
    deps = layers.get("deps", deps_key, lambda tree: _build_deps(
        tree, layers.tree(base_key), wheels, python, requirements, scratch))
    return _Runtime(debs=list(debs), python=python, base_key=base_key, base=base,
                    deps_key=deps_key, deps=deps, wheels=wheels)


def build_images(repo: Path, *, rota_names: Sequence[str], simulator_names: Sequence[str],
                 pause_name: str = "rota.local/pause:1") -> BuiltImages:
    """Build (or find cached) every layer and the archive holding the three images."""
    root = cache_root()
    started = time.monotonic()
    with locked(root / ".lock"):
        scratch = Path(tempfile.mkdtemp(prefix="rota-image-", dir=_scratch_parent(root)))
        layers = _Layers(root, scratch)
        try:
            pause = _pause_layer(layers, scratch)
            rt = _runtime_layers(repo, root, layers, scratch)
            base, deps, wheels = rt.base, rt.deps, rt.wheels
            lowers = [layers.tree(rt.deps_key), layers.tree(rt.base_key)]
            source_key = content_key("source", RECIPE, rt.deps_key, tree_key(repo, SOURCES))
            source = layers.get("source", source_key, lambda tree: _build_source(
                tree, _wheel_from_sources(repo, scratch), lowers, wheels, scratch))
            harness_key = content_key("harness", RECIPE, source_key, tree_key(repo, [HARNESS]))
            harness = layers.get("harness", harness_key, lambda tree: _build_harness(
                tree, repo, rt.python, [layers.tree(source_key), *lowers], scratch))
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        rota_layers = [base, deps, source, harness]
        env = [f"PATH={IMAGE_PATH}", f"VIRTUAL_ENV={VENV}", "PYTHONUNBUFFERED=1",
               "LANG=C.UTF-8"]
        images = [ImageSpec(name=pause_name, layers=[pause], entrypoint=["/pause"])]
        images += [ImageSpec(name=name, layers=rota_layers, env=env) for name in rota_names]
        images += [ImageSpec(name=name, layers=rota_layers, env=[*env, "ROTA_SIM_HOST=0.0.0.0"],
                             entrypoint=["python", "-m", "e2e.engine_simulator"])
                   for name in simulator_names]
        archive = root / "archives" / (content_key([i.model_dump_json() for i in images])
                                       + ".tar")
        if not archive.exists():
            write_archive(archive, images)
            _prune(root, keep=archive)
        os.utime(archive)
    seconds = {**layers.seconds, "total": round(time.monotonic() - started, 2)}
    return BuiltImages(archive=archive, pause=pause_name, rota=list(rota_names),
                       simulator=list(simulator_names),
                       layers={"pause": pause, "base": base, "deps": deps, "source": source,
                               "harness": harness},
                       built=layers.built, seconds=seconds)


def _scratch_parent(root: Path, need_bytes: int = 2 << 30) -> Path:
    """Where layers are built: memory (``/dev/shm``) when it has room, since creating
    thousands of small files is slow on some disks; else the cache directory."""
    shm = Path("/dev/shm")
    try:
        if shutil.disk_usage(shm).free >= need_bytes and os.access(shm, os.W_OK):
            return shm
    except OSError:
        pass
    root.mkdir(parents=True, exist_ok=True)
    return root


def _pause_layer(layers: _Layers, scratch: Path) -> LayerInfo:
    gcc = shutil.which("gcc")
    if gcc is None:
        raise BuildError("gcc is needed for the pause image (run e2e/toolchain/setup-host.sh)")
    version = _run([gcc, "--version"], "gcc --version").splitlines()[0]
    key = content_key("pause", RECIPE, PAUSE_SOURCE.read_text(), version)

    def build(tree: Path) -> None:
        tree.mkdir(parents=True)
        binary = tree / "pause"
        _run([gcc, "-Os", "-static", "-o", str(binary), str(PAUSE_SOURCE)],
             "compiling pause.c (static: needs libc6-dev)")
        _run(["strip", str(binary)], "strip pause")

    return layers.get("pause", key, build)


def _build_base(tree: Path, apt_dir: Path, python: str, scratch: Path) -> None:
    debs = debian.download(BASE_PACKAGES, apt_dir)
    debian.extract(debs, tree)
    debian.finish_rootfs(tree)
    chroot.run([tree], None, [f"/usr/bin/python{python}", "-m", "compileall", "-q", "-j0",
                              f"/usr/lib/python{python}"], scratch=scratch / "chroot")


def _build_deps(tree: Path, base: Path, wheels: Path, python: str,
                requirements: Sequence[str], scratch: Path) -> None:
    if not any(wheels.glob("pip-*.whl")):
        shutil.rmtree(wheels, ignore_errors=True)
        _download_wheels(wheels, python, requirements)
    env = {"PYTHONDONTWRITEBYTECODE": "1"}
    binds = {wheels: "/wheels"}
    chroot.run([base], tree, [f"/usr/bin/python{python}", "-m", "venv", "--without-pip", VENV],
               scratch=scratch / "chroot", env=env)
    chroot.run([base], tree, [f"{VENV}/bin/python", _pip_wheel(wheels), "install", "-q",
                              "--no-index", "--find-links", "/wheels", "--no-cache-dir",
                              "--disable-pip-version-check", *requirements],
               scratch=scratch / "chroot", env=env, binds=binds)
    _drop_scratch(tree)


def _wheel_from_sources(repo: Path, scratch: Path) -> Path:
    """rota's wheel, built from :data:`SOURCES` of ``repo`` (copied, so nothing else of the
    checkout can end up in it)."""
    src = scratch / "src"
    for name in SOURCES:
        path = repo / name
        if path.is_dir():
            shutil.copytree(path, src / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            src.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, src / name)
    dist = scratch / "dist"
    builder = _build_env(repo)
    _run([str(builder), "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
          "--disable-pip-version-check", "-w", str(dist), str(src)], "building rota's wheel")
    (wheel,) = dist.glob("rota-*.whl")
    return wheel


def _build_source(tree: Path, wheel: Path, lowers: Sequence[Path], wheels: Path,
                  scratch: Path) -> None:
    """Install rota's ``wheel`` (no dependencies: the deps layer has them) on ``lowers``."""
    dist = wheel.parent
    chroot.run(list(lowers), tree, [f"{VENV}/bin/python", _pip_wheel(wheels), "install", "-q",
                                    "--no-deps", "--no-index", "--no-cache-dir",
                                    "--disable-pip-version-check", f"/dist/{wheel.name}"],
               scratch=scratch / "chroot", env={"PYTHONDONTWRITEBYTECODE": "1"},
               binds={wheels: "/wheels", dist: "/dist"})
    _drop_scratch(tree)
    check = "import " + ", ".join(SMOKE_IMPORTS)
    chroot.run([tree, *lowers], tree.with_name("smoke-upper"),
               [f"{VENV}/bin/python", "-B", "-c", check], scratch=scratch / "smoke")
    shutil.rmtree(tree.with_name("smoke-upper"), ignore_errors=True)


def _build_harness(tree: Path, repo: Path, python: str, lowers: Sequence[Path],
                   scratch: Path) -> None:
    """The harness package in the virtualenv's site-packages, importable in the image."""
    site = tree / VENV.lstrip("/") / "lib" / f"python{python}" / "site-packages"
    site.mkdir(parents=True)
    shutil.copytree(repo / HARNESS, site / HARNESS,
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    check = "import " + ", ".join(HARNESS_SMOKE_IMPORTS)
    chroot.run([tree, *lowers], tree.with_name("harness-smoke-upper"),
               [f"{VENV}/bin/python", "-B", "-c", check], scratch=scratch / "harness-smoke")
    shutil.rmtree(tree.with_name("harness-smoke-upper"), ignore_errors=True)


class ReleaseImage(BaseModel):
    """A released image: its archive (OCI layout in a tar), name, digest and contents."""

    archive: Path
    name: str
    digest: str
    """The manifest's digest: what ``image@sha256:...`` pins."""
    labels: dict[str, str]
    debs: list[str]
    """Debian's packages of the base layer (file names: name_version_arch.deb)."""
    python_packages: dict[str, str]
    """Distribution name to version, of the image's virtualenv."""


def build_release_image(repo: Path, wheel: Path, *, name: str, labels: dict[str, str],
                        dest: Path) -> ReleaseImage:
    """rota's image for a release: base, deps and rota's release ``wheel``, with ``labels``,
    written as a one-image OCI archive at ``dest``."""
    root = cache_root()
    with locked(root / ".lock"):
        scratch = Path(tempfile.mkdtemp(prefix="rota-release-", dir=_scratch_parent(root)))
        layers = _Layers(root, scratch)
        try:
            rt = _runtime_layers(repo, root, layers, scratch)
            lowers = [layers.tree(rt.deps_key), layers.tree(rt.base_key)]
            staged = scratch / "dist" / wheel.name
            staged.parent.mkdir(parents=True)
            shutil.copy2(wheel, staged)
            source_key = content_key("release-source", RECIPE, rt.deps_key,
                                     file_digest(wheel))
            source = layers.get("release-source", source_key, lambda tree: _build_source(
                tree, staged, lowers, rt.wheels, scratch))
            packages = _installed_distributions(
                [layers.tree(source_key), *lowers], rt.python)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    env = [f"PATH={IMAGE_PATH}", f"VIRTUAL_ENV={VENV}", "PYTHONUNBUFFERED=1", "LANG=C.UTF-8"]
    image = ImageSpec(name=name, layers=[rt.base, rt.deps, source], env=env, labels=labels)
    write_archive(dest, [image])
    return ReleaseImage(archive=dest, name=name, digest=manifest_digest(image),
                        labels=labels, debs=rt.debs, python_packages=packages)


def _installed_distributions(trees: Sequence[Path], python: str) -> dict[str, str]:
    """Name and version of every distribution in the virtualenv of the layer ``trees``."""
    found: dict[str, str] = {}
    rel = Path(VENV.lstrip("/")) / "lib" / f"python{python}" / "site-packages"
    for tree in trees:
        for metadata in sorted((tree / rel).glob("*.dist-info/METADATA")):
            fields = dict(line.split(": ", 1) for line in
                          metadata.read_text(errors="replace").split("\n\n", 1)[0].splitlines()
                          if ": " in line)
            if "Name" in fields and "Version" in fields:
                found.setdefault(fields["Name"], fields["Version"])
    return dict(sorted(found.items()))


def _build_env(repo: Path) -> Path:
    """A virtualenv in the cache with what ``[build-system]`` requires; its python.

    Building the wheel in it without isolation saves installing setuptools on every
    build of the source layer.
    """
    requires = sorted(tomllib.loads((repo / "pyproject.toml").read_text())
                      ["build-system"]["requires"])
    env = cache_root() / "buildenv" / content_key(RECIPE, sys.version, requires)[:16]
    python = env / "bin" / "python"
    if (env / ".complete").exists():
        return python
    shutil.rmtree(env, ignore_errors=True)
    _run([sys.executable, "-m", "venv", str(env)], "creating the build environment")
    _run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *requires],
         "installing the build requirements")
    (env / ".complete").touch()
    return python


def _drop_scratch(tree: Path) -> None:
    """Remove what a build leaves outside the virtualenv (pip's temp files, the mount
    points of the build's binds)."""
    for name in ("tmp", "root", "wheels", "dist", "proc", "dev"):
        path = tree / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)


def _prune(root: Path, *, keep: Path, max_age_s: float = 86400.0) -> None:
    """Delete archives and source layers nobody used for a day (the cache is shared)."""
    now = time.time()
    for archive in (root / "archives").glob("*.tar"):
        if archive != keep and now - archive.stat().st_mtime > max_age_s:
            archive.unlink(missing_ok=True)
    for facts in (root / "layers").glob("*/layer.json"):
        if now - facts.stat().st_mtime > 7 * max_age_s:
            shutil.rmtree(facts.parent, ignore_errors=True)
