"""Streaming text out of token bytes: UTF-8 split across tokens, stop strings across tokens."""
from pyedgemoe.text_stream import TextStream


def test_utf8_character_split_across_tokens_is_emitted_whole():
    s = TextStream([])
    euro = "€".encode()
    assert s.push(b"a" + euro[:1]) == "a"
    assert s.push(euro[1:]) == "€"
    assert s.flush() == ""


def test_stop_string_across_tokens_cuts_the_text_before_it():
    s = TextStream(["\n\nUser:"])
    out = s.push(b"Hello") + s.push(b"\n\nUs") + s.push(b"er: more")
    assert out == "Hello"
    assert s.stopped
    assert s.flush() == ""


def test_text_that_only_looks_like_a_stop_prefix_is_released_at_flush():
    s = TextStream(["STOP"])
    assert s.push(b"abc ST") == "abc "
    assert s.flush() == "ST"
    assert not s.stopped
