"""`compressed_tensors_layerwise(max_shard_size=...)`: the layer-by-layer export split into shards as
``save_pretrained(max_shard_size=...)`` splits a checkpoint (names, index), holding the in-memory
export's tensors and loading with transformers + compressed-tensors; and `calibrate_layerwise` refusing
a model that calls one layer several times (ALBERT's shared layers) instead of calibrating it wrongly."""

from __future__ import annotations

import json
import os
import sys
import warnings

import pytest
import torch

import qstats
from _shared import bit_equal, checkpoint_tensors

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")
from safetensors.torch import load_file  # noqa: E402

LIMIT = 100_000


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=32, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    path = str(tmp_path_factory.mktemp("sharded_llama"))
    transformers.LlamaForCausalLM(config).save_pretrained(path, max_shard_size="200KB")
    return path


@pytest.fixture(scope="module")
def calibrated(llama):
    config = transformers.AutoConfig.from_pretrained(llama)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
    plan = qstats.Recipe.from_scheme("W8A8", ignore=["lm_head"]).resolve(model)
    generator = torch.Generator().manual_seed(1)
    batches = [{"input_ids": torch.randint(1, 64, (1, 12), generator=generator)} for _ in range(2)]
    states = qstats.calibrate_layerwise(model, llama, batches, plan, progress=False)
    return model, plan, qstats.compute_qparams_tree(states, plan)


def _loaded_logits(folder):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    with torch.no_grad():
        return model(torch.arange(1, 13)[None]).logits


def test_max_shard_size_shards_as_save_pretrained_and_loads_as_the_in_memory_export(llama, calibrated, tmp_path):
    """Before, compressed_tensors_layerwise took no max_shard_size (TypeError): always a shard per layer."""
    model, plan, qparams = calibrated
    sharded = tmp_path / "sharded"
    written = qstats.export.compressed_tensors_layerwise(model, llama, qparams, str(sharded), plan,
                                                         max_shard_size="100KB", progress=False)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(llama).eval()
    whole = tmp_path / "whole"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert qstats.export.compressed_tensors(loaded, qparams, str(whole), recipe_plan(loaded)) == written
    ours, reference = checkpoint_tensors(sharded), checkpoint_tensors(whole)
    assert sorted(ours) == sorted(reference) and all(bit_equal(ours[name], reference[name]) for name in ours)

    with open(sharded / "model.safetensors.index.json") as file:
        index = json.load(file)
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 4  # more than the default's one shard per layer and one for the rest
    assert files == [f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)]
    assert files == sorted(name for name in os.listdir(sharded) if "safetensors" in name and "index" not in name)
    assert sorted(index["weight_map"]) == sorted(ours)
    for file in files:
        shard = load_file(str(sharded / file))
        assert sorted(shard) == sorted(name for name, where in index["weight_map"].items() if where == file)
        assert len(shard) == 1 or sum(t.numel() * t.element_size() for t in shard.values()) <= LIMIT
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in ours.values())
    assert bit_equal(_loaded_logits(sharded), _loaded_logits(whole))
    assert all(param.device.type == "meta" for param in model.parameters())


def recipe_plan(model):
    return qstats.Recipe.from_scheme("W8A8", ignore=["lm_head"]).resolve(model)


def _added(monkeypatch, module: str) -> dict:
    """Records (as copies, in order) the tensors an export's ``module`` hands its shard writer: what
    its `without_tied_copies` returns, once for the in-memory export and once per layer layer by layer."""
    seen: dict = {}
    original = sys.modules[module].without_tied_copies

    def spy(model, tensors):
        kept = original(model, tensors)
        seen.update((name, tensor.detach().to("cpu", copy=True)) for name, tensor in kept.items())
        return kept

    monkeypatch.setattr(sys.modules[module], "without_tied_copies", spy)
    return seen


