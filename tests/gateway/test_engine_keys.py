"""Engine API keys: read from the Secret a claim names, cached, never guessed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from controller.gateway.engine_keys import EngineKeys, StaticSecrets, secret_ref
from controller.gateway.errors import Unavailable

pytestmark = pytest.mark.gateway


def test_the_secret_ref_of_an_engine_config() -> None:
    assert secret_ref(SimpleNamespace()) is None
    assert secret_ref(SimpleNamespace(api_key_secret=None)) is None
    ref = SimpleNamespace(name="engine-key", key=None)
    assert secret_ref(SimpleNamespace(api_key_secret=ref)) == ("engine-key", "api-key")
    ref = SimpleNamespace(name="engine-key", key="token")
    assert secret_ref(SimpleNamespace(api_key_secret=ref)) == ("engine-key", "token")


async def test_keys_are_read_once_per_ttl_and_a_missing_one_is_a_503() -> None:
    secrets = StaticSecrets({("engines", "engine-key"): {"api-key": "s3cret\n"}})
    keys = EngineKeys(secrets, ttl_s=3600)
    assert await keys.key_for("engines", None) is None
    assert await keys.key_for("engines", ("engine-key", "api-key")) == "s3cret"
    assert await keys.key_for("engines", ("engine-key", "api-key")) == "s3cret"
    assert secrets.reads == 1
    for namespace, ref in (("engines", ("engine-key", "other")),
                           ("tenant", ("engine-key", "api-key")),
                           ("engines", ("missing", "api-key"))):
        with pytest.raises(Unavailable) as refused:
            await keys.key_for(namespace, ref)
        assert refused.value.code == "engine_key_unavailable"
        assert refused.value.retry_after is None  # the dispatcher says, from what it measured
    with pytest.raises(Unavailable):
        await EngineKeys(None, ttl_s=1).key_for("engines", ("k", "api-key"))
