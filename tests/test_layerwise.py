"""qstats.calibrate_layerwise against qstats.calibrate on the loaded model (transformers' own loading).

Tiny random-weight Llama (tied embeddings) and Qwen3-MoE (stacked experts, saved by transformers
per expert) are written with ``save_pretrained`` in several safetensors shards; the layer-by-layer
calibration of the meta-device model must give the states of a full-model `qstats.calibrate` on
``from_pretrained``'s model bit for bit (float propagation), with padding masks, routed and
all-expert sites, offloaded inputs and resumed states. Quantized propagation is compared with
calibrating the loaded model under `qstats.fake_quantized` of the layers before each one, and
the all-reduced quantized run of two gloo ranks with the single-process run.
"""

from __future__ import annotations

import datetime
import os
import warnings

import pytest
import torch

import qstats
from _shared import assert_site_states_equal, fork_ranks, gloo_group

transformers = pytest.importorskip("transformers")

SPEC_W = qstats.QuantSpec(dtype="int8", mapping="symmetric", granularity=qstats.PerAxis(0))
SPEC_A = qstats.QuantSpec(dtype="int8", mapping="asymmetric")
LAYERS = 3


def _configs():
    llama = transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
    )  # fmt: skip
    qwen = transformers.Qwen3MoeConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=6, num_experts_per_tok=2,
        max_position_embeddings=64,
    )  # fmt: skip
    return {"llama": llama, "qwen3_moe": qwen}


def _recipe(name: str) -> qstats.Recipe:
    rules = [qstats.Rule("Linear", sites=("weight", "input"), spec=SPEC_W)]
    if name == "qwen3_moe":
        sites = ("gate_up_proj", "down_proj", "input", "down_proj.input")
        rules.append(qstats.Rule("Qwen3MoeExperts", sites=sites, spec=SPEC_W))
    # activations per tensor: a second rule for the inputs, so weights stay per channel
    return qstats.Recipe(
        [qstats.Rule(r.targets, sites=tuple(s for s in r.sites if "input" in s), spec=SPEC_A) for r in rules]
        + [qstats.Rule(r.targets, sites=tuple(s for s in r.sites if "input" not in s), spec=SPEC_W) for r in rules]
    )


def _batches(seed: int, count: int = 3, padded: bool = False) -> list:
    generator = torch.Generator().manual_seed(seed)
    out = []
    for index in range(count):
        ids = torch.randint(0, 96, (2, 6 + index), generator=generator)
        mask = torch.ones_like(ids)
        if padded:
            mask[1, : 2 + index] = 0  # left padding of the second sequence
        out.append({"input_ids": ids, "attention_mask": mask})
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``{name: (directory, loaded model)}``: each model saved in several shards, and loaded back."""
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, config in _configs().items():
            directory = tmp_path_factory.mktemp(name)
            torch.manual_seed(0)
            transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory, max_shard_size="20KB")
            assert len([f for f in os.listdir(directory) if f.endswith(".safetensors")]) >= 3
            loaded = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
            out[name] = (str(directory), loaded)
    return out


def _meta(name: str) -> torch.nn.Module:
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(_configs()[name]).eval()


def _attention_mask(batch):
    return batch["attention_mask"]


@pytest.mark.parametrize("all_experts", [False, True])
@pytest.mark.parametrize("name", ["llama", "qwen3_moe"])
def test_float_equals_full_model(saved, name, all_experts):
    directory, loaded = saved[name]
    batches, recipe = _batches(1, padded=True), _recipe(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qstats.UncalibratedWarning)
        want = qstats.calibrate(loaded, batches, recipe, progress=False, observation_weight=_attention_mask,
                                all_experts=all_experts)  # fmt: skip
        meta = _meta(name)
        got = qstats.calibrate_layerwise(meta, directory, batches, recipe, progress=False,
                                         observation_weight=_attention_mask, all_experts=all_experts)  # fmt: skip
    assert_site_states_equal(got, want)
    assert "lm_head" in got and f"model.layers.{LAYERS - 1}.mlp" + (".experts" if name == "qwen3_moe" else ".down_proj") in got
    # the model is left on the meta device, its ties intact
    assert all(p.device.type == "meta" for p in meta.parameters())
    if name == "llama":
        assert meta.lm_head.weight is meta.model.embed_tokens.weight


def test_padding_is_not_observed(saved):
    """The padded tokens change the full model's states when observed; masked, they do not count."""
    directory, _ = saved["llama"]
    batches, recipe = _batches(2, padded=True), _recipe("llama")
    masked = qstats.calibrate_layerwise(_meta("llama"), directory, batches, recipe, progress=False,
                                        observation_weight=_attention_mask)  # fmt: skip
    unmasked = qstats.calibrate_layerwise(_meta("llama"), directory, batches, recipe, progress=False)
    counts = [(masked[p]["input"], unmasked[p]["input"]) for p in masked if "input" in masked[p]]
    assert any(not torch.equal(a.min_val, b.min_val) or not torch.equal(a.max_val, b.max_val) for a, b in counts)


