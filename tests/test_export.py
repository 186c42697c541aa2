"""qstats.export.compressed_tensors, loaded back with compressed-tensors itself.

A tiny model is calibrated with qstats and exported; compressed-tensors validates the
``quantization_config``, initialises a fresh model from it (``apply_quantization_config``),
compresses it to the checkpoint layout, loads our safetensors into it strictly (names, shapes and
dtypes must all match) and decompresses it. The loaded scales, zero points and dequantized weights
must equal ours bit for bit, and our scales must equal compressed-tensors' own
``calculate_qparams`` on the observed ranges (an independent reference).
"""

from __future__ import annotations

import itertools
import json
import os
import warnings

import pytest
import torch
from _shared import bit_equal, eager_attention_arguments

import qstats

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors import ModelCompressor  # noqa: E402
from compressed_tensors.quantization import (  # noqa: E402
    QuantizationArgs,
    QuantizationConfig,
    apply_quantization_config,
)
from compressed_tensors.quantization.quant_scheme import MXFP4, MXFP8, NVFP4  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam  # noqa: E402
from safetensors.torch import load_file  # noqa: E402


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(32, 64)
        self.fc2 = torch.nn.Linear(64, 32)
        self.head = torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.head(self.fc2(torch.relu(self.fc1(x))))


def _calibrated(weight_args, input_args):
    torch.manual_seed(0)
    model = Tiny().eval()
    weight_spec = qstats.QuantSpec.from_compressed_tensors(weight_args)
    rules = [qstats.Rule(targets="Linear", sites=("weight",), spec=weight_spec)]
    if input_args is not None:
        rules.append(
            qstats.Rule(targets="Linear", sites=("input",), spec=qstats.QuantSpec.from_compressed_tensors(input_args))
        )
    recipe = qstats.Recipe(rules, ignore=["head"])
    batches = [torch.randn(5, 32) * (i + 1) for i in range(3)]
    states = qstats.calibrate(model, batches, recipe, progress=False)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    return model, recipe, batches, qparams


def _load_with_compressed_tensors(path):
    with open(os.path.join(path, "config.json")) as file:
        config = QuantizationConfig.model_validate(json.load(file)["quantization_config"])
    torch.manual_seed(1)  # different float weights: everything must come from the checkpoint
    fresh = Tiny().eval()
    apply_quantization_config(fresh, config)
    compressor = ModelCompressor(quantization_config=config)
    compressor.compress_model(fresh)
    fresh.load_state_dict(load_file(os.path.join(path, "model.safetensors")), strict=True)
    compressor.decompress_model(fresh)
    return config, fresh


CASES = {
    "w8a8-int-channel-asym-input": (
        QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel"),
        QuantizationArgs(num_bits=8, type="int", symmetric=False, strategy="tensor"),
        "int-quantized",
    ),
    "w8a8-fp8-tensor": (
        QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="tensor"),
        QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="tensor"),
        "float-quantized",
    ),
    "fp8-dynamic": (
        QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="channel"),
        QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="token", dynamic=True),
        "float-quantized",
    ),
    "w4-int-group-asym": (
        QuantizationArgs(num_bits=4, type="int", symmetric=False, strategy="group", group_size=16),
        None,
        "pack-quantized",
    ),
    "w3-int-channel-asym": (  # 3-bit values straddle int32 words
        QuantizationArgs(num_bits=3, type="int", symmetric=False, strategy="channel"),
        None,
        "pack-quantized",
    ),
    "w8-fp8-weights-only": (
        QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="channel"),
        None,
        "naive-quantized",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_compressed_tensors_loads_our_values(tmp_path, case):
    weight_args, input_args, expected_format = CASES[case]
    model, recipe, batches, qparams = _calibrated(weight_args, input_args)
    written = qstats.export.compressed_tensors(model, qparams, str(tmp_path), recipe)
    assert written["format"] == expected_format
    config, fresh = _load_with_compressed_tensors(str(tmp_path))
    assert config.ignore == ["head"]
    specs = recipe.specs(qparams, model)

    inputs = {"fc1": torch.cat(batches)}
    inputs["fc2"] = torch.relu(model.fc1(inputs["fc1"])).detach()
    for name in ("fc1", "fc2"):
        ours, loaded, original = qparams[name], getattr(fresh, name), getattr(model, name)
        scheme = loaded.quantization_scheme
        assert scheme.weights.strategy == weight_args.strategy and scheme.weights.num_bits == weight_args.num_bits
        # weight: scale (and zero point) as compressed-tensors holds them
        shape = loaded.weight_scale.shape
        assert bit_equal(loaded.weight_scale.data, ours["weight"].scale.reshape(shape))
        if not weight_args.symmetric:
            assert bit_equal(loaded.weight_zero_point.data, ours["weight"].zero_point.reshape(shape).to(torch.int8))
        # dequantized weight after compressed-tensors' decompression == our quantize/dequantize
        spec_w = specs[name]["weight"]
        ours_dq = qstats.dequantize(qstats.quantize(original.weight, ours["weight"], spec_w), ours["weight"], spec_w)
        assert bit_equal(loaded.weight.data, ours_dq)
        # independent reference: compressed-tensors' calculate_qparams on the weight's range
        w = original.weight.detach()
        if weight_args.strategy == "channel":
            lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
        elif weight_args.strategy == "group":
            g = w.reshape(w.shape[0], -1, weight_args.group_size)
            lo, hi = g.amin(-1), g.amax(-1)
        else:
            lo, hi = w.amin().reshape(1), w.amax().reshape(1)
        ref_scale, ref_zp = calculate_qparams(lo, hi, weight_args)
        assert bit_equal(loaded.weight_scale.data, ref_scale)
        if not weight_args.symmetric:
            assert bit_equal(loaded.weight_zero_point.data, ref_zp)
        # input activations
        if input_args is not None and input_args.dynamic:
            assert scheme.input_activations.dynamic is True and not hasattr(loaded, "input_scale")
        elif input_args is not None:
            assert bit_equal(loaded.input_scale.data, ours["input"].scale.reshape(1))
            x = inputs[name]
            ref_scale, ref_zp = calculate_qparams(x.amin().reshape(1), x.amax().reshape(1), input_args)
            assert bit_equal(loaded.input_scale.data, ref_scale)
            if not input_args.symmetric:
                assert bit_equal(loaded.input_zero_point.data, ref_zp)
        else:
            assert not hasattr(loaded, "input_scale")
    # unquantized parameters are carried over unchanged
    assert bit_equal(fresh.head.weight.data, model.head.weight.data)
    assert bit_equal(fresh.fc1.bias.data, model.fc1.bias.data)


