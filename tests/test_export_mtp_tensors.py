"""Multi-token-prediction tensors (``mtp.*``, Qwen3-Next/Qwen3.5 speculative decoding) that transformers
does not load are carried into the export as llm-compressor 0.14's save carries them: copied as they
are into ``model_mtp.safetensors``, added to the index, ``re:^mtp.*`` ignored in the quantization
config. Compared with `oneshot`'s saved folder, in memory and layer by layer."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

import qstats
from _shared import llm_compressor_oneshot, load_causal_lm

transformers = pytest.importorskip("transformers")
pytest.importorskip("llmcompressor")
safetensors_torch = pytest.importorskip("safetensors.torch")

VOCAB = 64
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
          "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": VOCAB,
          "tie_word_embeddings": False, "torch_dtype": "bfloat16"}  # fmt: skip


def _json(folder, name) -> dict:
    with open(os.path.join(folder, name)) as file:
        return json.load(file)


def _base(folder, mtp_layers: int = 1, mtp_tensors: bool = True) -> str:
    """Random weights saved by transformers, with MTP tensors beside them in the one file."""
    os.makedirs(folder)
    with open(os.path.join(folder, "config.json"), "w") as file:
        json.dump({**CONFIG, "mtp_num_hidden_layers": mtp_layers}, file)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.LlamaForCausalLM(transformers.AutoConfig.from_pretrained(folder))
    tensors = {name: tensor.to(torch.bfloat16).clone() for name, tensor in model.state_dict().items()}
    if mtp_tensors:
        tensors["mtp.fc.weight"] = torch.randn(32, 64).to(torch.bfloat16)
        tensors["mtp.layers.0.mlp.up_proj.weight"] = torch.randn(64, 32).to(torch.bfloat16)
        tensors["mtp.norm.weight"] = torch.ones(32, dtype=torch.bfloat16)
    safetensors_torch.save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    return str(folder)


def _shard(folder) -> dict:
    return safetensors_torch.load_file(os.path.join(folder, "model_mtp.safetensors"))


def _export_both(base, tmp_path, recipe, samples) -> None:
    model = load_causal_lm(base)
    states = qstats.calibrate(model, [{"input_ids": s[None]} for s in samples], recipe, progress=False)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    qstats.export.compressed_tensors(model, qparams, str(tmp_path / "ours"), recipe)
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(base),
                                                             dtype=torch.bfloat16)  # fmt: skip
    qstats.export.compressed_tensors_layerwise(meta, base, qparams, str(tmp_path / "layerwise"), recipe, progress=False)


def test_mtp_tensors_are_carried_as_llm_compressor_saves_them(tmp_path):
    from llmcompressor.modifiers.quantization import QuantizationModifier

    base = _base(tmp_path / "base")
    samples = [torch.randint(1, VOCAB, (8,), generator=torch.Generator().manual_seed(1))]
    modifier = QuantizationModifier(scheme="FP8_DYNAMIC", targets=["Linear"], ignore=["lm_head"])
    llm_compressor_oneshot(load_causal_lm(base), samples, modifier, tmp_path / "theirs")
    theirs = tmp_path / "theirs"
    assert "re:^mtp.*" in _json(theirs, "config.json")["quantization_config"]["ignore"]

    recipe = qstats.Recipe.from_scheme("FP8_DYNAMIC", ignore=["lm_head"], observed_dtype=torch.bfloat16)
    _export_both(base, tmp_path, recipe, samples)
    for folder in (tmp_path / "ours", tmp_path / "layerwise"):
        assert _json(folder, "config.json") == _json(theirs, "config.json"), folder
        index = _json(folder, "model.safetensors.index.json")
        reference = _json(theirs, "model.safetensors.index.json")["weight_map"]
        assert index["weight_map"].keys() == reference.keys(), folder  # layer by layer: shards of its own
        assert {name: file for name, file in index["weight_map"].items() if name.startswith("mtp.")} == \
            {name: file for name, file in reference.items() if name.startswith("mtp.")} != {}
        if folder.name == "ours":
            assert index["weight_map"] == reference
        # as llm-compressor counts it: the files' sizes (headers included; theirs name other metadata)
        files = set(index["weight_map"].values())
        assert index["metadata"]["total_size"] == sum(os.path.getsize(folder / file) for file in files)
        ours, reference = _shard(folder), _shard(theirs)
        assert ours.keys() == reference.keys()
        assert all(torch.equal(ours[name], reference[name]) and ours[name].dtype == reference[name].dtype
                   for name in ours)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loaded = transformers.AutoModelForCausalLM.from_pretrained(str(folder))
        assert loaded.model.layers[0].mlp.up_proj.weight.dtype == torch.float8_e4m3fn


def test_a_model_declaring_mtp_layers_without_mtp_tensors_is_warned_of(tmp_path):
    base = _base(tmp_path / "base", mtp_tensors=False)
    recipe = qstats.Recipe.from_scheme("FP8_DYNAMIC", ignore=["lm_head"])
    model = load_causal_lm(base)
    samples = [torch.randint(1, VOCAB, (8,))]
    qparams = qstats.compute_qparams_tree(
        qstats.calibrate(model, [{"input_ids": s[None]} for s in samples], recipe, progress=False), recipe, model)
    with pytest.warns(UserWarning, match="declares MTP layers but .* holds no 'mtp"):
        qstats.export.compressed_tensors(model, qparams, str(tmp_path / "ours"), recipe)
    assert not os.path.exists(tmp_path / "ours" / "model_mtp.safetensors")
    assert "re:^mtp.*" not in _json(tmp_path / "ours", "config.json")["quantization_config"]["ignore"]


def test_a_model_declaring_no_mtp_layers_writes_no_mtp_shard(tmp_path):
    base = _base(tmp_path / "base", mtp_layers=0)
    recipe = qstats.Recipe.from_scheme("FP8_DYNAMIC", ignore=["lm_head"])
    model = load_causal_lm(base)
    samples = [torch.randint(1, VOCAB, (8,))]
    qparams = qstats.compute_qparams_tree(
        qstats.calibrate(model, [{"input_ids": s[None]} for s in samples], recipe, progress=False), recipe, model)
    qstats.export.compressed_tensors(model, qparams, str(tmp_path / "ours"), recipe)
    assert sorted(os.listdir(tmp_path / "ours")) == ["config.json", "generation_config.json", "model.safetensors"]


@pytest.mark.parametrize("layerwise", [False, True])
def test_a_failed_export_leaves_no_safetensors_file_and_the_folder_takes_the_next_export(tmp_path, monkeypatch,
                                                                                        layerwise):
    from qstats.export import checkpoint

    base = _base(tmp_path / "base")
    recipe = qstats.Recipe.from_scheme("FP8_DYNAMIC", ignore=["lm_head"], observed_dtype=torch.bfloat16)
    model = load_causal_lm(base)
    samples = [torch.randint(1, VOCAB, (8,))]
    qparams = qstats.compute_qparams_tree(
        qstats.calibrate(model, [{"input_ids": s[None]} for s in samples], recipe, progress=False), recipe, model)
    path = str(tmp_path / "ours")

    def export():
        if not layerwise:
            return qstats.export.compressed_tensors(model, qparams, path, recipe)
        with torch.device("meta"):
            meta = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(base),
                                                                 dtype=torch.bfloat16)  # fmt: skip
        return qstats.export.compressed_tensors_layerwise(meta, base, qparams, path, recipe, progress=False)

    def interrupted(*args, **kwargs):  # the last step of write_config, after the MTP shard is written
        raise KeyboardInterrupt

    with monkeypatch.context() as patched:
        patched.setattr(checkpoint, "write_generation_config", interrupted)
        with pytest.raises(KeyboardInterrupt):
            export()
    left = sorted(os.listdir(path)) if os.path.isdir(path) else []
    assert not [name for name in left if name.endswith((".safetensors", ".safetensors.index.json"))], left
    export()
    assert _shard(path).keys() == {"mtp.fc.weight", "mtp.layers.0.mlp.up_proj.weight", "mtp.norm.weight"}


def test_a_model_declaring_mtp_layers_whose_folder_is_not_found_is_warned_of(tmp_path):
    base = _base(tmp_path / "base")
    recipe = qstats.Recipe.from_scheme("FP8_DYNAMIC", ignore=["lm_head"])
    model = load_causal_lm(base)
    samples = [torch.randint(1, VOCAB, (8,))]
    qparams = qstats.compute_qparams_tree(
        qstats.calibrate(model, [{"input_ids": s[None]} for s in samples], recipe, progress=False), recipe, model)
    os.replace(base, tmp_path / "moved")  # no folder, and no Hub model of that name in the cache
    with pytest.warns(UserWarning, match="declares MTP layers but the folder it was read from"):
        qstats.export.compressed_tensors(model, qparams, str(tmp_path / "ours"), recipe)
    assert not os.path.exists(tmp_path / "ours" / "model_mtp.safetensors")


def test_mtp_tensors_of_a_folder_laid_out_as_an_export_are_carried_as_compressed_tensors_reads_them(tmp_path):
    """A source folder as llm-compressor's save (and this export) writes one: ``model.safetensors``
    without the MTP tensors, ``model_mtp.safetensors`` with them and the index naming both. Reference:
    the tensors compressed-tensors' MTP copy reads from it (``_fetch_and_save_prefix_tensors``)."""
    from compressed_tensors.utils.safetensors_load import _fetch_and_save_prefix_tensors

    base = _base(tmp_path / "base")
    tensors = safetensors_torch.load_file(os.path.join(base, "model.safetensors"))
    mtp = {name: tensor for name, tensor in tensors.items() if name.startswith("mtp.")}
    rest = {name: tensor for name, tensor in tensors.items() if name not in mtp}
    safetensors_torch.save_file(rest, os.path.join(base, "model.safetensors"), metadata={"format": "pt"})
    safetensors_torch.save_file(mtp, os.path.join(base, "model_mtp.safetensors"), metadata={"format": "pt"})
    weight_map = {**dict.fromkeys(rest, "model.safetensors"), **dict.fromkeys(mtp, "model_mtp.safetensors")}
    with open(os.path.join(base, "model.safetensors.index.json"), "w") as file:
        json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, file)
    os.makedirs(tmp_path / "reference")
    want = _fetch_and_save_prefix_tensors(base, "mtp", str(tmp_path / "reference"), "model_mtp.safetensors")
    assert want.keys() == mtp.keys()

    recipe = qstats.Recipe.from_scheme("FP8_DYNAMIC", ignore=["lm_head"], observed_dtype=torch.bfloat16)
    samples = [torch.randint(1, VOCAB, (8,), generator=torch.Generator().manual_seed(1))]
    _export_both(base, tmp_path, recipe, samples)
    for folder in (tmp_path / "ours", tmp_path / "layerwise"):
        got = _shard(folder)
        assert got.keys() == want.keys(), folder
        assert all(torch.equal(got[name], want[name]) for name in want), folder
        assert "re:^mtp.*" in _json(folder, "config.json")["quantization_config"]["ignore"]