def test_offload_and_resume(saved, tmp_path):
    directory, loaded = saved["qwen3_moe"]
    recipe, first, second = _recipe("qwen3_moe"), _batches(3, 2), _batches(4, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qstats.UncalibratedWarning)
        want = qstats.calibrate(loaded, first + second, recipe, progress=False)
        offloaded = qstats.calibrate_layerwise(_meta("qwen3_moe"), directory, first + second, recipe, progress=False,
                                               offload_dir=tmp_path)  # fmt: skip
        assert os.listdir(tmp_path) == []  # its files are removed
        path = tmp_path / "states.safetensors"
        qstats.save(path, qstats.calibrate_layerwise(_meta("qwen3_moe"), directory, first, recipe, progress=False))
        resumed = qstats.calibrate_layerwise(_meta("qwen3_moe"), directory, second, recipe, progress=False,
                                             states=qstats.load(path))  # fmt: skip
    assert_site_states_equal(offloaded, want)
    assert_site_states_equal(resumed, want)


def _quantized_reference(loaded, batches, recipe) -> dict:
    """Each layer calibrated on the loaded model under `fake_quantized` of the layers before it
    (qparams from their own states), the modules after the layers under all of them."""
    plan = recipe.resolve(loaded)
    out: dict = {}
    for index in range(LAYERS + 1):
        before = {path: entry for path, entry in out.items() if path.startswith("model.layers.")}
        with qstats.fake_quantized(loaded, qstats.compute_qparams_tree(before, plan), plan):
            states = qstats.calibrate(loaded, batches, plan, progress=False)
        prefix = f"model.layers.{index}."
        keep = (lambda p: p.startswith(prefix)) if index < LAYERS else (lambda p: not p.startswith("model.layers."))
        out.update({path: entry for path, entry in states.items() if keep(path)})
    return out


@pytest.mark.parametrize("name", ["llama", "qwen3_moe"])
def test_quantized_propagation(saved, name):
    directory, loaded = saved[name]
    batches, recipe = _batches(5), _recipe(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qstats.UncalibratedWarning)
        got = qstats.calibrate_layerwise(_meta(name), directory, batches, recipe, progress=False, propagate="quantized")
        floated = qstats.calibrate_layerwise(_meta(name), directory, batches, recipe, progress=False)
        want = _quantized_reference(loaded, batches, recipe)
    assert_site_states_equal(got, want)
    assert not torch.equal(got["lm_head"]["input"].max_val, floated["lm_head"]["input"].max_val)
    assert_site_states_equal({p: e for p, e in got.items() if p.startswith("model.layers.0.")},
                  {p: e for p, e in floated.items() if p.startswith("model.layers.0.")})  # fmt: skip


