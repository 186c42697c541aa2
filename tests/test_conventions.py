"""Conventions as objects (qstats/conventions/): QuantSpec holds one, the core asks it."""

import ast
import copy
import pathlib
import pickle

import pytest
import torch

import qstats
from qstats.conventions import (
    CompressedTensorsConvention,
    Convention,
    TorchAOConvention,
    TorchaoConvention,
    lookup,
)

ROOT = pathlib.Path(__file__).resolve().parents[1]
NAMES = {"torch_ao": TorchAOConvention, "compressed_tensors": CompressedTensorsConvention, "torchao": TorchaoConvention}


@pytest.mark.parametrize("name", sorted(NAMES))
def test_a_spec_holds_the_convention_of_its_name(name):
    spec = qstats.QuantSpec(dtype="int4", convention=name)
    assert type(spec.convention) is NAMES[name]
    assert spec.convention == name and spec.convention != "other"
    same = qstats.QuantSpec(dtype="int4", convention=NAMES[name]())
    assert same == spec and hash(same) == hash(spec)
    assert spec != qstats.QuantSpec(dtype="int4", convention=sorted(set(NAMES) - {name})[0])
    assert f"convention={name!r}" in repr(spec)
    assert eval(repr(spec), vars(qstats)) == spec
    assert pickle.loads(pickle.dumps(spec)) == spec and copy.deepcopy(spec) == spec
    assert spec.replace(dtype="int8").convention is spec.convention


def test_unknown_convention_raises_naming_the_field():
    with pytest.raises(ValueError, match="QuantSpec.convention"):
        qstats.QuantSpec(convention="torch.ao")
    with pytest.raises(ValueError, match="QuantSpec.convention"):
        qstats.QuantSpec(convention=TorchAOConvention)  # the class, not a convention
    with pytest.raises(ValueError, match="convention must be"):
        lookup(None)
    assert lookup("torchao") is qstats.QuantSpec(convention="torchao").convention


class _Halving(Convention):
    """A user's convention: the default arithmetic with codes of half-scale steps."""

    name = "halving"

    def qparams(self, min_val, max_val, spec):
        scale, zero_point = super().qparams(min_val, max_val, spec)
        return scale / 2, zero_point


def test_a_users_convention_runs_through_the_core():
    x = torch.linspace(-3.0, 5.0, 64).reshape(4, 16)
    plain = qstats.QuantSpec(dtype="int8", mapping="asymmetric", granularity=qstats.PerAxis(0))
    custom = plain.replace(convention=_Halving())
    assert custom.convention == "halving" and custom != plain

    obs = qstats.minmax(plain)
    state = obs.update(obs.init(x), x)
    reference = qstats.compute_qparams(state, plain)
    ours = qstats.compute_qparams(state, custom)
    assert torch.equal(ours.scale, reference.scale / 2)
    assert torch.equal(ours.zero_point, reference.zero_point)
    # quantize and dequantize use the inherited (torch.ao) arithmetic with the halved scales
    expected = qstats.fake_quantize(x, ours, plain)
    assert torch.equal(qstats.fake_quantize(x, ours, custom), expected)
    assert torch.equal(qstats.dequantize(qstats.quantize(x, ours, custom), ours, custom), expected)


@pytest.mark.parametrize(
    "spec",
    [
        qstats.QuantSpec(dtype="int4", mapping="asymmetric", convention="compressed_tensors", compute_dtype="bfloat16"),
        qstats.QuantSpec.from_torchao(torch.uint4, mapping_type="ASYMMETRIC", zero_point_domain="FLOAT"),
        qstats.QuantSpec(dtype="uint8", mapping="asymmetric", zero_point_domain="float"),  # torch.ao's exact kernels
        qstats.QuantSpec.from_torchao(elem_dtype="fp4_e2m1", block_size=32, scaling_mode="RCEIL"),
        qstats.preset("mxfp4", convention="compressed_tensors", scale_rounding="round_then_floor"),
    ],
    ids=["ct-bf16", "torchao-float-zero", "torch_ao-float-zero", "torchao-mx-rceil", "ct-mx"],
)
def test_convention_methods_trace_without_graph_breaks(spec):
    x = torch.randn(4, 64)
    obs = qstats.minmax(spec)

    def step(x):
        qparams = qstats.compute_qparams(obs.update(obs.init(x), x), spec)
        return qstats.fake_quantize(x, qparams, spec)

    compiled = torch.compile(step, fullgraph=True, backend="eager")
    assert torch.equal(compiled(x), step(x))


CORE = ["_spec.py", "_qparams.py", "_quant.py", "_formats.py", "lsq.py", "observers/mse.py"] + [
    f"conventions/{name}.py" for name in ("__init__", "default", "torch_ao", "compressed_tensors", "torchao")
]


@pytest.mark.parametrize("path", CORE)
def test_core_modules_import_at_the_top_and_never_test_a_convention_name(path):
    tree = ast.parse((ROOT / "qstats" / path).read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            inner = [n for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom))]
            assert not inner, f"{path}: {node.name} imports inside the function (line {inner[0].lineno})"
        if isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute) and node.left.attr == "convention":
            raise AssertionError(f"{path}: line {node.lineno} compares spec.convention")


def _module_name(path) -> str:
    return "qstats." + str(path).removesuffix(".py").replace("/", ".").removesuffix(".__init__")


