"""A model compiled with ``fullgraph=True`` refuses the graph break of each (eager) observation hook:
`calibrate` says so in a ValueError naming fullgraph, with dynamo's error as its cause (dynamo's own
hinted at removing qstats' ``torch.compiler.disable``), and closes its progress bar; the module the
wrapper holds then calibrates as torch.ao's MinMaxObserver observes it, and the fullgraph wrapper runs
inside `fake_quantized` (traced hooks and parametrizations) as the eager model does."""

from __future__ import annotations

import pytest
import torch
from torch.ao.quantization import MinMaxObserver
from tqdm.auto import tqdm

import qstats


def test_a_fullgraph_compiled_model_is_refused_by_name_and_the_model_it_wraps_calibrates():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 4)).eval()
    spec = qstats.QuantSpec.from_torch_ao(dtype=torch.quint8, qscheme=torch.per_tensor_affine)
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("input",), spec=spec),
                            qstats.Rule("Linear", sites=("weight",), spec=qstats.QuantSpec(dtype="int8"))])
    batches = [torch.randn(3, 6, generator=torch.Generator().manual_seed(seed)) for seed in range(2)]
    bars = len(tqdm._instances)
    torch.compiler.reset()
    try:
        compiled = torch.compile(model, backend="eager", fullgraph=True)
        with pytest.raises(ValueError, match=r"^calibrate: a model compiled with fullgraph=True cannot call the "
                                             r"observation hooks") as raised:
            qstats.calibrate(compiled, batches, recipe, progress=True)
    finally:
        torch.compiler.reset()
    assert type(raised.value.__cause__).__module__ == "torch._dynamo.exc"
    assert len(tqdm._instances) == bars  # the progress bar was closed
    states = qstats.calibrate(model, batches, recipe, progress=False)
    observer = MinMaxObserver(dtype=torch.quint8)
    for x in batches:
        observer(x)
    assert torch.equal(states["0"]["input"].min_val, observer.min_val)
    assert torch.equal(states["0"]["input"].max_val, observer.max_val)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(5))
    torch.compiler.reset()
    try:
        compiled = torch.compile(model, backend="eager", fullgraph=True)
        with qstats.fake_quantized(compiled, qparams, recipe), torch.no_grad():
            got = compiled(x)
    finally:
        torch.compiler.reset()
    with qstats.fake_quantized(model, qparams, recipe), torch.no_grad():
        expected = model(x)
    with torch.no_grad():
        assert not torch.equal(expected, model(x))  # fake quantization changed the outputs
    assert torch.equal(got, expected)