@pytest.mark.parametrize("propagate", ["float", "quantized"])
def test_execution_device_moves_everything_and_changes_nothing(saved, propagate, tmp_path):
    """``device=``: layers run there, the store stays on the CPU. Only the CPU is here, so this
    runs every move (batches, layer arguments as tuples and dicts, outputs, resumed states) and
    checks the states equal the default run's; an accelerator's transfers are not exercised."""
    directory, _ = saved["qwen3_moe"]
    recipe, first, second = _recipe("qwen3_moe"), _batches(7, 2, padded=True), _batches(8, 2)
    options = {"progress": False, "propagate": propagate, "observation_weight": _attention_mask}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qstats.UncalibratedWarning)
        want = qstats.calibrate_layerwise(_meta("qwen3_moe"), directory, first + second, recipe, **options)
        got = qstats.calibrate_layerwise(_meta("qwen3_moe"), directory, first + second, recipe, device="cpu", **options)
        assert_site_states_equal(got, want)
        if propagate == "float":  # resumed states move too (quantized propagation is not resumable bit for bit)
            path = tmp_path / "states.safetensors"
            qstats.save(path, qstats.calibrate_layerwise(_meta("qwen3_moe"), directory, first, recipe, **options))
            resumed = qstats.calibrate_layerwise(_meta("qwen3_moe"), directory, second, recipe,
                                                 device=torch.device("cpu"), states=qstats.load(path), **options)
            assert_site_states_equal(resumed, want)
    for device in ("tpu9", "meta") + (() if torch.cuda.is_available() else ("cuda",)):
        with pytest.raises(ValueError, match="cannot hold tensors|holds no data"):
            qstats.calibrate_layerwise(_meta("llama"), saved["llama"][0], first, _recipe("llama"), device=device)


def test_bad_input(saved, tmp_path):
    directory, _ = saved["llama"]
    recipe = _recipe("llama")
    with pytest.raises(ValueError, match="propagate"):
        qstats.calibrate_layerwise(_meta("llama"), directory, _batches(0, 1), recipe, propagate="int8")
    with pytest.raises(ValueError, match="neither model.safetensors"):
        qstats.calibrate_layerwise(_meta("llama"), tmp_path, _batches(0, 1), recipe)
    other = _meta("qwen3_moe")
    with pytest.raises(ValueError, match="has shape|no tensor"):
        qstats.calibrate_layerwise(other, directory, _batches(0, 1), _recipe("qwen3_moe"), progress=False)
    with pytest.raises(ValueError, match="not a non-empty nn.ModuleList"):
        qstats.calibrate_layerwise(_meta("llama"), directory, _batches(0, 1), recipe, layers="model.norm")
    with pytest.raises(ValueError, match="does not observe"):
        qstats.calibrate_layerwise(_meta("llama"), directory, _batches(0, 1), recipe, states={"lm_head": {"output": None}})


def _rank(rank: int, port: int, directory: str, out: str) -> None:
    with gloo_group(rank, port):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            batches = _batches(6, 4)[rank::2]
            states = qstats.calibrate_layerwise(_meta("qwen3_moe"), directory, batches, _recipe("qwen3_moe"),
                                                progress=False, propagate="quantized", all_reduce=True)  # fmt: skip
        qstats.save(os.path.join(out, f"rank{rank}.safetensors"), states)


def test_all_reduce_two_ranks(saved, tmp_path):
    """Two ranks, each with half the batches, all-reduce every layer before propagating it
    quantized: each gets the states of one process over all the batches."""
    directory, _ = saved["qwen3_moe"]
    assert fork_ranks(_rank, directory, str(tmp_path)) == [0, 0]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks: a matmul's rounding may depend on the thread count
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want = qstats.calibrate_layerwise(_meta("qwen3_moe"), directory, _batches(6, 4), _recipe("qwen3_moe"),
                                              progress=False, propagate="quantized")  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    for rank in range(2):
        assert_site_states_equal(qstats.load(tmp_path / f"rank{rank}.safetensors"), want)


