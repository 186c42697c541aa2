"""`qstats.imatrix` passed to a Rule as the factory itself (``observer=qstats.imatrix``), as
`qstats.hessian` is: the rule calls ``observer(spec)``, which imatrix refused with a TypeError
(only the registered name ``"imatrix"`` worked). The importance is checked against llama.cpp's
definition computed from the layer's inputs: the sum of squared activations per input column over
the rows seen, divided by the number of rows."""

import warnings

import pytest
import torch

import qstats


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 8), torch.nn.ReLU(), torch.nn.Linear(8, 5))


def test_rule_with_the_imatrix_factory_calibrates_llama_cpp_importance():
    model = _model()
    batches = [torch.randn(3, 7, 12) for _ in range(2)]
    seen = {"0": [], "2": []}
    hooks = [model[int(name)].register_forward_pre_hook(lambda m, args, name=name: seen[name].append(args[0].detach()))
             for name in seen]
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("input",), observer=qstats.imatrix,
                                        spec=qstats.QuantSpec(dtype="int8"))])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        states = qstats.calibrate(model, batches, recipe, progress=False)
    for hook in hooks:
        hook.remove()
    for name, inputs in seen.items():
        rows = torch.cat([x.reshape(-1, x.shape[-1]) for x in inputs]).double()
        expected = (rows * rows).sum(0) / rows.shape[0]
        state = states[name]["input"]
        assert int(state.count) == rows.shape[0]
        torch.testing.assert_close(qstats.importance(state), expected)


def test_imatrix_takes_a_spec_or_none_and_refuses_anything_else():
    x = torch.randn(4, 6)
    for obs in (qstats.imatrix(), qstats.imatrix(qstats.QuantSpec(dtype="int4"))):
        torch.testing.assert_close(qstats.importance(obs.update(obs.init(x), x)), x.double().pow(2).mean(0))
    with pytest.raises(TypeError, match="imatrix: spec must be a QuantSpec or None"):
        qstats.imatrix("int8")