def test_layerwise_export_of_a_config_built_in_memory_carries_the_checkpoints_mtp_tensors(tmp_path):
    """`compressed_tensors_layerwise` of a meta model whose config names no folder (built in memory, as
    docs/layerwise.md builds it) writes what llm-compressor's save of the model loaded from that
    checkpoint writes: the MTP tensors and the checkpoint's config.json (it warned that the folder was
    not found and wrote neither: no ``model_mtp.safetensors``, transformers' own serialization of the
    config). The config's ``_name_or_path`` is left as it was."""
    from llmcompressor.modifiers.quantization import QuantizationModifier

    base = _base(tmp_path / "base")
    samples = [torch.randint(1, VOCAB, (8,), generator=torch.Generator().manual_seed(1))]
    modifier = QuantizationModifier(scheme="FP8_DYNAMIC", targets=["Linear"], ignore=["lm_head"])
    llm_compressor_oneshot(load_causal_lm(base), samples, modifier, tmp_path / "theirs")
    theirs = tmp_path / "theirs"

    recipe = qstats.Recipe.from_scheme("FP8_DYNAMIC", ignore=["lm_head"], observed_dtype=torch.bfloat16)
    model = load_causal_lm(base)
    states = qstats.calibrate(model, [{"input_ids": s[None]} for s in samples], recipe, progress=False)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    config = transformers.LlamaConfig.from_dict(_json(base, "config.json"))
    assert config._name_or_path == ""
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    folder = tmp_path / "layerwise"
    with warnings.catch_warnings():
        warnings.simplefilter("error", qstats.export.ExportWarning)
        qstats.export.compressed_tensors_layerwise(meta, base, qparams, str(folder), recipe, progress=False)
    assert meta.config._name_or_path == ""
    assert _json(folder, "config.json") == _json(theirs, "config.json")
    ours, reference = _shard(folder), _shard(theirs)
    assert ours.keys() == reference.keys() != set()
    assert all(torch.equal(ours[name], reference[name]) and ours[name].dtype == reference[name].dtype for name in ours)


