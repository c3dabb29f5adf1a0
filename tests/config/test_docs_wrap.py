"""``asyncgrpo config --doc``: a description's own line breaks never cut a sentence (a fresh-user trial read
"...could" / "otherwise decode..." on two comment lines)."""

from __future__ import annotations

from asyncgrpo_cli.config.docs import COMMENT_WIDTH, _comment


def test_paragraphs_are_rewrapped_whole_and_kept_apart():
    text = "Send a unique seed with every request, so engines\nsharing a seed never decode identical text.\n\nFalse " \
           "sends none."
    lines = _comment(text, "  ")
    assert lines[0] == "  # Send a unique seed with every request, so engines sharing a seed never decode identical text."
    assert lines[1:] == ["  #", "  # False sends none."]
    long = _comment("word " * 60, "")
    assert len(long) > 1 and all(len(line) <= COMMENT_WIDTH for line in long)
