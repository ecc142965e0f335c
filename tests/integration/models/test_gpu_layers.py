"""``--gpu-layers N|all``: where a model's layers run, as the flag, the config and the
``models`` answer report it (this is a CPU-only build: nothing is offloaded, ever)."""

from __future__ import annotations

import argparse

import pytest

from meshd.clients.argtypes import gpu_layers
from meshd.daemon.config import settings as cfg
from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig
from meshd.native.rpc import local_gpus
from meshd.protocol import Client
from meshd.testing import testmodels
from tests.integration.helpers.daemon import running_daemon


@pytest.mark.parametrize(("text", "value"), [("all", -1), ("ALL", -1), ("0", 0), ("24", 24)])
def test_flag_values(text: str, value: int) -> None:
    assert gpu_layers(text) == value


@pytest.mark.parametrize("text", ["-2", "some", "1.5", ""])
def test_bad_flag_values_say_what_is_expected(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="layers"):
        gpu_layers(text)


def test_config_key_from_environment_and_its_errors() -> None:
    c = cfg.load(None, environ={"MESHD_MODEL_GPU_LAYERS": "12"}, default_path=None).config
    assert c.model.gpu_layers == 12
    assert cfg.load(None, environ={}, default_path=None).config.model.gpu_layers is None
    with pytest.raises(cfg.ConfigError, match="gpu_layers"):
        cfg.load(None, environ={"MESHD_MODEL_GPU_LAYERS": "-5"}, default_path=None)


@pytest.mark.parametrize("requested", [None, 0, 3])
@pytest.mark.anyio
async def test_models_answer_reports_offloaded_layers(requested: int | None) -> None:
    """Without an accelerator or workers every layer stays on the CPU whatever was asked,
    and generation works the same."""
    if local_gpus():
        pytest.skip("this build has a GPU: the CPU-only expectation does not apply")
    path = str(testmodels.test_model_path("llama", acceptance=0.8))
    rt = ModelRuntime(RuntimeConfig(model_path=path, n_ctx_seq=256, n_seq_max=1,
                                    calibrate=False, threads=1, gpu_layers=requested))
    try:
        async with running_daemon(rt) as (_, sock), Client.connect(sock) as client:
            models = await client.models()
            assert [m.gpu_layers for m in models] == [0]
            assert client.welcome.model.gpu_layers == 0
            done = await client.generate(prompt="ab", max_tokens=4, temperature=0.0).collect()
            assert len(done.token_ids) == 4
    finally:
        rt.close()
