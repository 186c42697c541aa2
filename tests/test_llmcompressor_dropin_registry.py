"""qstats.llmcompressor in llm-compressor 0.14's observer registry: importing the module again
(``importlib.reload``) keeps working observers, and a ``qstats_*`` name another package registered
first is refused with an ImportError naming it. Each case runs in a fresh interpreter, as the
registry is process-wide."""

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("llmcompressor")


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)


def test_module_imported_again_keeps_observers_equal_to_llm_compressors():
    """After ``importlib.reload(qstats.llmcompressor)`` the registered names still load observers
    whose qparams equal llm-compressor's ``minmax`` / ``memoryless_minmax``, and that pickle."""
    result = _run("""
        import importlib, pickle
        import torch
        import qstats.llmcompressor
        importlib.reload(qstats.llmcompressor)
        from compressed_tensors.quantization import QuantizationArgs
        from llmcompressor.observers import Observer

        g = torch.Generator().manual_seed(0)
        xs = [torch.randn(2, 8, 64, generator=g) * (i + 1) for i in range(4)]
        weight = torch.randn(16, 64, generator=g)
        args = QuantizationArgs(num_bits=8, symmetric=False, strategy="tensor")
        for name, base, data in (("minmax", "input", xs), ("memoryless_minmax", "weight", [weight])):
            theirs = Observer.load_from_registry(name, base_name=base, args=args.model_copy(deep=True))
            ours = Observer.load_from_registry("qstats_" + name, base_name=base, args=args.model_copy(deep=True))
            assert type(ours) is qstats.llmcompressor.OBSERVERS[name]
            for x in data:
                theirs(x)
                ours(x)
            ours = pickle.loads(pickle.dumps(ours))
            want, got = theirs.get_qparams(), ours.get_qparams()
            assert torch.equal(got["scale"], want["scale"]) and torch.equal(got["zero_point"], want["zero_point"])
        print("equal")
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "equal" in result.stdout


def test_a_name_another_package_registered_is_refused_naming_it():
    result = _run("""
        from llmcompressor.observers import Observer
        from llmcompressor.observers.min_max import StaticMinMaxObserver

        @Observer.register("qstats_histogram")
        class Theirs(StaticMinMaxObserver):
            pass

        import qstats.llmcompressor
    """)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError") and "qstats_histogram" in last and "Theirs" in last, last


def test_a_name_another_package_holds_as_an_alias_is_refused_naming_it():
    result = _run("""
        from llmcompressor.observers import Observer
        from llmcompressor.observers.min_max import StaticMinMaxObserver

        @Observer.register("their_minmax", alias="qstats_minmax")
        class Theirs(StaticMinMaxObserver):
            pass

        import qstats.llmcompressor
    """)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError") and "qstats_minmax" in last and "Theirs" in last, last
