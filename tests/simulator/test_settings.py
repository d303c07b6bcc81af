"""Flags, environment and defaults."""

from __future__ import annotations

from pathlib import Path

import pytest

from e2e.engine_simulator.settings import DEFAULT_GPU_UUID, Faults, Settings, settings_from_args

GIB = 2**30


def test_defaults_come_from_the_cdi_environment() -> None:
    env = {
        "ROTA_MODEL": "org/model-a",
        "ROTA_ENGINE_PORT": "18000",
        "ROTA_AWAKE_MEMORY_BYTES": str(33 * GIB),
        "ROTA_RESIDENT_MEMORY_BYTES": "1Gi",
        "NVIDIA_VISIBLE_DEVICES": "GPU-aaaa,GPU-bbbb",
        "ROTA_FAKE_NVML_PROC_DIR": "/tmp/procs",
        "ROTA_SIM_WAKE_FAILS": "true",
    }
    settings = settings_from_args([], env)
    assert settings.model == "org/model-a"
    assert settings.port == 18000
    assert settings.awake_memory_bytes == 33 * GIB
    assert settings.resident_memory_bytes == GIB
    assert settings.gpu_uuid == "GPU-aaaa"
    assert settings.fake_nvml_dir == Path("/tmp/procs")
    assert settings.faults.wake_fails


def test_flags_win_over_the_environment() -> None:
    env = {"ROTA_MODEL": "env-model", "ROTA_GPU_UUID": "GPU-env", "ROTA_SIM_OMNI": "1",
           "NVIDIA_VISIBLE_DEVICES": "GPU-visible"}
    settings = settings_from_args(
        ["--model", "flag-model", "--gpu-uuid", "GPU-flag", "--no-omni", "--port", "0",
         "--tokens-per-second", "40", "--weights-bytes", "2Gi", "--no-refuse-while-asleep"],
        env,
    )
    assert settings.model == "flag-model"
    assert settings.gpu_uuid == "GPU-flag"
    assert not settings.omni
    assert settings.port == 0
    assert settings.tokens_per_second == 40.0
    assert settings.weights_bytes == 2 * GIB
    assert not settings.faults.refuse_while_asleep
    assert settings_from_args([], env).gpu_uuid == "GPU-env"


def test_plain_defaults() -> None:
    settings = settings_from_args([], {"NVIDIA_VISIBLE_DEVICES": "all"})
    assert settings.gpu_uuid == DEFAULT_GPU_UUID
    assert settings.host == "127.0.0.1"
    assert settings.memory_backend == "fake"
    assert settings.faults == Faults()  # vLLM 0.26's behaviour: no fault, kinder or not
    assert not any(Faults().model_dump().values())
    assert not settings.dev_mode
    assert settings.keep_alive_seconds == 5.0
    assert settings.omni_stages == 3
    assert settings.ttft_seconds == settings.tokens_per_second == 0.0


@pytest.mark.parametrize("argv", [
    ["--resident-memory-bytes", "9Gi", "--awake-memory-bytes", "8Gi"],
    ["--weights-bytes", "8Gi", "--awake-memory-bytes", "8Gi"],
    ["--memory-backend", "tpu"],
    ["--awake-memory-bytes", "lots"],
    ["--tokens-per-second", "-1"],
])
def test_bad_values_exit_with_usage(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        settings_from_args(argv, {})
    assert exit_info.value.code == 2
    assert "usage:" in capsys.readouterr().err


def test_help_says_it_is_a_simulator(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        settings_from_args(["--help"], {})
    out = capsys.readouterr().out
    assert "NOT a real inference engine" in out
    assert "ROTA_ENGINE_PORT" in out


def test_settings_reject_unknown_fields() -> None:
    with pytest.raises(ValueError, match="extra"):
        Settings.model_validate({"modle": "typo"})


def test_api_key_from_flag_or_vllm_environment_is_kept_secret() -> None:
    env = {"VLLM_API_KEY": "from-env"}
    from_env = settings_from_args([], env).api_key
    assert from_env is not None
    assert from_env.get_secret_value() == "from-env"
    from_flag = settings_from_args(["--api-key", "from-flag"], env).api_key
    assert from_flag is not None
    assert from_flag.get_secret_value() == "from-flag"
    assert "from-flag" not in repr(settings_from_args(["--api-key", "from-flag"], {}))
    assert settings_from_args([], {}).api_key is None


def test_empty_api_key_is_refused() -> None:
    with pytest.raises(SystemExit):
        settings_from_args(["--api-key", ""], {})


def test_dev_mode_comes_from_vllm_server_dev_mode() -> None:
    assert not settings_from_args([], {}).dev_mode
    assert settings_from_args([], {"VLLM_SERVER_DEV_MODE": "1"}).dev_mode
    assert not settings_from_args([], {"VLLM_SERVER_DEV_MODE": "0"}).dev_mode
    assert settings_from_args(["--dev-mode"], {}).dev_mode
    assert settings_from_args([], {"VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "7"}).keep_alive_seconds == 7