def test_missing_tensor_or_loaded_model_raise_and_leave_the_model_on_meta(saved, tmp_path):
    """A checkpoint without one tensor of layer 1 raises naming it, and every tensor loaded before it
    is back on the meta device; a model whose parameters are loaded already is refused."""
    from safetensors.torch import save_file

    directory, loaded = saved["llama"]
    tensors = {key: value.clone() for key, value in loaded.state_dict().items() if key != "lm_head.weight"}
    missing = "model.layers.1.mlp.down_proj.weight"
    del tensors[missing]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    model = _meta("llama")
    with pytest.raises(ValueError, match=f"no tensor {missing!r}"):
        qstats.calibrate_layerwise(model, tmp_path, _batches(0, 2), _recipe("llama"), progress=False)
    assert [n for n, v in list(model.named_parameters()) + list(model.named_buffers()) if v.device.type != "meta"] == []
    with pytest.raises(ValueError, match="not on the meta device"):
        qstats.calibrate_layerwise(loaded, directory, _batches(0, 1), _recipe("llama"), progress=False)


def _failing_rank(rank: int, port: int, directory: str, out: str, case: str) -> None:
    with gloo_group(rank, port, timeout=datetime.timedelta(seconds=30)):
        batches, weight = _batches(6, 2, padded=True), _attention_mask
        if rank == 1 and case == "bad_batch":
            batches[1]["input_ids"] = batches[1]["input_ids"] + 1000  # out of the vocabulary: fails in capture
        if rank == 1 and case == "bad_weight":
            weight = lambda batch: "mask"  # noqa: E731  (not a tensor: stored by the capture, fails in layer 0)
        if rank == 1 and case == "no_batches":
            batches = []
        if rank == 1 and case == "bad_checkpoint":
            directory = out  # holds no safetensors: fails in the checks before the first step
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                qstats.calibrate_layerwise(_meta("llama"), directory, batches, _recipe("llama"), progress=False,
                                           propagate="quantized", all_reduce=True,
                                           observation_weight=weight)  # fmt: skip
            message = "no error"
        except Exception as error:  # noqa: BLE001  (what each rank raised is the result)
            message = f"{type(error).__name__}: {error}"
        with open(os.path.join(out, f"{case}{rank}.txt"), "w") as file:
            file.write(message)


@pytest.mark.parametrize("case", ["bad_checkpoint", "bad_batch", "bad_weight", "no_batches"])
def test_all_reduce_one_rank_failing_makes_every_rank_raise(saved, tmp_path, case):
    """A rank with a bad argument, or whose batch fails before any collective (capture) or inside a
    layer: every rank raises instead of waiting for it in a collective. A rank with no batch is no
    error: it takes the other ranks' states of every site, as for a module only they call."""
    directory, _ = saved["llama"]
    codes = fork_ranks(_failing_rank, directory, str(tmp_path), case, timeout=60)
    assert [code is None for code in codes] == [False, False]
    messages = [(tmp_path / f"{case}{rank}.txt").read_text() for rank in range(2)]
    if case == "no_batches":
        assert messages == ["no error", "no error"], messages
        return
    assert "no error" not in messages[0] and "no error" not in messages[1], messages
    assert "another rank failed" in messages[0], messages


def test_checkpoint_missing_one_experts_tensor_names_it(saved, tmp_path):
    from safetensors.torch import save_file

    from qstats._lazy_checkpoint import LazyCheckpoint

    directory, _ = saved["qwen3_moe"]
    source = LazyCheckpoint(directory)
    missing = "model.layers.0.mlp.experts.3.up_proj.weight"
    assert missing in source
    save_file({key: source.tensor(key) for key in source.files if key != missing}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=f"no tensor {missing!r}"):
        qstats.calibrate_layerwise(_meta("qwen3_moe"), tmp_path, _batches(0, 1), _recipe("qwen3_moe"), progress=False)


def test_checkpoint_experts_of_different_input_widths_name_them(tmp_path):
    """An expert whose gate_proj and up_proj differ in input width ([3, 4] and [3, 5]) is a
    ValueError naming both tensors and their shapes (it was torch.cat's bare RuntimeError)."""
    from safetensors.torch import save_file

    from qstats._lazy_checkpoint import LazyCheckpoint

    prefix = "model.layers.0.mlp.experts"
    tensors = {}
    for expert in range(2):
        tensors[f"{prefix}.{expert}.gate_proj.weight"] = torch.zeros(3, 4)
        tensors[f"{prefix}.{expert}.up_proj.weight"] = torch.zeros(3, 5 if expert == 1 else 4)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    wanted = rf"{prefix}\.1\.gate_proj\.weight' \(3, 4\), '{prefix}\.1\.up_proj\.weight' \(3, 5\)"
    with pytest.raises(ValueError, match=wanted):
        LazyCheckpoint(tmp_path).stacked_experts(f"{prefix}.gate_up_proj")


