"""Per-request stats describe that request alone (also on a prefix-cache hit), and their
fields mean what PROTOCOL.md says."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from structlog.testing import capture_logs

from meshd.daemon.engine.generation_stats import GenerationStats
from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig
from meshd.testing import testmodels
from tests.integration.helpers.daemon import meshctl, running_daemon

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def smol() -> Iterator[ModelRuntime]:
    rt = ModelRuntime(RuntimeConfig(n_ctx_seq=512, n_seq_max=1, draft_max=4, calibrate=False,
                                    threads=1))
    yield rt
    rt.close()


@pytest.fixture(scope="module")
def llama() -> Iterator[ModelRuntime]:
    path = str(testmodels.test_model_path("llama"))
    rt = ModelRuntime(RuntimeConfig(model_path=path, n_ctx_seq=512, n_seq_max=2, draft_max=4,
                                    calibrate=False, threads=1))
    yield rt
    rt.close()


def generate(rt: ModelRuntime, text: str, **kw: object) -> GenerationStats:
    prompt = rt.tokenize_prompt(rt.render_chat([{"role": "user", "content": text}]), chat=True)
    gen = rt.generation(prompt, max_tokens=8, adaptive=False, **kw)  # type: ignore[arg-type]
    for _ in rt.run(gen):
        pass
    return gen.stats


def test_a_prefix_cache_hit_reports_only_its_own_work(smol: ModelRuntime) -> None:
    """The same chat three times: the second and third reuse the first's session from the
    prefix cache, and each reports its own forwards and times, not running totals."""
    runs = [generate(smol, "Say hi", proposer="off") for _ in range(3)]
    assert runs[0].reused_prompt_tokens == 0
    assert runs[1].reused_prompt_tokens > 0 and runs[2].reused_prompt_tokens > 0
    assert runs[1].session.target_forwards == runs[2].session.target_forwards
    assert runs[1].session.prefill_forwards == runs[2].session.prefill_forwards == 1
    for st in runs:
        assert st.emitted == 8
        # One forward per token after the first (which the prefill's logits give).
        assert st.session.target_forwards - st.session.prefill_forwards == st.emitted - 1
        assert st.session.prefill_ms + st.decode_ms <= st.wall_ms
        assert st.decode_ms > 0
        assert st.verify_calls == 0 and st.session.verify_ms == 0  # no drafts, no verify steps


def test_the_record_reads_the_sessions_own_counters(smol: ModelRuntime) -> None:
    """The request's figures are its session's counters over the request, embedded, and
    ``meshd generate --json``'s record says the same under the wire's names."""
    st = generate(smol, "Say hi", proposer="off")
    record = st.as_dict()
    # Prefill excluded, as in ``done`` and the stats lines (one count everywhere).
    assert record["target_forwards"] == st.decode_forwards > 0
    assert record["target_forwards"] == (st.session.target_forwards
                                         - st.session.prefill_forwards)
    assert record["prefill_ms"] == st.session.prefill_ms > 0
    assert record["decode_ms"] == st.session.decode_ms + st.session.verify_ms
    assert record["emitted"] == 8 and isinstance(record["refusals"], dict)


def test_verify_time_is_the_drafted_part_of_decode_time() -> None:
    path = str(testmodels.test_model_path("mimo2", acceptance=0.9))
    with ModelRuntime(RuntimeConfig(model_path=path, n_ctx_seq=256, draft_max=3,
                                    calibrate=False, threads=1)) as rt:
        runs = []
        for _ in range(2):
            gen = rt.generation(rt.tokenize_prompt("hello there", chat=False), max_tokens=30,
                                proposer="mtp", adaptive=False)
            for _ in rt.run(gen):
                pass
            runs.append(gen.stats)
    assert runs[0].session.target_forwards == runs[1].session.target_forwards  # no running totals
    for st in runs:
        assert st.verify_calls > 0 and st.drafted > 0 and st.accepted > 0
        assert 0 < st.session.verify_ms <= st.decode_ms
        assert st.session.prefill_ms + st.decode_ms <= st.wall_ms
        # Accepted drafts save forwards: fewer decode-phase forwards than tokens.
        assert st.session.target_forwards - st.session.prefill_forwards < st.emitted


async def test_meshctl_json_stats_do_not_add_up(llama: ModelRuntime,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """The user's view: the same request three times gives the same counts."""
    seen = []
    with capture_logs():
        async with running_daemon(llama) as (_, path):
            for _ in range(3):
                status = await meshctl("--socket", path, "generate", "hello world", "--max-tokens",
                                       "8", "--proposer", "off", "--json")
                assert status == 0
                seen.append(json.loads(capsys.readouterr().out)["done"]["speculation"])
    assert [s["target_forwards"] for s in seen] == [7, 7, 7]  # prefill excluded
    assert [s["extra"]["prefill_forwards"] for s in seen][1:] == [1, 1]
    for s in seen:
        assert s["prefill_ms"] <= s["wall_ms"] and s["decode_ms"] > 0
        assert s["verify_calls"] == 0 and s["verify_ms"] == 0
