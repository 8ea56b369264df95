"""Label matchers a user types (`kvtune doctor --prometheus --selector`), generated: every list of valid
matchers reads back as itself once rendered into PromQL (so no value, whatever it holds, can close the braces
and add to the query), and text that is not one is refused with one line saying where."""

from __future__ import annotations

import ast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtune.observability.promql import (
    MATCH_OPERATORS,
    MAX_SELECTOR_CHARS,
    Matcher,
    SelectorError,
    parse_matchers,
    parse_selector,
    quoted,
)

names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,20}", fullmatch=True).filter(lambda name: name[:2] != "__")
values = st.text(max_size=40)  # any text: quotes, backslashes, braces, newlines, terminal escapes, emoji
matchers = st.builds(Matcher, names, st.sampled_from(MATCH_OPERATORS), values)


@settings(max_examples=300, deadline=None)
@given(values)
def test_a_value_renders_as_a_string_literal_that_reads_back_as_itself(value: str) -> None:
    rendered = quoted(value)
    # Go's (PromQL's) double-quoted literal and Python's agree on every escape `quoted` writes.
    assert ast.literal_eval(rendered) == value
    assert rendered.isprintable()  # no control character reaches a terminal or a log
    assert parse_matchers(f"a={rendered}") == [Matcher("a", "=", value)]


@settings(max_examples=300, deadline=None)
@given(st.lists(matchers, max_size=6), st.booleans(), st.sampled_from([", ", ",", " , "]))
def test_matchers_rendered_into_a_query_read_back_as_the_same_matchers(
    given_matchers: list[Matcher], braced: bool, comma: str
) -> None:
    text = comma.join(matcher.render() for matcher in given_matchers)
    text = f"{{{text}}}" if braced else text
    if len(text) > MAX_SELECTOR_CHARS:
        return
    assert parse_matchers(text) == given_matchers
    selector = parse_selector(text)
    query = selector.of("vllm:num_requests_running")
    # The query holds exactly these matchers: what is between the braces parses back to them.
    assert query.startswith("vllm:num_requests_running")
    inside = query.removeprefix("vllm:num_requests_running")
    assert parse_matchers(inside) == given_matchers
    assert parse_selector(", ".join(selector.matchers)) == selector  # rendering is stable


@pytest.mark.parametrize(
    ("typed", "value"),
    [
        ('job="vllm"', "vllm"),
        ("job='vllm'", "vllm"),
        ("job=`a\\.b`", "a\\.b"),  # a raw string: no escapes
        ('job="a\\\\.b"', "a\\.b"),
        ('job="\\u00e9\\x41\\101\\n"', "éAA\n"),
        ("job='it\\'s'", "it's"),
        ('job="x\\"} or vector(1) #"', 'x"} or vector(1) #'),
    ],
)
def test_promql_string_literals_are_read_as_prometheus_reads_them(typed: str, value: str) -> None:
    assert parse_matchers(typed) == [Matcher("job", "=", value)]


@pytest.mark.parametrize(
    ("typed", "where", "expected"),
    [
        ("job=vllm", 5, 'a quoted value (e.g. "vllm")'),
        ('job="x"} or vector(1) #', 8, "a comma before the next matcher"),
        ('job="a" instance="b"', 9, "a comma before the next matcher"),
        ('9job="x"', 1, "a label name"),
        ('__name__="up"', 1, "a label name not starting with __"),
        ('job=="x"', 5, 'a quoted value (e.g. "vllm")'),
        ('job~="x"', 4, "one of =, !=, =~, !~"),
        ('job="x', 5, 'a closing " on the same line'),
        ('job="a\nb"', 5, 'a closing " on the same line'),
        ('job="\\q"', 6, "a known escape"),
        ('job="\\xff"', 5, "a value whose escapes spell UTF-8 text"),
        ('job="\\ud800"', 5, "a value whose escapes spell UTF-8 text"),
        ("job=`x", 5, "a closing `"),
        ('  {job="x",,}', 12, "a label name"),
    ],
)
def test_text_that_is_no_matcher_list_is_refused_saying_where(typed: str, where: int, expected: str) -> None:
    with pytest.raises(SelectorError) as refused:
        parse_matchers(typed)
    message = str(refused.value)
    assert f"expected {expected}" in message and f"at character {where};" in message, message
    assert "\n" not in message


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=60))
def test_any_text_is_matchers_or_one_line_of_refusal(text: str) -> None:
    try:
        parsed = parse_matchers(text)
    except SelectorError as exc:
        assert "\n" not in str(exc) and "is not a list of label matchers" in str(exc)
        return
    assert parse_matchers(", ".join(matcher.render() for matcher in parsed)) == parsed


def test_a_selector_too_long_or_shaped_like_a_credential_is_not_quoted_back() -> None:
    with pytest.raises(SelectorError, match="longer than 1,024 characters"):
        parse_matchers('job="' + "x" * MAX_SELECTOR_CHARS + '"')
    with pytest.raises(SelectorError) as refused:
        parse_matchers("hf_abcdefghijklmnopqrstuvwxyz0123")
    assert "hf_abcdefghij" not in str(refused.value) and "the value given" in str(refused.value)
