"""A fake runtime: a deterministic toy model behind the surface the real session uses,
so the engine (and what sits on it) can be tested without llama.cpp, in milliseconds.

The seam is the target context: :class:`FakeContext` has what
:class:`~meshd.native.session.SequenceSession`, ``verify_many`` and ``prefill_parts``
call on a :class:`~meshd.native.context.TargetContext` (one forward over rows of many
sequences, sequence slots, KV trims and copies, state save/restore), so the real
session code runs on it unchanged, and so does everything above it. Its state is honest:
each sequence holds exactly the tokens written at its positions, a forward refuses a
row that is not at its sequence's next position, and a row's logits are a pure function
of the tokens up to it (whatever shares its forward).

The toy model (:class:`ToyModel`): a byte-level vocabulary (ids 0-255 are the bytes,
then BOS, EOS and a few specials), whose favourite next token is chosen by ``rule``
(default: recite :data:`STORY`, then EOS); the others get small, fixed, pseudo-random
logits, so seeded sampling has choices to make. A test forces what it needs with its
own ``rule``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

import attrs
import numpy as np

from meshd.native.errors import CapacityError, NativeError, RuntimeStateError
from meshd.native.records import ContextConfig, FloatArray, ModelInfo, Row, TooManyTokens
from meshd.native.session import SequenceSession

if TYPE_CHECKING:
    from meshd.native.context import TargetContext
    from meshd.native.tokenizer import Tokenizer

__all__ = ["BOS", "CHAT_TEMPLATE", "EOS", "N_VOCAB", "STORY", "FakeContext", "FakeTokenizer",
           "ToyModel", "story_rule"]

#: Ids 0-255 are bytes; then the specials.
BOS, EOS, PAD = 256, 257, 258
N_VOCAB = 300
_SPECIAL_TEXT = {BOS: b"<s>", EOS: b"</s>", PAD: b"<pad>"}
#: What the default rule recites (its 4-grams are unique, so any 4 tokens of it say
#: where it goes on).
STORY = "Once upon a time, a small fox found a red key under the old oak."
#: How far the favourite token stands above the others (logits of the rest lie in
#: [0, NOISE)): greedy decoding always takes it, sampling at temperature 1 four times
#: in five.
MARGIN = 9.0
NOISE = 3.0

#: The toy model's chat template (Jinja, as a GGUF holds one): a chat prompt ends in
#: "assistant:", which the default rule answers with the whole :data:`STORY`.
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")

Rule = Callable[[Sequence[int]], int]


def story_rule(tokens: Sequence[int]) -> int:
    """The default rule: continue :data:`STORY` after the longest of the last 4 tokens
    found in it (its first place; EOS after its end), else start it."""
    text = STORY.encode()
    for n in range(min(4, len(tokens)), 0, -1):
        tail = tokens[-n:]
        if all(t < 256 for t in tail):
            at = text.find(bytes(tail))
            if at >= 0:
                end = at + n
                return text[end] if end < len(text) else EOS
    return text[0]


class FakeTokenizer:
    """Byte-level text <-> ids, with :class:`~meshd.native.tokenizer.Tokenizer`'s
    surface (the engine reads pieces; the requests layer tokenizes)."""

    def __init__(self, *, add_bos: bool = True) -> None:
        self.n_vocab = N_VOCAB
        self.add_bos = add_bos
        self.max_piece_bytes = max(len(t) for t in _SPECIAL_TEXT.values())

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False,
                 max_tokens: int | None = None) -> list[int]:
        data = text.encode("utf-8")
        ids: list[int] = [BOS] if add_special and self.add_bos else []
        while data:
            for token, special in _SPECIAL_TEXT.items():
                if parse_special and data.startswith(special):
                    ids.append(token)
                    data = data[len(special):]
                    break
            else:
                ids.append(data[0])
                data = data[1:]
        if max_tokens is not None and len(ids) > max_tokens:
            raise TooManyTokens(len(ids), max_tokens)
        return ids

    def piece(self, token: int, *, special: bool = False) -> bytes:
        if not 0 <= token < N_VOCAB:
            raise ValueError(f"token id {token} outside the vocabulary [0, {N_VOCAB})")
        if token < 256:
            return bytes([token])
        return _SPECIAL_TEXT.get(token, b"") if special else b""

    def detokenize(self, tokens: Sequence[int], *, special: bool = False) -> str:
        return b"".join(self.piece(t, special=special) for t in tokens).decode(
            "utf-8", "replace")

    def close(self) -> None:
        pass


class ToyModel:
    """The toy model: its facts (``info``), its tokenizer, and its logits for a
    context. ``recurrent``: report a recurrent state, so the engine repairs by in-place
    rollback or checkpoint-restore-replay instead of KV trims."""

    def __init__(self, rule: Rule = story_rule, *, recurrent: bool = False,
                 n_ctx_train: int = 4096, chat_template: str | None = CHAT_TEMPLATE,
                 seed: int = 0) -> None:
        self.rule = rule
        self.gpu_layers = 0
        self.placement = None
        self.plan = None
        self.tokenizer = FakeTokenizer()
        self.chat_template = chat_template
        self.info = ModelInfo(
            path="fake.gguf", architecture="toy", description="toy byte model",
            n_vocab=N_VOCAB, n_ctx_train=n_ctx_train, n_embd=8, n_layer=1, n_layer_nextn=0,
            n_params=N_VOCAB * N_VOCAB, size_bytes=N_VOCAB * N_VOCAB * 4,
            is_recurrent=recurrent, is_hybrid=False, eog_tokens=frozenset({EOS}),
            bos_token=BOS, eos_token=EOS, has_chat_template=chat_template is not None)
        rng = np.random.default_rng(seed)
        #: Logits of every token after each last token, before the rule's favourite.
        self._noise: FloatArray = rng.uniform(0.0, NOISE, size=(N_VOCAB, N_VOCAB)).astype(
            np.float32)

    def logits(self, tokens: Sequence[int]) -> FloatArray:
        """The next-token logits after ``tokens`` (a pure function of them)."""
        row: FloatArray = self._noise[tokens[-1]].copy()
        row[self.rule(tokens)] += MARGIN
        return row

    def check_devices(self) -> None:
        pass

    def meta(self, key: str) -> str | None:
        """GGUF metadata: the toy model has none."""
        return None

    def close(self) -> None:
        pass

    def context(self, config: ContextConfig | None = None) -> FakeContext:
        return FakeContext(self, config or ContextConfig(n_ctx_seq=512, n_seq_max=4))

    def open_session(self, context: FakeContext, *, reserve: int = 0) -> SequenceSession:
        """A real :class:`SequenceSession` on a free slot of the fake context."""
        return SequenceSession.open(context.as_target(), reserve=reserve, mtp=False)

    def as_tokenizer(self) -> Tokenizer:
        """The tokenizer, typed as the engine names it (it has the same surface)."""
        return cast("Tokenizer", self.tokenizer)


Holder = TypeVar("Holder")


@attrs.define
class _Faults:
    """Faults a test arms: the next forward fails (as a failed ``llama_decode``)."""

    fail_forwards: int = 0


class FakeContext:
    """A :class:`~meshd.native.context.TargetContext` over the toy model: sequences are
    token lists, a forward appends rows and returns the output rows' logits."""

    def __init__(self, model: ToyModel, config: ContextConfig) -> None:
        if config.n_ctx_seq > model.info.n_ctx_train:
            raise CapacityError(f"n_ctx_seq={config.n_ctx_seq} exceeds the model's "
                                f"training context {model.info.n_ctx_train}")
        self.model = model
        self.config = config
        self.exact = True
        self.lock = threading.RLock()
        self.n_vocab = model.info.n_vocab
        self.recurrent = model.info.has_recurrent_state
        self.rollback_window = (min(config.draft_max, 8)
                                if self.recurrent and config.in_place_rollback else 0)
        self.mtp: Any = None
        self.last_mtp_s = 0.0
        self.forward_id = 0
        self.sessions: dict[int, Any] = {}
        self.faults = _Faults()
        #: Every forward's rows, in order (what a test may count).
        self.forwards: list[list[Row]] = []
        self._free = list(range(config.n_seq_max))
        self._seqs: dict[int, list[int]] = {}
        self._closed = False

    def as_target(self) -> TargetContext:
        """This context, typed as the session names it (it has the same surface)."""
        return cast("TargetContext", self)

    @property
    def ctx(self) -> FakeContext:
        if self._closed:
            raise NativeError("the context has been closed")
        return self

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def tokens(self, seq_id: int) -> list[int]:
        """What sequence ``seq_id`` holds, position by position."""
        return list(self._seqs.get(seq_id, []))

    def close(self) -> None:
        with self.lock:
            for session in list(self.sessions.values()):
                session.close()
            self._closed = True

    def open_slot(self, open_on: Callable[[int], Holder], *, reserve: int = 0) -> Holder:
        with self.lock:
            if reserve > self.config.n_ctx_seq:
                raise CapacityError(f"request needs {reserve} tokens of context but each "
                                    f"session has {self.config.n_ctx_seq}")
            if not self._free:
                raise CapacityError(f"all {self.config.n_seq_max} session slots are in use")
            seq_id = min(self._free)
            self._free.remove(seq_id)
            try:
                holder = open_on(seq_id)
            except BaseException:
                self._free.append(seq_id)
                raise
            self.sessions[seq_id] = holder
            self._seqs[seq_id] = []
            return holder

    def release_slot(self, seq_id: int) -> None:
        with self.lock:
            if self.sessions.pop(seq_id, None) is None:
                return
            self._seqs.pop(seq_id, None)
            self._free.append(seq_id)

    def forward(self, rows: Sequence[Row]) -> tuple[FloatArray, FloatArray | None]:
        if not rows:
            raise ValueError("empty forward")
        if len(rows) > self.config.n_batch:
            raise ValueError(f"forward of {len(rows)} rows exceeds "
                             f"n_batch={self.config.n_batch}")
        with self.lock:
            _ = self.ctx
            self.forward_id += 1
            if self.faults.fail_forwards > 0:
                self.faults.fail_forwards -= 1
                seqs = sorted({r.seq_id for r in rows})
                raise RuntimeStateError(f"llama_decode failed with code 1 for sequences {seqs}",
                                        seq_id=seqs[0] if len(seqs) == 1 else None)
            out: list[FloatArray] = []
            for r in rows:
                seq = self._seqs[r.seq_id]
                if r.pos != len(seq):
                    raise RuntimeStateError(
                        f"row at position {r.pos} of a sequence holding {len(seq)} tokens",
                        seq_id=r.seq_id)
                seq.append(r.token)
                if r.output:
                    out.append(self.model.logits(seq))
            self.forwards.append(list(rows))
            logits = (np.stack(out) if out
                      else np.empty((0, self.n_vocab), dtype=np.float32))
            return logits, None

    def seq_rm(self, seq_id: int, p0: int, p1: int = -1) -> bool:
        with self.lock:
            seq = self._seqs.get(seq_id)
            if seq is None:
                return True
            if p1 != -1:
                return False  # only suffixes (as meshd asks)
            del seq[max(p0, 0):]
            return True

    def holds_from_start(self, seq_id: int) -> bool:
        return True

    def seq_cp_whole(self, src: int, dst: int) -> None:
        with self.lock:
            self._seqs[dst] = list(self._seqs[src])

    def seq_state_save(self, seq_id: int) -> tuple[list[int], int, int]:
        with self.lock:
            state = list(self._seqs[seq_id])
        return state, max(1, len(state)), max(1, len(state))

    def seq_state_load(self, seq_id: int, data: list[int]) -> int:
        with self.lock:
            self._seqs[seq_id] = list(data)
        return max(1, len(data))

    def seq_state_bytes(self, seq_id: int) -> int:
        return 4 * len(self._seqs.get(seq_id, []))
