"""A fused NVFP4 group (q/k/v, gate/up) mixing qstats and llm-compressor weight observers is refused
with the same TypeError whichever member computes its qparams first: llm-compressor's own observer
reads ``min_vals``/``max_vals`` of every member for the shared global scale, which a qstats member
does not hold (it raised KeyError 'min_vals' inside llm-compressor)."""

import pytest
import torch

pytest.importorskip("llmcompressor")
import qstats.llmcompressor  # noqa: E402,F401  (registers the qstats_* observers)
from compressed_tensors.quantization.quant_scheme import NVFP4  # noqa: E402
from llmcompressor.observers import Observer  # noqa: E402
from llmcompressor.observers.fusion import FusionHandler  # noqa: E402


def _fused(names):
    modules = [torch.nn.Linear(64, 32) for _ in names]
    observers = [Observer.load_from_registry(name, base_name="weight", args=NVFP4["weights"].model_copy(deep=True))
                 for name in names]
    FusionHandler.fuse(list(zip(observers, modules)))
    for observer, module in zip(observers, modules):
        observer(module.weight)
    return observers


def test_llm_compressors_observer_first_gets_the_mixed_group_error():
    theirs, ours = _fused(["memoryless_minmax", "qstats_memoryless_minmax"])
    member = qstats.llmcompressor.QstatsMemorylessMinmaxObserver.__name__
    with pytest.raises(TypeError, match=f"{member} has no '(min|max)_vals'.*mixes qstats and llm-compressor observers"):
        theirs.get_qparams()
    with pytest.raises(TypeError, match="mixes qstats and llm-compressor observers"):
        ours.get_qparams()


@pytest.mark.parametrize("names", [["memoryless_minmax"] * 2, ["qstats_memoryless_minmax"] * 2])
def test_an_unmixed_group_shares_one_global_scale(names):
    scales = [observer.get_qparams()["global_scale"] for observer in _fused(names)]
    assert torch.equal(scales[0], scales[1])