def test_nvfp4_global_and_group_scales(tmp_path):
    """NVFP4 (fp4 elements, fp8 group scales, a float32 global scale): our weight_global_scale and
    input_global_scale equal compressed-tensors' generate_gparam on the observed ranges, the group
    scales its calculate_qparams, and its decompressed weights our dequantized ones."""
    model, recipe, batches, qparams = _calibrated(NVFP4["weights"], NVFP4["input_activations"])
    written = qstats.export.compressed_tensors(model, qparams, str(tmp_path), recipe)
    assert written["format"] == "nvfp4-pack-quantized"
    _, fresh = _load_with_compressed_tensors(str(tmp_path))
    specs = recipe.specs(qparams, model)
    inputs = {"fc1": torch.cat(batches)}
    inputs["fc2"] = torch.relu(model.fc1(inputs["fc1"])).detach()
    for name in ("fc1", "fc2"):
        ours, loaded, w = qparams[name], getattr(fresh, name), getattr(model, name).weight.detach()
        ref_global = generate_gparam(w.amin(), w.amax()).reshape(1)
        assert bit_equal(loaded.weight_global_scale.data, ours["weight"].global_scale.reshape(1))
        assert bit_equal(loaded.weight_global_scale.data, ref_global)
        x = inputs[name]
        assert bit_equal(loaded.input_global_scale.data, generate_gparam(x.amin(), x.amax()).reshape(1))
        groups = w.reshape(w.shape[0], -1, 16)
        ref_scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), NVFP4["weights"], global_scale=ref_global)
        assert bit_equal(ref_scale.float(), ours["weight"].scale)
        # compressed-tensors decompresses to bfloat16 group scales and weights
        assert bit_equal(loaded.weight_scale.data, ours["weight"].scale.to(loaded.weight_scale.dtype))
        spec_w = specs[name]["weight"]
        ours_dq = qstats.dequantize(qstats.quantize(w, ours["weight"], spec_w), ours["weight"], spec_w)
        assert bit_equal(loaded.weight.data, ours_dq.to(loaded.weight.dtype))


PRESETS = {"nvfp4": NVFP4, "mxfp4": MXFP4, "mxfp8": MXFP8}


@pytest.mark.parametrize("case", sorted(CASES) + sorted(PRESETS))
def test_compressed_tensors_writes_the_same_checkpoint(tmp_path, case):
    """compressed-tensors' own compressor, given our QParams (scales, zero points, global scales)
    on the float model, produces exactly the tensors we wrote (codes, packing, dtypes, names)."""
    if case in PRESETS:
        weight_args, input_args = PRESETS[case]["weights"], PRESETS[case]["input_activations"]
    else:
        weight_args, input_args = CASES[case][:2]
    model, recipe, _, qparams = _calibrated(weight_args, input_args)
    qstats.export.compressed_tensors(model, qparams, str(tmp_path), recipe)
    ours = load_file(os.path.join(str(tmp_path), "model.safetensors"))
    with open(os.path.join(str(tmp_path), "config.json")) as file:
        config = QuantizationConfig.model_validate(json.load(file)["quantization_config"])
    reference = Tiny().eval()
    reference.load_state_dict(model.state_dict())
    apply_quantization_config(reference, config)
    with torch.no_grad():
        for name, param in reference.named_parameters():
            module_path, attribute = name.rsplit(".", 1)
            site, _, field = attribute.partition("_")
            if field in ("scale", "zero_point", "global_scale") and site in qparams.get(module_path, {}):
                value = getattr(qparams[module_path][site], field)
                param.copy_(value.to(param.dtype).reshape(param.shape))
    ModelCompressor(quantization_config=config).compress_model(reference)
    theirs = reference.state_dict()
    assert sorted(theirs) == sorted(ours)
    for name in ours:
        assert bit_equal(ours[name], theirs[name]), name


@pytest.mark.parametrize("preset", ["mxfp4", "mxfp8"])
@pytest.mark.parametrize("rounding", ["compressed_tensors", "floor"])
def test_mx_weights_load_with_compressed_tensors(tmp_path, preset, rounding):
    """MXFP4 / MXFP8 (fp4 / fp8 elements in groups of 32, e8m0 scales stored as uint8 exponents):
    compressed-tensors' MX compressor decompresses our checkpoint to our dequantized weights. With
    the spec from compressed-tensors' own preset, the stored exponents equal its calculate_qparams
    (generate_mx_scales) on the group ranges, compressed with its compress_mx_scale; with qstats'
    preset (OCP floor rounding) they are qstats' own, and still decompress exactly."""
    from compressed_tensors.compressors.mx_utils import compress_mx_scale

    args = PRESETS[preset]
    torch.manual_seed(0)
    model = Tiny().eval()
    if rounding == "compressed_tensors":
        weight_spec = qstats.QuantSpec.from_compressed_tensors(args["weights"])
    else:
        weight_spec = qstats.preset(preset)
    input_spec = qstats.QuantSpec.from_compressed_tensors(args["input_activations"])
    recipe = qstats.Recipe(
        [
            qstats.Rule(targets="Linear", sites=("weight",), spec=weight_spec),
            qstats.Rule(targets="Linear", sites=("input",), spec=input_spec),
        ],
        ignore=["head"],
    )
    states = qstats.calibrate(model, [torch.randn(4, 32)], recipe, progress=False)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    written = qstats.export.compressed_tensors(model, qparams, str(tmp_path), recipe)
    assert written["format"] == {"mxfp4": "mxfp4-pack-quantized", "mxfp8": "mxfp8-quantized"}[preset]
    group = written["config_groups"]["group_0"]
    assert group["input_activations"]["dynamic"] is True
    ours = load_file(os.path.join(str(tmp_path), "model.safetensors"))
    _, fresh = _load_with_compressed_tensors(str(tmp_path))
    for name in ("fc1", "fc2"):
        w = getattr(model, name).weight.detach()
        qp = qparams[name]["weight"]
        assert ours[f"{name}.weight_scale"].dtype == torch.uint8
        # the exponents decode to our scales
        assert torch.equal(2.0 ** (ours[f"{name}.weight_scale"].to(torch.float32) - 127), qp.scale)
        if rounding == "compressed_tensors":
            groups = w.reshape(w.shape[0], -1, 32)
            ref_scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), args["weights"])
            assert torch.equal(ours[f"{name}.weight_scale"], compress_mx_scale(ref_scale, torch.uint8))
        ours_dq = qstats.dequantize(qstats.quantize(w, qp, weight_spec), qp, weight_spec)
        loaded = getattr(fresh, name).weight.data
        assert bit_equal(loaded, ours_dq.to(loaded.dtype))
        assert torch.equal(loaded.float(), ours_dq)  # exact in the decompressed dtype
        assert not torch.equal(ours_dq, w)