class _ExpertBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(5))

    def forward(self, hidden):
        return sum(expert(hidden) for expert in self.experts) / len(self.experts)


class _ExpertModel(torch.nn.Module):
    """Two layers of five per-expert Linear modules each: the experts' lists outnumber the layers."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.layers = torch.nn.ModuleList(_ExpertBlock() for _ in range(2))
        self.head = torch.nn.Linear(8, 4)

    def forward(self, ids):
        hidden = self.embed(ids)
        for layer in self.layers:
            hidden = layer(hidden)
        return self.head(hidden)


def test_default_layers_are_the_outer_list_not_the_experts_inside(tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(0)
    loaded = _ExpertModel().eval()
    save_file(loaded.state_dict(), str(tmp_path / "model.safetensors"))
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("weight", "input"), spec=SPEC_A)])
    batches = [torch.randint(0, 16, (2, 5)) for _ in range(2)]
    with torch.device("meta"):
        model = _ExpertModel().eval()
    got = qstats.calibrate_layerwise(model, tmp_path, batches, recipe, progress=False)
    assert_site_states_equal(got, qstats.calibrate(loaded, batches, recipe, progress=False))


class _RoutedBlock(torch.nn.Module):
    """A decoder layer whose second Linear runs only on batches whose first value is large (data-
    dependent routing, as per-expert Linear modules): some ranks' batches never call it."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.a(x)
        return y + self.b(x) if float(x.flatten()[0]) > 100 else y


