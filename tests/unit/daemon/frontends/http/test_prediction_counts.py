"""Predicted Outputs' counters: the longest common subsequence of the prediction's tokens
and the answer's, as the textbook table computes it."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from meshd.daemon.frontends.http.openai.prediction import common_subsequence, prediction_details

tokens = st.lists(st.integers(0, 6), max_size=40)


def _table(a: list[int], b: list[int]) -> int:
    row = [0] * (len(b) + 1)
    for x in a:
        new = [0]
        for j, y in enumerate(b):
            new.append(row[j] + 1 if x == y else max(row[j + 1], new[j]))
        row = new
    return row[-1]


@given(tokens, tokens)
def test_the_bit_vector_lcs_is_the_table_s(a: list[int], b: list[int]) -> None:
    assert common_subsequence(a, b) == common_subsequence(b, a) == _table(a, b)


def test_counters_accept_a_verbatim_answer_and_reject_what_an_edit_replaced() -> None:
    def tokenize(text: str) -> list[int]:
        return [ord(c) for c in text]

    predicted = tokenize("def f(x): return x + 1")
    assert prediction_details(predicted, "def f(x): return x + 1", tokenize) == {
        "accepted_prediction_tokens": len(predicted), "rejected_prediction_tokens": 0}
    edited = prediction_details(predicted, "def f(x): return y + 1", tokenize)
    assert edited == {"accepted_prediction_tokens": len(predicted) - 1,
                      "rejected_prediction_tokens": 1}
    assert prediction_details(predicted, "", tokenize)["rejected_prediction_tokens"] == \
        len(predicted)
