"""Tensors llm-compressor 0.14's view of a strategy (``flatten_for_calibration``) cannot take: its own
observers raise torch's ``unflatten`` RuntimeError or an unpacking ValueError naming neither the layer
nor the group size; the qstats drop-ins refuse them with a ValueError naming both sizes."""

import pytest
import torch

pytest.importorskip("qstats.llmcompressor")  # registers the qstats_* observers (skips without llm-compressor)
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402
from compressed_tensors.quantization.quant_scheme import FP8_BLOCK, NVFP4, W4A16  # noqa: E402
from llmcompressor.observers import Observer  # noqa: E402

CASES = {  # base name, args, observed shape, words the refusal must hold
    "group-of-32-over-100-columns": ("weight", QuantizationArgs(num_bits=4, strategy="group", group_size=32), (16, 100),
                                     ["100 columns", "group_size 32"]),
    "group-of-128-over-64-columns": ("weight", W4A16["weights"], (16, 64), ["64 columns", "group_size 128"]),
    "nvfp4-weight": ("weight", NVFP4["weights"], (16, 40), ["40 columns", "group_size 16"]),
    "nvfp4-input": ("input", NVFP4["input_activations"], (2, 3, 100), ["100 columns", "group_size 16"]),
    "block-of-a-3d-weight": ("weight", FP8_BLOCK["weights"], (2, 16, 64), ["block_structure [128, 128]", "(2, 16, 64)"]),
}


@pytest.mark.parametrize("observer", ["memoryless_minmax", "static_minmax", "mse"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_shapes_llm_compressor_cannot_view_are_refused_naming_the_sizes(case, observer):
    base, args, shape, words = CASES[case]
    x = torch.randn(shape)
    theirs = Observer.load_from_registry(observer, base_name=base, args=args.model_copy(deep=True))
    with pytest.raises((RuntimeError, ValueError)):  # llm-compressor's own refusal
        theirs(x)
    ours = Observer.load_from_registry(f"qstats_{observer}", base_name=base, args=args.model_copy(deep=True))
    with pytest.raises(ValueError, match=f"Qstats.*Observer \\({base}, strategy ") as refusal:
        ours(x)
    assert all(word in str(refusal.value) for word in words), str(refusal.value)