class _RoutedNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(_RoutedBlock() for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _routed_batches(rank: int) -> list:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    if rank % 2 == 0:
        x[0, 0] = 1000.0  # calls every layer's `b`, on ranks 0 and 2 only
    return [x]


def _routed_rank(rank: int, port: int, directory: str, out: str, gptq: bool, world: int) -> None:
    with gloo_group(rank, port, world=world, timeout=datetime.timedelta(seconds=30)):
        with torch.device("meta"):
            meta = _RoutedNet().eval()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if gptq:
                result = qstats.gptq_layerwise(meta, directory, _routed_batches(rank), _routed_recipe(True),
                                               progress=False, all_reduce=True).weights  # fmt: skip
                torch.save(result, os.path.join(out, f"rank{rank}.pt"))
            else:
                states = qstats.calibrate_layerwise(meta, directory, _routed_batches(rank), _routed_recipe(False),
                                                    progress=False, all_reduce=True)  # fmt: skip
                qstats.save(os.path.join(out, f"rank{rank}.safetensors"), states)


def _routed_recipe(gptq: bool) -> qstats.Recipe:
    if gptq:
        return qstats.Recipe([qstats.Rule("Linear", sites=("weight",), spec=qstats.QuantSpec(dtype="int4",
                              granularity=qstats.PerAxis(0)))])  # fmt: skip
    return qstats.Recipe([qstats.Rule("Linear", sites=("input",), spec=SPEC_A)])


@pytest.mark.parametrize("gptq, world", [(False, 2), (False, 3), (True, 2)])
def test_all_reduce_with_a_module_only_some_ranks_call(tmp_path, gptq, world):
    """Ranks 0 and 2 call every layer's ``b``, rank 1 none: the ranks still end with the same sites
    (the holders' states of ``b`` merged in rank order), equal to one process over all the ranks'
    batches; GPTQ'd weights equal. Before, the ranks raised "different state trees" (calibrate) or
    hung in mismatched collectives (GPTQ)."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    save_file(_RoutedNet().state_dict(), str(tmp_path / "model.safetensors"))
    out = tmp_path / "out"
    out.mkdir()
    assert fork_ranks(_routed_rank, str(tmp_path), str(out), gptq, world, world=world, timeout=90) == [0] * world
    with torch.device("meta"):
        meta = _RoutedNet().eval()
    batches = [batch for rank in range(world) for batch in _routed_batches(rank)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if gptq:
            want = qstats.gptq_layerwise(meta, str(tmp_path), batches, _routed_recipe(True), progress=False).weights
        else:
            want = qstats.calibrate_layerwise(meta, str(tmp_path), batches, _routed_recipe(False), progress=False)
    for rank in range(world):
        if gptq:
            got = torch.load(out / f"rank{rank}.pt")
            assert sorted(got) == sorted(want) and "layers.1.b.weight" in got
            for name in want:  # the Hessians merged in another order than one process's sums: float rounding
                torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-6)
        else:
            got = qstats.load(out / f"rank{rank}.safetensors")
            assert "layers.1.b" in got
            assert_site_states_equal(got, want)


def _bad_option_rank(rank: int, port: int, directory: str, out: str) -> None:
    with gloo_group(rank, port, timeout=datetime.timedelta(seconds=30)):
        with torch.device("meta"):
            meta = _RoutedNet().eval()
        try:
            qstats.gptq_layerwise(meta, directory, _routed_batches(rank), _routed_recipe(True), progress=False,
                                  all_reduce=True, experts_at_once=0 if rank == 1 else 8)  # fmt: skip
            message = "no error"
        except Exception as error:  # noqa: BLE001  (what each rank raised is the result)
            message = f"{type(error).__name__}: {error}"
        with open(os.path.join(out, f"rank{rank}.txt"), "w") as file:
            file.write(message)


def test_gptq_options_are_checked_before_any_work_and_on_every_rank(tmp_path):
    """A bad GPTQ option raises before the first batch is read; with ``all_reduce``, one rank's bad
    option makes every rank raise (the other waited for it before)."""
    from safetensors.torch import save_file

    save_file(_RoutedNet().state_dict(), str(tmp_path / "model.safetensors"))
    read = []

    def batches():
        read.append(1)
        yield from _routed_batches(0)

    offload = tmp_path / "offload"
    offload.mkdir()
    for options in ({"actorder": "group"}, {"block_size": 0}, {"dampening": -1.0}, {"experts_at_once": 0}):
        with torch.device("meta"):
            meta = _RoutedNet().eval()
        with pytest.raises(ValueError, match="gptq_layerwise: " + next(iter(options))):
            qstats.gptq_layerwise(meta, str(tmp_path), batches(), _routed_recipe(True), progress=False,
                                  offload_dir=offload, **options)  # fmt: skip
    assert read == [] and list(offload.iterdir()) == []  # no batch read, no offload folder left
    assert fork_ranks(_bad_option_rank, str(tmp_path), str(tmp_path), timeout=60) == [0, 0]
    messages = [(tmp_path / f"rank{rank}.txt").read_text() for rank in range(2)]
    assert messages[1].startswith("ValueError: gptq_layerwise: experts_at_once"), messages
    assert messages[0].startswith("RuntimeError: another rank failed"), messages


def _counted(batches: list, read: list):
    """``batches`` as a generator that records each batch read (a check before any work reads none)."""
    for batch in batches:
        read.append(1)
        yield batch


def test_a_wrong_layers_name_is_a_value_error_naming_it(saved):
    """``layers=`` naming no module raised torch's AttributeError ("LlamaModel has no attribute `layer`")."""
    directory, _ = saved["llama"]
    with pytest.raises(ValueError, match=r"calibrate_layerwise: layers='model\.layer' names no module"):
        qstats.calibrate_layerwise(_meta("llama"), directory, _batches(0, 1), _recipe("llama"), layers="model.layer")


def test_a_bad_checkpoint_or_offload_dir_leaves_no_offload_folder(saved, tmp_path):
    """A checkpoint refused after the offload folder was made left that folder behind; an
    offload_dir that does not exist raised tempfile's FileNotFoundError on a made-up name."""
    offload = tmp_path / "offload"
    offload.mkdir()
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="neither model.safetensors"):
        qstats.calibrate_layerwise(_meta("llama"), empty, _batches(0, 1), _recipe("llama"), offload_dir=offload)
    assert list(offload.iterdir()) == []
    with pytest.raises(ValueError, match="offload_dir=.*no_such.* is not a directory"):
        qstats.calibrate_layerwise(_meta("llama"), saved["llama"][0], _batches(0, 1), _recipe("llama"),
                                   offload_dir=tmp_path / "no_such")  # fmt: skip


