"""The preparer's book of calls in flight: a later call of the other verb wins, effects
are forgotten once no older call is in flight, and the watchdog sees a call stuck past
its deadline (on a clock the test moves)."""

from __future__ import annotations

from driver.calls import CallBook


def test_a_later_call_of_the_other_verb_overtakes_an_older_one() -> None:
    book = CallBook()
    with book.arrive("prepare", ["a", "b"]) as prepare, \
            book.arrive("unprepare", ["a"]) as unprepare:
        book.took_effect(unprepare, "a")
        assert book.overtaken(prepare, "a")
        assert not book.overtaken(prepare, "b")  # not named by the unprepare
        assert not book.overtaken(unprepare, "a")  # its own effect


def test_a_later_call_of_the_same_verb_overtakes_nothing() -> None:
    book = CallBook()
    with book.arrive("prepare", ["a"]) as first, book.arrive("prepare", ["a"]) as second:
        book.took_effect(second, "a")
        assert not book.overtaken(first, "a")


def test_an_older_effect_never_overtakes_a_newer_call() -> None:
    book = CallBook()
    with book.arrive("unprepare", ["a"]) as older, book.arrive("prepare", ["a"]) as newer:
        book.took_effect(older, "a")
        assert not book.overtaken(newer, "a")
        book.took_effect(newer, "a")
        assert book.overtaken(older, "a")


def test_effects_are_forgotten_once_no_older_call_is_in_flight() -> None:
    book = CallBook()
    with book.arrive("prepare", ["a"]) as old:
        with book.arrive("unprepare", ["a"]) as new:
            book.took_effect(new, "a")
        assert book.overtaken(old, "a")  # the older call is still in flight
    with book.arrive("prepare", ["a"]) as later:
        assert not book.overtaken(later, "a")
    assert book.in_flight() == []
    assert book._effects == {}


def test_the_watchdog_names_a_call_stuck_past_its_deadline() -> None:
    now = [100.0]
    book = CallBook(clock=lambda: now[0], default_deadline_s=45, stall_grace_s=15)
    with book.arrive("unprepare", ["a"]), book.arrive("prepare", ["b", "c"], deadline=110.0):
        assert book.stalled() == ""
        now[0] = 125.5  # the prepare's deadline + grace has passed
        problem = book.stalled()
        assert "prepare of 2 claim(s)" in problem
        assert "1 call(s) overdue" in problem
        now[0] = 161.0  # the unprepare (no deadline of its own: 45 s) is overdue too
        assert "unprepare" in book.stalled()
        assert "2 call(s) overdue" in book.stalled()
    assert book.stalled() == ""
