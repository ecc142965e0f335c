"""The synthetic test models: files, the designed token rule, and llama.cpp running them.

The llama.cpp driver below is deliberately minimal (raw ctypes calls on one sequence);
it exists to validate the models, not to be a runtime.
"""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import gguf
import numpy as np
import pytest

from meshd.testing import testmodels as tm

MTP_KINDS = ("qwen35", "mimo2")
PROMPT = [72, 101, 108, 108, 111, 44, 32, 119]  # "Hello, w"


@pytest.fixture(scope="session")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("test-models")


def _tensors(path: Path) -> dict[str, np.ndarray]:
    reader = gguf.GGUFReader(path)
    return {t.name: np.array(t.data) for t in reader.tensors}


def _field(reader: gguf.GGUFReader, key: str) -> Any:
    return reader.fields[key].contents()


# ------------------------------------------------------------------- files, no llama.cpp


@pytest.mark.parametrize("kind", tm.KINDS)
def test_same_arguments_same_bytes(kind: str, tmp_path: Path) -> None:
    a = tm.write_test_model(kind, tmp_path / "a.gguf", seed=3, acceptance=0.5)
    b = tm.write_test_model(kind, tmp_path / "b.gguf", seed=3, acceptance=0.5)
    c = tm.write_test_model(kind, tmp_path / "c.gguf", seed=4, acceptance=0.5)
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()


@pytest.mark.parametrize("kind", MTP_KINDS)
def test_acceptance_changes_only_the_mtp_embedding(kind: str, cache: Path) -> None:
    full = _tensors(tm.test_model_path(kind, acceptance=1.0, cache_dir=cache))
    half = _tensors(tm.test_model_path(kind, acceptance=0.5, cache_dir=cache))
    assert full.keys() == half.keys()
    differ = {k for k in full if not np.array_equal(full[k], half[k])}
    assert differ == {f"blk.{_n_trunk(kind)}.nextn.embed_tokens.weight"}


def _n_trunk(kind: str) -> int:
    return {"llama": 2, "qwen35": 4, "mimo2": 2}[kind]


def test_qwen35_layout_follows_the_notes(cache: Path) -> None:
    path = tm.test_model_path("qwen35", cache_dir=cache)
    reader = gguf.GGUFReader(path)
    assert _field(reader, "general.architecture") == "qwen35"
    assert _field(reader, "qwen35.block_count") == 5
    assert _field(reader, "qwen35.nextn_predict_layers") == 1
    assert _field(reader, "qwen35.full_attention_interval") == 4
    assert sum(_field(reader, "qwen35.rope.dimension_sections")) == tm.HEAD_DIM // 2
    state, rank = (
        _field(reader, "qwen35.ssm.state_size"),
        _field(reader, "qwen35.ssm.time_step_rank"),
    )
    assert _field(reader, "qwen35.ssm.inner_size") == state * rank
    assert rank % _field(reader, "qwen35.ssm.group_count") == 0
    names = {t.name for t in reader.tensors}
    for il in range(3):  # delta net
        assert {f"blk.{il}.ssm_a", f"blk.{il}.ssm_dt.bias", f"blk.{il}.attn_gate.weight"} <= names
        assert f"blk.{il}.attn_q.weight" not in names
    for il in (3, 4):  # attention, MTP
        assert {f"blk.{il}.attn_q.weight", f"blk.{il}.attn_q_norm.weight"} <= names
        assert f"blk.{il}.ssm_a" not in names
    assert {"blk.4.nextn.eh_proj.weight", "blk.4.nextn.enorm.weight"} <= names
    assert not any(n.startswith("blk.5.") for n in names)


@pytest.mark.parametrize("kind", tm.KINDS)
def test_tokenizer_and_metadata(kind: str, cache: Path) -> None:
    reader = gguf.GGUFReader(tm.test_model_path(kind, cache_dir=cache))
    assert _field(reader, "tokenizer.ggml.model") == "gpt2"
    assert _field(reader, "tokenizer.ggml.pre") == "default"
    tokens = _field(reader, "tokenizer.ggml.tokens")
    assert len(tokens) == tm.N_VOCAB
    assert tokens[ord("A")] == "A" and tokens[ord(" ")] == "Ġ" and tokens[10] == "Ċ"
    assert tokens[tm.EOS_ID] == "<|eos|>"
    assert len(_field(reader, "tokenizer.ggml.merges")) >= 1
    assert _field(reader, "tokenizer.ggml.eos_token_id") == tm.EOS_ID
    assert _field(reader, "tokenizer.ggml.bos_token_id") == tm.BOS_ID
    assert all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in reader.tensors)
    assert _field(reader, f"{kind}.embedding_length") == tm.N_EMBD


