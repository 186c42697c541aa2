"""Static activations under llm-compressor's ``nvfp4_expanded_mse`` (alias ``fouroversix``): its
``memoryless_mse`` searching from 1.8x the range down, the latest batch's search. `Recipe.from_scheme`
and `Recipe.from_compressed_tensors` refused the name for activations ("no qstats equivalent"); their
rule gives llm-compressor's scale and zero point bit for bit."""

import warnings

import pytest
import torch

import qstats

pytest.importorskip("llmcompressor")
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402
from llmcompressor.observers import Observer  # noqa: E402

ARGS = {"int8-symmetric": dict(num_bits=8, symmetric=True, strategy="tensor"),
        "int8-asymmetric": dict(num_bits=8, symmetric=False, strategy="tensor"),
        "fp8": dict(num_bits=8, type="float", strategy="tensor")}


def _batches() -> list:
    generator = torch.Generator().manual_seed(0)
    out = []
    for i in range(3):
        x = torch.randn(4, 16, 32, generator=generator) * (1 + 5 * i)
        x[0, 0, 0] = 40.0 * (i + 1)  # an outlier the search clips, larger in every batch
        out.append(x)
    return out


@pytest.mark.parametrize("name", ["nvfp4_expanded_mse", "fouroversix", "NVFP4-Expanded-MSE"])
@pytest.mark.parametrize("fields", sorted(ARGS))
@pytest.mark.parametrize("options", [{}, {"expand": 1.3, "grid": 50}], ids=["defaults", "options"])
def test_activation_rule_equals_llm_compressors_observer(name, fields, options):
    args = QuantizationArgs(**ARGS[fields], observer=name, observer_kwargs=options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # llm-compressor's fouroversix alias warns
        reference = Observer.load_from_registry(name, base_name="input", args=args.model_copy(deep=True))
    for x in _batches():
        reference(x)
    want = reference.get_qparams()
    config = {"config_groups": {"group_0": {"targets": ["Linear"], "input_activations": args.model_dump()}}}
    for recipe in (qstats.Recipe.from_scheme({"input_activations": args}), qstats.Recipe.from_compressed_tensors(config)):
        (rule,) = recipe.rules
        observer, state = rule.make_observer(), None
        for x in _batches():
            state = observer.update(observer.init(x) if state is None else state, x)
        got = qstats.compute_qparams(state, rule.spec, **dict(rule.qparams_kwargs))
        assert torch.equal(got.scale.reshape(()), want["scale"].reshape(()).float())
        assert torch.equal(got.zero_point.reshape(()).int(), want["zero_point"].reshape(()).int())
