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
