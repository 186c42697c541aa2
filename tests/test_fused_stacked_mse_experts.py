"""fused_qparams(stacked=True) of stacked experts observed by `qstats.mse` (NVFP4), against
llm-compressor 0.14's ``memoryless_mse`` observers of the experts' Linears fused into one group
(``FusionHandler.fuse``): one global scale over all experts, each expert's search stopped on its
own (``patience``), as the list form of the same states gives."""

import pytest
import torch
from _shared import bit_equal

import qstats

pytest.importorskip("llmcompressor")
from compressed_tensors.quantization.quant_scheme import NVFP4  # noqa: E402
from llmcompressor.observers import Observer  # noqa: E402
from llmcompressor.observers.fusion import FusionHandler  # noqa: E402

EXPERTS = 3


def _llm_compressor(weights):
    """Each expert a Linear with a memoryless_mse observer, all fused: their qparams."""
    linears = []
    for weight in weights:
        linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
        linear.weight.data = weight.clone()
        linears.append(linear)
    observers = [Observer.load_from_registry("memoryless_mse", base_name="weight", args=NVFP4["weights"].model_copy(deep=True))
                 for _ in linears]
    FusionHandler.fuse(list(zip(observers, linears)))
    for observer, linear in zip(observers, linears):
        observer(linear.weight)
    return [observer.get_qparams() for observer in observers]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_stacked_mse_experts_share_llm_compressors_global_scale(dtype):
    g = torch.Generator().manual_seed(0)
    weights = (torch.randn(EXPERTS, 8, 64, generator=g) * torch.tensor([1.0, 3.0, 0.5]).view(EXPERTS, 1, 1)).to(dtype)
    spec = qstats.QuantSpec.from_compressed_tensors(NVFP4["weights"], observed_dtype=dtype)
    obs = qstats.mse(spec)
    stacked = torch.func.vmap(lambda w: obs.update(obs.init(w), w))(weights)
    got = qstats.fused_qparams(stacked, spec, stacked=True, patience=5)  # memoryless_mse's patience
    listed = qstats.fused_qparams([obs.update(obs.init(w), w) for w in weights], spec, patience=5)
    want = _llm_compressor(weights)
    for expert in range(EXPERTS):
        assert bit_equal(got.global_scale[expert], want[expert]["global_scale"].reshape(()))
        assert bit_equal(got.scale[expert], want[expert]["scale"].float().reshape(got.scale[expert].shape))
        assert bit_equal(got.scale[expert], listed[expert].scale)
        assert bit_equal(got.global_scale[expert], listed[expert].global_scale)
