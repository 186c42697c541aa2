"""compute_qparams of a stacked `qstats.mse` state (experts observed at once, state ``[E, ...]``):
each expert's search stops on its own (``patience``), as llm-compressor 0.14's ``memoryless_mse``
observer of each expert's Linear stops; before, the candidates' factors did not broadcast over the
stack (a RuntimeError)."""

import pytest
import torch
from _shared import bit_equal

import qstats

pytest.importorskip("llmcompressor")
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402
from llmcompressor.observers import Observer  # noqa: E402

ARGS = dict(num_bits=8, type="int", symmetric=True, strategy="channel")


def _memoryless_mse(weight):
    observer = Observer.load_from_registry("memoryless_mse", base_name="weight", args=QuantizationArgs(**ARGS))
    observer(weight)
    return observer.get_qparams()["scale"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_stacked_mse_state_stops_each_expert_on_its_own(dtype):
    g = torch.Generator().manual_seed(0)
    # experts of different shapes of distribution, so that their searches stop at different steps
    weights = torch.stack([torch.randn(8, 64, generator=g), torch.rand(8, 64, generator=g) * 2 - 1,
                           torch.randn(8, 64, generator=g) ** 3]).to(dtype)
    spec = qstats.QuantSpec.from_compressed_tensors(QuantizationArgs(**ARGS), observed_dtype=dtype)
    obs = qstats.stacked_observer(qstats.mse(spec), weights.shape[0])
    got = qstats.compute_qparams(obs.update(obs.init(weights), weights), spec, patience=5)
    for expert, weight in enumerate(weights):
        want = _memoryless_mse(weight)
        assert bit_equal(got.scale[expert], want.float().reshape(got.scale[expert].shape))
