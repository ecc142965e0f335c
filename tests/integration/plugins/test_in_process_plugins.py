"""Third-party in-process proposers, installed as entry points of their own distribution
(as ``pip install`` would), cannot stall the daemon or fail silently: a hanging one is
dropped at its deadline while other requests go on, and its faults (late, raise,
garbage) are logged and counted per plugin in ``stats`` and ``/metrics``."""

from __future__ import annotations

import importlib
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs

from meshd.daemon.frontends.http.metrics import render_metrics
from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig
from meshd.plugins.config import parse_table
from meshd.plugins.registry import Registry
from meshd.protocol import Client
from tests.integration.helpers.daemon import (
    assert_no_leaks,
    assert_serves,
    reference,
    running_daemon,
)

PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"
MAX_TOKENS = 24
#: How long the hanging plugin sleeps in every ``propose``.
HANG_S = 5.0
#: The most an unrelated request's first token may take while it hangs.
TTFT_BOUND_S = 1.0

PLUGIN = textwrap.dedent('''
    """A misbehaving third-party proposer: one entry point per way to misbehave."""
    import time

    from meshd.plugins.base import Capabilities, Proposal


    class Misbehaving:
        capabilities = Capabilities(max_len=4)

        def __init__(self, name, env):
            self.name, self.env = name, env

        def propose(self, request):
            if self.name == "hang":
                time.sleep(float(self.env.options.get("sleep_s", 0)))
                return Proposal((request.tokens[-1],))
            if self.name == "raising":
                raise RuntimeError("the plugin's code is broken")
            if self.name == "garbage":
                return ["not", "a", "proposal"]
            return Proposal((self.env.vocab_size + 7,))  # oov

        def observe(self, outcome):
            pass

        def close(self):
            pass


    def hang(env):
        return Misbehaving("hang", env)


    def raising(env):
        return Misbehaving("raising", env)


    def garbage(env):
        return Misbehaving("garbage", env)


    def oov(env):
        return Misbehaving("oov", env)
''')

#: entry point -> the fault it must be counted as.
FAULTS = {"raising": "plugin_error", "garbage": "garbage", "oov": "out_of_vocab"}

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def third_party(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    """The registry after installing ``meshd-misbehaving`` (a dist-info on sys.path)."""
    root = tmp_path_factory.mktemp("site")
    (root / "meshd_misbehaving.py").write_text(PLUGIN)
    info = root / "meshd_misbehaving-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: meshd-misbehaving\n"
                                   "Version: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[meshd.proposers]\n" + "".join(f"{n} = meshd_misbehaving:{n}\n"
                                        for n in ("hang", *FAULTS)))
    sys.path.insert(0, str(root))
    importlib.invalidate_caches()
    try:
        registry = Registry.load()
    finally:
        sys.path.remove(str(root))
    assert "meshd-misbehaving" in {e.name: e for e in registry.entries()}["hang"].origin
    yield registry


@pytest.fixture(scope="module")
def runtime(third_party: Registry) -> Iterator[ModelRuntime]:
    plugins = {"hang": parse_table("hang", {"sleep_s": HANG_S, "deadline_ms": 50})}
    with ModelRuntime(RuntimeConfig(n_ctx_seq=512, n_seq_max=2, draft_max=4,
                                    calibrate=False, threads=1, plugins=plugins),
                      registry=third_party) as rt:
        yield rt


def _metric(path: Path | bytes, name: str, labels: dict[str, str]) -> float:
    text = path.decode() if isinstance(path, bytes) else path.read_text()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v
                                           for k, v in labels.items()):
                return sample.value
    return 0.0


@pytest.mark.slow
async def test_a_hanging_plugin_does_not_delay_other_requests(
        runtime: ModelRuntime) -> None:
    rt = runtime
    prompt = rt.tokenize_prompt(PROMPT, chat=False)
    expected, _, _ = reference(rt, prompt, max_tokens=MAX_TOKENS)
    async with running_daemon(rt) as (server, path), Client.connect(path) as client:
        result: dict[str, object] = {}

        async def hanging() -> None:
            t0 = time.monotonic()
            got = await client.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0,
                                        proposer="hang").collect()
            result["tokens"], result["wall"] = list(got.token_ids), time.monotonic() - t0

        with capture_logs() as logs:
            async with anyio.create_task_group() as tg:
                tg.start_soon(hanging)
                with anyio.fail_after(30):  # its first step is asking the plugin
                    while server.scheduler.active == 0:
                        await anyio.sleep(0.01)
                await anyio.sleep(0.2)
                t0 = time.monotonic()
                async with client.generate("Hello", max_tokens=2, temperature=0.0,
                                           proposer="off") as other:
                    async for _ in other:
                        ttft = time.monotonic() - t0
                        break
        print(f"unrelated request's time to first token: {ttft * 1e3:.0f} ms; "
              f"the hanging plugin's request took {result['wall']:.2f} s")
        assert ttft < TTFT_BOUND_S
        assert result["tokens"] == expected  # the step went on without the draft
        counters = (await client.stats()).counters
        assert counters["plugin.hang.faults.late"] >= 1
        # Skipped while the late call still runs: one thread, nothing piled up behind it.
        assert counters["plugin.hang.faults.stuck"] >= 1
        assert [t.name for t in threading.enumerate()].count("meshd-plugin-hang") == 1
        metrics = render_metrics(server.service)
        assert _metric(metrics, "meshd_plugin_faults_total",
                       {"plugin": "hang", "kind": "late"}) == counters["plugin.hang.faults.late"]
        late = [e for e in logs if e["event"] == "plugin_fault" and e.get("kind") == "late"]
        assert len(late) == 1  # once per episode, however many steps it missed
        await assert_serves(path)
        assert_no_leaks(server)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(FAULTS))
async def test_plugin_faults_are_logged_and_counted(runtime: ModelRuntime,
                                                    name: str) -> None:
    rt = runtime
    prompt = rt.tokenize_prompt(PROMPT, chat=False)
    expected, _, _ = reference(rt, prompt, max_tokens=MAX_TOKENS)
    kind = FAULTS[name]
    async with running_daemon(rt) as (server, path), Client.connect(path) as client:
        before = (await client.stats()).counters.get(f"plugin.{name}.faults.{kind}", 0)
        with capture_logs() as logs:
            got = await client.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0,
                                        proposer=name).collect()
        assert list(got.token_ids) == expected
        counters = (await client.stats()).counters
        faults = counters[f"plugin.{name}.faults.{kind}"] - before
        assert faults >= 2  # one per step it was asked
        assert _metric(render_metrics(server.service), "meshd_plugin_faults_total",
                       {"plugin": name, "kind": kind}) == faults + before
        logged = [e for e in logs if e["event"] == "plugin_fault"]
        assert [(e["plugin"], e["kind"]) for e in logged] == [(name, kind)]
        assert_no_leaks(server)
