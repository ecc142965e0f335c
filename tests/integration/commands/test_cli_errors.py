"""Errors a user can act on: what they say and the exit codes scripts branch on."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from meshd.clients import ctl
from meshd.daemon.commands.cli import main
from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig
from meshd.protocol import BadRequest, Cancel, Client, SamplingParams
from meshd.testing import testmodels
from tests.integration.helpers.daemon import running_daemon


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def test_a_prompt_over_the_context_names_ctx_and_the_limit(
        capsys: pytest.CaptureFixture[str]) -> None:
    """`meshd generate` exits 3 for it, as meshctl does for the daemon's model_error."""
    path = str(testmodels.test_model_path("llama"))
    status = main(["generate", "-m", path, "-c", "64", "-t", "1", "--raw", "--fixed-k",
                   "-p", "word " * 100])
    assert status == ctl.EXIT_MODEL
    err = capsys.readouterr().err
    assert "does not fit the context of 64 tokens per session (--ctx): at most 63 prompt " \
        "tokens" in err


@pytest.mark.anyio
async def test_field_paths_are_written_one_way_in_the_client_library() -> None:
    """The client library's own checks (before anything is sent) name fields as the
    server does."""
    path = str(testmodels.test_model_path("llama"))
    with capture_logs(), ModelRuntime(RuntimeConfig(
            model_path=path, n_ctx_seq=128, calibrate=False, threads=1)) as rt:
        async with running_daemon(rt) as (_, sock), Client.connect(sock) as client:
            await check_field_paths(client)


async def check_field_paths(client: Client) -> None:
    cases = [
        (dict(prompt="x", top_p=2.0), "generate.sampling.top_p: must be a number in (0, 1]"),
        (dict(prompt="x", max_tokens=0), "generate.max_tokens: must be an integer >= 1"),
        (dict(prompt="x", stop=[""]), "generate.stop[0]: must be a non-empty string"),
        (dict(prompt="x", draft_max=0), "generate.speculative.draft_max: must be an integer"),
        (dict(messages=[{"role": "", "content": "x"}]),
         "generate.messages[0].role: must be a non-empty string"),
    ]
    for kwargs, message in cases:
        with pytest.raises(BadRequest) as info:
            client.generate(**kwargs, request_id="r")  # type: ignore[arg-type]
        assert info.value.message.startswith(message), info.value.message
    with pytest.raises(BadRequest, match=r"^top_k: must be an integer >= 0"):
        SamplingParams(top_k=-1)  # a message object alone knows only its own field names
    with pytest.raises(BadRequest, match=r"^ack: must be a non-empty string"):
        Cancel(id="x", ack="")


@pytest.mark.anyio
async def test_advertised_proposers_are_the_usable_ones() -> None:
    """welcome.proposers and the "available" list leave out proposers that cannot serve
    the model, and a request naming one is told why."""
    llama = str(testmodels.test_model_path("llama"))
    mimo2 = str(testmodels.test_model_path("mimo2", acceptance=0.9))
    for model, drafts, expected in (
        (llama, (), ["auto", "composite", "ngram"]),
        (llama, (mimo2,), ["auto", "composite", f"draft:{mimo2}", "ngram"]),
        (mimo2, (), ["auto", "composite", "mtp", "ngram"]),
    ):
        with capture_logs(), ModelRuntime(RuntimeConfig(
                model_path=model, n_ctx_seq=128, calibrate=False, threads=1,
                allowed_drafts=drafts)) as rt:
            async with running_daemon(rt) as (_, sock), Client.connect(sock) as client:
                # Third-party plugins installed here (the example package) come on top.
                extra = set(rt.registry.names()) - {"mtp", "ngram", "composite", "draft"}
                assert [p for p in client.welcome.proposers if p not in extra] == expected
                if "mtp" in expected:
                    continue
                with pytest.raises(BadRequest) as info:
                    await client.generate("abc", max_tokens=2, proposer="mtp").collect()
                assert info.value.message == (
                    "generate.speculative.proposer: proposer 'mtp' cannot serve this model: "
                    "the model has no MTP head (available: off, "
                    f"{', '.join(client.welcome.proposers)})")
                if not drafts:
                    with pytest.raises(BadRequest, match="start meshd serve with "
                                                         "--draft-model PATH"):
                        await client.generate("abc", max_tokens=2,
                                              proposer=f"draft:{mimo2}").collect()


def test_generate_says_why_a_proposer_cannot_serve_the_model(
        capsys: pytest.CaptureFixture[str]) -> None:
    path = str(testmodels.test_model_path("llama"))
    assert main(["generate", "-m", path, "-t", "1", "--raw", "-p", "x", "--proposer",
                 "mtp", "--fixed-k"]) == 2
    assert "proposer 'mtp' cannot serve this model: the model has no MTP head" \
        in capsys.readouterr().err
