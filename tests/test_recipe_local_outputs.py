"""NVFP4 output activations (``tensor_group`` with ``dynamic="local"``: group scales at run time under a
calibrated global scale): llm-compressor 0.14 attaches an observer to such inputs but none to such outputs
(its calibration takes ``not dynamic`` for outputs), so ``oneshot`` saves compressed-tensors' uninitialized
(``torch.empty``) ``output_global_scale``. A Recipe calibrates it as llm-compressor calibrates those inputs:
equal to its observer of that name over the outputs (docs/recipes.md)."""

from __future__ import annotations

import warnings

import pytest
import torch

import qstats

pytest.importorskip("llmcompressor")
from compressed_tensors.quantization.quant_scheme import NVFP4  # noqa: E402

SCALES = (1.0, 4.0, 2.0)


@pytest.mark.parametrize("name", ["minmax", "static_minmax"])
def test_nvfp4_output_global_scale_is_calibrated_as_llm_compressor_calibrates_inputs(name):
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.observers import Observer

    args = NVFP4["input_activations"].model_copy(update={"observer": name})
    group = {"targets": ["Linear"], "weights": NVFP4["weights"].model_dump(), "output_activations": args.model_dump()}
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64)).eval()
    started = torch.nn.Sequential(torch.nn.Linear(64, 64))
    modifier = QuantizationModifier(config_groups={"group_0": group})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        modifier.initialize_quantization(started)
        modifier.start_calibration(started)
    assert hasattr(started[0], "output_global_scale") and getattr(started[0], "output_observer", None) is None
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(4, 16, 64, generator=g) * s for s in SCALES]
    reference = Observer.load_from_registry(name, base_name="output", args=args)
    with torch.no_grad():
        for x in batches:
            reference(model(x))
    plan = qstats.Recipe.from_compressed_tensors(modifier).resolve(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qparams = qstats.compute_qparams_tree(qstats.calibrate(model, batches, plan, progress=False), plan)
    ours = qparams["0"]["output"].global_scale.reshape(())
    assert torch.equal(ours, reference.get_qparams()["global_scale"].reshape(()).float())
