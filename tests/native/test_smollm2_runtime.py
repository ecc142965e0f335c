"""The native layer against the real, quantized default model (SmolLM2-135M Q4_1)."""

from __future__ import annotations

import numpy as np
import pytest

from meshd.native.context import ContextConfig, TargetContext
from meshd.native.errors import CapacityError, RuntimeStateError
from meshd.native.model import Model
from meshd.native.session import SequenceSession, verify_many
from meshd.native.tokenizer import Utf8Assembler


def greedy(ctx: TargetContext, prompt: list[int], n: int) -> list[int]:
    with SequenceSession.open(ctx) as s:
        tok = int(s.prefill(prompt).argmax())
        out = [tok]
        for _ in range(n - 1):
            tok = int(s.decode(tok).argmax())
            out.append(tok)
    return out


def test_quantized_model_loads_and_decodes(smollm2: Model, smol_ctx: TargetContext) -> None:
    """AMX regression: a quantized model must decode (ggml's AMX mat-mul SIGILLs here)."""
    assert "Q4_1" in smollm2.info.description
    tok = smollm2.tokenizer
    prompt = tok.tokenize("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                          "<|im_start|>assistant\n", parse_special=True)
    text = tok.detokenize(greedy(smol_ctx, prompt, 12))
    assert "Paris" in text


def test_model_capabilities(smollm2: Model) -> None:
    info = smollm2.info
    assert info.architecture == "llama"
    assert info.n_vocab == 49152
    assert not info.has_mtp and not info.has_recurrent_state
    assert info.eos_token in info.eog_tokens
    assert info.has_chat_template


def test_tokenizer_round_trip(smollm2: Model) -> None:
    tok = smollm2.tokenizer
    texts = ["Hello, world!", "héllo wörld — ünïcödé", "日本語のテキスト 😀🚀", "  spaces\n\ttabs"]
    for text in texts:
        assert tok.detokenize(tok.tokenize(text, add_special=False)) == text


def test_streaming_never_emits_half_a_code_point(smollm2: Model) -> None:
    tok = smollm2.tokenizer
    text = "Emoji 😀🚀 and CJK 日本語 and accents é à ü"
    ids = tok.tokenize(text, add_special=False)
    pieces = [tok.piece(t) for t in ids]
    # The test only means something if some token splits a character.
    assert any(_incomplete_utf8(p) for p in pieces)
    asm = Utf8Assembler()
    out = [asm.push(p) for p in pieces] + [asm.flush()]
    assert all("\ufffd" not in chunk for chunk in out)
    assert "".join(out) == text


def _incomplete_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


def test_verify_rows_match_serial_decoding(smollm2: Model, smol_ctx: TargetContext) -> None:
    prompt = smollm2.tokenizer.tokenize("def fibonacci(n):\n    ")
    ref = greedy(smol_ctx, prompt, 9)
    with SequenceSession.open(smol_ctx) as s:
        first = int(s.prefill(prompt).argmax())
        assert first == ref[0]
        rows = s.verify(ref[:8])  # [last, d0..d6] with drafts = the true continuation
        assert [int(i) for i in rows.argmax(axis=1)] == ref[1:9]


def test_trim_leaves_no_trace(smollm2: Model, smol_ctx: TargetContext) -> None:
    """After a verify with rejected drafts and a trim, logits equal a fresh context's."""
    prompt = smollm2.tokenizer.tokenize("The quick brown fox")
    ref = greedy(smol_ctx, prompt, 4)
    with SequenceSession.open(smol_ctx) as s, SequenceSession.open(smol_ctx) as fresh:
        s.prefill(prompt)
        s.verify([ref[0], ref[1], 1234, 999, 4321])  # two right, three wrong
        s.trim(len(prompt) + 2)
        got = s.decode(ref[2])
        fresh.prefill([*prompt, ref[0], ref[1]])
        want = fresh.decode(ref[2])
    assert int(got.argmax()) == int(want.argmax()) == ref[3]
    np.testing.assert_allclose(got, want, atol=2e-2)


def test_two_sessions_in_one_forward_match_each_alone(
    smollm2: Model, smol_ctx: TargetContext
) -> None:
    tok = smollm2.tokenizer
    pa, pb = tok.tokenize("Once upon a time"), tok.tokenize("import numpy as np\n")
    ra, rb = greedy(smol_ctx, pa, 5), greedy(smol_ctx, pb, 5)
    with SequenceSession.open(smol_ctx) as a, SequenceSession.open(smol_ctx) as b:
        a.prefill(pa)
        b.prefill(pb)
        la, lb = verify_many([(a, ra[:4]), (b, rb[:3])])
    assert [int(i) for i in la.argmax(axis=1)] == ra[1:5]
    assert [int(i) for i in lb.argmax(axis=1)] == rb[1:4]


def test_slots_are_pooled_and_capacity_is_refused(smol_ctx: TargetContext) -> None:
    sessions = [SequenceSession.open(smol_ctx) for _ in range(smol_ctx.config.n_seq_max)]
    try:
        with pytest.raises(CapacityError, match="slots"):
            SequenceSession.open(smol_ctx)
    finally:
        for s in sessions:
            s.close()
    with pytest.raises(CapacityError, match="context"):
        SequenceSession.open(smol_ctx, reserve=smol_ctx.config.n_ctx_seq + 1)
    with SequenceSession.open(smol_ctx) as s, pytest.raises(CapacityError):
        s.prefill([1] * (smol_ctx.config.n_ctx_seq + 1))


def test_bad_token_is_a_clear_error(smol_ctx: TargetContext) -> None:
    with SequenceSession.open(smol_ctx) as s, pytest.raises(ValueError, match="vocabulary"):
        s.prefill([10**7])


def test_trim_on_attention_model_and_rollback_refused(
    smollm2: Model, smol_ctx: TargetContext
) -> None:
    with SequenceSession.open(smol_ctx) as s:
        s.prefill(smollm2.tokenizer.tokenize("abc def"))
        s.verify([1, 2, 3])
        # No recurrent state here: in-place rollback is not a thing, trim is.
        assert not s.can_rollback_in_place(s.n_past - 1)
        with pytest.raises(RuntimeStateError):
            s.rollback_in_place(s.n_past - 1)


# ------------------------------------------------------------------ bits of a window

_LONG_TEXT = (
    "The committee met on Tuesday to review the budget. Every department presented "
    "its figures, and the chair asked each head to explain the largest changes since "
    "last year. Questions followed about travel, equipment and the new building. "
) * 12


def _rows_by_width(ctx: TargetContext, tokens: list[int], n_prompt: int,
                   width: int) -> np.ndarray:
    """Logits of ``tokens[n_prompt:]``, fed ``width`` rows per forward after a prefill
    (width 1: plain decodes)."""
    rows = []
    with SequenceSession.open(ctx) as s:
        s.prefill(tokens[:n_prompt])
        rest = tokens[n_prompt:]
        for start in range(0, len(rest), width):
            part = rest[start:start + width]
            if width == 1:
                rows.append(s.decode(part[0])[None, :])
            else:
                rows.append(np.array(s.verify(part)))
                s.retire()
    return np.concatenate(rows)


def test_window_width_does_not_change_the_logits(smollm2: Model,
                                                 smol_ctx: TargetContext) -> None:
    """Why speculation (and a padded shared window) keeps plain decoding's tokens.

    Within 256 tokens of context a window of any width computes the same bits as
    one-token decodes. Past that, ggml's CPU flash-attention kernel runs a one-row
    forward differently (README, Identity and its limits), but windows of every width
    of two rows or more still agree with each other bit for bit: padding a window to a
    shared length changes nothing.
    """
    tokens = smollm2.tokenizer.tokenize(_LONG_TEXT, add_special=False)
    assert len(tokens) >= 420
    short = tokens[:150 + 40]
    plain = _rows_by_width(smol_ctx, short, 150, 1)
    for width in (2, 5, 8):
        assert np.array_equal(_rows_by_width(smol_ctx, short, 150, width), plain), width
    long = tokens[:380 + 40]
    wide = _rows_by_width(smol_ctx, long, 380, 2)
    for width in (5, 8):
        assert np.array_equal(_rows_by_width(smol_ctx, long, 380, width), wide), width


def test_with_one_thread_every_width_computes_the_same_bits_at_any_length(
        smollm2: Model) -> None:
    """Past 256 tokens the one-row forward differs only because its attention kernel
    splits the KV range across threads; with one thread nothing is split, so one-token
    decodes and windows agree bit for bit there too (README: ``--threads 1`` for exact
    identity at any length)."""
    tokens = smollm2.tokenizer.tokenize(_LONG_TEXT, add_special=False)[:380 + 24]
    ctx = TargetContext(smollm2, ContextConfig(n_ctx_seq=1024, n_seq_max=1, draft_max=8,
                                               n_threads=1))
    try:
        plain = _rows_by_width(ctx, tokens, 380, 1)
        assert np.array_equal(_rows_by_width(ctx, tokens, 380, 6), plain)
    finally:
        ctx.close()


def test_a_window_shared_with_other_sequences_keeps_its_bits(
        smollm2: Model, smol_ctx: TargetContext) -> None:
    """A window verified in one forward with other requests' windows (same width, as
    the shared plan makes them) gives the bits it gives alone."""
    tokens = smollm2.tokenizer.tokenize(_LONG_TEXT, add_special=False)[:420]
    n_prompt, width = 380, 4
    alone = _rows_by_width(smol_ctx, tokens, n_prompt, width)
    other = tokens[7:7 + n_prompt]
    with SequenceSession.open(smol_ctx) as a, SequenceSession.open(smol_ctx) as b:
        a.prefill(tokens[:n_prompt])
        b.prefill(other)
        rows = []
        rest = tokens[n_prompt:]
        for start in range(0, len(rest), width):
            part = rest[start:start + width]
            out = verify_many([(a, part), (b, other[start % 50:start % 50 + len(part)])])
            rows.append(np.array(out[0]))
            a.retire()
            b.retire()
    assert np.array_equal(np.concatenate(rows), alone)