def test_bfloat16_model_stores_bfloat16_scales(tmp_path):
    """A bfloat16 model: scales are stored in bfloat16 as compressed-tensors initialises them. With a
    float32 scale spec the export warns and quantizes with the rounded scales; with
    scale_dtype='bfloat16' nothing is rounded. Either way the written codes are qstats.quantize with
    the stored scales, so the checkpoint is self-consistent."""
    weight_args = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
    torch.manual_seed(0)
    model = Tiny().eval().to(torch.bfloat16)
    x = torch.randn(6, 32, dtype=torch.bfloat16)
    for scale_dtype, warns in (("float32", True), ("bfloat16", False)):
        spec = qstats.QuantSpec.from_compressed_tensors(weight_args, scale_dtype=scale_dtype)
        recipe = qstats.Recipe([qstats.Rule(targets="Linear", sites=("weight",), spec=spec)], ignore=["head"])
        states = qstats.calibrate(model, [x], recipe, progress=False)
        qparams = qstats.compute_qparams_tree(states, recipe, model)
        out = tmp_path / scale_dtype
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            qstats.export.compressed_tensors(model, qparams, str(out), recipe, format="naive-quantized")
        assert any("rounded" in str(w.message) for w in caught) == warns
        written = load_file(os.path.join(str(out), "model.safetensors"))
        scale = written["fc1.weight_scale"]
        assert scale.dtype == torch.bfloat16
        stored = qparams["fc1"]["weight"]._replace(scale=scale.float().reshape(-1))
        codes = qstats.quantize(model.fc1.weight, stored, spec)
        assert torch.equal(written["fc1.weight"], codes.to(torch.int8))
        if not warns:
            assert bit_equal(scale.float().reshape(-1), qparams["fc1"]["weight"].scale)



def test_half_precision_model_without_observed_dtype_warns(tmp_path):
    """NVFP4A16 on a bfloat16 model from a recipe without ``observed_dtype``: qstats computes the
    global scale in float32, compressed-tensors (``generate_gparam`` on the bfloat16 weight, as
    llm-compressor calls it) in bfloat16; they differ, and the export says so (no scale is rounded,
    so nothing else warned). With ``observed_dtype=torch.bfloat16`` they are equal and it is quiet."""
    torch.manual_seed(0)
    model = Tiny().eval().to(torch.bfloat16)
    x = torch.randn(6, 32, dtype=torch.bfloat16)
    w = model.fc1.weight.detach()
    reference = generate_gparam(w.amin(), w.amax()).reshape(1)
    for observed_dtype, warns in ((None, True), (torch.bfloat16, False)):
        recipe = qstats.Recipe.from_scheme("NVFP4A16", ignore=["head"], observed_dtype=observed_dtype)
        states = qstats.calibrate(model, [x], recipe, progress=False)
        qparams = qstats.compute_qparams_tree(states, recipe, model)
        out = str(tmp_path / str(observed_dtype))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            qstats.export.compressed_tensors(model, qparams, out, recipe)
        assert any("observed_dtype" in str(c.message) for c in caught) == warns
        written = load_file(os.path.join(out, "model.safetensors"))["fc1.weight_global_scale"]
        assert bit_equal(written, reference) != warns


def test_unsigned_torch_ao_range_is_shifted_onto_signed(tmp_path):
    """A quint8 asymmetric input (torch.ao convention) is written with codes and zero point moved
    by -128; the dequantized values compressed-tensors computes are unchanged."""
    torch.manual_seed(0)
    model = Tiny().eval()
    spec_in = qstats.QuantSpec(dtype="uint8", mapping="asymmetric")
    spec_w = qstats.QuantSpec(dtype="uint8", mapping="asymmetric", granularity=qstats.PerAxis(0))
    recipe = qstats.Recipe(
        [
            qstats.Rule(targets="Linear", sites=("weight",), spec=spec_w),
            qstats.Rule(targets="Linear", sites=("input",), spec=spec_in),
        ],
        ignore=["head"],
    )
    x = torch.randn(6, 32) + 1.0
    states = qstats.calibrate(model, [x], recipe, progress=False)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    qstats.export.compressed_tensors(model, qparams, str(tmp_path), recipe)
    _, fresh = _load_with_compressed_tensors(str(tmp_path))
    ours = qparams["fc1"]
    assert torch.equal(fresh.fc1.input_zero_point.data.to(torch.int32), ours["input"].zero_point.reshape(1) - 128)
    ours_dq = qstats.dequantize(qstats.quantize(model.fc1.weight, ours["weight"], spec_w), ours["weight"], spec_w)
    assert bit_equal(fresh.fc1.weight.data, ours_dq)


def test_unexportable_specs_raise(tmp_path):
    torch.manual_seed(0)
    model = Tiny().eval()
    for spec, match in [
        (
            qstats.QuantSpec(
                dtype="uint8", mapping="asymmetric", zero_point_domain="float", granularity=qstats.PerAxis(0)
            ),
            "zero_point_domain",
        ),
        (qstats.QuantSpec(dtype="int8", mapping="symmetric_no_clipping_err", granularity=qstats.PerAxis(0)), "mapping"),
        (qstats.QuantSpec(dtype="int16", granularity=qstats.PerAxis(0)), "8 bits"),
        (qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(1)), "granularity"),
        (qstats.preset("mxfp4", granularity=qstats.PerGroup(16)), "MXFP4 / MXFP8"),
        (qstats.preset("mxfp6_e2m3"), "MXFP4 / MXFP8"),
        (qstats.QuantSpec(dtype="int8", scale_dtype="e8m0", granularity=qstats.PerGroup(32)), "MXFP4 / MXFP8"),
    ]:
        recipe = qstats.Recipe([qstats.Rule(targets="Linear", sites=("weight",), spec=spec)], ignore=["head"])
        states = qstats.calibrate(model, [torch.randn(2, 32)], recipe, progress=False)
        qparams = qstats.compute_qparams_tree(states, recipe, model)
        with pytest.raises(ValueError, match=match):
            qstats.export.compressed_tensors(model, qparams, str(tmp_path), recipe)
    model, recipe, _, qparams = _calibrated(*CASES["w8-fp8-weights-only"][:2])
    with pytest.raises(ValueError, match="format must be one of"):
        qstats.export.compressed_tensors(model, qparams, str(tmp_path), recipe, format="bogus")
    with pytest.raises(ValueError, match="cannot hold float weights"):
        qstats.export.compressed_tensors(model, qparams, str(tmp_path), recipe, format="pack-quantized")
    with pytest.raises(ValueError, match="lacks"):
        qstats.export.compressed_tensors(model, {"nope": {}}, str(tmp_path), {"nope": {}})


