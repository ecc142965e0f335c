"""A hybrid model drops its rollback snapshots while requests do not speculate and gets
them back when one does, with output unchanged either way.

Why: llama.cpp writes the in-place rollback snapshots of every recurrent layer on every
forward, plain decodes included, so a model that keeps them runs slower than plain
decoding when nothing is drafted (the runtime rebuilds its context between requests)."""

from __future__ import annotations

import anyio
import pytest

from meshd.daemon.engine.generation import Generation
from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig
from meshd.daemon.models.scheduler import Finished, GenerationFailed, GenerationRequest, Scheduler
from meshd.native.context import DEFAULT_CONFIG, ContextConfig, TargetContext
from meshd.native.errors import CapacityError
from meshd.native.model import Model
from meshd.policy.rollback_depth import QUIET_REQUESTS
from meshd.testing import testmodels


def _serve(rt: ModelRuntime, prompt: list[int], proposer: str) -> Generation:
    gen = rt.generation(prompt, max_tokens=40, proposer=proposer)
    for _ in rt.run(gen):
        pass
    return gen


def test_snapshots_follow_speculation_and_tokens_do_not_change() -> None:
    path = str(testmodels.test_model_path("qwen35", acceptance=0.9))
    rt = ModelRuntime(RuntimeConfig(model_path=path, n_ctx_seq=256, n_seq_max=2,
                                    draft_max=4, calibrate=False, threads=1))
    try:
        full = rt.context.rollback_window
        assert full == 4
        prompt = rt.tokenize_prompt("snapshots come and go", chat=False)
        reference = _serve(rt, prompt, "off").committed
        for _ in range(QUIET_REQUESTS - 1):
            assert _serve(rt, prompt, "off").committed == reference
        assert rt.context.rollback_window == full  # switched only between requests
        plain = _serve(rt, prompt, "off")  # opens on the rebuilt context
        assert rt.context.rollback_window == 0
        assert plain.committed == reference
        drafted = _serve(rt, prompt, "mtp")  # checkpoints and replays: still exact
        assert drafted.committed == reference
        assert drafted.stats.accepted >= 0.1 * len(drafted.committed)
        assert drafted.stats.session.checkpoints > 0  # every window needs one
        assert drafted.stats.session.rollbacks_in_place == 0
        again = _serve(rt, prompt, "mtp")  # the snapshots are back
        assert rt.context.rollback_window == full
        assert again.committed == reference
        assert again.stats.drafted > 0
        assert again.stats.session.checkpoints == 0  # windows within the snapshots
    finally:
        rt.close()
    assert rt.ledger.rollback is not None


def test_a_daemon_whose_default_is_off_starts_without_snapshots() -> None:
    """`meshd serve --proposer off` decodes from its first request without the
    snapshots' cost; a request that names a proposer and speculates brings them back."""
    path = str(testmodels.test_model_path("qwen35", acceptance=0.9))
    with ModelRuntime(RuntimeConfig(model_path=path, n_ctx_seq=256, n_seq_max=1,
                                    draft_max=4, calibrate=False, threads=1)) as ref:
        prompt = ref.tokenize_prompt("start without snapshots", chat=False)
        reference = _serve(ref, prompt, "off").committed
    rt = ModelRuntime(RuntimeConfig(model_path=path, n_ctx_seq=256, n_seq_max=1,
                                    draft_max=4, calibrate=False, threads=1,
                                    default_proposer="off"))
    try:
        assert rt.context.rollback_window == 0  # before any request
        assert _serve(rt, prompt, "off").committed == reference
        drafted = _serve(rt, prompt, "mtp")
        assert drafted.committed == reference and drafted.stats.accepted > 0
        again = _serve(rt, prompt, "mtp")
        assert rt.context.rollback_window == 4 and again.committed == reference
    finally:
        rt.close()


@pytest.mark.quiet_machine  # calibrate=True measures the machine
def test_a_dropped_head_drops_the_snapshots_after_that_request() -> None:
    """A request that followed the MTP head and dropped it (its drafts did not pay, with
    the snapshots) leaves no reason to keep them: the next request runs without."""
    path = str(testmodels.test_model_path("qwen35", acceptance=0.0))
    rt = ModelRuntime(RuntimeConfig(model_path=path, n_ctx_seq=256, n_seq_max=1,
                                    draft_max=4, calibrate=True, threads=1))
    try:
        assert rt.context.rollback_window == 4
        prompt = rt.tokenize_prompt("a head that never pays " * 4, chat=False)
        gen = rt.generation(prompt, max_tokens=120, proposer="mtp")
        # The head's drafts are judged per position, not by copy runs.
        assert gen.gate.adaptive is not None and not gen.gate.adaptive.streaks
        for _ in rt.run(gen):
            pass
        assert "mtp_head_dropped" in gen.stats.refusals
        _serve(rt, prompt, "off")
        assert rt.context.rollback_window == 0
    finally:
        rt.close()


