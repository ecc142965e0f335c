"""Output constraints (JSON schema, Lark, regex, GBNF) through llguidance.

Why llguidance: it is the grammar engine llama.cpp, vLLM and SGLang use, and it has what
speculation needs besides a token mask: how many of a draft's tokens the grammar allows
(drafts are cut there before they are verified), the tokens it forces next (drafted like
any proposer's tokens) and a rollback of consumed tokens.

:func:`compile_grammar` turns a request's constraint into llguidance's grammar text and
checks it against the model's vocabulary, raising :class:`ConstraintError` with
llguidance's own message, or :mod:`.schema_checks`' where the language is empty or the
input nests too deep; :class:`GrammarState` is one request's matcher. Between steps it
holds exactly the committed tokens; the sampler's walk over a verify window advances it
row by row (``Sampler.match_rows``) and the engine brings it back to the committed tokens
afterwards, so a trim, an in-place rollback and a checkpoint restore all find it where
they leave the model.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence, Set
from typing import TYPE_CHECKING, Final

import numpy as np
import numpy.typing as npt
from llguidance import LLMatcher, LLTokenizer
from llguidance.gbnf_to_lark import gbnf_to_lark

from meshd.protocol.messages import CONSTRAINT_KINDS

if TYPE_CHECKING:  # a TypedDict of the stubs only
    from llguidance._lib import JsonCompileOptions

from meshd.daemon.engine.sampling import FloatArray, Sampler
from meshd.daemon.engine.schema_checks import bounded_numbers, gbnf_problem, schema_problem

__all__ = [
    "CONSTRAINT_KINDS",
    "JSON_DEFAULTS",
    "ConstraintError",
    "GrammarState",
    "compile_grammar",
]

#: How JSON is laid out unless the schema's ``x-guidance`` says otherwise: the separators
#: of Python's ``json.dumps`` and no other whitespace. One layout lets the grammar force
#: keys, quotes and separators (drafted for free); any-whitespace JSON forces almost none.
JSON_DEFAULTS: Final[JsonCompileOptions] = {
    "whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
}


class ConstraintError(ValueError):
    """A schema or grammar llguidance refuses; the message is llguidance's own."""


def _grammar_text(kind: str, value: object) -> str:
    if kind == "json_object":
        return str(LLMatcher.grammar_from_json_schema({"type": "object"},
                                                      defaults=JSON_DEFAULTS))
    if kind == "json_schema":
        if not isinstance(value, Mapping):
            raise ConstraintError("a JSON schema must be an object")
        problem = schema_problem(value)
        if problem is not None:
            raise ConstraintError(problem)
        try:
            return str(LLMatcher.grammar_from_json_schema(
                json.dumps(bounded_numbers(dict(value))), defaults=JSON_DEFAULTS))
        except ValueError as exc:
            raise ConstraintError(str(exc)) from None
    if not isinstance(value, str):
        raise ConstraintError(f"a {kind} grammar must be a string")
    if kind == "lark":
        return str(LLMatcher.grammar_from_lark(value))
    if kind == "regex":
        return str(LLMatcher.grammar_from_regex(value))
    if kind == "gbnf":
        problem = gbnf_problem(value)
        if problem is not None:
            raise ConstraintError(f"GBNF: {problem}")
        try:
            return str(LLMatcher.grammar_from_lark(gbnf_to_lark(value)))
        except Exception as exc:  # the converter raises plain exceptions on bad GBNF
            raise ConstraintError(f"GBNF: {exc}") from None
    raise ConstraintError(f"unknown constraint kind {kind!r} "
                          f"(one of {', '.join(CONSTRAINT_KINDS)})")


def is_json_document(grammar: str) -> bool:
    """Whether llguidance's ``grammar`` is one JSON schema (what ``json_schema`` and
    ``json_object`` compile to), not a lark, regex or tool-call grammar."""
    try:
        parsed = json.loads(grammar)
    except ValueError:
        return False
    grammars = parsed.get("grammars") if isinstance(parsed, dict) else None
    return (isinstance(grammars, list) and len(grammars) == 1
            and isinstance(grammars[0], dict) and grammars[0].get("json_schema") is not None)


