"""Kubernetes resource quantities as exact integers, and byte counts for people.

The API server hands rota capacities (``"80Gi"``, ``"2147483648"``, ``"1e3"``) as quantity
strings, and may hand one back in another spelling than the one written (``"1024Ki"`` as
``"1Mi"``). Every budget decision compares them, so they are parsed exactly (no floats) into
integers, and anything that is not a whole, non-negative number that fits in an int64 is
refused rather than rounded: a rounded budget is a wrong budget.

Grammar (as in ``k8s.io/apimachinery/pkg/api/resource``)::

    quantity  ::= [sign] number [suffix]
    number    ::= digits | digits "." [digits] | "." digits
    suffix    ::= binary | decimal | exponent
    binary    ::= Ki | Mi | Gi | Ti | Pi | Ei
    decimal   ::= m | k | M | G | T | P | E
    exponent  ::= ("e" | "E") [sign] digits

A fraction in the number (``"1.5Gi"``) or the milli suffix (``"2000m"``) is accepted only
when the value it denotes is a whole number.
"""

from __future__ import annotations

import re
from fractions import Fraction

__all__ = [
    "MAX_QUANTITY",
    "format_bytes",
    "format_quantity",
    "parse_quantity",
    "quantity_equal",
]

MAX_QUANTITY = 2**63 - 1
"""The largest value a Kubernetes quantity may carry (int64)."""

_MAX_INPUT_CHARS = 100
_MAX_EXPONENT = 64  # 10**64 is far above MAX_QUANTITY; larger exponents are refused early

_BINARY = {
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
}
_DECIMAL = {
    "": Fraction(1),
    "m": Fraction(1, 1000),
    "k": Fraction(10**3),
    "M": Fraction(10**6),
    "G": Fraction(10**9),
    "T": Fraction(10**12),
    "P": Fraction(10**15),
    "E": Fraction(10**18),
}

_QUANTITY = re.compile(
    r"(?P<sign>[+-]?)"
    r"(?P<int>[0-9]*)(?:\.(?P<frac>[0-9]*))?"
    r"(?:(?P<binary>Ki|Mi|Gi|Ti|Pi|Ei)"
    r"|[eE](?P<exp>[+-]?[0-9]+)"
    r"|(?P<decimal>[mkMGTPE]?))"
)

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


def _shown(value: str) -> str:
    """The input as it may appear in an error message: quoted and cut short."""
    if len(value) > 40:
        value = value[:40] + "..."
    return repr(value)


def parse_quantity(value: str | int) -> int:
    """Return the exact integer a Kubernetes quantity denotes.

    Args:
        value: a quantity string such as ``"2Gi"``, ``"1e3"`` or ``"500"``, or an int.

    Returns:
        The value as an int, between 0 and :data:`MAX_QUANTITY`.

    Raises:
        ValueError: the input is empty, malformed, negative, not a whole number, or larger
            than an int64. The message names the input.
    """
    if isinstance(value, bool):
        raise ValueError(f"invalid quantity {value!r}: expected a string or an integer")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"invalid quantity {value}: must not be negative")
        if value > MAX_QUANTITY:
            raise ValueError(f"invalid quantity {value}: larger than {MAX_QUANTITY}")
        return value
    if not isinstance(value, str):
        raise ValueError(
            f"invalid quantity of type {type(value).__name__}: expected a string or an integer"
        )
    if not value:
        raise ValueError("invalid quantity '': empty")
    if len(value) > _MAX_INPUT_CHARS:
        raise ValueError(
            f"invalid quantity {_shown(value)}: longer than {_MAX_INPUT_CHARS} characters"
        )
    match = _QUANTITY.fullmatch(value)
    if match is None or not (match["int"] or match["frac"]):
        raise ValueError(
            f"invalid quantity {_shown(value)}: expected a number with an optional suffix "
            "(Ki, Mi, Gi, Ti, Pi, Ei, m, k, M, G, T, P, E or an exponent such as e3)"
        )
    digits = match["int"] or "0"
    fraction = match["frac"] or ""
    number = Fraction(int(digits + fraction), 10 ** len(fraction))
    if match["binary"]:
        scaled = number * _BINARY[match["binary"]]
    elif match["exp"] is not None:
        exponent = int(match["exp"])
        if abs(exponent) > _MAX_EXPONENT:
            raise ValueError(f"invalid quantity {_shown(value)}: exponent out of range")
        scaled = number * Fraction(10) ** exponent
    else:
        scaled = number * _DECIMAL[match["decimal"]]
    if match["sign"] == "-" and scaled != 0:
        raise ValueError(f"invalid quantity {_shown(value)}: must not be negative")
    if scaled.denominator != 1:
        raise ValueError(f"invalid quantity {_shown(value)}: not a whole number")
    result = int(scaled)
    if result > MAX_QUANTITY:
        raise ValueError(f"invalid quantity {_shown(value)}: larger than {MAX_QUANTITY}")
    return result


def format_quantity(value: int) -> str:
    """The shortest exact quantity spelling: the largest binary suffix dividing ``value``.

    ``format_quantity(2**31) == "2Gi"``, ``format_quantity(1000) == "1000"``; meant for
    objects rota writes to the API server, and parsed back exactly by :func:`parse_quantity`.

    Raises:
        ValueError: ``value`` is negative or larger than an int64.
    """
    parse_quantity(value)
    if value:
        for suffix, factor in reversed(_BINARY.items()):
            if value % factor == 0:
                return f"{value // factor}{suffix}"
    return str(value)


def quantity_equal(a: str | int, b: str | int) -> bool:
    """True when both spell the same value; an invalid quantity equals nothing."""
    try:
        return parse_quantity(a) == parse_quantity(b)
    except ValueError:
        return False


def format_bytes(n: int) -> str:
    """Format a byte count for a message: ``512 B``, ``1.5 KiB``, ``60.0 GiB``.

    The unit is the largest binary unit not above ``|n|``; one decimal is shown for every
    unit but bytes. Meant for people, never parsed back.
    """
    sign = "-" if n < 0 else ""
    magnitude = abs(n)
    if magnitude < 1024:
        return f"{sign}{magnitude} B"
    unit = 0
    while unit + 1 < len(_UNITS) and magnitude >= 1024 ** (unit + 1):
        unit += 1
    return f"{sign}{magnitude / 1024**unit:.1f} {_UNITS[unit]}"
