"""The drop-in observers on an Embedding's input (a config group on ``Embedding`` with static input
args): llm-compressor's observers take a scale from the token ids, which compressed-tensors' forward
then cannot apply; the qstats observers refuse the integer tensor, naming it (they raised that
observed_dtype must be a float dtype)."""

import warnings

import pytest
import torch

pytest.importorskip("llmcompressor")
import qstats.llmcompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config  # noqa: E402
from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES  # noqa: E402
from llmcompressor.observers import Observer  # noqa: E402

IDS = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0))


def test_compressed_tensors_cannot_run_an_embedding_with_an_input_scale():
    model = torch.nn.Sequential(torch.nn.Embedding(64, 16), torch.nn.Linear(16, 16))
    config = QuantizationConfig.model_validate({"config_groups": {"g": {"targets": ["Embedding"], **PRESET_SCHEMES["FP8"]}},
                                                "quantization_status": "frozen"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        apply_quantization_config(model, config, show_progress=False)
    theirs = Observer.load_from_registry("static_minmax", base_name="input",
                                         args=PRESET_SCHEMES["FP8"]["input_activations"].model_copy(deep=True))
    with torch.no_grad():
        model[0].input_scale.copy_(theirs(IDS).get_qparams()["scale"])
        model[0].weight_scale.fill_(0.01)
        with pytest.raises(RuntimeError, match="indices"):
            model(IDS)


@pytest.mark.parametrize("name", ["qstats_static_minmax", "qstats_minmax", "qstats_histogram", "qstats_mse"])
def test_qstats_observers_refuse_token_ids_naming_them(name):
    assert name.removeprefix("qstats_") in qstats.llmcompressor.OBSERVERS
    observer = Observer.load_from_registry(name, base_name="input",
                                           args=PRESET_SCHEMES["FP8"]["input_activations"].model_copy(deep=True))
    with pytest.raises(ValueError, match=r"\(input\): observed a torch.int64 tensor, not floating point: an Embedding"):
        observer(IDS)
