"""qstats.gptq on Hessians that left input rows out (`HessianState.nonfinite`): a NaN row, and rows
whose square passes float32 (|x| above 1.8e19). llm-compressor 0.14's ``accumulate_hessian`` turns
its Hessian NaN (then ``quantize_weight`` rounds the layer to nearest) or Inf; qstats' Hessian leaves
those rows out, and gptq says so, naming them, instead of quantizing silently on the other rows (or
calling an overflowed layer one that "saw no input row")."""

from __future__ import annotations

import re
import warnings

import pytest
import torch

import qstats
from qstats.observers.hessian import HessianState, hessian

llmc_gptq = pytest.importorskip("llmcompressor.modifiers.gptq.gptq_quantize")
llmc_helpers = pytest.importorskip("llmcompressor.modifiers.gptq.helpers")
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402

ARGS = QuantizationArgs(num_bits=4, symmetric=True, strategy="group", group_size=16)
SPEC = qstats.QuantSpec.from_compressed_tensors(ARGS)


def _data(seed=0, out=32, columns=64, rows=200):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(out, columns, generator=gen) * 0.05, torch.randn(rows, columns, generator=gen)


def _qparams(weight):
    observer = qstats.minmax(SPEC)
    return qstats.compute_qparams(observer.update(observer.init(weight), weight), SPEC)


def _llm_compressor(weight, x, qparams):
    """llm-compressor's Hessian of ``x`` (one sample per row) and its quantize_weight."""
    layer = torch.nn.Linear(x.shape[1], weight.shape[0], bias=False)
    total, samples = llmc_helpers.make_empty_hessian(layer), torch.zeros(())
    total, samples = llmc_helpers.accumulate_hessian(x[:, None], layer, total, samples)
    quantized, _, fallback = llmc_gptq.quantize_weight(weight.clone()[None], (total / samples)[None],
                                                       qparams.scale[None], qparams.zero_point[None], None, ARGS)
    return quantized[0], bool(fallback[0])


def test_a_nan_row_is_left_out_with_a_warning_where_llm_compressor_rounds_the_layer():
    weight, x = _data()
    qparams = _qparams(weight)
    poisoned = x.clone()
    poisoned[3, 5] = float("nan")
    rounded, fallback = _llm_compressor(weight, poisoned, qparams)
    assert fallback and torch.equal(rounded, qstats.fake_quantize(weight, qparams, SPEC))  # its NaN Hessian
    state = hessian().update(hessian().init(poisoned), poisoned)
    with pytest.warns(UserWarning, match=r"Hessian of the layer left out 1 row holding a NaN or Inf.*other rows"):
        got, codes, _ = qstats.gptq(weight, state, SPEC, qparams=qparams)
    # GPTQ on the other rows: llm-compressor's on the finite rows
    want, fallback = _llm_compressor(weight, torch.cat([x[:3], x[4:]]), qparams)
    assert not fallback
    assert (codes == qstats.quantize(want, qparams, SPEC)).float().mean() == 1.0


def test_a_slice_of_a_stack_names_the_weight_and_its_experts_by_their_number_in_the_stack():
    """``name`` and ``first_expert`` (gptq_layerwise's chunks of experts): experts 4-7 of a stack of 8,
    expert 6 with an Inf row and expert 5 with no row, are named as 6 and 5 of the stack."""
    weight, x = _data(1, out=8, columns=16, rows=30)
    x = x.expand(8, 30, 16).clone()
    x[6, 7, 0] = float("inf")
    observer = qstats.stacked_observer(hessian(), 8)
    mask = torch.ones(8, 30)
    mask[5] = 0.0
    state = observer.update(observer.init(x), x, weight=mask)
    chunk = type(state)(*(field[4:8] for field in state))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qstats.gptq(weight.expand(4, 8, 16), chunk, SPEC, name="mlp.experts.down_proj", first_expert=4)
    messages = sorted(str(w.message) for w in caught)
    assert len(messages) == 2
    assert "Hessian of mlp.experts.down_proj experts [5] (1 of experts 4-7) saw no input row" in messages[0]
    assert "Hessian of mlp.experts.down_proj experts [6] (1 of experts 4-7) left out 1 row" in messages[1]
    with pytest.raises(TypeError, match="first_expert must be an int >= 0, got -1"):
        qstats.gptq(weight, hessian().update(hessian().init(x[0]), x[0]), SPEC, first_expert=-1)