@pytest.mark.parametrize("mtp_layers", [1, 0])
def test_layerwise_export_warns_of_the_checkpoints_mtp_tensors_only_where_it_does_not_copy_them(tmp_path, mtp_layers):
    """The checkpoint's ``mtp.*`` tensors, which the model has no tensor for, are warned of as not read
    only where the export leaves them out (a config declaring no MTP layers: llm-compressor's save
    writes none, and from_pretrained reports them unexpected); where it copies them, as llm-compressor's
    save of the loaded model does, nothing is said (it warned they were 'not read (a model built from
    another config...?)'). Reference: the MTP shard of the export, equal to the checkpoint's tensors."""
    base = _base(tmp_path / "base", mtp_layers=mtp_layers)
    recipe = qstats.Recipe.from_scheme("FP8_DYNAMIC", ignore=["lm_head"])
    model = load_causal_lm(base)
    samples = [torch.randint(1, VOCAB, (8,), generator=torch.Generator().manual_seed(1))]
    qparams = qstats.compute_qparams_tree(
        qstats.calibrate(model, [{"input_ids": s[None]} for s in samples], recipe, progress=False), recipe, model)
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(base),
                                                             dtype=torch.bfloat16)  # fmt: skip
    folder = tmp_path / "layerwise"
    ignored = getattr(meta, "_keys_to_ignore_on_load_unexpected", None)
    ignored = ignored if ignored is None else type(ignored)(ignored)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qstats.export.compressed_tensors_layerwise(meta, base, qparams, str(folder), recipe, progress=False)
    unused = [str(w.message) for w in caught if "not read" in str(w.message)]
    checkpoint = safetensors_torch.load_file(os.path.join(base, "model.safetensors"))
    mtp = {name: tensor for name, tensor in checkpoint.items() if name.startswith("mtp.")}
    if mtp_layers:
        assert unused == []
        copied = _shard(folder)
        assert copied.keys() == mtp.keys() and all(torch.equal(copied[name], mtp[name]) for name in mtp)
    else:
        assert not os.path.exists(folder / "model_mtp.safetensors")
        assert len(unused) == 1 and "holds 3 tensor(s)" in unused[0] and "mtp.fc.weight" in unused[0]
    assert getattr(meta, "_keys_to_ignore_on_load_unexpected", None) == ignored  # left as it was