def test_transformers_loads_the_export_and_runs_it_like_fake_quantized(tmp_path):
    """End to end: transformers' AutoModel.from_pretrained loads the exported tiny BERT through its
    compressed-tensors quantizer (int8 weights kept compressed), and its quantized forward (weights
    decompressed, inputs fake-quantized by compressed-tensors) equals qstats.fake_quantized on the
    float model bit for bit."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=16,
    )
    torch.manual_seed(0)
    model = transformers.BertModel(config).eval()
    weight_args = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
    input_args = QuantizationArgs(num_bits=8, type="int", symmetric=False, strategy="tensor")
    recipe = qstats.Recipe(
        [
            qstats.Rule(
                targets="Linear", sites=("weight",), spec=qstats.QuantSpec.from_compressed_tensors(weight_args)
            ),
            qstats.Rule(
                targets="Linear", sites=("input",), spec=qstats.QuantSpec.from_compressed_tensors(input_args)
            ),
        ],
        ignore=["re:.*pooler.*"],
    )
    g = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(0, 50, (2, 8), generator=g)} for _ in range(3)]
    states = qstats.calibrate(model, batches, recipe, progress=False)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    written = qstats.export.compressed_tensors(model, qparams, str(tmp_path), recipe)
    assert written["ignore"] == ["pooler.dense"]

    loaded = transformers.AutoModel.from_pretrained(str(tmp_path)).eval()
    query = loaded.encoder.layer[0].attention.self.query
    assert query.weight.dtype == torch.int8  # kept compressed until the first forward
    path = "encoder.layer.0.attention.self.query"
    assert bit_equal(query.weight_scale.data, qparams[path]["weight"].scale.reshape(-1, 1))
    test_batch = {"input_ids": torch.randint(0, 50, (2, 8), generator=g)}
    with torch.no_grad():
        theirs = loaded(**test_batch).last_hidden_state
        with qstats.fake_quantized(model, qparams, recipe):
            ours = model(**test_batch).last_hidden_state
        plain = model(**test_batch).last_hidden_state
    assert bit_equal(theirs, ours)
    assert not torch.equal(ours, plain)  # quantization did change the output


def test_dynamic_sites_need_no_qparams(tmp_path):
    weight_args, input_args, _ = CASES["fp8-dynamic"]
    model, recipe, _, qparams = _calibrated(weight_args, input_args)
    without = {path: {"weight": sites["weight"], "input": None} for path, sites in qparams.items()}
    specs = recipe.specs(qparams, model)
    qstats.export.compressed_tensors(model, without, str(tmp_path / "a"), specs)
    qstats.export.compressed_tensors(model, qparams, str(tmp_path / "b"), recipe)
    a = load_file(os.path.join(str(tmp_path / "a"), "model.safetensors"))
    b = load_file(os.path.join(str(tmp_path / "b"), "model.safetensors"))
    assert sorted(a) == sorted(b) and all(bit_equal(a[k], b[k]) for k in a)
    # a static site cannot go without parameters
    static = qstats.QuantSpec.from_compressed_tensors(CASES["w8a8-int-channel-asym-input"][1])
    bad_specs = {path: {"weight": s["weight"], "input": static} for path, s in specs.items()}
    with pytest.raises(TypeError, match="expected QParams"):
        qstats.export.compressed_tensors(model, without, str(tmp_path / "c"), bad_specs)


def test_a_folder_holding_a_checkpoint_is_refused(tmp_path):
    """Shards or an index left in the folder would be read beside (or instead of) the new
    checkpoint: refused, naming the folder, and nothing is written; a folder with only a
    config.json is extended."""
    model, recipe, _, qparams = _calibrated(*CASES["w8a8-int-channel-asym-input"][:2])
    old = tmp_path / "float"
    old.mkdir()
    (old / "model-00001-of-00002.safetensors").write_bytes(b"stale")
    (old / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    with pytest.raises(ValueError, match="already holds safetensors files or an index"):
        qstats.export.compressed_tensors(model, qparams, str(old), recipe)
    assert sorted(os.listdir(old)) == ["model-00001-of-00002.safetensors", "model.safetensors.index.json"]
    index_only = tmp_path / "index_only"
    index_only.mkdir()
    (index_only / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    with pytest.raises(ValueError, match="index_only"):
        qstats.export.compressed_tensors(model, qparams, str(index_only), recipe)
    configured = tmp_path / "configured"
    configured.mkdir()
    (configured / "config.json").write_text('{"model_type": "tiny"}')
    qstats.export.compressed_tensors(model, qparams, str(configured), recipe)
    with open(configured / "config.json") as file:
        assert json.load(file)["model_type"] == "tiny"
    with pytest.raises(ValueError, match="already holds"):  # exporting twice into one folder
        qstats.export.compressed_tensors(model, qparams, str(configured), recipe)


def test_modules_the_recipe_quantizes_without_qparams_warn(tmp_path):
    """A module the recipe quantizes whose qparams are left out is written in full precision and
    listed in ``ignore``: an UncalibratedWarning names it; the whole tree warns nothing."""
    model, recipe, _, qparams = _calibrated(*CASES["w8a8-int-channel-asym-input"][:2])
    with pytest.warns(qstats.UncalibratedWarning, match=r"1 module\(s\).*unquantized.*\(fc2\)"):
        written = qstats.export.compressed_tensors(model, {"fc1": qparams["fc1"]}, str(tmp_path / "part"), recipe)
    assert "fc2" in written["ignore"]
    assert load_file(os.path.join(str(tmp_path / "part"), "model.safetensors"))["fc2.weight"].dtype == torch.float32
    with warnings.catch_warnings():
        warnings.simplefilter("error", qstats.UncalibratedWarning)
        qstats.export.compressed_tensors(model, qparams, str(tmp_path / "whole"), recipe)


def test_a_forced_format_leaves_groups_without_weights_dense(tmp_path):
    """``format=`` applies to groups with quantized weights: an input-only group was written with
    it, and compressed-tensors' weight compressor then failed on the missing weight args."""
    torch.manual_seed(0)
    model = Tiny().eval()
    input_spec = qstats.QuantSpec.from_compressed_tensors(CASES["w8a8-int-channel-asym-input"][1])
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("input",), spec=input_spec)], ignore=["head"])
    states = qstats.calibrate(model, [torch.randn(4, 32)], recipe, progress=False)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    written = qstats.export.compressed_tensors(model, qparams, str(tmp_path), recipe, format="int-quantized")
    assert written["config_groups"]["group_0"]["format"] == "dense"
    _, fresh = _load_with_compressed_tensors(str(tmp_path))
    assert bit_equal(fresh.fc1.weight.data, model.fc1.weight.data)
    assert bit_equal(fresh.fc1.input_scale.data, qparams["fc1"]["input"].scale.reshape(1))


