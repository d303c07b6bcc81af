"""The text fields of a ``multipart/form-data`` body, read without parsing its files. Pure.

The audio routes (``/v1/audio/transcriptions``, ``/v1/audio/translations``) take an upload
whose ``model`` (and ``stream``) are form fields next to the audio file. The gateway needs
those two fields to route; the body itself goes to the engine unchanged, boundary and all,
so nothing here rebuilds or decodes the file parts.
"""

from __future__ import annotations

import email.message
import email.parser
import email.utils
from collections.abc import Collection

from controller.gateway.errors import RotaGatewayError

__all__ = ["FormError", "form_fields"]

_HEADERS = email.parser.HeaderParser()
_MAX_BOUNDARY = 70  # RFC 2046


class FormError(RotaGatewayError, ValueError):
    """The body is not a readable ``multipart/form-data`` form."""


def _param(message: email.message.Message, name: str, header: str) -> str | None:
    value = message.get_param(name, header=header)
    if value is None or isinstance(value, str):
        return value
    return str(email.utils.collapse_rfc2231_value(value))


def form_fields(body: bytes, content_type: str, names: Collection[str]) -> dict[str, str]:
    """The text fields named ``names`` of the form ``body`` (the first of each; file
    parts, those with a ``filename``, are skipped).

    Raises:
        FormError: ``content_type`` is not ``multipart/form-data`` with a boundary, or the
            body is not a closed form of that boundary.
    """
    header = email.message.Message()
    header["Content-Type"] = content_type
    if header.get_content_type() != "multipart/form-data":
        raise FormError(f"the body must be multipart/form-data, not {content_type[:100]!r}")
    boundary = _param(header, "boundary", "content-type")
    if not boundary or len(boundary) > _MAX_BOUNDARY:
        raise FormError("the Content-Type names no usable multipart boundary")
    pieces = body.split(b"--" + boundary.encode("latin-1"))
    if len(pieces) < 2 or not pieces[-1].startswith(b"--"):
        raise FormError("the form does not end with its closing boundary")
    fields: dict[str, str] = {}
    for piece in pieces[1:-1]:
        if not piece.startswith(b"\r\n"):
            raise FormError("a part of the form does not start on a new line")
        head, blank, value = piece[2:].partition(b"\r\n\r\n")
        if not blank or not value.endswith(b"\r\n"):
            raise FormError("a part of the form has no header or no end")
        part = _HEADERS.parsestr(head.decode("latin-1"))
        name = _param(part, "name", "content-disposition")
        if name is not None and name in names and name not in fields and \
                _param(part, "filename", "content-disposition") is None:
            fields[name] = value[:-2].decode("utf-8", errors="replace")
    return fields
