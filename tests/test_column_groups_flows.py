"""NVFP4 inputs whose group scales come at run time, observed per group of 16 features
(`column_groups`, under `qstats.moving_average_minmax` and `qstats.mse` in ``mode="moving_average"``),
in the flows beside `qstats.calibrate`: `calibrate_layerwise` and routed stacked experts (a tiny
Qwen3-MoE) against `qstats.calibrate` on the loaded model; `qstats.distributed.all_reduce` on 2
gloo ranks against the sequential merge of their states (docs/distributed.md) and llm-compressor's
average of the ranks' statistics; save/load and resume; padding masks against the unpadded rows;
`qstats.testing.check_all` (laws)."""

from __future__ import annotations

import datetime
import os
import warnings

import pytest
import torch
from _shared import bit_equal, exit_rank, fork_ranks, gloo_group

import qstats
from qstats.recipe import feature_grouped

transformers = pytest.importorskip("transformers")

NVFP4 = qstats.preset("nvfp4")
OBSERVERS = {"moving_average_minmax": (qstats.moving_average_minmax, {}),
             "mse": (qstats.mse, {"mode": "moving_average"})}  # fmt: skip


def _recipe(observer: str, targets=("Linear",), sites=("input",), spec=NVFP4) -> qstats.Recipe:
    factory, options = OBSERVERS[observer]
    return qstats.Recipe([qstats.Rule(targets, sites=sites, observer=factory, observer_kwargs=options, spec=spec)])


def _equal_trees(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for path in want:
        assert set(got[path]) == set(want[path]), path
        for site in want[path]:
            assert type(got[path][site]) is type(want[path][site])
            assert all(bit_equal(a, b) for a, b in zip(got[path][site], want[path][site], strict=True)), (path, site)


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16)).eval()


def _batches() -> list:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(2, 3 + i, 64, generator=g) * (1 + i) for i in range(4)]


# --------------------------------------------------------------------------------------------
# Qwen3-MoE: calibrate_layerwise and routed stacked experts


def _config():
    return transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=4, num_experts_per_tok=2)  # fmt: skip


def _moe_recipe(observer: str) -> qstats.Recipe:
    return _recipe(observer, ("Linear", "Qwen3MoeExperts"), ("input", "down_proj.input"))


def _moe_batches() -> list:
    g = torch.Generator().manual_seed(5)
    return [{"input_ids": torch.randint(0, 64, (1, 3 + i), generator=g)} for i in range(3)]


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen3_moe_nvfp4")
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.AutoModelForCausalLM.from_config(_config()).save_pretrained(directory)
    return str(directory)