def _broken(directory: str, into, how: str) -> str:
    """A copy of the sharded checkpoint ``directory`` under ``into``, broken as ``how`` says."""
    import json
    import shutil

    out = str(into / how)
    shutil.copytree(directory, out)
    with open(os.path.join(out, "model.safetensors.index.json")) as file:
        index = json.load(file)
    shard = index["weight_map"]["model.layers.1.mlp.down_proj.weight"]
    if how == "missing_shard":
        os.remove(os.path.join(out, shard))
    elif how == "corrupt_shard":
        with open(os.path.join(out, shard), "wb") as file:
            file.write(b"not safetensors")
    elif how == "bad_index":
        with open(os.path.join(out, "model.safetensors.index.json"), "w") as file:
            file.write('{"metadata": {}}')
    elif how == "index_names_the_wrong_shard":
        index["weight_map"]["model.layers.1.mlp.down_proj.weight"] = next(
            name for name in index["weight_map"].values() if name != shard)
        with open(os.path.join(out, "model.safetensors.index.json"), "w") as file:
            json.dump(index, file)
    return out


@pytest.mark.parametrize("how, message", [
    ("missing_shard", "checkpoint's file .* is missing"),
    ("corrupt_shard", "checkpoint's file .* cannot be read as safetensors"),
    ("bad_index", "model.safetensors.index.json' is not a safetensors index with a weight_map"),
    ("index_names_the_wrong_shard", r"the index puts 1 tensor\(s\) in .*model\.layers\.1\.mlp\.down_proj\.weight"),
])  # fmt: skip
def test_a_broken_checkpoint_fails_before_any_batch_naming_the_file(saved, tmp_path, how, message):
    """A missing or corrupt shard, or an index naming a shard that lacks the tensor, raised
    FileNotFoundError or safetensors' SafetensorError (without the file's name), or KeyError
    'weight_map', and only once the layer holding it was reached, after the capture and every layer before."""
    directory = _broken(saved["llama"][0], tmp_path, how)
    read: list = []
    model = _meta("llama")
    with pytest.raises(ValueError, match=message):
        qstats.calibrate_layerwise(model, directory, _counted(_batches(0, 2), read), _recipe("llama"), progress=False)
    assert read == [] and all(p.device.type == "meta" for p in model.parameters())


def test_a_tensor_missing_from_the_checkpoint_fails_before_any_batch(saved, tmp_path):
    """The model's tensors are checked by name before the capture: a tensor of the last layer that the
    checkpoint lacks (or one expert's) was found only once every layer before it had run."""
    from safetensors.torch import save_file

    from qstats._lazy_checkpoint import LazyCheckpoint

    for name, missing in (("llama", f"model.layers.{LAYERS - 1}.self_attn.o_proj.weight"),
                          ("qwen3_moe", f"model.layers.{LAYERS - 1}.mlp.experts.5.down_proj.weight")):  # fmt: skip
        source = LazyCheckpoint(saved[name][0])
        folder = tmp_path / name
        folder.mkdir()
        kept = {key: source.tensor(key) for key in source.files if key != missing}
        save_file(kept, str(folder / "model.safetensors"))
        read: list = []
        with pytest.raises(ValueError, match=f"no tensor {missing!r}"):
            qstats.calibrate_layerwise(_meta(name), folder, _counted(_batches(0, 2), read), _recipe(name),
                                       progress=False)  # fmt: skip
        assert read == []


