"""The value-copy proposer over a byte-level vocabulary (token = one byte): what it
drafts inside and outside a JSON string, and where in the prompt it copies from."""

from __future__ import annotations

import pytest

from meshd.plugins.base import ProposalRequest
from meshd.plugins.value_copy import (
    MAX_COPY_BYTES,
    MAX_KEY_BYTES,
    MAX_SKIPS,
    ValueCopyProposer,
)

PROMPT = ("From: Ingrid Solberg <ingrid.solberg@nordkapp.no>\n"
          "Order NK-20931, ship express to Tromsø. Call +47 412 55 810.")


def tokens_of(text: str) -> list[int]:
    return list(text.encode())


def make(prompt: str = PROMPT) -> ValueCopyProposer:
    return ValueCopyProposer(tokens_of(prompt), lambda t: bytes([t]), tokens_of)


def drafted(prop: ValueCopyProposer, answer: str, prompt: str = PROMPT,
            max_len: int = 200) -> str:
    seq = tokens_of(prompt) + tokens_of(answer)
    got = prop.propose(ProposalRequest(tokens=seq, n_prompt=len(tokens_of(prompt)),
                                       max_len=max_len, deadline=0.0))
    return "" if got is None else bytes(got.tokens).decode("utf-8", "replace")


def test_a_value_found_in_the_prompt_is_continued_from_there() -> None:
    """(A proposer follows one answer as it grows: one per answer here.)"""
    after = PROMPT.encode()[PROMPT.index("Ingrid") + 2:]
    assert drafted(make(), '{"name": "In') == after[:MAX_COPY_BYTES].decode()
    assert drafted(make(), '{"name": "Ingrid", "order": "NK-') == \
        "20931, ship express to Tromsø. Call +47 412 55 810."
    assert drafted(make(), '{"name": "Ingrid", "phone": "+47 4', max_len=6) == "12 55 "


def test_nothing_is_drafted_outside_a_string_or_before_the_value_has_two_bytes() -> None:
    assert drafted(make(), '{"name": "Ingrid"') == ""  # the string is closed
    assert drafted(make(), '{"name": "Ingrid", ') == ""
    assert drafted(make(), '{"name": "I') == ""  # one byte says nothing yet
    assert drafted(make(), '{"count": 4') == ""  # numbers are not strings


def test_an_escaped_quote_does_not_close_the_string() -> None:
    prompt = 'He said "stop" twice, then left.'
    # Inside the string, past an escaped quote: matched by what follows the escape.
    assert drafted(make(prompt), '{"quote": "He said \\"s', prompt) == ""  # one byte
    assert drafted(make(prompt), '{"quote": "He said \\"st', prompt) == \
        'op" twice, then left.'
    assert drafted(make(prompt), '{"quote": "He said \\"stop\\" tw', prompt) == \
        "ice, then left."


def test_a_whole_value_is_copied_only_from_where_a_word_starts() -> None:
    # "grid" occurs only inside "Ingrid" and "ingrid": not a copy of anything.
    assert drafted(make(), '{"name": "grid') == ""
    prompt = "ingrid's grid layout"
    assert drafted(make(prompt), '{"name": "grid', prompt) == " layout"


def test_the_search_for_a_word_start_gives_up_after_a_bounded_number_of_skips() -> None:
    near = "xab " * MAX_SKIPS + "ab near"
    assert drafted(make(near), '{"k": "ab', near) == " near"
    far = "xab " * (MAX_SKIPS + 1) + "ab far"
    assert drafted(make(far), '{"k": "ab', far) == ""


def test_a_long_value_is_matched_by_its_tail() -> None:
    body = "".join(f"line {i} of a long passage; " for i in range(12))
    prompt = f"Quote: {body}The end."
    value = body[:-4]
    assert len(value.encode()) > MAX_KEY_BYTES
    assert drafted(make(prompt), '{"q": "' + value, prompt) == "ge; The end."


def test_the_answer_is_followed_token_by_token_and_the_draft_is_cached() -> None:
    prop = make()
    assert drafted(prop, '{"city": "Tr') == "omsø. Call +47 412 55 810."
    calls: list[str] = []
    prop._tokenize = lambda text: calls.append(text) or tokens_of(text)  # type: ignore[method-assign]
    seq = tokens_of(PROMPT) + tokens_of('{"city": "Tr')
    first = prop.draft(seq)
    assert prop.draft(seq) == first and calls == []  # already made for this length
    assert prop.ready(seq + tokens_of("om")) and len(calls) == 1


@pytest.mark.parametrize("answer", ['{"a": "', '{"a": "zz'])
def test_no_draft_where_the_value_is_not_in_the_prompt(answer: str) -> None:
    assert drafted(make(), answer) == ""
