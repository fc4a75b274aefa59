"""Streaming text out of token bytes, a piece a token: UTF-8 split across tokens, stop strings across tokens."""
from pyedgemoe.text_stream import TextStream


def test_utf8_character_split_across_tokens_is_given_whole_by_the_token_that_ends_it():
    s = TextStream([])
    euro = "€".encode()
    assert s.push(b"a" + euro[:1]) == ["a"]
    assert s.push(euro[1:2]) == [""]  # a token inside the character: its piece is empty
    assert s.push(euro[2:]) == ["€"]
    assert s.flush() == []


def test_stop_string_across_tokens_cuts_the_text_before_it():
    s = TextStream(["\n\nUser:"])
    assert s.push(b"Hello") == ["Hello"]
    assert s.push(b"\n\nUs") == []  # held: it may begin the stop string
    assert s.push(b"er: more") == []
    assert s.stopped
    assert s.flush() == []


def test_a_token_is_held_whole_and_cut_where_a_stop_string_begins_in_it():
    s = TextStream(["STOP"])
    assert s.push(b"abc ST") == []
    assert s.push(b"OP x") == ["abc "]
    assert s.stopped


def test_tokens_that_only_look_like_a_stop_prefix_are_released_each_as_it_was():
    s = TextStream(["STOP"])
    assert s.push(b"abc ST") == []
    assert s.push(b"O") == []
    assert s.push(b"NE") == ["abc ST", "O", "NE"]
    assert s.push(b" S") == []
    assert s.flush() == [" S"]
    assert not s.stopped