def _check_against_huggingface_hub(folder, added: dict, size) -> None:
    """The files and index of ``folder`` are those huggingface_hub's split (save_pretrained's) gives
    the tensors in the order the export added them."""
    from huggingface_hub import split_torch_state_dict_into_shards

    split = split_torch_state_dict_into_shards(added, max_shard_size=size)
    files = sorted(name for name in os.listdir(folder) if "safetensors" in name and "index" not in name)
    assert files == sorted(split.filename_to_tensors)
    if not split.is_sharded:
        assert files == ["model.safetensors"] and not (folder / "model.safetensors.index.json").exists()
        return
    with open(folder / "model.safetensors.index.json") as file:
        index = json.load(file)
    assert index["weight_map"] == split.tensor_to_filename
    assert index["metadata"]["total_size"] == split.metadata["total_size"]
    for name, names in split.filename_to_tensors.items():
        assert sorted(load_file(str(folder / name))) == sorted(names)


@pytest.mark.parametrize("size", ["100KB", 20_000, 10**9])  # 20 kB: the embeddings get shards of their own
def test_both_exports_shard_as_huggingface_hub_splits_the_tensors_they_add(llama, calibrated, tmp_path,
                                                                            monkeypatch, size):
    model, plan, qparams = calibrated
    held = _held_between_layers(monkeypatch)
    added_layerwise = _added(monkeypatch, "qstats.export.layerwise")
    added_whole = _added(monkeypatch, "qstats.export.checkpoint")
    qstats.export.compressed_tensors_layerwise(model, llama, qparams, str(tmp_path / "layerwise"), plan,
                                               max_shard_size=size, progress=False)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(llama).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qstats.export.compressed_tensors(loaded, qparams, str(tmp_path / "whole"), recipe_plan(loaded),
                                         max_shard_size=size)
    # the same tensors in different orders (the in-memory export puts quantized modules first): each
    # export is checked on its own order
    assert sorted(added_layerwise) == sorted(added_whole) and list(added_layerwise) != list(added_whole)
    _check_against_huggingface_hub(tmp_path / "layerwise", added_layerwise, size)
    _check_against_huggingface_hub(tmp_path / "whole", added_whole, size)
    assert len(held) == 4 and max(held) <= {"100KB": 100_000}.get(size, size)  # one open shard at most


def _held_between_layers(monkeypatch) -> list:
    """The bytes the layer-by-layer export keeps from one part (layer) to the next."""
    shards = sys.modules["qstats.export.layerwise"]._Shards
    held: list = []
    original = shards.add

    def add(self, tensors):
        original(self, tensors)
        held.append(sum(tensor.numel() * tensor.element_size() for tensor in self.open.values()))

    monkeypatch.setattr(shards, "add", add)
    return held


def test_a_max_shard_size_holding_everything_writes_one_model_safetensors(llama, calibrated, tmp_path):
    model, plan, qparams = calibrated
    qstats.export.compressed_tensors_layerwise(model, llama, qparams, str(tmp_path / "one"), plan,
                                               max_shard_size=10**9, progress=False)
    assert sorted(name for name in os.listdir(tmp_path / "one") if "safetensors" in name) == ["model.safetensors"]
    default = tmp_path / "default"
    qstats.export.compressed_tensors_layerwise(model, llama, qparams, str(default), plan, progress=False)
    ours, reference = checkpoint_tensors(tmp_path / "one"), checkpoint_tensors(default)
    assert sorted(ours) == sorted(reference) and all(bit_equal(ours[name], reference[name]) for name in ours)


@pytest.mark.parametrize("size", [0, -5, "5 GiB", "GB", True, 1.5])
def test_a_bad_max_shard_size_is_refused_before_anything_is_written(llama, calibrated, tmp_path, size):
    model, plan, qparams = calibrated
    with pytest.raises(ValueError, match="compressed_tensors_layerwise: max_shard_size"):
        qstats.export.compressed_tensors_layerwise(model, llama, qparams, str(tmp_path / "out"), plan,
                                                   max_shard_size=size, progress=False)
    assert not (tmp_path / "out").exists()


