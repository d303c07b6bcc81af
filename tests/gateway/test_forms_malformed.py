"""A malformed multipart form is a clear 400 ``invalid_form``, never a bare 500 (review F9).

On the old gateway ``boundary*=utf-8''%E2%82%AC`` (an RFC 2231 boundary that decodes to a
character outside latin-1) raised UnicodeEncodeError inside ``form_fields``, and mixing
numbered and unnumbered RFC 2231 pieces (``boundary*0=a; boundary*=b``) a TypeError from the
standard library: aiohttp answered both with a bare 500.
"""

from __future__ import annotations

import pytest

from controller.gateway.forms import FormError, form_fields
from tests.gateway.conftest import MODEL_A, RigFactory

pytestmark = pytest.mark.gateway

FORM = (b'--XyZ\r\nContent-Disposition: form-data; name="model"\r\n\r\n'
        + MODEL_A.encode() + b"\r\n--XyZ--\r\n")
MALFORMED_TYPES = [
    "multipart/form-data; boundary*=utf-8''%E2%82%AC",
    "multipart/form-data; boundary*0*=utf-8''%E2%82; boundary*1*=%AC",
    "multipart/form-data; boundary*0=XyZ; boundary*=XyZ",
    "multipart/form-data; boundary*=XyZ; boundary*1=a",
    "multipart/form-data; boundary*=iso-8859-1''%E9",
    "multipart/form-data; boundary=\"XyZ \"",
]


@pytest.mark.parametrize("content_type", MALFORMED_TYPES)
def test_an_unusable_boundary_is_a_form_error(content_type: str) -> None:
    with pytest.raises(FormError):
        form_fields(FORM, content_type, ("model",))


def test_an_unreadable_part_header_is_a_form_error() -> None:
    body = (b"--XyZ\r\nContent-Disposition: form-data; name*0=mo; name*=del\r\n\r\nm\r\n"
            b"--XyZ--\r\n")
    with pytest.raises(FormError, match="unreadable"):
        form_fields(body, "multipart/form-data; boundary=XyZ", ("model",))


@pytest.mark.parametrize("content_type", MALFORMED_TYPES[:4])
async def test_the_gateway_answers_a_malformed_form_with_invalid_form(
        make_rig: RigFactory, content_type: str) -> None:
    rig = await make_rig()
    async with rig.gateway.post("/v1/audio/transcriptions", data=FORM,
                                headers={"Content-Type": content_type}) as resp:
        assert resp.status == 400  # old gateway: 500
        error = (await resp.json())["error"]
    assert (error["code"], error["type"]) == ("invalid_form", "invalid_request_error")
    assert rig.controller.calls == 0
