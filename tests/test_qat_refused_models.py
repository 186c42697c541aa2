"""Models `qstats.qat.prepare` refuses, each with an error naming the module: one that torch.fx cannot trace (the
module whose forward failed, not only the root's class; torch.ao's ``prepare_qat_fx`` raises torch.fx's bare
TraceError, naming no module), lazy modules not yet materialized, a layer type it cannot quantize."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.ao.quantization import get_default_qat_qconfig_mapping
from torch.ao.quantization.quantize_fx import prepare_qat_fx

import qstats


class _Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x) if x.sum() > 0 else x  # data-dependent control flow


class _Repeat(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        for _ in range(int(x.shape[0])):  # int() of a proxy
            x = self.fc(x)
        return x


class _Net(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.blocks = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.ReLU(), inner))
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.blocks(x))


@pytest.mark.parametrize("inner", [_Gate, _Repeat])
def test_untraceable_submodule_is_named(inner):
    model = _Net(inner())
    with pytest.raises(Exception):  # the reference fails too
        prepare_qat_fx(copy.deepcopy(model).train(), get_default_qat_qconfig_mapping("x86"), (torch.randn(2, 4),))
    with pytest.raises(TypeError, match=rf"cannot trace _Net\.forward, in the forward of 'blocks\.1\.1' "
                                        rf"\({inner.__name__}\)"):
        qstats.qat.prepare(model, qstats.minmax(qstats.QuantSpec("int8")))


class _TriesFastPath(nn.Module):
    """Tries a submodule that torch.fx cannot trace and falls back to its input where it raises (an optional
    fast path), then runs ``inner``, which fails: the error names ``inner``, not the path it caught."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.fast, self.fc, self.inner = _Gate(), nn.Linear(4, 4), inner

    def forward(self, x):
        try:
            x = self.fast(x)
        except Exception:  # torch.fx's TraceError here: the model goes on without it
            pass
        return self.inner(self.fc(x))


class _Unregistered(nn.Module):
    """Holds a failing module in a plain list, which the model does not register: no path of its own."""

    def __init__(self):
        super().__init__()
        self.held = [_Gate()]

    def forward(self, x):
        return self.held[0](x)


def test_a_failure_a_forward_caught_is_not_the_one_named():
    model = _TriesFastPath(_Repeat())
    with pytest.raises(TypeError, match=r"cannot trace _TriesFastPath\.forward, in the forward of 'inner' \(_Repeat\)"):
        qstats.qat.prepare(model, qstats.minmax(qstats.QuantSpec("int8")))


class _TriesFastPathThenLoops(_TriesFastPath):
    def forward(self, x):
        x = super().forward(x)
        for _ in range(int(x.shape[0])):  # int() of a proxy, in the root's own forward
            x = self.fc(x)
        return x


def test_a_failure_a_forward_caught_is_not_named_for_the_roots_own():
    model = _TriesFastPathThenLoops(nn.Identity())
    with pytest.raises(TypeError, match=r"cannot trace _TriesFastPathThenLoops\.forward \(TypeError"):
        qstats.qat.prepare(model, qstats.minmax(qstats.QuantSpec("int8")))


def test_a_failure_in_an_unregistered_module_names_the_registered_one_holding_it():
    model = _Net(_Unregistered())
    with pytest.raises(TypeError, match=r"in the forward of 'blocks\.1\.1' \(_Unregistered\)"):
        qstats.qat.prepare(model, qstats.minmax(qstats.QuantSpec("int8")))


def test_untraceable_root_forward_names_the_root_only():
    with pytest.raises(TypeError, match=r"cannot trace _Repeat\.forward \(TypeError"):
        qstats.qat.prepare(_Repeat(), qstats.minmax(qstats.QuantSpec("int8")))


def test_lazy_modules_are_refused_naming_them_until_materialized():
    torch.manual_seed(0)
    model = nn.Sequential(nn.LazyLinear(4), nn.ReLU(), nn.Sequential(nn.LazyConv1d(3, 1)))
    observer = qstats.minmax(qstats.QuantSpec("int8"))
    with pytest.raises(ValueError, match=r"'0' \(LazyLinear\), '2\.0' \(LazyConv1d\) have uninitialized"):
        qstats.qat.prepare(model, observer)
    x = torch.randn(2, 4, 6)
    expected = model(x)  # materializes them: Linear and Conv1d
    qat = qstats.qat.prepare(model, observer)
    assert qat.layers == ("0", "2.0")
    out, _ = qat.apply(qat.params(), qat.init(x), x, phase=qstats.QATPhase(observe=True, fake_quantize=False))
    torch.testing.assert_close(out, expected)


def test_a_layer_type_prepare_cannot_quantize_is_named():
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.GRU(4, 4)))
    with pytest.raises(TypeError, match=r"cannot quantize a GRU.*\(layer '1\.0' is a GRU\)"):
        qstats.qat.prepare(model, qstats.minmax(qstats.QuantSpec("int8")), layers=(nn.Linear, nn.GRU))