# --------------------------------------------------------------------------------------------
# kv cache and attention (q/k/v) scales


def _llama(**overrides):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(**{
        **dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False),
        **overrides,
    })
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def _attention_arguments(model, batches):
    """{attention path: {site: query/key/value each attention module hands eager attention}} over
    the batches, flattened and concatenated (`eager_attention_arguments`)."""
    out: dict = {}
    for (path, site), xs in eager_attention_arguments(model, batches).items():
        out.setdefault(path, {})[site] = torch.cat([x.reshape(-1) for x in xs])
    return out


KV_FP8 = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="tensor")


@pytest.mark.parametrize("sites", [("k", "v"), ("q", "k", "v")])
def test_kv_cache_and_attention_scales_load_with_compressed_tensors(tmp_path, sites):
    """k_scale / v_scale (kv_cache_scheme) and q_scale (attention group) on the attention modules:
    compressed-tensors registers exactly these parameters from our config and loads our file
    strictly; the scales equal its calculate_qparams on the query/key/value eager attention receives
    (after the rotary embedding; recorded separately)."""
    model = _llama()
    model.set_attn_implementation("eager")
    weight_args = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="channel")
    recipe = qstats.Recipe(
        [
            qstats.Rule("Linear", sites=("weight",), spec=qstats.QuantSpec.from_compressed_tensors(weight_args)),
            qstats.Rule("LlamaAttention", sites=sites, spec=qstats.QuantSpec.from_compressed_tensors(KV_FP8)),
        ],
        ignore=["lm_head"],
    )
    generator = torch.Generator().manual_seed(2)
    batches = [torch.randint(0, 64, (2, 8), generator=generator) for _ in range(2)]
    states = qstats.calibrate(model, batches, recipe, progress=False)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the observed q/k follow the rotary embedding: no warning
        written = qstats.export.compressed_tensors(model, qparams, str(tmp_path), recipe)
    config = QuantizationConfig.model_validate(written)
    # the args name the observer that calibrated k/v (qstats.minmax: llm-compressor's static_minmax)
    assert config.kv_cache_scheme == KV_FP8.model_copy(update={"observer": "static_minmax"})
    attention_groups = [g for g in config.config_groups.values() if g.weights is None]
    assert len(attention_groups) == ("q" in sites)
    ours = load_file(os.path.join(str(tmp_path), "model.safetensors"))

    torch.manual_seed(3)
    fresh = _llama()
    apply_quantization_config(fresh, config)
    compressor = ModelCompressor(quantization_config=config)
    compressor.compress_model(fresh)
    fresh.load_state_dict(ours, strict=True)
    outputs = _attention_arguments(model, batches)
    for layer in range(2):
        path = f"model.layers.{layer}.self_attn"
        attention = fresh.get_submodule(path)
        registered = sorted(name for name, _ in attention.named_parameters(recurse=False))
        assert registered == sorted(f"{site}_scale" for site in sites)
        for site in sites:
            x = outputs[path][site]
            reference, _ = calculate_qparams(x.amin().reshape(1), x.amax().reshape(1), KV_FP8)
            assert bit_equal(getattr(attention, f"{site}_scale").data, reference)
            assert bit_equal(ours[f"{path}.{site}_scale"], qparams[path][site].scale.reshape(1))


def test_unexportable_attention_sites_raise(tmp_path):
    model = _llama()
    per_tensor = qstats.QuantSpec.from_compressed_tensors(KV_FP8)
    int8 = qstats.QuantSpec(dtype="int8", mapping="symmetric")
    for rules, match in [
        ([qstats.Rule("LlamaAttention", sites=("k",), spec=per_tensor)], "both 'k' and 'v'"),
        ([qstats.Rule("LlamaAttention", sites=("q",), spec=per_tensor)], "'k' and 'v' sites too"),
        (
            [
                qstats.Rule("LlamaAttention", sites=("q",), spec=int8),
                qstats.Rule("LlamaAttention", sites=("k", "v"), spec=per_tensor),
            ],
            "specs of",
        ),
        (
            [qstats.Rule("LlamaAttention", sites=("k", "v"), spec=per_tensor.replace(granularity=qstats.PerAxis(-1)))],
            "PerTensor",
        ),
        (
            [
                qstats.Rule("model.layers.0.self_attn", sites=("k", "v"), spec=int8),
                qstats.Rule("LlamaAttention", sites=("k", "v"), spec=per_tensor),
            ],
            "one kv-cache scheme",
        ),
    ]:
        recipe = qstats.Recipe(rules)
        states = qstats.calibrate(model, [torch.randint(0, 64, (1, 4))], recipe, progress=False)
        qparams = qstats.compute_qparams_tree(states, recipe, model)
        with pytest.raises(ValueError, match=match):
            qstats.export.compressed_tensors(model, qparams, str(tmp_path), recipe)


@pytest.mark.parametrize("scheme", ["NVFP4", "MXFP4"])
def test_group_scaled_attention_sites_are_refused_as_other_granularities_are(tmp_path, scheme):
    """compressed-tensors' kv-cache and attention scales are per tensor: NVFP4/MX q/k/v specs are refused by
    name (NVFP4 ones were written, unloadable as kv-cache args; MX ones failed with a bare TypeError)."""
    from compressed_tensors.quantization.quant_scheme import MXFP4, NVFP4

    args = {"NVFP4": NVFP4, "MXFP4": MXFP4}[scheme]["input_activations"]
    spec = qstats.QuantSpec.from_compressed_tensors(args)
    model = _llama(hidden_size=64)  # k/v outputs of 32 features: whole groups of 16 and 32
    recipe = qstats.Recipe([qstats.Rule("LlamaAttention", sites=("k", "v"), spec=spec)])
    states = qstats.calibrate(model, [torch.randint(0, 64, (1, 32))], recipe, progress=False)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    with pytest.raises(ValueError, match=r"self_attn/k: granularity .* of a 'k' site: .* per tensor \(PerTensor\)"):
        qstats.export.compressed_tensors(model, qparams, str(tmp_path), recipe)


def test_kv_cache_scheme_needs_k_v_scales_on_every_attention_module(tmp_path):
    """compressed-tensors gives every attention module k_scale/v_scale under the kv_cache_scheme: k/v
    qparams of layer 0 only were written, and transformers loaded layer 1's scales uninitialised
    (1e-38, keys and values quantized to nothing). Refused, naming the module, with nothing written."""
    model = _llama()
    recipe = qstats.Recipe(
        [qstats.Rule("model.layers.0.self_attn", sites=("k", "v"), spec=qstats.QuantSpec.from_compressed_tensors(KV_FP8))]
    )
    states = qstats.calibrate(model, [torch.randint(0, 64, (1, 4))], recipe, progress=False)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    with pytest.raises(ValueError, match=r"kv_cache_scheme: .*1 have no k/v qparams \(model\.layers\.1\.self_attn\)"):
        qstats.export.compressed_tensors(model, qparams, str(tmp_path / "out"), recipe)
    assert not (tmp_path / "out").exists()


