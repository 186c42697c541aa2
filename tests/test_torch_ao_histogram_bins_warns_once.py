"""The torch.ao histogram drop-in built with the histogram's former option name ``bins=`` warns once,
where it is built, not again at every forward, calculate_qparams or state_dict; it observes as
``buckets_per_octave=`` does."""

import warnings

import torch

import qstats
from qstats import torch_ao


def _former_name_warnings(caught):
    return [w for w in caught if issubclass(w.category, FutureWarning) and "buckets_per_octave" in str(w.message)]


def test_bins_warns_once_for_one_observer_through_its_forwards_and_qparams():
    torch.manual_seed(0)
    xs = [torch.randn(64) for _ in range(3)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        obs = torch_ao.default_histogram_observer.with_args(bins=256)()
        for x in xs:
            obs(x)
        obs.calculate_qparams()
        obs.state_dict()
    assert len(_former_name_warnings(caught)) == 1, [str(w.message) for w in caught]
    # the same statistic as the current name, computed directly with the qstats observer
    direct = qstats.histogram(obs.spec, buckets_per_octave=256)
    state = direct.init(xs[0])
    for x in xs:
        state = direct.update(state, x)
    for name, value in zip(state._fields, state):
        assert torch.equal(getattr(obs, name), value), name


def test_bins_warns_once_in_the_eager_prepare_calibrate_convert_flow():
    # torch.ao's prepare builds each activation observer several times to read its dtype; under the
    # default filter (once per line) the user sees one warning, from prepare, and none from the
    # forwards or convert, whose lines would each show one more
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.ao.quantization.QuantStub(), torch.nn.Linear(8, 4),
                                torch.ao.quantization.DeQuantStub()).eval()
    model.qconfig = torch.ao.quantization.QConfig(
        activation=torch_ao.default_histogram_observer.with_args(bins=256),
        weight=torch_ao.default_per_channel_weight_observer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        prepared = torch.ao.quantization.prepare(model)
        for _ in range(3):
            prepared(torch.randn(2, 8))
        torch.ao.quantization.convert(prepared)
    warned = _former_name_warnings(caught)
    assert len(warned) == 1, [(w.filename, w.lineno) for w in caught]
    # it points at the user's call of prepare, past torch's deprecation wrapper around prepare
    assert warned[0].filename == __file__, warned[0].filename
