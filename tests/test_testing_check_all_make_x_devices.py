"""qstats.testing.check_all names a ``make_x`` that returns meta tensors, or batches on another device,
of another shape or dtype from call to call, instead of failing inside its probe or a law with an
error naming neither; and takes an object with the Observer's fields whose state holds no statistic
(it failed on ``obs._replace``)."""

import types

import pytest
import torch

import qstats
from qstats import testing


def _make_x(generator):
    return torch.randn(4, 8, generator=generator)


def test_check_all_names_a_make_x_that_returns_meta_tensors():
    obs = qstats.minmax(qstats.QuantSpec())
    with pytest.raises(ValueError, match=r"check_all: make_x\(generator\) returned a tensor on the meta device, "
                                         r"which holds no values"):
        testing.check_all(obs, lambda generator: _make_x(generator).to("meta"), max_examples=1)


def test_check_all_names_a_make_x_whose_batches_change_device():
    obs = qstats.minmax(qstats.QuantSpec())
    devices = iter(["cpu", "meta"] * 4)
    with pytest.raises(ValueError, match=r"check_all: make_x\(generator\) returned batches on different devices "
                                         r"\(cpu, then meta\)"):
        testing.check_all(obs, lambda generator: _make_x(generator).to(next(devices)), max_examples=1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_check_all_takes_a_make_x_that_moves_its_batch_to_the_gpu():
    obs = qstats.minmax(qstats.QuantSpec(granularity=qstats.PerAxis(0)))
    testing.check_all(obs, lambda generator: _make_x(generator).cuda(), laws=("identity", "stability"),
                      max_examples=2)


def test_check_all_names_a_make_x_whose_shape_follows_the_seed():
    def make_x(generator):  # a token count drawn per batch: the laws stack batches of one shape
        return torch.randn(int(torch.randint(2, 6, (), generator=generator)), 8, generator=generator)

    shapes = {tuple(make_x(torch.Generator().manual_seed(seed)).shape) for seed in range(20)}
    assert len(shapes) > 1  # an independent check that the shape changes from seed to seed
    obs = qstats.minmax(qstats.QuantSpec(granularity=qstats.PerAxis(-1)))
    with pytest.raises(ValueError, match=r"check_all: make_x\(generator\) returned batches of different shapes"):
        testing.check_all(obs, make_x, laws="vmap", max_examples=5)


def test_check_all_takes_an_object_with_the_observer_s_fields_whose_state_holds_no_statistic():
    placeholder = qstats.placeholder(qstats.QuantSpec())
    with pytest.raises(TypeError, match="no statistics|no range rule"):  # an independent check: no statistic
        qstats.compute_qparams(placeholder.init(torch.ones(2)), placeholder.spec)
    duck = types.SimpleNamespace(init=placeholder.init, update=placeholder.update, merge=placeholder.merge,
                                 exact=placeholder.exact, spec=placeholder.spec, name="duck")
    with pytest.warns(UserWarning, match="duck: purity: compute_qparams and fake_quantize not checked"):
        testing.check_all(duck, _make_x, laws=("identity", "purity"), max_examples=2)
