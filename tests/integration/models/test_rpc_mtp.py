"""The MTP head and the draft model stay on the daemon's machine when the model is split
over workers.

What a user of ``meshd serve --rpc`` with an MTP model would see: the same tokens and the
same speculation as a local run, and drafting that never waits on the network. Checked
on the synthetic qwen35 (hybrid) and mimo2 (attention-only) models with one MTP block each,
split over two ``meshd worker``
processes on loopback: llama.cpp's own load log says where each layer and the MTP
context's cache went, and the relays in front of the workers count every round trip.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator

import numpy as np
import pytest

from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig
from meshd.native.rpc_workers import RemoteWorkers
from meshd.native.session import SequenceSession
from meshd.testing import testmodels
from meshd.testing.loopback import LoopbackWorkers

PROMPT = "the quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def workers() -> Iterator[LoopbackWorkers]:
    with LoopbackWorkers(2) as w:
        yield w


#: A hybrid (recurrent + attention) and an attention-only architecture with an MTP block.
KINDS = ("qwen35", "mimo2")


def _model(kind: str = "qwen35") -> str:
    # acceptance 0.8: rejected drafts, so repairs (of the recurrent state too) run.
    return str(testmodels.test_model_path(kind, acceptance=0.8))


def _config(kind: str = "qwen35", **kw: object) -> RuntimeConfig:
    return RuntimeConfig(model_path=_model(kind), n_ctx_seq=512, threads=1, calibrate=False,
                         draft_max=4, **kw)  # type: ignore[arg-type]


def _generate(rt: ModelRuntime, proposer: str) -> tuple[list[int], tuple[int, int, int]]:
    gen = rt.generation(rt.tokenize_prompt(PROMPT, chat=False), max_tokens=40,
                        proposer=proposer, adaptive=False)
    list(rt.run(gen))
    st = gen.stats
    return list(gen.committed), (st.drafted, st.accepted, st.session.target_forwards)


def _trips(remote: RemoteWorkers | None) -> tuple[int, int, int]:
    assert remote is not None
    st = remote.stats()
    return st.round_trips, st.bytes_sent, st.bytes_received


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_mtp_split_over_two_workers_equals_local(workers: LoopbackWorkers, kind: str) -> None:
    with ModelRuntime(_config(kind)) as local:
        expected = {p: _generate(local, p) for p in ("off", "mtp")}
    with ModelRuntime(_config(kind, rpc_workers=workers.addresses)) as split:
        for proposer, (tokens, stats) in expected.items():
            assert _generate(split, proposer) == (tokens, stats), \
                f"{proposer}: split output or speculation (drafted, accepted, forwards) " \
                "differs from local"
    drafted, accepted, _ = expected["mtp"][1]
    assert 0 < accepted < drafted, "the model should accept some drafts and reject some"


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_mtp_head_output_and_cache_are_on_this_machine(
        workers: LoopbackWorkers, caplog: pytest.LogCaptureFixture, kind: str) -> None:
    with caplog.at_level(logging.DEBUG, logger="meshd.llama"), \
            ModelRuntime(_config(kind, rpc_workers=workers.addresses)) as split:
        info = split.model.info
        assert split.remote is not None
        names = split.remote.device_names
        assert len(names) == 3 and names[-1] == "CPU", names
        assert all(re.fullmatch(r"RPC\d+", n) for n in names[:-1]), names
    log = caplog.text
    n_trunk = info.n_layer
    assert info.n_layer_nextn == 1
    placed = dict(re.findall(r"layer +(\d+) assigned to device (\w+)", log))
    # llama.cpp's layers: the trunk, the MTP block(s), then the output head as one more.
    for il in range(n_trunk):
        assert placed[str(il)].startswith("RPC"), f"trunk layer {il} should be remote"
    for il in range(n_trunk, n_trunk + info.n_layer_nextn + 1):
        assert placed[str(il)] == "CPU", f"layer {il} (MTP block or output) is remote"
    # The MTP context caches only the MTP block, on the block's device.
    assert re.search(rf"llama_kv_cache: layer +{n_trunk}: dev = CPU", log)
    assert not re.search(rf"llama_kv_cache: layer +{n_trunk}: dev = RPC", log)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_mtp_drafting_never_crosses_the_network(workers: LoopbackWorkers, kind: str) -> None:
    with ModelRuntime(_config(kind, rpc_workers=workers.addresses)) as split:
        prompt = split.tokenize_prompt(PROMPT, chat=False)
        with SequenceSession.open(split.context, reserve=len(prompt) + 8) as session:
            before = _trips(split.remote)
            last = int(np.argmax(session.prefill(prompt)))
            after_prefill = _trips(split.remote)
            assert after_prefill[0] > before[0], "the trunk runs on the workers"
            assert session.mtp is not None
            pos = len(prompt)
            drafted, _ = session.mtp.draft(last, pos, 4)
            assert len(drafted) == 4
            assert _trips(split.remote) == after_prefill, "an MTP draft used the network"
            per_window = []
            for _ in range(2):
                before = _trips(split.remote)[0]
                rows = session.verify([last, *drafted[:-1]])  # the MTP head catches up
                per_window.append(_trips(split.remote)[0] - before)
                last, pos = int(np.argmax(rows[-1])), pos + 4
                before_draft = _trips(split.remote)
                drafted, _ = session.mtp.draft(last, pos, 4)
                assert len(drafted) == 4
                assert _trips(split.remote) == before_draft, "an MTP draft used the network"
            per_decode = []
            for _ in range(2):
                before = _trips(split.remote)[0]
                last = int(np.argmax(session.decode(last)))
                per_decode.append(_trips(split.remote)[0] - before)
            # The second of each shape (llama.cpp asks the workers about a new shape's
            # allocations once): a window of four rows, the MTP catch-up included,
            # crosses the network as often as a single decode.
            assert per_window[1] == per_decode[1] > 0


@pytest.mark.slow
def test_draft_model_stays_local(workers: LoopbackWorkers) -> None:
    """A draft model loaded while the target is split runs here: the workers' devices
    are not in ggml's registry, so llama.cpp's default device choice never picks them."""
    draft_path = str(testmodels.test_model_path("llama"))
    with ModelRuntime(_config(rpc_workers=workers.addresses)) as split:
        draft = split.draft_model(draft_path)
        assert draft.model.placement is None and draft.model.gpu_layers == 0
        prompt = split.tokenize_prompt(PROMPT, chat=False)
        sequence = draft.open_sequence()
        try:
            before = _trips(split.remote)
            tokens, _ = sequence.draft(prompt, 4)
            assert len(tokens) == 4
            assert _trips(split.remote) == before, "the draft model used a worker"
        finally:
            sequence.close()


@pytest.mark.slow
def test_bench_rpc_counts_no_round_trip_per_mtp_draft(
        tmp_path: pytest.TempPathFactory, capsys: pytest.CaptureFixture[str]) -> None:
    from meshd.daemon.commands.cli import main

    out = f"{tmp_path}/rpc.json"
    assert main(["bench-rpc", "--model", _model(), "--workers", "2",
                 "--reps", "1", "--tokens", "16", "--draft-k", "4", "--threads", "1",
                 "--json", out]) == 0
    with open(out) as f:
        results = json.load(f)
    split = results["2 workers"]
    assert set(split) == {"off", "ngram", "mtp"}
    assert split["mtp"]["round_trips_per_draft"] == 0
    assert split["mtp"]["rows_per_forward"] > 1  # verify windows of several rows ...
    assert split["mtp"]["round_trips_per_forward"] == pytest.approx(2)  # ... cost 2
    assert results["local"]["mtp"]["round_trips_per_draft"] == 0
    assert "trips/draft" in capsys.readouterr().out
