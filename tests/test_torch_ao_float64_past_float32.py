"""float64 inputs holding finite values past float32's range: torch.ao's MinMaxObserver casts them to
float32 (Inf) and gives an Inf scale; qstats leaves them out of the range and counts them in
``nonfinite`` (docs/differences.md), so its scale is the one of the other values."""

import torch
from torch.ao.quantization.observer import MinMaxObserver

import qstats


def test_float64_value_past_float32_is_left_out_and_counted_where_torch_ao_scale_is_inf():
    x = torch.tensor([-1.0, 0.5, 2.5, 1e39], dtype=torch.float64)
    reference = MinMaxObserver(dtype=torch.quint8)
    reference(x)
    assert torch.isinf(reference.calculate_qparams()[0]).all()

    spec = qstats.QuantSpec.from_torch_ao(torch.quint8)
    obs = qstats.minmax(spec)
    state = obs.update(obs.init(x), x)
    assert int(state.nonfinite) == 1
    # the same observer of torch.ao on the values qstats keeps
    kept = MinMaxObserver(dtype=torch.quint8)
    kept(x[:3].float())
    scale, zero_point = kept.calculate_qparams()
    qparams = qstats.compute_qparams(state, spec)
    assert torch.equal(qparams.scale.reshape(1), scale) and torch.equal(qparams.zero_point.reshape(1).int(), zero_point.int())
