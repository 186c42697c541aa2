"""Shared fixtures."""

import importlib.util
import os
import warnings

import pytest
import torch


@pytest.fixture
def single_thread_quiet():
    """One torch thread and no warnings for the test: thousands of tiny ops, where intra-op threads
    only add contention (torch.aminmax over a permuted 120-element tensor takes milliseconds with 2
    busy threads, microseconds with 1)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture
def quantized_engine(single_thread_quiet):
    """torch.ao's quantized engine set to fbgemm (qnnpack where fbgemm is missing) for the test, on
    one thread without warnings (`single_thread_quiet`)."""
    before = torch.backends.quantized.engine
    torch.backends.quantized.engine = "fbgemm" if "fbgemm" in torch.backends.quantized.supported_engines else "qnnpack"
    yield
    torch.backends.quantized.engine = before


@pytest.fixture
def moe_example():
    """``examples/moe_experts.py`` loaded as a module (its ``main`` calibrates the plain-torch MoE)."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "moe_experts.py")
    spec = importlib.util.spec_from_file_location("moe_experts_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def per_row_dynamic_tokens(monkeypatch):
    """compressed-tensors' dynamic ``"token"`` scales of a 2-D input, one per row (its 3-D case)."""
    import compressed_tensors.quantization.lifecycle.forward as forward

    original = forward.compute_dynamic_scales_and_zp

    def per_row(value, args, module, global_scale=None):
        if value.ndim != 2 or args.strategy != "token":
            return original(value=value, args=args, module=module, global_scale=global_scale)
        scale, zero_point = original(value=value[None], args=args, module=module, global_scale=global_scale)
        return scale[0], None if zero_point is None else zero_point[0]

    monkeypatch.setattr(forward, "compute_dynamic_scales_and_zp", per_row)
