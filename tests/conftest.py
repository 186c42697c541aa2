"""Shared fixtures."""

import importlib.util
import os
import warnings

import pytest
import torch

try:
    from hypothesis import Phase, settings
except ImportError:  # the tests that need hypothesis skip without it
    settings = None
else:
    # A failing example is not shrunk: the tests that expect a law check to fail match the law its
    # message names, which the first failing example names as well as the smallest one, and shrinking
    # ran hundreds of examples (the 26 files that use hypothesis: 266 s with it, 89 s without; one
    # file 88 s -> 4 s). Hypothesis still stops at its first failing example and replays it.
    # QSTATS_TEST_SHRINK=1 shrinks, to read a failure.
    UNSHRUNK = "qstats-unshrunk"
    settings.register_profile(UNSHRUNK, phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.target))
    settings.load_profile("default" if os.environ.get("QSTATS_TEST_SHRINK") else UNSHRUNK)


@pytest.fixture
def hypothesis_shrinks():
    """Hypothesis's default settings for the test, shrinking included: a test of what happens while
    hypothesis shrinks (where it meets other failures than the first) needs it."""
    if settings is None:
        pytest.skip("needs hypothesis")
    before = settings._current_profile
    settings.load_profile("default")
    yield
    settings.load_profile(before)


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
