"""The native layer against the real, quantized default model (SmolLM2-135M Q4_1)."""

from __future__ import annotations

import numpy as np
import pytest

from meshd.native.context import ContextConfig, TargetContext
from meshd.native.errors import CapacityError, RuntimeStateError
from meshd.native.model import Model
from meshd.native.primitives import resolve_cache_type_k, rounds_rows_alike
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
) * 24


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
    """Why speculation (and a padded shared window) keeps plain decoding's tokens: a
    window of any width, one row included, computes the same bits at any context length
    (past 256 tokens too, where the KV view reaches 512 cells and llama.cpp would send
    one-row forwards through another attention kernel: the context pins one,
    docs/identity.md, Identity and its limits)."""
    assert smol_ctx.config.cache_type_k == "f16"  # "auto", with the kernel pinned
    assert smol_ctx.exact
    tokens = smollm2.tokenizer.tokenize(_LONG_TEXT, add_special=False)
    assert len(tokens) >= 310
    for n_prompt in (150, 270):  # 270: every row past 256 tokens of context
        part = tokens[:n_prompt + 40]
        plain = _rows_by_width(smol_ctx, part, n_prompt, 1)
        for width in (2, 5, 8):
            assert np.array_equal(_rows_by_width(smol_ctx, part, n_prompt, width),
                                  plain), (n_prompt, width)


#: Past 256 tokens of context (where the KV view reaches 512 cells), all rows.
N_F16 = 280


def test_unpinned_one_row_forwards_differ_past_256_tokens(smollm2: Model) -> None:
    """What pinning the attention kernel buys: with llama.cpp's own choice by width (an
    f16 cache, ``pin_attention`` off, as in any other llama.cpp program) a one-row
    forward past 256 tokens rounds differently from a window, with 2 threads or more;
    with one thread it does not (nothing is split across threads)."""
    tokens = smollm2.tokenizer.tokenize(_LONG_TEXT, add_special=False)[:N_F16 + 24]
    for threads, same in ((2, False), (1, True)):
        ctx = TargetContext(smollm2, ContextConfig(n_ctx_seq=1024, n_seq_max=1,
                                                   draft_max=8, n_threads=threads,
                                                   cache_type_k="f16",
                                                   pin_attention=False))
        try:
            assert ctx.config.cache_type_k == "f16" and not ctx.exact
            plain = _rows_by_width(ctx, tokens, N_F16, 1)
            wide = _rows_by_width(ctx, tokens, N_F16, 6)
            assert np.array_equal(wide, plain) is same, threads
            # The rounding, not a bug: the rows still agree to a fraction of a logit.
            assert float(np.abs(wide - plain).max()) < 2.0
        finally:
            ctx.close()


def test_auto_k_cache_is_bf16_only_where_the_kernel_cannot_be_pinned() -> None:
    assert resolve_cache_type_k("auto", all_on_cpu=True) == "f16"
    assert resolve_cache_type_k("auto", all_on_cpu=True, pinnable=False) == "bf16"
    assert resolve_cache_type_k("auto", all_on_cpu=False) == "f16"
    assert resolve_cache_type_k("auto", all_on_cpu=False, pinnable=False) == "f16"
    assert resolve_cache_type_k("f16", all_on_cpu=True) == "f16"
    assert resolve_cache_type_k("bf16", all_on_cpu=False) == "bf16"
    with pytest.raises(ValueError, match="unknown K-cache type 'q4_0'"):
        resolve_cache_type_k("q4_0", all_on_cpu=True)
    with pytest.raises(ValueError, match="unknown K-cache type"):
        ContextConfig(cache_type_k="f32")
    # On the CPU a pinned kernel, or a bf16 cache, makes every forward round a row alike.
    assert rounds_rows_alike("f16", all_on_cpu=True)
    assert not rounds_rows_alike("f16", all_on_cpu=True, pinnable=False)
    assert rounds_rows_alike("bf16", all_on_cpu=True, pinnable=False)
    assert not rounds_rows_alike("bf16", all_on_cpu=False)
    assert not rounds_rows_alike("f16", all_on_cpu=False)


