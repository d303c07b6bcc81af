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
import re
from collections.abc import Collection

from controller.gateway.errors import RotaGatewayError

__all__ = ["FormError", "form_fields"]

_HEADERS = email.parser.HeaderParser()
_BOUNDARY = re.compile(r"[\x20-\x7e]{0,69}[\x21-\x7e]")
"""1 to 70 printable ASCII characters, not ending in a space (RFC 2046's length; its
character set widened to every printable one, so that no client's odd choice is refused):
a boundary is matched against the body's bytes, so it must be one byte per character."""
_EXTENDED_BOUNDARY = re.compile(r";\s*boundary\*", re.IGNORECASE)
"""RFC 2231's ``boundary*=`` and ``boundary*0=``: the standard library decodes them, the
engines' form parsers do not, so a form read here by such a boundary is not the form the
engine reads (the engine simulator answered it 500)."""


class FormError(RotaGatewayError, ValueError):
    """The body is not a readable ``multipart/form-data`` form."""


def _param(message: email.message.Message, name: str, header: str) -> str | None:
    """The parameter ``name`` of ``header``, RFC 2231 encodings decoded.

    Raises:
        FormError: the parameter is unreadable: the standard library raises TypeError on
            ``boundary*0=a; boundary*=b`` (numbered and unnumbered pieces mixed).
    """
    try:
        value = message.get_param(name, header=header)
    except (TypeError, ValueError):
        raise FormError(f"the {header} header's {name!r} parameter is unreadable") from None
    if value is None or isinstance(value, str):
        return value
    return str(email.utils.collapse_rfc2231_value(value))


def form_fields(body: bytes, content_type: str, names: Collection[str]) -> dict[str, str]:
    """The text fields named ``names`` of the form ``body`` (the first of each; file
    parts, those with a ``filename``, are skipped).

    Raises:
        FormError: ``content_type`` is not ``multipart/form-data`` with a usable boundary,
            the body is not a closed form of that boundary, or a part's header is
            unreadable or names no form-data field.
    """
    header = email.message.Message()
    header["Content-Type"] = content_type
    if header.get_content_type() != "multipart/form-data":
        raise FormError(f"the body must be multipart/form-data, not {content_type[:100]!r}")
    if _EXTENDED_BOUNDARY.search(content_type):
        raise FormError("the multipart boundary must be a plain boundary= parameter, not "
                        "RFC 2231's boundary*=")
    boundary = _param(header, "boundary", "content-type")
    if not boundary or not _BOUNDARY.fullmatch(boundary):
        raise FormError("the Content-Type names no usable multipart boundary (1 to 70 "
                        "printable ASCII characters)")
    pieces = body.split(b"--" + boundary.encode("ascii"))
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
        if part.get_content_disposition() != "form-data" or not name:
            # The engines' form parsers refuse such a part: refused here, no engine is
            # woken for a form it cannot read.
            raise FormError("a part of the form has no 'Content-Disposition: form-data' "
                            "with a name")
        if name in names and name not in fields and \
                _param(part, "filename", "content-disposition") is None:
            fields[name] = value[:-2].decode("utf-8", errors="replace")
    return fields