def test_a_failed_sharded_export_leaves_no_file(llama, calibrated, tmp_path):
    model, plan, qparams = calibrated
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="name no tensor"):
        qstats.export.compressed_tensors_layerwise(model, llama, qparams, str(out), plan, max_shard_size="50KB",
                                                   weights={"model.no_such.weight": torch.zeros(2)}, progress=False)
    assert not out.exists()  # nor the folder the export created


@pytest.mark.parametrize("layers, groups", [(3, 1), (4, 2)])
def test_a_layer_called_several_times_is_refused_not_calibrated_wrongly(tmp_path, layers, groups):
    """ALBERT runs its layer groups num_hidden_layers times (each group several times in a row).
    Before, calibrate_layerwise calibrated each group on its first call only, then its stand-ins
    replayed the next batches' stored outputs: an IndexError from deep inside. A full-model
    calibrate sees every call; layer by layer cannot, so it is refused with a clear error."""
    config = transformers.AlbertConfig(
        vocab_size=64, embedding_size=16, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
        intermediate_size=48, num_hidden_groups=groups, max_position_embeddings=32)  # fmt: skip
    transformers.AlbertForMaskedLM(config).save_pretrained(tmp_path)
    with torch.device("meta"):
        model = transformers.AlbertForMaskedLM(config).eval()
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("input", "weight"), spec=qstats.QuantSpec(dtype="int8"))])
    batches = [{"input_ids": torch.randint(0, 64, (2, 8))} for _ in range(4)]
    loaded = transformers.AlbertForMaskedLM.from_pretrained(str(tmp_path)).eval()
    calls: list = []
    hooks = [group.register_forward_pre_hook(lambda module, args, index=index: calls.append(index))
             for index, group in enumerate(loaded.albert.encoder.albert_layer_groups)]
    with torch.no_grad():
        loaded(**batches[0])
    for hook in hooks:
        hook.remove()
    assert calls == [i * groups // layers for i in range(layers)]  # the reference: groups called several times
    expected = f"in the order {calls[:2]}".replace("[", r"\[").replace("]", r"\]")
    with pytest.raises(ValueError, match=f"albert_layer_groups' {expected}.*shared across depths"):
        qstats.calibrate_layerwise(model, str(tmp_path), batches, recipe, progress=False)
    with pytest.raises(ValueError, match="gptq_layerwise: .*shared across depths"):
        qstats.gptq_layerwise(model, str(tmp_path), batches, qstats.Recipe.from_scheme("W4A16"), progress=False)


def test_a_layer_fed_the_first_layers_extra_output_is_refused(tmp_path):
    """T5's first block computes the relative position bias and the stack passes it to every later
    block. Before, calibrate_layerwise gave block 1 the first block's arguments (no bias) and returned
    states that differ from a full-model calibrate without a word; now it refuses the model."""
    config = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4)
    torch.manual_seed(0)
    transformers.T5EncoderModel(config).save_pretrained(tmp_path)
    loaded = transformers.T5EncoderModel.from_pretrained(str(tmp_path)).eval()
    batch = {"input_ids": torch.randint(0, 64, (2, 8))}
    seen: dict = {}
    blocks = loaded.encoder.block
    hooks = [blocks[0].register_forward_hook(lambda module, args, output: seen.update(bias=output[1])),
             blocks[1].register_forward_pre_hook(lambda module, args: seen.update(given=args[2]))]
    with torch.no_grad():
        loaded(**batch)
    for hook in hooks:
        hook.remove()
    assert seen["given"] is seen["bias"]  # the reference: block 1 runs on block 0's bias
    with torch.device("meta"):
        model = transformers.T5EncoderModel(config).eval()
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("input",), spec=qstats.QuantSpec(dtype="int8"))])
    with pytest.raises(ValueError, match=r"passes encoder\.block\.1 a tensor that encoder\.block\.0 returned"):
        qstats.calibrate_layerwise(model, str(tmp_path), [batch], recipe, progress=False)
    assert all(param.device.type == "meta" for param in model.parameters())
