"""What a user reads about one request agrees everywhere and explains itself: the stats
line and the log give one forward count, meshctl shows the seed the daemon chose and
says when ``--seed`` does nothing, ``--explain`` says what each refusal means, and
``/metrics`` keeps plain decodes apart from verify forwards."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs

import meshd.protocol
from meshd.clients.refusals import REFUSAL_REASONS
from meshd.daemon.frontends.http.metrics import render_metrics
from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig
from meshd.policy.gate import Refusal
from meshd.testing import testmodels
from tests.integration.helpers.daemon import meshctl, running_daemon

pytestmark = pytest.mark.anyio

#: Repeats itself, so n-gram lookup drafts (and sometimes has nothing: proposer_empty).
REPEATING = "1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3,"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(autouse=True)
def _quiet_daemon_logs() -> Iterator[None]:
    """The daemon's log events would otherwise land in the stdout meshctl writes to."""
    with capture_logs():
        yield


@pytest.fixture(scope="module")
def runtime() -> Iterator[ModelRuntime]:
    path = str(testmodels.test_model_path("llama"))
    rt = ModelRuntime(RuntimeConfig(model_path=path, n_ctx_seq=512, n_seq_max=2, draft_max=4,
                                    calibrate=False, threads=1))
    yield rt
    rt.close()


def stats_fields(err: str) -> dict[str, str]:
    """The ``key=value`` fields of the stats line meshctl printed on stderr."""
    line = next(ln for ln in err.splitlines() if ln.startswith("finish="))
    return dict(field.split("=", 1) for field in line.split())


async def test_one_forward_count_in_the_stats_line_the_done_frame_and_the_log(
        runtime: ModelRuntime, capsys: pytest.CaptureFixture[str]) -> None:
    async with running_daemon(runtime) as (_, path):
        with capture_logs() as logs:
            assert await meshctl("--socket", path, "generate", REPEATING, "--max-tokens",
                                 "24", "--proposer", "ngram") == 0
            line = stats_fields(capsys.readouterr().err)
            assert await meshctl("--socket", path, "generate", REPEATING, "--max-tokens",
                                 "24", "--proposer", "ngram", "--json") == 0
            done = json.loads(capsys.readouterr().out)["done"]
    finished = [e for e in logs if e["event"] == "request_finished"]
    assert len(finished) == 2
    forwards = done["speculation"]["target_forwards"]
    assert forwards > 0
    assert int(line["forwards"]) == forwards
    assert [e["target_forwards"] for e in finished] == [forwards, forwards]
    assert all(e["prefill_forwards"] >= 1 for e in finished)


async def test_meshctl_shows_the_seed_it_can_replay(runtime: ModelRuntime,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    async with running_daemon(runtime) as (_, path):
        argv = ["--socket", path, "generate", "hello", "--max-tokens", "12",
                "--temperature", "1.0"]
        assert await meshctl(*argv) == 0
        out, err = capsys.readouterr()
        seed = stats_fields(err)["seed"]
        assert await meshctl(*argv, "--seed", seed) == 0
        replay, replay_err = capsys.readouterr()
        assert replay == out and stats_fields(replay_err)["seed"] == seed
        assert "no effect" not in err + replay_err
        assert await meshctl("--socket", path, "generate", "hello", "--max-tokens", "4") == 0
        assert "seed" not in stats_fields(capsys.readouterr().err)  # greedy: no seed


async def test_a_seed_at_temperature_zero_gets_a_note(runtime: ModelRuntime,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    async with running_daemon(runtime) as (_, path):
        assert await meshctl("--socket", path, "generate", "hello", "--max-tokens", "4",
                             "--seed", "7") == 0
        err = capsys.readouterr().err
        assert "meshctl: note: --seed 7 has no effect at temperature 0" in err


async def test_explain_says_what_each_refusal_means(runtime: ModelRuntime,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    async with running_daemon(runtime) as (_, path):
        argv = ["--socket", path, "generate", REPEATING, "--max-tokens", "24",
                "--proposer", "ngram"]
        assert await meshctl(*argv) == 0
        plain = capsys.readouterr().err
        assert await meshctl(*argv, "--explain") == 0
        err = capsys.readouterr().err
    refused = stats_fields(err)["refused"]
    assert refused != "-"
    counts = dict(item.split(":") for item in refused.split(","))
    for reason, n in counts.items():
        assert f"{reason} x{n}: {REFUSAL_REASONS[reason]}" in err
    assert REFUSAL_REASONS[next(iter(counts))] not in plain  # only when asked


def test_every_refusal_reason_is_explained_and_documented() -> None:
    """The daemon counts only members of ``Refusal`` (``GenerationStats.refuse`` takes
    one); meshctl's explanations and PROTOCOL.md's table cover exactly those, alike."""
    doc = (Path(meshd.protocol.__file__).parent / "PROTOCOL.md").read_text()
    section = doc.split("#### Refusal reasons", 1)[1].split("\n#### ", 1)[0]
    table = dict(re.findall(r"^\| `(\w+)` \| (.+) \|$", section, flags=re.M))
    assert set(REFUSAL_REASONS) == {r.value for r in Refusal}
    assert table == dict(REFUSAL_REASONS)


def samples(text: bytes) -> dict[str, float]:
    """The samples of a single-model daemon's figures (labelled with its model only)."""
    return {s.name: s.value
            for family in text_string_to_metric_families(text.decode())
            for s in family.samples if set(s.labels) == {"model"}}


@pytest.fixture(scope="module")
def smol() -> Iterator[ModelRuntime]:
    """SmolLM2, which continues a repeating prompt, so n-gram lookup drafts."""
    rt = ModelRuntime(RuntimeConfig(n_ctx_seq=1024, n_seq_max=2, draft_max=4,
                                    calibrate=False, threads=1))
    yield rt
    rt.close()


async def test_metrics_keep_decode_and_verify_apart(smol: ModelRuntime) -> None:
    prompt_tokens = len(smol.tokenize_prompt(REPEATING, chat=False))
    async with running_daemon(smol) as (server, path):
        before = samples(render_metrics(server.service))
        async with meshd.protocol.Client.connect(path) as client:
            plain = await client.generate(REPEATING, max_tokens=10, temperature=0.0,
                                          proposer="off").collect()
            mid = samples(render_metrics(server.service))
            await client.generate(REPEATING, max_tokens=24, temperature=0.0,
                                  proposer="ngram").collect()
        after = samples(render_metrics(server.service))
    # Plain decoding: one-row forwards only, each counted as a decode, none as a verify.
    assert plain.done.speculation.verify_calls == 0
    decodes = mid["meshd_decode_seconds_count"] - before.get("meshd_decode_seconds_count", 0)
    assert decodes == plain.done.speculation.target_forwards \
        == plain.done.usage.completion_tokens - 1  # the first token comes with the prefill
    assert mid["meshd_verify_seconds_count"] == before.get("meshd_verify_seconds_count", 0)
    assert after["meshd_verify_seconds_count"] > mid["meshd_verify_seconds_count"]
    assert after["meshd_prompt_tokens_total"] - before.get("meshd_prompt_tokens_total", 0) \
        == 2 * prompt_tokens
    assert after["meshd_request_seconds_count"] - before.get("meshd_request_seconds_count",
                                                             0) == 2
    assert after["meshd_request_seconds_sum"] >= plain.done.speculation.wall_ms / 1e3