def test_fp8_asymmetric_zero_points_are_stored_as_float8(tmp_path):
    """Asymmetric fp8 args: compressed-tensors registers float8_e4m3fn zero points (its zp_dtype)
    and its calculate_qparams gives non-integer ones; they were truncated to int8. The file's
    dtypes equal those compressed-tensors registers, the zero points its calculate_qparams on the
    weight's rows, and its decompression our dequantized weights."""
    weight_args = QuantizationArgs(num_bits=8, type="float", symmetric=False, strategy="channel")
    input_args = QuantizationArgs(num_bits=8, type="float", symmetric=False, strategy="tensor")
    model, recipe, batches, qparams = _calibrated(weight_args, input_args)
    qstats.export.compressed_tensors(model, qparams, str(tmp_path), recipe)
    ours = load_file(os.path.join(str(tmp_path), "model.safetensors"))
    _, fresh = _load_with_compressed_tensors(str(tmp_path))
    with open(os.path.join(str(tmp_path), "config.json")) as file:
        config = QuantizationConfig.model_validate(json.load(file)["quantization_config"])
    registered = Tiny().eval()
    apply_quantization_config(registered, config)
    ModelCompressor(quantization_config=config).compress_model(registered)
    expected = registered.state_dict()
    specs = recipe.specs(qparams, model)
    for name in ("fc1", "fc2"):
        for key in ("weight_zero_point", "input_zero_point", "weight_scale", "input_scale", "weight"):
            assert ours[f"{name}.{key}"].dtype == expected[f"{name}.{key}"].dtype, (name, key)
        w = getattr(model, name).weight.detach()
        _, ref_zp = calculate_qparams(w.amin(1, keepdim=True), w.amax(1, keepdim=True), weight_args)
        assert bit_equal(ours[f"{name}.weight_zero_point"], ref_zp)
        qp, spec = qparams[name]["weight"], specs[name]["weight"]
        ours_dq = qstats.dequantize(qstats.quantize(w, qp, spec), qp, spec)
        assert bit_equal(getattr(fresh, name).weight.data, ours_dq)
    assert not torch.equal(ours["fc1.weight_zero_point"].float(), ours["fc1.weight_zero_point"].float().round())


def test_nonfinite_zero_and_non_power_of_two_scales_raise(tmp_path):
    """Scales a checkpoint cannot hold raise a ValueError naming the site instead of being written:
    a float32 scale under float16's smallest subnormal (a spec eps of 1e-10 on an all-zero row of
    a float16 model) becomes 0 as stored; NaN and negative scales; MX scales that are not powers
    of two (their uint8 exponent would silently round them)."""
    torch.manual_seed(0)
    model = Tiny().eval().half()
    with torch.no_grad():
        model.fc1.weight[3].zero_()
    spec = qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0), eps=1e-10)
    recipe = qstats.Recipe([qstats.Rule(targets="Linear", sites=("weight",), spec=spec)], ignore=["head"])
    states = qstats.calibrate(model, [torch.randn(2, 32).half()], recipe, progress=False)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    assert float(qparams["fc1"]["weight"].scale[3]) > 0 and float(qparams["fc1"]["weight"].scale[3].half()) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match="fc1/weight: 1 of 64 weight scales"):
            qstats.export.compressed_tensors(model, qparams, str(tmp_path), recipe)
    model, recipe, _, qparams = _calibrated(*CASES["w8a8-int-channel-asym-input"][:2])
    for site, value in (("weight", float("nan")), ("input", -1.0), ("input", float("inf"))):
        bad = {path: dict(sites) for path, sites in qparams.items()}
        qp = bad["fc2"][site]
        bad["fc2"][site] = qp._replace(scale=torch.full_like(qp.scale, value))
        with pytest.raises(ValueError, match=f"fc2/{site}: .*NaN, infinite, zero or negative"):
            qstats.export.compressed_tensors(model, bad, str(tmp_path), recipe)
    torch.manual_seed(0)
    model = Tiny().eval()
    spec = qstats.preset("mxfp4")
    recipe = qstats.Recipe([qstats.Rule(targets="Linear", sites=("weight",), spec=spec)], ignore=["head"])
    states = qstats.calibrate(model, [torch.randn(2, 32)], recipe, progress=False)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    qp = qparams["fc1"]["weight"]
    qparams["fc1"]["weight"] = qp._replace(scale=qp.scale * 1.5)
    with pytest.raises(ValueError, match="fc1/weight: e8m0"):
        qstats.export.compressed_tensors(model, qparams, str(tmp_path), recipe)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nonfinite_weights_raise(tmp_path, value):
    """A NaN weight has no code (int casts of NaN are undefined) and an Inf would be written as the
    grid's last code: the export refuses both, naming the site, instead of writing either."""
    model, recipe, _, qparams = _calibrated(*CASES["w8a8-int-channel-asym-input"][:2])
    with torch.no_grad():
        model.fc2.weight[0, 1] = value
    with pytest.raises(ValueError, match="fc2/weight: 1 of .* weights are NaN or infinite"):
        qstats.export.compressed_tensors(model, qparams, str(tmp_path), recipe)


def test_qparams_of_another_shape_raise_naming_the_site(tmp_path):
    """Group qparams of another module (swapped entries of the tree) raised qstats.quantize's shape
    error without saying which module's weight it was about."""
    model, recipe, _, qparams = _calibrated(*CASES["w4-int-group-asym"][:2])
    swapped = {"fc1": qparams["fc2"], "fc2": qparams["fc1"]}
    with pytest.raises(ValueError, match=r"fc1/weight: qparams of shape \(32, 4\) .*\(a weight of shape \(64, 32\)\)"):
        qstats.export.compressed_tensors(model, swapped, str(tmp_path), recipe)


# --------------------------------------------------------------------------------------------
# fused groups (q/k/v, gate/up): one NVFP4 global scale, as llm-compressor links its observers


def _llm_compressor_fused_weight_qparams(model, args):
    """llm-compressor's own weight calibration of every Linear but lm_head: its weight observer
    on each module, linked by its ``fuse_weight_observers`` (q/k/v and gate/up share the global
    scale), then each observer's ``get_qparams``."""
    observers = pytest.importorskip("llmcompressor.observers")
    helpers = pytest.importorskip("llmcompressor.observers.helpers")
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    for module in linears.values():
        module.weight_observer = observers.Observer.load_from_registry(
            "memoryless_minmax", base_name="weight", args=args
        )
    helpers.fuse_weight_observers(model)
    out = {}
    for name, module in linears.items():
        module.weight_observer(module.weight)
        out[name] = module.weight_observer.get_qparams()
    for module in linears.values():
        del module.weight_observer
    return out


