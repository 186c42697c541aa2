"""A site that saw no calibration data gets the spec's fallback quantization parameters (scale 1, which
`Recipe.from_scheme`'s compressed-tensors specs take), and `compute_qparams_tree` says which: a batch
all padding under ``observation_weight``, batches of NaN only.
Before, only the export warned; `fake_quantized` and `report` ran with scale 1 silently."""

import warnings

import pytest
import torch

import qstats


def _qparams_and_warnings(model, batches, recipe, **options):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        states = qstats.calibrate(model, batches, recipe, progress=False, **options)
        qparams = qstats.compute_qparams_tree(states, recipe, model)
    return qparams, [w for w in caught if issubclass(w.category, qstats.UncalibratedWarning)]


def _unseen(model, batches, weight=None):
    """The Linear inputs that no kept value reached, found with plain forward hooks."""
    seen = {}

    def hook(name):
        def record(module, args):
            x = args[0] if weight is None else args[0][weight != 0]
            seen[name] = seen.get(name, False) or bool(torch.isfinite(x).any())
        return record

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    with torch.no_grad():
        for batch in batches:
            model(batch)
    for handle in handles:
        handle.remove()
    return sorted(f"{n}.input" for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and not seen.get(n))


@pytest.mark.parametrize("scheme", ["FP8", "NVFP4"])
def test_all_padding_and_nan_batches_are_named(scheme):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).eval()
    recipe = qstats.Recipe.from_scheme(scheme)
    padding = torch.zeros(2, 5)
    batches = [torch.randn(2, 5, 16)]
    qparams, caught = _qparams_and_warnings(model, batches, recipe, observation_weight=lambda batch: padding)
    assert _unseen(model, batches, padding) == ["0.input", "2.input"]
    assert len(caught) == 1 and all(name in str(caught[0].message) for name in ("0.input", "2.input"))
    assert float(qparams["0"]["input"].scale) == 1.0  # the fallback the warning is about
    assert ".weight" not in str(caught[0].message)

    half = torch.ones(2, 5)
    half[1] = 0
    _, caught = _qparams_and_warnings(model, batches, recipe, observation_weight=lambda batch: half)
    assert _unseen(model, batches, half) == [] and caught == []

    nan = [torch.full((2, 5, 16), float("nan"))]
    _, caught = _qparams_and_warnings(model, nan, recipe)
    assert _unseen(model, nan) == ["0.input", "2.input"]
    assert len(caught) == 1 and "0.input" in str(caught[0].message)
