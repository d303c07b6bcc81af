"""Exact quantity parsing and the byte formatting used in messages."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rota.api.quantity import (
    MAX_QUANTITY,
    format_bytes,
    format_quantity,
    parse_quantity,
    quantity_equal,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", 0),
        ("1", 1),
        ("+7", 7),
        ("-0", 0),
        ("2Gi", 2 * 2**30),
        ("1Ki", 1024),
        ("3Mi", 3 * 2**20),
        ("1Ti", 2**40),
        ("1Pi", 2**50),
        ("7Ei", 7 * 2**60),
        ("1.5Gi", 3 * 2**29),
        (".5Ki", 512),
        ("1k", 1000),
        ("2M", 2_000_000),
        ("80G", 80 * 10**9),
        ("1T", 10**12),
        ("1P", 10**15),
        ("1E", 10**18),
        ("1e3", 1000),
        ("1E3", 1000),
        ("2.5e2", 250),
        ("12e+0", 12),
        ("5000e-3", 5),
        ("2000m", 2),
        ("0m", 0),
        ("1.", 1),
        ("143771Mi", 143771 * 2**20),
        ("9223372036854775807", MAX_QUANTITY),
    ],
)
def test_parses_exactly(text: str, expected: int) -> None:
    assert parse_quantity(text) == expected


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ("", "empty"),
        ("-1", "negative"),
        ("-2Gi", "negative"),
        ("0.5", "whole"),
        ("1500m", "whole"),
        ("1e-1", "whole"),
        ("1.0000000001Ki", "whole"),
        ("9223372036854775808", "larger"),
        ("8Ei", "larger"),
        ("1e19", "larger"),
        ("1e999999", "exponent"),
        (" 1Gi", "expected a number"),
        ("1Gi ", "expected a number"),
        ("1GiB", "expected a number"),
        ("1gi", "expected a number"),
        ("Gi", "expected a number"),
        (".", "expected a number"),
        ("1e", "expected a number"),
        ("0x10", "expected a number"),
        ("1_000", "expected a number"),
        ("1" * 101, "longer"),
        (-5, "negative"),
        (2**63, "larger"),
    ],
)
def test_refuses_with_the_input_named(value: str | int, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment) as caught:
        parse_quantity(value)
    shown = str(value)[:40]
    assert shown in str(caught.value)


@pytest.mark.parametrize("value", [True, 1.0, None, b"1"])
def test_refuses_other_types(value: object) -> None:
    with pytest.raises(ValueError, match="expected a string or an integer"):
        parse_quantity(value)  # type: ignore[arg-type]


def test_error_quotes_only_a_prefix_of_long_input() -> None:
    with pytest.raises(ValueError, match="longer") as caught:
        parse_quantity("9" * 199 + "x")
    assert len(str(caught.value)) < 120


@given(st.integers(min_value=0, max_value=MAX_QUANTITY))
def test_plain_and_formatted_spellings_round_trip(value: int) -> None:
    assert parse_quantity(str(value)) == value
    assert parse_quantity(value) == value
    assert parse_quantity(format_quantity(value)) == value


@given(
    st.integers(min_value=0, max_value=2**20),
    st.sampled_from(
        [("Ki", 2**10), ("Mi", 2**20), ("Gi", 2**30), ("k", 10**3), ("M", 10**6), ("G", 10**9)]
    ),
)
def test_suffixes_scale(number: int, suffix: tuple[str, int]) -> None:
    text, factor = suffix
    assert parse_quantity(f"{number}{text}") == number * factor
    assert parse_quantity(f"{number}e3") == number * 1000


@given(st.integers(min_value=0, max_value=10**9), st.integers(min_value=1, max_value=999))
def test_milli_is_accepted_only_when_whole(whole: int, rest: int) -> None:
    assert parse_quantity(f"{whole * 1000}m") == whole
    with pytest.raises(ValueError, match="whole"):
        parse_quantity(f"{whole * 1000 + rest}m")


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (0, "0"),
        (1000, "1000"),
        (1024, "1Ki"),
        (2**31, "2Gi"),
        (1536 * 2**20, "1536Mi"),
        (143771 * 2**20, "143771Mi"),
        (2**60, "1Ei"),
    ],
)
def test_format_quantity(value: int, expected: str) -> None:
    assert format_quantity(value) == expected


def test_format_quantity_refuses_negative() -> None:
    with pytest.raises(ValueError, match="negative"):
        format_quantity(-1)


@pytest.mark.parametrize(
    ("a", "b", "equal"),
    [
        ("1Mi", "1024Ki", True),
        ("1Mi", 1048576, True),
        ("1G", "1e9", True),
        ("1Gi", "1G", False),
        ("bogus", "bogus", False),
    ],
)
def test_quantity_equal(a: str | int, b: str | int, equal: bool) -> None:
    assert quantity_equal(a, b) is equal


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (0, "0 B"),
        (512, "512 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (1536, "1.5 KiB"),
        (60 * 2**30, "60.0 GiB"),
        (143771 * 2**20, "140.4 GiB"),
        (int(3.6 * 2**30), "3.6 GiB"),
        (2**40, "1.0 TiB"),
        (2**62, "4.0 EiB"),
        (-2 * 2**30, "-2.0 GiB"),
    ],
)
def test_format_bytes(value: int, expected: str) -> None:
    assert format_bytes(value) == expected