def test_nvfp4_fused_groups_share_llm_compressors_global_scale(tmp_path):
    """compute_qparams_tree gives q/k/v and gate/up one global scale, llm-compressor's (its
    ``fuse_weight_observers``), and with it llm-compressor's fp8 group scales; the exported
    checkpoint holds them. Without fusing, the scales differ from llm-compressor's and the export
    warns."""
    pytest.importorskip("transformers")
    model = _llama()
    with torch.no_grad():  # projections of different ranges, so that fusing changes something
        for index, layer in enumerate(model.model.layers):
            layer.self_attn.k_proj.weight.mul_(3.0 + index)
            layer.mlp.up_proj.weight.mul_(0.25)
    args = NVFP4["weights"]
    spec = qstats.QuantSpec.from_compressed_tensors(args)
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("weight",), spec=spec)], ignore=["lm_head"])
    states = qstats.calibrate(model, [], recipe, progress=False)
    reference = _llm_compressor_fused_weight_qparams(model, args)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    unfused = qstats.compute_qparams_tree(states, recipe, model, fuse=False)
    assert sorted(qparams) == sorted(reference)
    differs = 0
    for name, theirs in reference.items():
        ours = qparams[name]["weight"]
        assert torch.equal(ours.global_scale.reshape(1), theirs["global_scale"].reshape(1)), name
        assert torch.equal(ours.scale, theirs["scale"].float().reshape(ours.scale.shape)), name
        differs += not torch.equal(unfused[name]["weight"].global_scale.reshape(1), theirs["global_scale"].reshape(1))
    assert differs >= 4  # k_proj, v_proj or up_proj of each layer had their own

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # shared scales: no warning
        qstats.export.compressed_tensors(model, qparams, str(tmp_path / "fused"), recipe)
    written = load_file(os.path.join(str(tmp_path / "fused"), "model.safetensors"))
    for name, theirs in reference.items():
        assert torch.equal(written[f"{name}.weight_global_scale"], theirs["global_scale"].reshape(1).float()), name
    with pytest.warns(UserWarning, match="different global scales"):
        qstats.export.compressed_tensors(model, unfused, str(tmp_path / "unfused"), recipe)


def test_fused_group_under_mixed_schemes_warns():
    """A group whose members are not all NVFP4 under one spec keeps its own global scales, with a
    warning naming the group (llm-compressor refuses it; vLLM needs one scheme per fused matmul)."""
    pytest.importorskip("transformers")
    model = _llama()
    nvfp4 = qstats.QuantSpec.from_compressed_tensors(NVFP4["weights"])
    int8 = qstats.QuantSpec(dtype="int8", mapping="symmetric", granularity=qstats.PerAxis(0))
    recipe = qstats.Recipe(
        [qstats.Rule("re:.*v_proj", sites=("weight",), spec=int8), qstats.Rule("Linear", sites=("weight",), spec=nvfp4)],
        ignore=["lm_head"],
    )
    states = qstats.calibrate(model, [], recipe, progress=False)
    with pytest.warns(UserWarning, match=r"model\.layers\.0\.self_attn\.q_proj, .*v_proj run as one matmul"):
        qparams = qstats.compute_qparams_tree(states, recipe, model)
    for path in ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj"):
        alone = qstats.compute_qparams(states[path]["weight"], nvfp4)
        assert torch.equal(qparams[path]["weight"].global_scale, alone.global_scale)


def test_default_format_is_the_one_compressed_tensors_infers():
    """The export's default format of a Linear is what compressed-tensors' own
    ``infer_module_format`` gives its scheme, for every pair of weight and input specs (int
    weights under fp8 inputs included: W4AFP8 is ``int-quantized``)."""
    from compressed_tensors.compressors.format import infer_module_format
    from compressed_tensors.quantization import QuantizationScheme

    from qstats.export import quantization_args
    from qstats.export.config import default_format

    spec = qstats.QuantSpec
    weights = {
        "int4-group": spec(dtype="int4", mapping="symmetric", granularity=qstats.PerGroup(32)),
        "int4-asym-channel": spec(dtype="int4", mapping="asymmetric", granularity=qstats.PerAxis(0)),
        "int8-channel": spec(dtype="int8", mapping="symmetric", granularity=qstats.PerAxis(0)),
        "fp8-channel": spec(dtype="fp8_e4m3fn", mapping="symmetric", granularity=qstats.PerAxis(0)),
        "nvfp4": qstats.QuantSpec.from_compressed_tensors(NVFP4["weights"]),
        "mxfp4": qstats.QuantSpec.from_compressed_tensors(MXFP4["weights"]),
        "mxfp8": qstats.QuantSpec.from_compressed_tensors(MXFP8["weights"]),
    }
    inputs = {
        "none": None,
        "int8-tensor": spec(dtype="int8", mapping="asymmetric"),
        "int8-token": spec(dtype="int8", mapping="symmetric", granularity=qstats.PerToken()),
        "fp8-tensor": spec(dtype="fp8_e4m3fn", mapping="symmetric"),
        "fp8-token": spec(dtype="fp8_e4m3fn", mapping="symmetric", granularity=qstats.PerToken()),
        "nvfp4": qstats.QuantSpec.from_compressed_tensors(NVFP4["input_activations"]),
    }
    checked = set()
    for (w_name, w_spec), (i_name, i_spec) in itertools.product(weights.items(), inputs.items()):
        w_args = quantization_args(w_spec, "weight")
        i_args = None if i_spec is None else quantization_args(i_spec, "input")
        scheme = QuantizationScheme(
            targets=["Linear"], weights=QuantizationArgs.model_validate(w_args),
            input_activations=None if i_args is None else QuantizationArgs.model_validate(i_args),
        )
        theirs = infer_module_format(torch.nn.Linear, scheme).value
        assert default_format(w_args, i_args) == theirs, (w_name, i_name)
        checked.add(theirs)
    assert checked >= {"int-quantized", "pack-quantized", "naive-quantized", "float-quantized", "nvfp4-pack-quantized"}


@pytest.mark.parametrize(
    "granularity", [qstats.PerRow(dim=0), qstats.PerBlock((2, 4, 4))], ids=["PerRow(dim=0)", "PerBlock(2,4,4)"]
)
def test_granularities_compressed_tensors_cannot_express_are_refused(granularity):
    """PerRow along another dimension was written as 'channel', an N-D block as a 2-D block_structure."""
    spec = qstats.QuantSpec(granularity=granularity)
    with pytest.raises(ValueError, match="compressed-tensors"):
        qstats.export.quantization_args(spec, "weight")


