"""A version-2 client against today's daemon: the recorded session of a client of the
last version-2 release (tests/integration/data/protocol_v2_session.ndjson) replayed over a raw Unix
socket gets only what version 2 defines (no ``done.model``, none of the model fields
version 3 added), and what version 3 added is refused as version 2 refused anything
unknown. The replay and the raw connection are the version-1 test's.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig
from tests.integration.helpers import DATA
from tests.integration.helpers.daemon import assert_no_leaks, running_daemon, wait_idle
from tests.integration.helpers.protocol_replay import (
    V1_ERROR_CODES,
    V1_FINISH_REASONS,
    JsonLines,
    load_session,
    replay,
)

pytestmark = pytest.mark.anyio

SESSION = DATA / "protocol_v2_session.ndjson"

V2_FINISH_REASONS = V1_FINISH_REASONS | {"shutdown"}
V2_ERROR_CODES = V1_ERROR_CODES | {"forbidden"}
V2_OPS = "cancel, detokenize, generate, health, hello, models, stats, tokenize"
V3_MODEL_FIELDS = {"loaded", "state", "default", "proposers", "keep_alive_s"}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def runtime() -> Iterator[ModelRuntime]:
    """The default SmolLM2, small and single-threaded: these tests are about frames."""
    rt = ModelRuntime(RuntimeConfig(n_ctx_seq=512, n_seq_max=2, calibrate=False, threads=1))
    yield rt
    rt.close()


def check_v2_values(frame: dict[str, Any]) -> None:
    """Enum values version 2 has (the templates leave some of them open)."""
    if frame["op"] == "done":
        assert frame["finish_reason"] in V2_FINISH_REASONS, frame
    elif frame["op"] == "error":
        assert frame["code"] in V2_ERROR_CODES, frame


async def test_a_recorded_version_2_session_is_answered_in_version_2(
        runtime: ModelRuntime) -> None:
    async with running_daemon(runtime) as (server, path):
        async with JsonLines.open(path) as conn:
            seen = await replay(conn, load_session(SESSION), check_v2_values)
        await wait_idle(server)
        assert_no_leaks(server)
    done = {f["id"]: f for f in seen if f["op"] == "done"}
    assert len(done) == 4 and done["c4d2.1-11"]["finish_reason"] == "cancelled"
    assert isinstance(done["c4d2.1-3"]["seed"], int)  # sampled: the daemon chose one
    assert done["c4d2.1-11"]["usage"]["completion_tokens"] < 400
    models = [m for f in seen if f["op"] in ("welcome", "models_reply")
              for m in ([f["model"]] if f["op"] == "welcome" else f["models"])]
    assert models and not any(V3_MODEL_FIELDS & m.keys() for m in models)


@pytest.mark.parametrize(("frame", "message"), [
    ({"op": "generate", "id": "g", "prompt": "Hi", "max_tokens": 2, "model": "smollm"},
     "generate: unknown field 'model' (allowed: id, prompt, messages, max_tokens, sampling, "
     "stop, speculative, constraint, logprobs, prediction)"),
    ({"op": "generate", "id": "g", "prompt": "Hi", "max_tokens": 2, "keep_alive": 0},
     "generate: unknown field 'keep_alive' (allowed: id, prompt, messages, max_tokens, "
     "sampling, stop, speculative, constraint, logprobs, prediction)"),
    ({"op": "load", "id": "g", "model": "smollm"},
     f"unknown op 'load' (expected one of: {V2_OPS})"),
    ({"op": "unload", "id": "g", "model": "smollm"},
     f"unknown op 'unload' (expected one of: {V2_OPS})"),
])
async def test_a_version_2_client_may_not_use_version_3(
        runtime: ModelRuntime, frame: dict[str, Any], message: str) -> None:
    async with running_daemon(runtime) as (server, path), JsonLines.open(path) as conn:
        assert (await conn.hello(2))["protocol_version"] == 2
        await conn.send(frame)
        error = await conn.recv()
        assert error == {"op": "error", "id": "g", "code": "bad_request", "message": message}
        await conn.send({"op": "health", "id": "after"})  # the connection carries on
        health = await conn.recv()
        assert health is not None and health["op"] == "health_reply"
        await wait_idle(server)
