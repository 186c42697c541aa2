"""Static (``dynamic=False``) activation args whose scales compressed-tensors / llm-compressor 0.14
cannot calibrate or apply, read by `Recipe.from_scheme` and `Recipe.from_compressed_tensors`:
``tensor_group`` inputs without NVFP4's ``dynamic="local"``, and per-channel or per-block outputs.
Their specs read per row, so the sites were scaled at run time in silence and exported as NVFP4's
``"local"`` inputs or as dynamic per-token outputs; they are refused, naming the args."""

import pytest
import torch

import qstats

pytest.importorskip("compressed_tensors")
pytest.importorskip("llmcompressor")
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402
from compressed_tensors.quantization.lifecycle.forward import fake_quantize  # noqa: E402
from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES  # noqa: E402
from llmcompressor.observers import Observer  # noqa: E402

W8 = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
STATIC_NVFP4_INPUT = PRESET_SCHEMES["NVFP4"]["input_activations"].model_copy(update={"dynamic": False})
STATIC_OUTPUTS = {
    "channel": QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel"),
    "block": QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="block", block_structure=[1, 16]),
}


def _readers(scheme: dict):
    config = {"config_groups": {"group_0": {"targets": ["Linear"], **scheme}}}
    return (lambda: qstats.Recipe.from_scheme(scheme), lambda: qstats.Recipe.from_compressed_tensors(config),
            lambda: qstats.Recipe.from_dict({"scheme": scheme}))


def test_static_tensor_group_inputs_are_refused_as_compressed_tensors_cannot_apply_their_scales():
    """llm-compressor's ``static_minmax`` gives static ``tensor_group`` inputs one scale per group of
    the features, which compressed-tensors' forward broadcasts against the tokens (it fails at 5)."""
    args = STATIC_NVFP4_INPUT.model_copy(deep=True)
    theirs = Observer.load_from_registry("static_minmax", base_name="input", args=args)
    g = torch.Generator().manual_seed(0)
    for length in (5, 7):
        theirs(torch.randn(2, length, 64, generator=g))
    qparams = theirs.get_qparams()
    assert qparams["scale"].shape == (4,)  # 64 features / 16
    with pytest.raises(RuntimeError):
        fake_quantize(torch.randn(2, 5, 64, generator=g), qparams["scale"], qparams["zero_point"], args,
                      global_scale=qparams["global_scale"])
    scheme = {"weights": PRESET_SCHEMES["NVFP4"]["weights"].model_dump(), "input_activations": args.model_dump()}
    for read in _readers(scheme):
        with pytest.raises(ValueError, match=r"the input args: static per-group activations .*'tensor_group'"):
            read()
    (_, inputs) = qstats.Recipe.from_scheme("NVFP4").rules  # NVFP4's dynamic="local" inputs still read
    assert inputs.sites == ("input",) and isinstance(inputs.spec.granularity, qstats.TensorGroup)


@pytest.mark.parametrize("strategy", sorted(STATIC_OUTPUTS))
def test_static_per_channel_and_per_block_outputs_are_refused_as_llm_compressor_refuses_them(strategy):
    """llm-compressor's output observer refuses them when calibration starts; qstats exported them
    as dynamic per-token outputs, with no scale."""
    args = STATIC_OUTPUTS[strategy]
    theirs = Observer.load_from_registry("minmax", base_name="output", args=args.model_copy(deep=True))
    with pytest.raises(ValueError, match=f"{strategy.capitalize()} quantization cannot be applied to activations"):
        theirs(torch.randn(2, 5, 64))
    for read in _readers({"weights": W8, "output_activations": args.model_dump()}):
        with pytest.raises(ValueError, match=rf"the output args: static per-channel and per-block .*'{strategy}'"):
            read()


def test_static_per_tensor_outputs_and_dynamic_per_token_ones_still_read():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32)).eval()
    outputs = [{"num_bits": 8, "type": "int", "symmetric": True, "strategy": "tensor"},
               {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}]
    for output in outputs:
        plan = qstats.Recipe.from_scheme({"weights": W8, "output_activations": output}).resolve(model)
        assert plan.sites["0"]["output"].rule.dynamic == output.get("dynamic", False)