def test_recipe_from_a_config_with_kv_cache_scheme_calibrates_and_exports_the_kv_scales(tmp_path):
    """``Recipe.from_compressed_tensors`` of a config with ``kv_cache_scheme`` observes the k/v sites
    of every attention module under that scheme: the same qparams as the explicit rule above (whose
    scales are checked against compressed-tensors), and the scheme written back unchanged."""
    weight_args = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="channel")
    config = {
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weight_args.model_dump()}},
        "kv_cache_scheme": KV_FP8.model_dump(),
        "ignore": ["lm_head"],
    }
    recipe = qstats.Recipe.from_compressed_tensors(config)
    explicit = qstats.Recipe(
        [
            qstats.Rule("Linear", sites=("weight",), spec=qstats.QuantSpec.from_compressed_tensors(weight_args)),
            qstats.Rule("LlamaAttention", sites=("k", "v"), observer=qstats.moving_average_minmax,
                        spec=qstats.QuantSpec.from_compressed_tensors(KV_FP8), observer_kwargs={"averaging_constant": 0.01}),
        ],
        ignore=["lm_head"],
    )
    model = _llama()
    generator = torch.Generator().manual_seed(2)
    batches = [torch.randint(0, 64, (2, 8), generator=generator) for _ in range(2)]
    ours = qstats.compute_qparams_tree(qstats.calibrate(model, batches, recipe, progress=False), recipe, model)
    reference = qstats.compute_qparams_tree(qstats.calibrate(model, batches, explicit, progress=False), explicit, model)
    for layer in range(2):
        path = f"model.layers.{layer}.self_attn"
        for site in ("k", "v"):
            assert bit_equal(ours[path][site].scale, reference[path][site].scale)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the observed k follows the rotary embedding: no warning
        written = qstats.export.compressed_tensors(model, ours, str(tmp_path), recipe)
    assert QuantizationConfig.model_validate(written).kv_cache_scheme == KV_FP8


def test_tied_embeddings_with_a_quantized_lm_head_load_untied(tmp_path):
    """A model whose lm_head is tied to its input embeddings, lm_head quantized: the config kept
    ``tie_word_embeddings: true``, so transformers tied the quantized lm_head to the float embeddings
    and failed loading ('Linear has no attribute weight'); the export unties them, as llm-compressor
    does, and transformers runs the checkpoint like qstats.fake_quantized."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    weight_args = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("weight",), spec=qstats.QuantSpec.from_compressed_tensors(weight_args))])
    generator = torch.Generator().manual_seed(0)
    states = qstats.calibrate(model, [torch.randint(0, 64, (2, 8), generator=generator)], recipe, progress=False)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    qstats.export.compressed_tensors(model, qparams, str(tmp_path / "tied"), recipe)
    with open(tmp_path / "tied" / "config.json") as file:
        assert json.load(file)["tie_word_embeddings"] is False
    assert model.config.tie_word_embeddings is True  # the model itself is left alone
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "tied")).eval()
    test_batch = torch.randint(0, 64, (2, 8), generator=generator)
    with torch.no_grad():
        theirs = loaded(test_batch).logits
        with qstats.fake_quantized(model, qparams, recipe):
            ours = model(test_batch).logits
    assert bit_equal(theirs, ours)
    assert bit_equal(loaded.model.embed_tokens.weight.data, model.model.embed_tokens.weight.data)
    # lm_head left unquantized: the tie stays; untied by hand while the config still says tied: untied
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    qstats.export.compressed_tensors(model, qparams, str(tmp_path / "by_hand"), recipe)
    with open(tmp_path / "by_hand" / "config.json") as file:
        assert json.load(file)["tie_word_embeddings"] is False
    recipe = qstats.Recipe(recipe.rules, ignore=["lm_head"])
    qparams = {path: sites for path, sites in qparams.items() if path != "lm_head"}
    qstats.export.compressed_tensors(model, qparams, str(tmp_path / "kept"), recipe)
    with open(tmp_path / "kept" / "config.json") as file:
        assert json.load(file)["tie_word_embeddings"] is True


def test_partial_fp8_blocks_load_with_compressed_tensors(tmp_path):
    """FP8 blocks of 48x48 on 64x32 and 32x64 weights (edge blocks of 16 rows / columns, as a
    64x128 k_proj under 128x128 blocks): weight_scale of ceil-sized grids equal to llm-compressor's
    padded calibration, the codes its compressor writes from our scales, and the decompressed
    weights our dequantized values."""
    import dataclasses

    from llmcompressor.observers.helpers import flatten_for_calibration

    args = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="block", block_structure=[48, 48])
    spec = qstats.QuantSpec.from_compressed_tensors(args)
    spec = dataclasses.replace(spec, granularity=qstats.PerBlock((48, 48), partial=True))
    torch.manual_seed(0)
    model = Tiny().eval()
    recipe = qstats.Recipe([qstats.Rule(targets="Linear", sites=("weight",), spec=spec)], ignore=["head"])
    states = qstats.calibrate(model, [torch.randn(5, 32)], recipe, progress=False)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    written = qstats.export.compressed_tensors(model, qparams, str(tmp_path / "ours"), recipe)
    assert written["config_groups"]["group_0"]["weights"]["block_structure"] == [48, 48]
    ours = load_file(os.path.join(str(tmp_path / "ours"), "model.safetensors"))
    config, fresh = _load_with_compressed_tensors(str(tmp_path / "ours"))
    reference = Tiny().eval()
    reference.load_state_dict(model.state_dict())
    apply_quantization_config(reference, config)
    for name, grid in (("fc1", (2, 1)), ("fc2", (1, 2))):
        w = getattr(model, name).weight.detach()
        flat = flatten_for_calibration(w, "weight", args)
        ref_scale, _ = calculate_qparams(flat.amin(dim=(0, -1)), flat.amax(dim=(0, -1)), args)
        assert ref_scale.shape == grid and bit_equal(ours[f"{name}.weight_scale"], ref_scale)
        with torch.no_grad():
            getattr(reference, name).weight_scale.copy_(ref_scale)
        dequantized = qstats.dequantize(qstats.quantize(w, qparams[name]["weight"], spec), qparams[name]["weight"], spec)
        assert bit_equal(getattr(fresh, name).weight.data, dequantized)
    ModelCompressor(quantization_config=config).compress_model(reference)
    theirs = reference.state_dict()
    assert sorted(theirs) == sorted(ours)
    assert all(bit_equal(ours[name], theirs[name]) for name in ours)
