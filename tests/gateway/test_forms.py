"""The text fields of a multipart form, as the audio routes read ``model`` and ``stream``:
what the OpenAI SDK and curl send, file parts skipped, malformed forms refused."""

from __future__ import annotations

import pytest

from controller.gateway.forms import FormError, form_fields

CT = "multipart/form-data; boundary=XyZ"


def _form(*parts: tuple[str, bytes]) -> bytes:
    body = b"".join(b"--XyZ\r\n" + head.encode() + b"\r\n\r\n" + value + b"\r\n"
                    for head, value in parts)
    return body + b"--XyZ--\r\n"


def test_text_fields_are_read_and_file_parts_skipped() -> None:
    body = _form(
        ('Content-Disposition: form-data; name="file"; filename="model.wav"\r\n'
         "Content-Type: audio/wav", b"\x00\x01model\r\n--not-the-boundary"),
        ('Content-Disposition: form-data; name="model"', b"org/whisper"),
        ("Content-Disposition: form-data; name=stream", b"true"),
        ('Content-Disposition: form-data; name="model"', b"second/ignored"))
    assert form_fields(body, CT, ("model", "stream")) == {"model": "org/whisper",
                                                          "stream": "true"}


def test_a_quoted_boundary_and_a_field_with_a_newline_inside() -> None:
    body = _form(('Content-Disposition: form-data; name="prompt"', b"two\r\nlines"),
                 ('Content-Disposition: form-data; name="model"', b"m"))
    fields = form_fields(body, 'multipart/form-data; boundary="XyZ"', ("model", "prompt"))
    assert fields == {"model": "m", "prompt": "two\r\nlines"}


@pytest.mark.parametrize(("body", "content_type", "said"), [
    (b"{}", "application/json", "must be multipart/form-data"),
    (_form(('Content-Disposition: form-data; name="model"', b"m")), "multipart/form-data",
     "no usable multipart boundary"),
    (_form(('Content-Disposition: form-data; name="model"', b"m")),
     "multipart/form-data; boundary=" + "b" * 71, "no usable multipart boundary"),
    (b"--XyZ\r\nContent-Disposition: form-data; name=model\r\n\r\nm\r\n", CT,
     "closing boundary"),
    (b"--XyZ\r\nContent-Disposition: form-data; name=model\r\nm\r\n--XyZ--\r\n", CT,
     "no header or no end"),
])
def test_a_malformed_form_is_refused(body: bytes, content_type: str, said: str) -> None:
    with pytest.raises(FormError, match=said):
        form_fields(body, content_type, ("model",))