def test_cache_builds_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHD_TEST_MODEL_CACHE", str(tmp_path / "env"))
    path = tm.test_model_path("mimo2", seed=1, acceptance=0.25)
    assert path.parent == tmp_path / "env"
    stamp = path.stat().st_mtime_ns
    assert tm.test_model_path("mimo2", seed=1, acceptance=0.25) == path
    assert path.stat().st_mtime_ns == stamp
    assert tm.test_model_path("mimo2", seed=1, acceptance=0.5) != path
    assert [p.name for p in path.parent.iterdir() if p.suffix == ".tmp"] == []
    # llama has no MTP head: acceptance does not make a new file
    assert tm.test_model_path("llama", acceptance=0.3) == tm.test_model_path("llama")


def test_cli_and_argument_checks(tmp_path: Path) -> None:
    out = tmp_path / "m.gguf"
    assert tm.main(["qwen35", str(out), "--seed", "2", "--acceptance", "0.7"]) == 0
    assert (
        out.read_bytes()
        == tm.write_test_model("qwen35", tmp_path / "n.gguf", seed=2, acceptance=0.7).read_bytes()
    )
    assert tm.main(["mimo2", str(out), "--acceptance", "1.5"]) == 2
    assert tm.main(["mimo2", str(out), "--type", "q8_0"]) == 2  # a type needs a size
    with pytest.raises(ValueError):
        tm.write_test_model("gpt9", out)
    with pytest.raises(ValueError):
        tm.test_model_path("llama", seed=-1, cache_dir=tmp_path)


# --------------------------------------------------------------------- the token rule