@pytest.mark.parametrize("observer", list(OBSERVERS))
def test_layerwise_and_routed_experts_equal_calibrate(moe_checkpoint, observer):
    """`calibrate_layerwise` on the meta model gives `qstats.calibrate`'s states on the loaded model
    bit for bit, the stacked experts' inputs (2-D rows routed by a mask) observed per tensor, as
    llm-compressor's linearized experts: one entry for each expert, each expert's equal to calibrating its
    own routed rows."""
    recipe = _moe_recipe(observer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(moe_checkpoint).eval()
        with torch.device("meta"):
            meta = transformers.AutoModelForCausalLM.from_config(_config()).eval()
        want = qstats.calibrate(model, _moe_batches(), recipe, progress=False)
        got = qstats.calibrate_layerwise(meta, moe_checkpoint, _moe_batches(), recipe, progress=False)
    _equal_trees(got, want)
    experts = want["model.layers.0.mlp.experts"]
    assert experts["input"].max_val.shape == (4,) and experts["down_proj.input"].max_val.shape == (4,)
    # expert 0's rows, recorded: the statistics of the experts' own observer over them
    rows, gates = [], model.model.layers[0].mlp.gate
    handle = gates.register_forward_hook(lambda m, args, out: rows.append((args[0].reshape(-1, 32), out)))
    with torch.no_grad():
        for batch in _moe_batches():
            model(**batch)
    handle.remove()
    factory, options = OBSERVERS[observer]
    grouped = feature_grouped(lambda spec: factory(spec, **options), NVFP4)
    state = grouped.init(rows[0][0])
    for x, routed in rows:
        mask = (routed[2] == 0).any(-1)  # the router's top-k expert indices
        if mask.any():
            state = grouped.update(state, x[mask])
    torch.testing.assert_close(experts["input"].max_val[0], state.max_val, rtol=0, atol=0)


# --------------------------------------------------------------------------------------------
# all_reduce on 2 gloo ranks; save/load and resume


def _rank(rank: int, port: int, out: str, observer: str) -> None:
    with gloo_group(rank, port, world=2, timeout=datetime.timedelta(seconds=30)):
        recipe, model = _recipe(observer), _mlp()
        states = qstats.calibrate(model, _batches()[rank::2], recipe, progress=False)
        merged = qstats.distributed.all_reduce(states, recipe.observers(states, model))
        qstats.save(os.path.join(out, f"rank{rank}.safetensors"), merged)
    exit_rank(0)


@pytest.mark.parametrize("observer", list(OBSERVERS))
def test_all_reduce_of_two_ranks_is_their_sequential_merge(tmp_path, observer):
    """Each rank calibrates 2 batches: both ranks hold the sequential merge of the two ranks' states
    (folded by the moving average's merge, docs/distributed.md) bit for bit, per group of features;
    with as many batches on each rank that is llm-compressor's average of the ranks' statistics
    (``ReduceOp.AVG`` of ``min_vals``/``max_vals``). Saved, loaded and resumed by a calibration of
    more batches, the states are those of one calibration over all the batches."""
    assert fork_ranks(_rank, str(tmp_path), observer, timeout=90) == [0, 0]
    recipe, model = _recipe(observer), _mlp()
    ranks = [qstats.calibrate(model, _batches()[rank::2], recipe, progress=False) for rank in range(2)]
    observers = recipe.observers(ranks[0], model)
    want = {path: {site: observers[path][site].merge(ranks[0][path][site], ranks[1][path][site])
                   for site in ranks[0][path]} for path in ranks[0]}  # fmt: skip
    assert want["0"]["input"].max_val.shape == (4,) and want["2"]["input"].max_val.shape == (2,)
    for rank in range(2):
        got = qstats.load(tmp_path / f"rank{rank}.safetensors")
        _equal_trees(got, want)
        for path in want:
            ours, theirs = got[path]["input"], [r[path]["input"] for r in ranks]
            for field in ("min_val", "max_val"):
                average = (getattr(theirs[0], field) + getattr(theirs[1], field)) / 2
                torch.testing.assert_close(getattr(ours, field), average, rtol=1e-6, atol=0)
    first = qstats.calibrate(model, _batches()[:2], recipe, progress=False)
    qstats.save(tmp_path / "first.safetensors", first)
    resumed = qstats.calibrate(model, _batches()[2:], recipe, progress=False,
                               states=qstats.load(tmp_path / "first.safetensors"))
    _equal_trees(resumed, qstats.calibrate(model, _batches(), recipe, progress=False))


# --------------------------------------------------------------------------------------------
# padding masks, laws


@pytest.mark.parametrize("observer", list(OBSERVERS))
def test_padding_masks_leave_the_padded_rows_out(observer):
    """A padding mask (`observation_weight`) gives the states of the same batches without their
    padded rows, each group's statistics over the kept tokens only."""
    recipe, model = _recipe(observer), _mlp()
    g = torch.Generator().manual_seed(2)
    masks = [torch.rand(x.shape[:2], generator=g) > 0.4 for x in _batches()]
    weights = iter(masks)
    got = qstats.calibrate(model, _batches(), recipe, progress=False, observation_weight=lambda batch: next(weights))
    want = qstats.calibrate(model, [x[mask][None] for x, mask in zip(_batches(), masks)], recipe, progress=False)
    _equal_trees(got, want)


@pytest.mark.parametrize("observer", list(OBSERVERS))
def test_the_grouped_observer_keeps_the_laws(observer):
    """`qstats.testing.check_all` on the observer a `Recipe` builds for such a site: merges, masked
    and empty batches, purity, vmap and the distributed reduction hold. Its state holds statistics
    of groups of features, not qparams of the tensor it sees: its ``spec`` is None (it was the grouped
    view's ``PerAxis(1)``, whose per-group qparams the laws then failed to fake-quantize the tensor with)."""
    pytest.importorskip("hypothesis")
    factory, options = OBSERVERS[observer]
    grouped = feature_grouped(lambda spec: factory(spec, **options), NVFP4)
    qstats.testing.check_all(grouped, lambda g: torch.randn(2, 3, 32, generator=g), max_examples=5)


@pytest.mark.parametrize("observer", list(OBSERVERS))
def test_bfloat16_inputs_observed_in_bfloat16_are_llm_compressors(observer):
    """A bfloat16 model observed in bfloat16 (``compute_dtype``, `Recipe`'s ``observed_dtype``): each
    group's moving-average statistics of bf16 inputs are those of llm-compressor's observer on them,
    and so is the global scale."""
    pytest.importorskip("llmcompressor")
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.utils import generate_gparam
    from llmcompressor.observers import Observer

    args = QuantizationArgs(num_bits=4, type="float", strategy="tensor_group", group_size=16, dynamic="local")
    spec = qstats.QuantSpec.from_compressed_tensors(args).replace(compute_dtype="bfloat16")
    factory, options = OBSERVERS[observer]
    ours = feature_grouped(lambda grouped: factory(grouped, **options), spec)
    theirs = Observer.load_from_registry("minmax" if observer == "moving_average_minmax" else "mse",
                                         base_name="input", args=args)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(2, tokens, 64, generator=g) * s).bfloat16() for tokens, s in ((5, 1.0), (9, 3.0), (3, 2.0))]
    state = ours.init(batches[0])
    for x in batches:
        theirs(x)
        state = ours.update(state, x)
    assert bit_equal(state.min_val, theirs.min_vals.float()) and bit_equal(state.max_val, theirs.max_vals.float())
    want = generate_gparam(theirs.min_vals.min().reshape(1), theirs.max_vals.max().reshape(1))
    assert bit_equal(qstats.compute_qparams(state, spec).global_scale.reshape(1), want)


