"""Every placeholder form a user might leave in a Secret is refused, whatever its case and
separators, with a message that says what to do; random keys pass. The rule
(controller.credentials.placeholder_reason) is what is checked, not a list of strings."""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest

from controller.credentials import PlaceholderSecret, SecretFile

LEFT_IN = ["replace-me-with-a-random-key", "<your-key>", "changeme", "CHANGE_ME", "xxx",
           "your-api-key", "Your API Key", "<API_KEY>", "${API_KEY}", "{{ api_key }}",
           "REPLACE_ME", "change-me-before-applying", "XXXXXXXXXXXXXXXX", "********",
           "secret", "token", "apikey", "api-key", "placeholder", "insert-key-here",
           "sk-your-key-goes-here", "your_token", "dummy"]


@pytest.mark.parametrize("value", LEFT_IN)
async def test_a_placeholder_is_refused_with_what_to_do(value: str, tmp_path: Path) -> None:
    path = tmp_path / "api-key"
    path.write_text(f"{value}\n")
    with pytest.raises(PlaceholderSecret) as refused:
        await SecretFile(path).load()
    message = str(refused.value)
    assert "placeholder" in message
    assert 'create secret generic <name> --from-literal=<key>="$(openssl rand -hex 32)"' \
        in message
    if len(value) > 12:
        assert value not in message  # the value is never logged


@pytest.mark.parametrize("make", [lambda: secrets.token_hex(32),
                                  lambda: secrets.token_urlsafe(32),
                                  lambda: "sk-" + secrets.token_urlsafe(24)],
                         ids=["hex", "urlsafe", "prefixed"])
def test_random_keys_pass(make: object) -> None:
    from controller.credentials import placeholder_reason

    assert callable(make)
    for _ in range(2000):
        value = make()
        assert placeholder_reason(value) is None, value


def test_short_test_fixture_keys_still_pass() -> None:
    """Keys the test suites use (short words that are not placeholders)."""
    from controller.credentials import placeholder_reason

    for value in ("alpha", "new-token", "s3cret-activation-token", "good-token", "rota"):
        assert placeholder_reason(value) is None, value