def _renamed_configs():
    """Models whose checkpoint names transformers 5 renames on load (``block_sparse_moe.*`` -> ``mlp.*``
    and per-expert ``w1``/``w3``/``w2`` -> stacked experts for Mixtral; ``router.layer.weight`` ->
    ``router.weight`` and ``input_linear``/``output_linear`` -> stacked experts for GraniteMoE)."""
    shape = dict(vocab_size=96, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64)
    return {
        "mixtral": (transformers.MixtralConfig(head_dim=8, **shape), "MixtralExperts", "MixtralTopKRouter",
                    "model.layers.0.block_sparse_moe.gate.weight"),
        "granitemoe": (transformers.GraniteMoeConfig(**shape), "GraniteMoeExperts", "GraniteMoeTopKRouter",
                       "model.layers.0.block_sparse_moe.router.layer.weight"),
    }  # fmt: skip


@pytest.mark.parametrize("name", ["mixtral", "granitemoe"])
def test_checkpoint_names_transformers_renames_on_load(tmp_path, name):
    """The meta model's tensors are read under the names ``save_pretrained`` wrote (transformers' own
    reversed conversion mapping): the states equal a full-model `calibrate` of ``from_pretrained``'s
    model bit for bit, routers' weights and stacked experts included."""
    config, experts, router, stored = _renamed_configs()[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path, max_shard_size="20KB")
        loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    from safetensors.torch import save_file

    from qstats._lazy_checkpoint import LazyCheckpoint

    assert stored in LazyCheckpoint(tmp_path)  # the checkpoint's names are not the model's
    recipe = qstats.Recipe([
        qstats.Rule(("Linear", experts), sites=("input", "down_proj.input"), spec=SPEC_A),
        qstats.Rule(("Linear", router), sites=("weight",), spec=SPEC_W),
        qstats.Rule(experts, sites=("gate_up_proj", "down_proj"), spec=SPEC_W),
    ])  # fmt: skip
    batches = _batches(3, padded=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qstats.UncalibratedWarning)
        want = qstats.calibrate(loaded, batches, recipe, progress=False, observation_weight=_attention_mask,
                                all_experts=True)  # fmt: skip
        with torch.device("meta"):
            meta = transformers.AutoModelForCausalLM.from_config(config).eval()
        got = qstats.calibrate_layerwise(meta, tmp_path, batches, recipe, progress=False,
                                         observation_weight=_attention_mask, all_experts=True)  # fmt: skip
    assert_site_states_equal(got, want)
    prefix = "model.layers.1." + ("mlp" if name == "mixtral" else "block_sparse_moe")
    assert {f"{prefix}.experts", f"{prefix}.{'gate' if name == 'mixtral' else 'router'}"} <= set(got)
    assert all(p.device.type == "meta" for p in meta.parameters())
    # a tensor the checkpoint lacks is named as the checkpoint would name it
    source, folder = LazyCheckpoint(tmp_path), tmp_path / "without"
    folder.mkdir()
    save_file({key: source.tensor(key) for key in source.files if key != stored}, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=f"no tensor {stored!r}"):
        qstats.calibrate_layerwise(meta, folder, batches, recipe, progress=False)


def test_an_experts_layout_that_would_mix_experts_is_refused_before_any_layer_is_read(saved, monkeypatch):
    """An experts module whose declared count is not its parameters' leading size: refused up front
    (it was refused only when its layer had been read and run)."""
    directory, _ = saved["qwen3_moe"]
    model = _meta("qwen3_moe")
    experts = next(m for m in model.modules() if type(m).__name__ == "Qwen3MoeExperts")
    experts.num_experts = experts.gate_up_proj.shape[0] - 1
    read = []
    monkeypatch.setattr(qstats.layerwise, "load_modules", lambda *args, **kwargs: read.append(args) or [])
    with pytest.raises(ValueError, match="calibrate_layerwise: module 'model.layers.0.mlp.experts'"):
        qstats.calibrate_layerwise(model, directory, _batches(5), _recipe("qwen3_moe"), progress=False)
    assert read == []