def test_previous_token_head_wins_by_a_wide_margin() -> None:
    assert tm.prev_token_score_gap(4096) >= 20.0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reference_output_is_long_varied_printable(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(20):
        prompt = rng.integers(0, tm.N_VOCAB, size=int(rng.integers(1, 12))).tolist()
        out = tm.reference_continuation(prompt, tm.CYCLE_LENGTH + 1, seed=seed)
        first = out[: tm.CYCLE_LENGTH]
        # states (previous, current) never repeat within one cycle; the cycle then closes
        states = list(itertools.pairwise(first))
        assert len(set(states)) == len(states)
        assert len(set(out[:200])) >= 100
        assert max(first.count(t) for t in set(first)) <= 2
        assert tm.EOS_ID not in out and tm.BOS_ID not in out
        assert all(t == 10 or 32 <= t < 127 or 256 <= t < tm.BOS_ID for t in out)


def test_reference_draft_agreement_tracks_acceptance() -> None:
    seq = tm.reference_continuation(PROMPT, 240)
    ctx = PROMPT + seq
    for acceptance in (1.0, 0.75, 0.5, 0.25, 0.0):
        hits = [
            tm.reference_draft(ctx[: i + 1], 1, acceptance=acceptance)[0] == ctx[i + 1]
            for i in range(len(PROMPT), len(ctx) - 1)
        ]
        assert abs(np.mean(hits) - acceptance) < 0.05, acceptance


# ------------------------------------------------------------------------- llama.cpp


@pytest.fixture(scope="module")
def llama() -> Iterator[tuple[ModuleType, ModuleType]]:
    """(llama_cpp.llama_cpp, llama_cpp.llama_cpp_ext) with the backend up and logging off."""
    lc = pytest.importorskip("llama_cpp.llama_cpp")
    lx = pytest.importorskip("llama_cpp.llama_cpp_ext")
    from meshd.native import llama as native_llama

    @lc.llama_log_callback
    def quiet(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        pass

    lc.llama_log_set(quiet, ctypes.c_void_p())
    lc.llama_backend_init()
    yield lc, lx
    # hand llama.cpp's log back to meshd's logger: later tests in this process read it
    lc.llama_log_set(ctypes.cast(None, lc.llama_log_callback), ctypes.c_void_p())
    native_llama.route_logs()
    del quiet


class Runner:
    """One model and a few contexts on it; sequence 0 only."""

    def __init__(self, llama: tuple[ModuleType, ModuleType], path: Path, *, mtp: bool) -> None:
        self.lc, self.lx = llama
        params = self.lc.llama_model_default_params()
        params.load_mtp = mtp
        self.model = self.lc.llama_model_load_from_file(str(path).encode(), params)
        assert self.model, path
        self.n_vocab = self.lc.llama_vocab_n_tokens(self.lc.llama_model_get_vocab(self.model))
        self.n_embd = self.lc.llama_model_n_embd(self.model)
        self.contexts: list[Any] = []
        self.batches: dict[Any, Any] = {}  # MTP context -> its ext batch

    def context(self, *, n_ctx: int = 512, n_rs_seq: int = 0, mtp: bool = False) -> Any:
        cp = self.lc.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = n_ctx, 256, 256, 1
        cp.n_threads = cp.n_threads_batch = 1
        cp.n_rs_seq = n_rs_seq
        if mtp:
            cp.ctx_type = self.lc.LLAMA_CONTEXT_TYPE_MTP
        ctx = self.lc.llama_init_from_model(self.model, cp)
        assert ctx
        self.contexts.append(ctx)
        return ctx

    def decode(
        self, ctx: Any, tokens: Sequence[int], pos0: int, *, all_logits: bool = False
    ) -> None:
        lc = self.lc
        batch = lc.llama_batch_init(len(tokens), 0, 1)
        try:
            for i, tok in enumerate(tokens):
                batch.token[i], batch.pos[i] = tok, pos0 + i
                batch.n_seq_id[i], batch.seq_id[i][0] = 1, 0
                batch.logits[i] = all_logits or i == len(tokens) - 1
            batch.n_tokens = len(tokens)
            assert lc.llama_decode(ctx, batch) == 0
        finally:
            lc.llama_batch_free(batch)

    def logits(self, ctx: Any, i: int = -1) -> np.ndarray:
        ptr = self.lc.llama_get_logits_ith(ctx, i)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()

    def nextn_row(self, ctx: Any, i: int) -> np.ndarray:
        ptr = self.lx.llama_get_embeddings_nextn_ith(ctx, i)
        return np.ctypeslib.as_array(ptr, shape=(self.n_embd,)).copy()

    def mtp_decode(
        self, ctx: Any, entries: Sequence[tuple[int, int, np.ndarray]], output: bool
    ) -> None:
        """Decode (token, position, previous target hidden row) entries on an MTP context."""
        lc = self.lc
        if ctx not in self.batches:
            self.batches[ctx] = lc.llama_batch_ext_init(ctx)
        batch = self.batches[ctx]
        lc.llama_batch_ext_clear(batch)
        rows = [np.ascontiguousarray(h, dtype=np.float32) for _, _, h in entries]
        for (tok, pos, _), row in zip(entries, rows, strict=True):
            idx = lc.llama_batch_ext_add_token(batch, 0, tok)
            assert idx >= 0
            assert lc.llama_batch_ext_set_pos(batch, idx, ctypes.byref(lc.llama_pos(pos)))
            embd = lc.llama_embd(row.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, self.n_embd)
            assert lc.llama_batch_ext_set_embd_token(batch, idx, embd)
            assert lc.llama_batch_ext_set_output_logits(batch, idx, output)
        assert lc.llama_process(ctx, lc.LLAMA_PROCESS_TYPE_DECODE, batch) == 0

    def close(self) -> None:
        for batch in self.batches.values():
            self.lc.llama_batch_ext_free(batch)
        for ctx in self.contexts:
            self.lc.llama_free(ctx)
        self.lc.llama_model_free(self.model)


MakeRunner = Callable[..., Runner]


@pytest.fixture
def runner(llama: tuple[ModuleType, ModuleType], cache: Path) -> Iterator[MakeRunner]:
    made: list[Runner] = []

    def make(kind: str, *, acceptance: float = 1.0, mtp: bool = False) -> Runner:
        path = tm.test_model_path(kind, acceptance=acceptance, cache_dir=cache)
        made.append(Runner(llama, path, mtp=mtp))
        return made[-1]

    yield make
    for r in made:
        r.close()


def _margin(logits: np.ndarray) -> float:
    top2 = np.sort(logits)[-2:]
    return float(top2[1] - top2[0])


@pytest.mark.parametrize("kind", tm.KINDS)
def test_greedy_follows_the_rule_with_clear_margins(kind: str, runner: MakeRunner) -> None:
    r = runner(kind)
    ctx = r.context()
    r.decode(ctx, PROMPT, 0)
    out, margins, serial = [], [], []
    for pos in range(len(PROMPT), len(PROMPT) + 200):
        logits = r.logits(ctx)
        serial.append(logits)
        margins.append(_margin(logits))
        out.append(int(np.argmax(logits)))
        r.decode(ctx, [out[-1]], pos)
    assert out == tm.reference_continuation(PROMPT, 200)
    assert min(margins) > 5.0, min(margins)  # design value 10, history features take <= ~3
    assert len(set(out)) >= 100

    # one batched forward over the same tokens: same argmax everywhere, logits equal to
    # float noise
    batched = r.context()
    r.decode(batched, PROMPT + out, 0, all_logits=True)
    rows = np.array([r.logits(batched, len(PROMPT) - 1 + i) for i in range(200)])
    assert rows.argmax(axis=1).tolist() == out
    assert np.abs(rows - np.array(serial)).max() < 1e-3


@pytest.mark.parametrize("kind", tm.KINDS)
def test_random_prompts_follow_the_rule(kind: str, runner: MakeRunner) -> None:
    """Any token (control bytes, >= 0x80, specials), any length including 1."""
    r = runner(kind)
    rng = np.random.default_rng(11)
    for _ in range(12):
        prompt = rng.integers(0, tm.N_VOCAB, size=int(rng.integers(1, 30))).tolist()
        ref = tm.reference_continuation(prompt, 20)
        ctx = r.context(n_ctx=128)
        r.decode(ctx, prompt + ref, 0, all_logits=True)
        got = [int(np.argmax(r.logits(ctx, i))) for i in range(len(prompt) - 1, len(prompt) + 19)]
        assert got == ref, prompt


@pytest.mark.parametrize("kind", tm.KINDS)
def test_output_depends_on_history(kind: str, runner: MakeRunner) -> None:
    r = runner(kind)

    def last_logits(tokens: list[int]) -> np.ndarray:
        ctx = r.context(n_ctx=128)
        r.decode(ctx, tokens, 0)
        return r.logits(ctx)

    # same last two tokens, different earlier history: the logits move, the token does not
    rng = np.random.default_rng(5)
    tail = [104, 101]  # "he"
    diffs = []
    for _ in range(4):
        a = last_logits(rng.integers(32, 127, size=20).tolist() + tail)
        b = last_logits(rng.integers(32, 127, size=20).tolist() + tail)
        assert np.argmax(a) == np.argmax(b)
        diffs.append(np.abs(a - b).max())
    assert min(diffs) > 0.05, diffs

    # the token before the last one decides between the two successors of the last one
    by_next: dict[int, list[int]] = {}
    for before in range(32, 127):
        by_next.setdefault(tm.reference_continuation([before, 104], 1)[0], []).append(before)
    assert len(by_next) == 2
    group_a, group_b = by_next.values()
    for one, other in zip(group_a[:5], group_b[:5], strict=True):
        a = last_logits([one, 104])
        b = last_logits([other, 104])
        assert np.argmax(a) != np.argmax(b)
        assert min(_margin(a), _margin(b)) > 5.0


@pytest.mark.parametrize("kind", MTP_KINDS)
@pytest.mark.parametrize(
    ("acceptance", "low", "high"), [(1.0, 0.95, 1.0), (0.5, 0.35, 0.65), (0.0, 0.0, 0.05)]
)
def test_mtp_head_acceptance(
    kind: str, acceptance: float, low: float, high: float, runner: MakeRunner
) -> None:
    """Drive the MTP head as llama-server does; its 1-step draft vs the target's token."""
    r = runner(kind, acceptance=acceptance, mtp=True)
    assert r.lc.llama_model_n_layer_nextn(r.model) == 1
    tgt, mtp = r.context(), r.context(mtp=True)
    r.lx.llama_set_embeddings_nextn(tgt, True, False)
    r.lx.llama_set_embeddings_nextn(mtp, True, True)

    r.decode(tgt, PROMPT, 0)
    hidden = [np.zeros(r.n_embd)] + [r.nextn_row(tgt, i) for i in range(len(PROMPT))]
    r.mtp_decode(mtp, [(t, p, hidden[p]) for p, t in enumerate(PROMPT)], output=False)
    last, pending, pos = int(np.argmax(r.logits(tgt))), hidden[-1], len(PROMPT)
    tokens = [*PROMPT, last]
    hits, margins = [], []
    for _ in range(200):
        r.mtp_decode(mtp, [(last, pos, pending)], output=True)
        mtp_logits = r.logits(mtp, 0)
        draft = int(np.argmax(mtp_logits))
        margins.append(_margin(mtp_logits))
        assert draft == tm.reference_draft(tokens, 1, acceptance=acceptance)[0]
        r.decode(tgt, [last], pos)
        nxt = int(np.argmax(r.logits(tgt)))
        pending = r.nextn_row(tgt, 0)
        hits.append(draft == nxt)
        last, pos = nxt, pos + 1
        tokens.append(nxt)
    assert tokens[len(PROMPT) :] == tm.reference_continuation(PROMPT, 201)
    assert low <= np.mean(hits) <= high, np.mean(hits)
    assert min(margins) > 5.0

    # a 4-step chain (each step fed the MTP head's own hidden row), then drop its KV
    chain, h = [], pending
    for k in range(4):
        r.mtp_decode(mtp, [(chain[-1] if chain else last, pos + k, h)], output=True)
        chain.append(int(np.argmax(r.logits(mtp, 0))))
        h = r.nextn_row(mtp, 0)
    assert chain == tm.reference_draft(tokens, 4, acceptance=acceptance)
    assert r.lc.llama_memory_seq_rm(r.lc.llama_get_memory(mtp), 0, pos + 1, -1)


@pytest.mark.parametrize("kind", tm.KINDS)
def test_verify_windows_with_rollback_follow_the_rule(kind: str, runner: MakeRunner) -> None:
    """Greedy decoding through 4-token verify windows with 3, 2, 1, 0 right drafts.

    Rejected drafts are removed with seq_rm: KV trim for attention, and for qwen35's
    recurrent state the n_rs_seq snapshots (llama.cpp refuses positions that go back
    without the trim, so there is no "forgot to trim" variant to check here).
    """
    r = runner(kind)
    ctx = r.context(n_rs_seq=4)
    mem = r.lc.llama_get_memory(ctx)
    ref = tm.reference_continuation(PROMPT, 80)
    r.decode(ctx, PROMPT, 0)
    out = [int(np.argmax(r.logits(ctx)))]
    pos, window = len(PROMPT), 0
    while len(out) < 60:
        n_right = 3 - window % 4
        truth = ref[len(out) : len(out) + 3]
        drafts = truth[:n_right] + [(t + 7 - 32) % 95 + 32 for t in truth[n_right:]]
        r.decode(ctx, [out[-1], *drafts], pos, all_logits=True)
        preds = [int(np.argmax(r.logits(ctx, i))) for i in range(4)]
        n_acc = 0
        while n_acc < 3 and drafts[n_acc] == preds[n_acc]:
            n_acc += 1
        assert n_acc == n_right
        out += [*drafts[:n_acc], preds[n_acc]]
        if n_acc < 3:
            assert r.lc.llama_memory_seq_rm(mem, 0, pos + n_acc + 1, -1)
        pos += n_acc + 1
        window += 1
    assert out == ref[: len(out)]


def test_stale_recurrent_state_changes_tokens(runner: MakeRunner) -> None:
    """llama.cpp 0.3.36's rollback trap (see the runtime notes) must be visible in tokens.

    Removing more tokens than the last decode held still returns True but restores a
    stale conv/ssm state; the previous-token bit then comes from the wrong token.
    """
    r = runner("qwen35")
    mem_ok, wrong = [], 0
    for trial in range(8):
        prompt = np.random.default_rng(trial).integers(32, 127, size=6).tolist()
        ref = tm.reference_continuation(prompt, 1)[0]
        ctx = r.context(n_ctx=64, n_rs_seq=4)
        r.decode(ctx, prompt[:-1], 0)
        r.decode(ctx, prompt[-1:], len(prompt) - 1)
        r.decode(ctx, [(ref + 5 - 32) % 95 + 32], len(prompt))
        mem_ok.append(r.lc.llama_memory_seq_rm(r.lc.llama_get_memory(ctx), 0, len(prompt) - 1, -1))
        r.decode(ctx, prompt[-1:], len(prompt) - 1)
        wrong += int(np.argmax(r.logits(ctx))) != ref
    if not all(mem_ok):
        pytest.skip(
            "this llama.cpp refuses the over-long rollback instead of restoring stale state"
        )
    assert wrong >= 1


def test_tokenizer_round_trip(runner: MakeRunner) -> None:
    r = runner("llama")
    lc = r.lc
    vocab = lc.llama_model_get_vocab(r.model)
    text = "Hello world, the cat\nhé ✓\x00\x7f".encode()
    buf = (lc.llama_token * 64)()
    n = lc.llama_tokenize(vocab, text, len(text), buf, len(buf), True, False)
    ids = list(buf[:n])
    assert ids[:6] == [72, 101, 108, 108, 111, 265]  # " w" is a merged token
    piece = ctypes.create_string_buffer(32)

    def to_bytes(token: int) -> bytes:
        n = lc.llama_token_to_piece(vocab, token, piece, len(piece), 0, True)
        return piece.raw[:n]

    back = b"".join(to_bytes(t) for t in ids)
    assert back == text
    assert lc.llama_vocab_eos(vocab) == tm.EOS_ID
    assert lc.llama_vocab_is_eog(vocab, tm.EOS_ID)