def compile_grammar(kind: str, value: object, tokenizer: LLTokenizer) -> str:
    """llguidance's grammar for a constraint, checked against the model's vocabulary.

    Blocking (a large schema takes up to a second); never call it on the event loop."""
    grammar = _grammar_text(kind, value)
    if kind in ("json_object", "json_schema"):  # (llguidance finds what has no value)
        error, messages = LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        if error:
            raise ConstraintError(messages[0] if messages else "invalid grammar")
        return grammar
    # A grammar whose language is empty compiles; its first mask then allows nothing,
    # and the answer would be an empty ``stop``. (A matcher reports what validation
    # would, at about twice its cost.)
    matcher = LLMatcher(tokenizer, grammar, log_level=0)
    if matcher.is_error():
        raise ConstraintError(matcher.get_error() or "invalid grammar")
    matcher.compute_bitmask()
    if matcher.is_error():
        raise ConstraintError("it allows no answer: no token can begin one (a rule that "
                              "only refers to itself?)")
    return grammar


class GrammarState:
    """One request's grammar matcher, in the terms the engine needs."""

    def __init__(self, tokenizer: LLTokenizer, grammar: str, *, n_vocab: int,
                 eog: Set[int]) -> None:
        self._matcher = LLMatcher(tokenizer, grammar, log_level=0)
        if self._matcher.is_error():
            raise ConstraintError(self._matcher.get_error())
        self._n_vocab = n_vocab
        self._eog = eog
        #: Tokens consumed past the committed ones (inside a window's walk).
        self._ahead = 0
        #: Full masks computed (each a pass over the vocabulary), for the statistics.
        self.masks = 0
        self._forced: list[int] | None = None
        #: The grammar holds the whole answer to one JSON document (a JSON schema or
        #: ``json_object``): an unescaped quote in it opens or closes a string.
        self.json_document = is_json_document(grammar)

    def allows(self, token: int) -> bool:
        """May ``token`` come next? (End-of-generation tokens once the grammar accepts.)"""
        if token in self._eog:
            return bool(self._matcher.is_accepting())
        return bool(self._matcher.validate_tokens([token]) == 1)

    def allowed(self) -> npt.NDArray[np.bool_]:
        """The next token's mask over the model's vocabulary (True: allowed)."""
        self.masks += 1
        bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        mask = np.unpackbits(bits, bitorder="little").astype(bool)
        if mask.shape[0] >= self._n_vocab:
            return mask[: self._n_vocab]
        return np.concatenate([mask, np.zeros(self._n_vocab - mask.shape[0], dtype=bool)])

    def choose(self, row: FloatArray, sampler: Sampler) -> int:
        """The sampler's token for one logits row under the grammar.

        Greedy: the unconstrained argmax when the grammar allows it (the masked argmax is
        then the same token), so most steps need no mask at all."""
        if sampler.params.greedy:
            best = int(np.argmax(row))
            if self.allows(best):
                return best
        return sampler.sample(np.where(self.allowed(), row, -np.inf))

    def valid_prefix(self, draft: Sequence[int]) -> int:
        """How many leading tokens of ``draft`` the grammar allows from here."""
        return int(self._matcher.validate_tokens(list(draft))) if draft else 0

    def forced(self) -> list[int]:
        """The tokens the grammar forces next (empty when it leaves a choice)."""
        if self._forced is None:
            self._forced = ([] if self._matcher.is_stopped()
                            else list(self._matcher.compute_ff_tokens()))
        return self._forced

    def advance(self, token: int) -> None:
        """Consume one allowed token inside a verify window's walk."""
        if not self._matcher.consume_token(token):
            raise ConstraintError(f"the grammar refused token {token}: "
                                  f"{self._matcher.get_error()}")
        self._ahead += 1
        self._forced = None

    def settle(self, committed: Sequence[int]) -> None:
        """After a window: hold exactly the committed tokens. The walk consumed the
        drafts the target matched; the commits are a prefix of them, then (perhaps) the
        target's own token."""
        self._forced = None
        keep = min(len(committed), self._ahead)
        if self._ahead > keep:
            self._matcher.rollback(self._ahead - keep)
        self._ahead = 0
        for token in committed[keep:]:
            if self._matcher.is_stopped():
                break  # only an end-of-generation token can follow; the request ends
            if not self._matcher.consume_token(token):
                raise ConstraintError(f"the grammar refused committed token {token}: "
                                      f"{self._matcher.get_error()}")
