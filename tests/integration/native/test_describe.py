"""A model file described without loading its weights, as a daemon lists a model it has
not loaded yet."""

from __future__ import annotations

from meshd.native.default_model import default_model_path
from meshd.native.model import Model, describe_model
from meshd.testing import testmodels


def test_a_file_is_described_as_its_loaded_model_says() -> None:
    for path in (default_model_path(),
                 testmodels.test_model_path("qwen35", acceptance=0.9)):
        described, template = describe_model(path)
        model = Model.load(path)
        try:
            loaded = model.info
            assert described.architecture == loaded.architecture
            assert described.n_vocab == loaded.n_vocab
            assert described.has_mtp == loaded.has_mtp
            assert described.has_chat_template == loaded.has_chat_template
            assert described.eog_tokens == loaded.eog_tokens
            assert template == model.chat_template
        finally:
            model.close()
    assert describe_model(testmodels.test_model_path("qwen35", acceptance=0.9))[0].has_mtp
