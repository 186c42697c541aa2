"""docs/recipes.md: NVFP4's ``dynamic="local"`` inputs (block scales at run time) are calibrated for
their global scale only, which equals llm-compressor's observer of the same name bit for bit: under
``static_minmax`` and ``memoryless_minmax`` (the whole tensor's extremes), and under ``minmax``,
``mse`` and ``memoryless_mse``, which average (or search) each group of 16 features over the batches
and take the largest, as qstats then observes them (per group of features)."""

from __future__ import annotations

import warnings

import pytest
import torch

import qstats

pytest.importorskip("llmcompressor")
from compressed_tensors.quantization.quant_scheme import NVFP4  # noqa: E402

SCALES = (1.0, 4.0, 2.0, 3.0)  # the latest batch is not the widest: memoryless differs from static


def _global_scales(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(qstats', llm-compressor's) global scale of a Linear's NVFP4 input after four batches."""
    from llmcompressor.observers import Observer

    args = NVFP4["input_activations"].model_copy(update={"observer": name})
    assert args.dynamic == "local"
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(4, 16, 64, generator=g) * s for s in SCALES]
    reference = Observer.load_from_registry(name, base_name="input", args=args)
    for x in batches:
        reference(x)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32)).eval()
    plan = qstats.Recipe.from_scheme({"input_activations": args}).resolve(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qparams = qstats.compute_qparams_tree(qstats.calibrate(model, batches, plan, progress=False), plan)
    return qparams["0"]["input"].global_scale.reshape(()), reference.get_qparams()["global_scale"].reshape(())


@pytest.mark.parametrize("name", ["static_minmax", "memoryless_minmax", "minmax", "mse", "memoryless_mse"])
def test_nvfp4_input_global_scale_equals_llm_compressors(name):
    ours, theirs = _global_scales(name)
    assert torch.equal(ours, theirs.float())


@pytest.mark.parametrize("name", ["minmax", "mse"])
def test_averaging_observers_differ_from_the_whole_tensors(name):
    """The batches' scales differ: a whole-tensor average (or search) would give another global scale."""
    from llmcompressor.observers import Observer

    args = NVFP4["input_activations"].model_copy(update={"observer": name, "strategy": "tensor", "group_size": None})
    g = torch.Generator().manual_seed(0)
    whole = Observer.load_from_registry(name, base_name="input", args=args)
    for s in SCALES:
        whole(torch.randn(4, 16, 64, generator=g) * s)
    tensor_scale = 448 * 6 / whole.get_statistics()["max_vals"].abs().max()
    ours, _ = _global_scales(name)
    assert 0.001 < (ours / tensor_scale - 1).abs().item() < 0.1