def test_compiled_update_is_the_eager_update():
    """``torch.compile(update, fullgraph=True)`` of the grouped observer gives the eager states bit
    for bit over batches of other token counts."""
    grouped = feature_grouped(qstats.moving_average_minmax, NVFP4)
    compiled = torch.compile(grouped.update, fullgraph=True, dynamic=True)
    eager = state = grouped.init(_batches()[0])
    for x in _batches():
        eager, state = grouped.update(eager, x), compiled(state, x)
    assert all(bit_equal(a, b) for a, b in zip(state, eager, strict=True))


@pytest.mark.parametrize("observer", list(OBSERVERS))
def test_features_that_16_does_not_divide_are_refused_naming_the_site(observer):
    """An input of 40 features: `qstats.calibrate` and `qstats.observing` raise a ValueError naming
    the module and site, not the grouped observer's reshape."""
    model = torch.nn.Sequential(torch.nn.Linear(40, 16)).eval()
    with pytest.raises(ValueError, match=r"calibrate: module '0' site 'input': TensorGroup.group_size 16 does not "
                                         r"divide dimension 40"):
        qstats.calibrate(model, [torch.randn(2, 40)], _recipe(observer), progress=False)
    with pytest.raises(ValueError, match=r"observing: module '0' site 'input'.* 16 does not divide dimension 40"):
        with qstats.observing(model, _recipe(observer)), torch.no_grad():
            model(torch.randn(2, 40))


@pytest.mark.parametrize("observer", list(OBSERVERS))
def test_report_measures_the_run_time_groups_under_the_calibrated_global_scale(observer):
    """`qstats.report` of such a site: its range is the groups' widest and its SQNR on a batch is that
    of compressed-tensors' fake quantization (run-time group scales under the calibrated global scale)."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    args = QuantizationArgs(num_bits=4, type="float", strategy="tensor_group", group_size=16, dynamic="local",
                            scale_dtype=torch.float8_e4m3fn)  # fmt: skip
    recipe, model = _recipe(observer, spec=qstats.QuantSpec.from_compressed_tensors(args)), _mlp()
    states = qstats.calibrate(model, _batches(), recipe, progress=False)
    qparams = qstats.compute_qparams_tree(states, recipe.resolve(model))
    x = _batches()[0]
    row = next(r for r in qstats.report(states, qparams, model, recipe, [x]).rows if r.module == "0")
    state = states["0"]["input"]
    assert row.min == pytest.approx(float(state.min_val.min())) and row.max == pytest.approx(float(state.max_val.max()))
    global_scale = qparams["0"]["input"].global_scale.reshape(1)
    scales, zero_points = compute_dynamic_scales_and_zp(x, args, None, global_scale=global_scale)
    noise = (fake_quantize(x, scales, zero_points, args, global_scale=global_scale) - x).double().square().sum()
    assert row.sqnr_db == pytest.approx(float(10 * torch.log10(x.double().square().sum() / noise)), abs=0.01)