def _imports(path, anywhere=False):
    """The qstats modules ``qstats/<path>`` imports by relative imports at its top level (also
    inside functions with ``anywhere``), and the modules of names it imports from a package."""
    package = _module_name(path).split(".")[: None if path.endswith("__init__.py") else -1]
    tree = ast.parse((ROOT / "qstats" / path).read_text())
    found = set()
    for node in ast.walk(tree) if anywhere else tree.body:
        if anywhere and _is_import_module_call(node):  # importlib.import_module("qstats.x" or ".x", __name__)
            name = node.args[0].value
            found.add(".".join(package) + name if name.startswith(".") else name)
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - node.level + 1]
            module = [*base, *(node.module.split(".") if node.module else [])]
            if node.module:  # `from . import x` needs x, not the package being imported
                found.add(".".join(module))
            found.update(".".join([*module, alias.name]) for alias in node.names)
    return found


def _is_import_module_call(node) -> bool:
    return (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module"
            and node.args and isinstance(node.args[0], ast.Constant))


def _assert_acyclic(graph: dict) -> None:
    done, active = set(), []

    def visit(module):
        assert module not in active, "import cycle: " + " -> ".join(active[active.index(module):] + [module])
        if module in done:
            return
        active.append(module)
        for dependency in graph[module]:
            visit(dependency)
        active.pop()
        done.add(module)

    for module in graph:
        visit(module)


def test_no_import_cycle_among_the_core_modules():
    modules = {_module_name(path): path for path in CORE}
    graph = {module: _imports(path) & set(modules) for module, path in modules.items()}
    assert graph["qstats._formats"] <= set(), graph["qstats._formats"]  # the formats need no spec
    _assert_acyclic(graph)


def test_no_import_cycle_in_the_package_and_no_import_inside_a_function():
    """Every module of the package, imports inside functions included (``importlib`` ones too); the
    imports inside a function are of modules that import an optional dependency on first use:
    `check_all`'s and `qstats.testing`'s of the strategies (hypothesis), and the attention sites'
    of the attention functions they register with transformers."""
    paths = [str(p.relative_to(ROOT / "qstats")) for p in sorted((ROOT / "qstats").rglob("*.py"))]
    modules = {_module_name(path): path for path in paths}
    graph = {module: (_imports(path, anywhere=True) & set(modules)) - {module} for module, path in modules.items()}
    inner = {module: sorted((_imports(path, anywhere=True) - _imports(path)) & set(modules))
             for module, path in modules.items()}
    assert {module: found for module, found in inner.items() if found} == {
        "qstats.testing._check_all": ["qstats.testing.strategies"],
        "qstats.testing": ["qstats.testing.strategies"],
        "qstats._attention": ["qstats._attention_functions"]}
    _assert_acyclic(graph)


def test_every_module_of_the_package_is_reachable_as_a_module():
    """``qstats.X`` (and ``qstats.observers.X``, ...) is the module ``qstats/X.py``, never a function
    of the same name that shadows it (``import qstats.X as m``, ``mock.patch("qstats.X.f")``)."""
    import importlib
    import pkgutil
    import types

    import qstats

    shadowed = []
    def unimportable(name):
        raise ImportError(f"{name} does not import")

    for info in pkgutil.walk_packages(qstats.__path__, "qstats.", onerror=unimportable):
        parent, _, name = info.name.rpartition(".")
        found = getattr(importlib.import_module(parent), name, None)
        if found is not None and not isinstance(found, types.ModuleType):
            shadowed.append(f"{info.name} ({type(found).__name__})")
    assert not shadowed, shadowed


def test_compressed_tensors_int16_in_float16_is_refused():
    """compressed-tensors divides by the code range 65535 in float16, where it is Inf: every scale
    is 0, replaced by float16's eps (0.000977), so values past 32 (symmetric) clip. The spec used
    to reproduce that silently (1000.0 fake-quantized to 32.0, or to 65504 asymmetric)."""
    compressed_tensors = pytest.importorskip("compressed_tensors.quantization")
    from compressed_tensors.quantization.utils import calculate_qparams

    w = torch.tensor([[-3000.0, 1000.0, 0.5]], dtype=torch.float16)
    for symmetric in (True, False):
        args = compressed_tensors.QuantizationArgs(num_bits=16, symmetric=symmetric, strategy="tensor")
        scale, _ = calculate_qparams(w.amin(), w.amax(), args)
        assert float(scale) == float(torch.finfo(torch.float16).eps)  # unusable whatever the data
        with pytest.raises(ValueError, match="compute_dtype 'float16'"):
            qstats.QuantSpec.from_compressed_tensors(args, observed_dtype=torch.float16)
        if not symmetric:  # bfloat16 rounds its zero points out of the range (test_compressed_tensors_wide_integers_*)
            with pytest.raises(ValueError, match="compute_dtype 'bfloat16'"):
                qstats.QuantSpec.from_compressed_tensors(args, observed_dtype=torch.bfloat16)
        for dtype in (torch.float32, torch.bfloat16)[:2 if symmetric else 1]:  # computed there, the scale is the data's
            spec = qstats.QuantSpec.from_compressed_tensors(args, observed_dtype=dtype)
            x = w.to(dtype)
            obs = qstats.minmax(spec)
            qp = qstats.compute_qparams(obs.update(obs.init(x), x), spec)
            assert (qstats.fake_quantize(x, qp, spec).float() - x.float()).abs().max() <= 16  # bf16 ulp at 3000