def test_fixed_depth_when_adaptation_is_off() -> None:
    path = str(testmodels.test_model_path("qwen35", acceptance=0.9))
    rt = ModelRuntime(RuntimeConfig(model_path=path, n_ctx_seq=256, n_seq_max=1,
                                    draft_max=4, calibrate=False, threads=1,
                                    adaptive_rollback=False))
    try:
        prompt = rt.tokenize_prompt("snapshots stay", chat=False)
        for _ in range(QUIET_REQUESTS + 1):
            _serve(rt, prompt, "off")
        assert rt.context.rollback_window == 4 and rt.ledger.rollback is None
    finally:
        rt.close()


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_admissions_wait_for_the_snapshots_to_come_back(anyio_backend: str) -> None:
    """Under overlapping requests the context is never idle by itself: once speculation
    wants the snapshots back, new requests wait for the running one to end, the context
    is rebuilt, and they are served with the snapshots."""
    path = str(testmodels.test_model_path("qwen35", acceptance=0.9))
    rt = ModelRuntime(RuntimeConfig(model_path=path, n_ctx_seq=512, n_seq_max=2,
                                    draft_max=4, calibrate=False, threads=1))
    try:
        prompt = rt.tokenize_prompt("snapshots under load", chat=False)
        for _ in range(QUIET_REQUESTS + 1):
            _serve(rt, prompt, "off")
        assert rt.context.rollback_window == 0
        sched = Scheduler(rt)
        order: list[str] = []

        async def run(name: str, request: GenerationRequest) -> None:
            async with sched.submit(request).events as events:
                async for ev in events:
                    if isinstance(ev, Finished | GenerationFailed):
                        assert isinstance(ev, Finished)
                        order.append(f"{name} done")
                        return
                    if ev.tokens and f"{name} first" not in order:
                        order.append(f"{name} first")

        async def until(event: str) -> None:
            while event not in order:
                await anyio.sleep(0.001)

        async with anyio.create_task_group() as tg:
            await tg.start(sched.run)
            async with anyio.create_task_group() as clients:
                clients.start_soon(run, "long", GenerationRequest(
                    tuple(prompt), max_tokens=400, proposer="off"))
                await until("long first")
                # Speculates without snapshots while the long one runs, and pays.
                clients.start_soon(run, "mtp", GenerationRequest(
                    tuple(prompt), max_tokens=40, proposer="mtp"))
                await until("mtp done")
                assert rt.ledger.snapshots_wanted_back and "long done" not in order
                clients.start_soon(run, "next", GenerationRequest(
                    tuple(prompt), max_tokens=20, proposer="mtp"))
            tg.cancel_scope.cancel()
        # A slot was free, yet the third request waited for the long one to end.
        assert order.index("long done") < order.index("next first")
        assert rt.context.rollback_window == 4
        assert not rt.ledger.snapshots_wanted_back
    finally:
        rt.close()


def test_a_refused_rebuild_keeps_the_old_depth_and_stops_trying(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where llama.cpp cannot make the context with its snapshots (memory: a fault the
    tests cannot cause for real, so it is injected), the runtime serves on without them,
    says so once, and does not rebuild on every later request."""
    path = str(testmodels.test_model_path("qwen35", acceptance=0.9))
    notes: list[tuple[str, str]] = []
    rt = ModelRuntime(RuntimeConfig(model_path=path, n_ctx_seq=256, n_seq_max=1,
                                    draft_max=4, calibrate=False, threads=1),
                      notes=lambda event, message: notes.append((event, message)))
    try:
        prompt = rt.tokenize_prompt("no memory for snapshots", chat=False)
        reference = _serve(rt, prompt, "off").committed
        for _ in range(QUIET_REQUESTS):
            _serve(rt, prompt, "off")
        assert rt.context.rollback_window == 0
        made = TargetContext.__init__

        def refuse_snapshots(self: TargetContext, model: Model,
                             config: ContextConfig = DEFAULT_CONFIG) -> None:
            if config.in_place_rollback:
                raise CapacityError("llama.cpp could not allocate the context")
            made(self, model, config)

        monkeypatch.setattr(TargetContext, "__init__", refuse_snapshots)
        assert _serve(rt, prompt, "mtp").committed == reference  # pays: wanted back
        for proposer in ("mtp", "off", "mtp"):
            assert _serve(rt, prompt, proposer).committed == reference
        after_first_try = rt.context
        for proposer in ("mtp", "mtp"):
            assert _serve(rt, prompt, proposer).committed == reference
        assert rt.context is after_first_try  # no rebuild on every request
        assert rt.context.rollback_window == 0
        assert [e for e, _ in notes].count("rollback_depth_failed") == 1
        assert rt.ledger.rollback is not None and rt.ledger.rollback.stuck
    finally:
        rt.close()