def test_the_runtime_pins_the_attention_kernel() -> None:
    """meshd's runtime patch is in the built llama.cpp (native/patches): without it the
    default K cache falls back to bf16 and a long prompt's prefill takes 4.5x as long."""
    from meshd.native.llama import attn_kernel_pinnable
    assert attn_kernel_pinnable()


def test_how_a_prompt_is_batched_does_not_change_the_logits(
        smollm2: Model, smol_ctx: TargetContext) -> None:
    """A prompt prefilled in one batch and the same prompt prefilled in two (what a
    prefix-cache hit does: the cached part was prefilled for an earlier request, and
    only the new tail is prefilled now, in a batch of a few rows where a fresh prefill
    would run hundreds) give the same bits, so a cache hit cannot move a greedy text."""
    tokens = smollm2.tokenizer.tokenize(_LONG_TEXT, add_special=False)[:300]
    assert len(tokens) == 300  # past 256 tokens of context
    for cut in (100, 270):  # a long tail, and a tail of a few rows past 256 tokens
        with SequenceSession.open(smol_ctx) as s:
            whole = np.array(s.prefill(tokens[:-1]))
            whole_next = np.array(s.decode(tokens[-1]))
        with SequenceSession.open(smol_ctx) as s:
            s.prefill(tokens[:cut])
            split = np.array(s.prefill(tokens[cut:-1]))
            split_next = np.array(s.decode(tokens[-1]))
        assert np.array_equal(split, whole), cut
        assert np.array_equal(split_next, whole_next), cut


def test_a_window_shared_with_other_sequences_keeps_its_bits(
        smollm2: Model, smol_ctx: TargetContext) -> None:
    """A window verified in one forward with another request's window gives the bits it
    gives alone, a one-row decode included, past 256 tokens of context too: requests
    decoded together keep each one's text."""
    n_prompt = 270  # every row past 256 tokens of context
    tokens = smollm2.tokenizer.tokenize(_LONG_TEXT, add_special=False)[:n_prompt + 40]
    assert len(tokens) == n_prompt + 40 and len(tokens[7:7 + n_prompt]) == n_prompt
    for width in (1, 4):
        alone = _rows_by_width(smol_ctx, tokens, n_prompt, width)
        other = tokens[7:7 + n_prompt]
        with SequenceSession.open(smol_ctx) as a, SequenceSession.open(smol_ctx) as b:
            a.prefill(tokens[:n_prompt])
            b.prefill(other)
            rows = []
            rest = tokens[n_prompt:]
            for start in range(0, len(rest), width):
                part = rest[start:start + width]
                out = verify_many([(a, part),
                                   (b, other[start % 50:start % 50 + len(part) + 1])])
                rows.append(np.array(out[0]))
                a.retire()
                b.retire()
        assert np.array_equal(np.concatenate(rows), alone), width


def test_decoded_tokens_and_the_same_tokens_prefilled_keep_their_bits(
        smollm2: Model, smol_ctx: TargetContext) -> None:
    """A turn's answer decoded one token at a time and the same answer prefilled as part
    of the next turn's prompt give the same bits (every forward takes one attention
    kernel): a multi-turn chat reads the same logits whether its history comes from the
    prefix cache or is prefilled afresh."""
    tokens = smollm2.tokenizer.tokenize(_LONG_TEXT, add_special=False)[:310]
    assert len(tokens) == 310
    head, answer = tokens[:262], tokens[262:-1]  # the answer past 256 tokens of context
    with SequenceSession.open(smol_ctx) as s:
        s.prefill(head)
        for tok in answer:
            s.decode(tok)
        cached = np.array(s.decode(tokens[-1]))
    with SequenceSession.open(smol_ctx) as s:
        fresh = np.array(s.prefill(tokens))
    assert np.array_equal(cached, fresh)
