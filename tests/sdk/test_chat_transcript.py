"""ChatTranscript: what a context fills (or cuts back) as a chat template
renders a conversation again after each message. One object for the SDK's
Context and the server's prompt-length check (tartlet/sdk/chat_transcript.py)."""

from tartlet.sdk.chat_transcript import ChatTranscript


def test_a_rendering_that_extends_fills_only_the_tail():
    t = ChatTranscript()
    assert t.refill("<s>sys|", 3) == (3, "<s>sys|")  # the chat starts after 3 tokens the context held
    t.filled("<s>sys|", 7)
    assert t.refill("<s>sys|user hi|", 7) == (7, "user hi|")
    t.filled("<s>sys|user hi|", 10)
    assert t.marks == [(0, 3), (7, 7), (15, 10)]


def test_a_rewritten_part_cuts_back_to_the_last_fill_before_the_difference():
    t = ChatTranscript()
    for text, n in (("A|", 2), ("A|B {x:1}|", 6), ("A|B {x:1}|C|", 8)):
        keep, tail = t.refill(text, t.marks[-1][1] if t.marks else 0)
        t.filled(text, n)
    # the template now renders B's call with other spacing: refill from after "A|"
    keep, tail = t.refill("A|B {x: 1}|C|D|", 8)
    assert (keep, tail) == (2, "B {x: 1}|C|D|")
    t.filled("A|B {x: 1}|C|D|", 11)
    assert t.marks == [(0, 0), (2, 2), (15, 11)]


def test_generated_text_and_a_recorded_turn():
    t = ChatTranscript()
    t.filled("U|<a>", 4)
    t.extend("hello", 6)  # a generated reply, outside the template
    assert t.rendered == "U|<a>hello" and t.marks[-1] == (10, 6)
    t.replace_from(5, "<call/>", 5)  # the turn recorded as a tool call
    assert t.rendered == "U|<a><call/>" and t.marks == [(5, 4), (12, 5)]
    c = t.copy()
    c.reset()
    assert c.rendered == "" and t.rendered == "U|<a><call/>"