def test_an_expert_with_a_nan_row_is_named():
    weight, x = _data(1, out=8, columns=16, rows=30)
    x = x.expand(3, 30, 16).clone()
    x[2, 7, 0] = float("inf")
    observer = qstats.stacked_observer(hessian(), 3)
    state = observer.update(observer.init(x), x)
    with pytest.warns(UserWarning, match=r"experts \[2\] \(1 of 3\) left out 1 row holding"):
        qstats.gptq(weight.expand(3, 8, 16), state, SPEC)


def test_rows_past_float32_squares_name_the_float64_hessian_which_gives_llm_compressor_codes():
    """Inputs of 2^65 (3.7e19): every square passes float32, so a float32 Hessian keeps no row;
    gptq names them and the float64 Hessian. Its codes are llm-compressor's on the same rows times
    2^-64 (an exact scaling; llm-compressor's own float32 Hessian is Inf there)."""
    weight, x = _data(2)
    qparams = _qparams(weight)
    large = x * 2.0**65
    state = hessian().update(hessian().init(large), large)
    assert int(state.count) == 0 and int(state.nonfinite) == x.shape[0]
    with pytest.warns(qstats.UncalibratedWarning, match=r"saw no input row \(it left out 200 rows.*float64"):
        qstats.gptq(weight, state, SPEC, qparams=qparams)
    wide = hessian(dtype=torch.float64)
    _, codes, _ = qstats.gptq(weight, wide.update(wide.init(large), large), SPEC, qparams=qparams)
    want, fallback = _llm_compressor(weight, x * 2.0, qparams)
    assert not fallback
    assert (codes == qstats.quantize(want, qparams, SPEC)).float().mean() == 1.0


def test_a_float32_sum_past_its_range_names_the_float64_hessian():
    weight, x = _data(3)
    large = x * 4e18  # each square finite, their sum Inf
    state = hessian().update(hessian().init(large), large)
    assert int(state.nonfinite) == 0
    with pytest.raises(ValueError, match=r"Hessian sum of the layer holds NaN or Inf.*dtype=torch.float64"):
        qstats.gptq(weight, state, SPEC)


def test_a_hand_built_state_without_left_out_rows_does_not_warn():
    weight, x = _data(4, out=8, columns=16, rows=30)
    state = hessian().update(hessian().init(x), x)
    with pytest.warns(UserWarning, match="left out 5 rows"):
        qstats.gptq(weight, state._replace(nonfinite=torch.tensor(5)), SPEC)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        qstats.gptq(weight, HessianState(state.total, state.count, torch.tensor(0)), SPEC)


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.used = torch.nn.Linear(32, 32)

    def forward(self, x):
        return self.used(x)


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(_Block() for _ in range(2))
        self.head = torch.nn.Linear(32, 32)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_gptq_layerwise_names_each_weight_whose_hessian_left_rows_out(tmp_path):
    """gptq names no weight ("the Hessian of the layer"): gptq_layerwise's warning names each, and
    Python, which shows one warning of a text per line, shows one per weight."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    net = _Net().eval()
    save_file(net.state_dict(), str(tmp_path / "model.safetensors"))
    with torch.device("meta"):
        meta = _Net().eval()
    x = torch.randn(4, 8, 32)
    x[1, 2, 5] = float("nan")
    # the float model's Linears whose inputs hold a non-finite row (the NaN runs through every layer)
    dirty = set()
    hooks = [module.register_forward_hook(lambda m, args, out, name=name: dirty.add(name) if not
                                          bool(torch.isfinite(args[0]).all()) else None)
             for name, module in net.named_modules() if isinstance(module, torch.nn.Linear)]
    with torch.no_grad():
        net(x)
    for hook in hooks:
        hook.remove()
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("weight",), spec=SPEC)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # Python's: one warning of a text from a line
        qstats.gptq_layerwise(meta, str(tmp_path), [x], recipe, progress=False)
    named = {re.search(r"Hessian of (\S+) left out 1 row", str(w.message)).group(1) for w in caught
             if "left out 1 row" in str(w.message)}
    assert dirty == {"layers.0.used", "layers.1.used", "head"}
    assert named == {f"{name}.weight" for name in dirty}
