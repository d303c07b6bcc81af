"""Every rota command answers like a well-kept tool: one name in usage, errors and
``--version`` (the installed script's, never ``python -m ...``), a one-line error and exit 2
for a bad flag value or a kubeconfig that cannot be loaded (never a traceback), help in
plain words (no reStructuredText, no description that reads "None"), and no flag that
does nothing."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from controller import engine_gate, kubectl_rota
from controller.__main__ import main as controller_main
from controller.guard.__main__ import main as guard_main
from driver.__main__ import main as driver_main
from rota.kit.kube_client import version

Main = Callable[[list[str]], int]


def _lease(argv: list[str]) -> int:
    return controller_main(["lease", *argv])


def _gateway(argv: list[str]) -> int:
    return controller_main(["gateway", *argv])


def _kubectl(argv: list[str]) -> int:
    return kubectl_rota.main(["status", *argv])


# name -> (entry point, the arguments every run needs, the name it must give itself)
COMMANDS: dict[str, tuple[Main, list[str], str]] = {
    "driver": (driver_main, ["--node-name", "n1"], "rota-driver"),
    "lease": (_lease, ["--node-name", "n1"], "rota-controller lease"),
    "gateway": (_gateway, [], "rota-controller gateway"),
    "guard": (guard_main, [], "rota-engine-guard"),
}


@pytest.fixture(autouse=True)
def _root_logger_kept() -> Iterator[None]:
    """An entry point configures the root logger; give the other tests theirs back."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def _exit_of(run: Callable[[], int]) -> int:
    try:
        return run()
    except SystemExit as exc:
        return int(exc.code or 0)


@pytest.mark.parametrize(("run", "name"), [
    (lambda: driver_main(["--version"]), "rota-driver"),
    (lambda: controller_main(["--version"]), "rota-controller"),
    (lambda: controller_main(["lease", "--version"]), "rota-controller lease"),
    (lambda: controller_main(["gateway", "--version"]), "rota-controller gateway"),
    (lambda: guard_main(["--version"]), "rota-engine-guard"),
    (lambda: engine_gate.main(["--version"]), "rota-engine-gate"),
    (lambda: kubectl_rota.main(["--version"]), "kubectl rota"),
], ids=["driver", "controller", "lease", "gateway", "guard", "gate", "kubectl"])
def test_every_command_has_version(run: Callable[[], int], name: str,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert _exit_of(run) == 0
    assert capsys.readouterr().out.strip() == f"{name} {version()}"


@pytest.mark.parametrize(("run", "name"), [
    (lambda: driver_main(["--help"]), "rota-driver"),
    (lambda: controller_main(["--help"]), "rota-controller"),
    (lambda: controller_main(["lease", "--help"]), "rota-controller lease"),
    (lambda: controller_main(["gateway", "--help"]), "rota-controller gateway"),
    (lambda: guard_main(["--help"]), "rota-engine-guard"),
    (lambda: engine_gate.main(["--help"]), "rota-engine-gate"),
    (lambda: kubectl_rota.main(["--help"]), "kubectl rota"),
    (lambda: kubectl_rota.main(["status", "--help"]), "kubectl rota status"),
], ids=["driver", "controller", "lease", "gateway", "guard", "gate", "kubectl",
        "kubectl-status"])
def test_help_names_the_command_in_plain_words(run: Callable[[], int], name: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert _exit_of(run) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: {name} ")
    assert "python -m" not in text
    for markup in ("``", ":mod:", ":func:", ":class:", ":data:"):
        assert markup not in text, f"{name} --help shows {markup}"
    assert " None " not in text.replace("\n", " ")
    assert "\n  None" not in text


def test_probe_max_tokens_is_gone(capsys: pytest.CaptureFixture[str]) -> None:
    """It was defined and never read (its help said 4, the probe asks for 8)."""
    assert _exit_of(lambda: controller_main(["lease", "--help"])) == 0
    assert "--probe-max-tokens" not in capsys.readouterr().out


@pytest.mark.parametrize("which", ["driver", "lease", "gateway", "guard"])
def test_a_bad_log_level_is_one_line_and_exit_2(which: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    run, needed, name = COMMANDS[which]
    assert run([*needed, "--log-level", "loud"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"{name}: ")
    assert "log_level" in err
    assert "\n" not in err
    assert "Traceback" not in err


@pytest.mark.parametrize("which", ["driver", "lease", "gateway", "kubectl"])
@pytest.mark.parametrize("content", [None, "clusters: [\n", "just words\n"],
                         ids=["missing", "not-yaml", "not-a-kubeconfig"])
def test_an_unloadable_kubeconfig_is_one_line_and_exit_2(
        which: str, content: str | None, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "kubeconfig"
    if content is not None:
        path.write_text(content)
    run, needed, name = (_kubectl, [], "kubectl rota") if which == "kubectl" \
        else COMMANDS[which]
    extra = ["--nvml-backend", "fake", "--fake-nvml-fixture", "h200"] if which == "driver" \
        else []
    assert run([*needed, *extra, "--kubeconfig", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"{name}: cannot load kubeconfig {path}")
    assert "\n" not in err
    assert "Traceback" not in err


def test_kubectl_rota_names_the_kubeconfig_variable(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """``KUBECONFIG=/nonexistent kubectl rota status`` (the review's case)."""
    missing = tmp_path / "nonexistent"
    monkeypatch.setenv("KUBECONFIG", str(missing))
    assert kubectl_rota.main(["status"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"kubectl rota: cannot load kubeconfig {missing}")
    assert "\n" not in err
