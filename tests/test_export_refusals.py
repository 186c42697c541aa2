"""Models `qstats.export.compressed_tensors` refuses up front, naming the problem and the way out:
an FSDP2-sharded model (its tensors DTensors, a shard on each rank; the export failed deep in the
weight's quantization with "aten.mul.Tensor got mixed torch.Tensor and DTensor"), and q/k/v sites of
a transformers model whose decoder config compressed-tensors cannot read the attention heads from
(OPT: no ``num_key_value_heads``; the checkpoint was written, and failed to load). Which configs fail
is asked of compressed-tensors' own ``get_num_attn_heads``/``get_num_kv_heads``/``get_head_dim``."""

from __future__ import annotations

import os
import sys
import traceback
import warnings
from datetime import timedelta

import pytest
import torch

import qstats
from _shared import exit_rank, fork_ranks, gloo_group, tiny_llama_config

W8 = qstats.Recipe([
    qstats.Rule("Linear", sites=("weight",), observer=qstats.minmax,
                spec=qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0))),
])


def _tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).eval()


def _export_sharded(rank: int, port: int, out: str) -> None:
    """One gloo rank: exports a ``fully_shard``-ed model (its error into ``out/error.txt``), then the
    full state dict gathered as docs/distributed.md says, loaded into the model unwrapped."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    try:
        with gloo_group(rank, port, world=1, timeout=timedelta(seconds=60)):
            model = _tiny_model()
            qparams = qstats.compute_qparams_tree(qstats.calibrate(model, [], W8, progress=False), W8, model)
            fully_shard(model)
            assert qstats._ops.is_dtensor(model[0].weight)
            try:
                qstats.export.compressed_tensors(model, qparams, os.path.join(out, "sharded"), W8)
            except ValueError as error:
                with open(os.path.join(out, "error.txt"), "w") as file:
                    file.write(str(error))
            full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            unwrapped = _tiny_model()
            unwrapped.load_state_dict(full)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                qstats.export.compressed_tensors(unwrapped, qparams, os.path.join(out, "gathered"), W8)
    except BaseException:
        traceback.print_exc()
        exit_rank(1)
    exit_rank(0)


def test_an_fsdp2_sharded_model_is_refused_naming_the_gathered_state_dict(tmp_path):
    pytest.importorskip("torch.distributed.fsdp")
    if not hasattr(torch.distributed.fsdp, "fully_shard"):
        pytest.skip("this torch has no torch.distributed.fsdp.fully_shard (FSDP2)")
    assert fork_ranks(_export_sharded, str(tmp_path), world=1) == [0]
    message = (tmp_path / "error.txt").read_text()
    for part in ("DTensor", "0.weight", "2.weight", "get_model_state_dict", "full_state_dict=True", "unwrapped"):
        assert part in message, (part, message)
    assert not (tmp_path / "sharded").exists() or not os.listdir(tmp_path / "sharded")  # nothing written
    # the route the message gives exports what the unwrapped model exports
    model = _tiny_model()
    qparams = qstats.compute_qparams_tree(qstats.calibrate(model, [], W8, progress=False), W8, model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qstats.export.compressed_tensors(model, qparams, str(tmp_path / "unwrapped"), W8)
    from safetensors.torch import load_file

    gathered = load_file(str(tmp_path / "gathered" / "model.safetensors"))
    alone = load_file(str(tmp_path / "unwrapped" / "model.safetensors"))
    assert gathered.keys() == alone.keys() and all(torch.equal(gathered[k], alone[k]) for k in alone)


def _opt():
    import transformers

    return transformers.OPTForCausalLM(transformers.OPTConfig(
        vocab_size=64, hidden_size=32, word_embed_proj_dim=32, ffn_dim=64, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=64))


def _llama():
    import transformers

    return transformers.LlamaForCausalLM(tiny_llama_config())


def _compressed_tensors_reads_heads(model) -> bool:
    """Whether compressed-tensors' ``initialize_attn_qparams`` can read the attention's head counts and size
    from the config ``initialize_hooked_kv_cache`` gives it."""
    from compressed_tensors.utils import get_head_dim, get_num_attn_heads, get_num_kv_heads

    config = model.config.get_text_config(decoder=True)
    try:
        for read in (get_num_attn_heads, get_num_kv_heads, get_head_dim):
            read(config)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("build, attention", [(_opt, "OPTAttention"), (_llama, "LlamaAttention")])
@pytest.mark.parametrize("sites", [("k", "v"), ("q", "k", "v")])
def test_kv_cache_of_a_config_without_head_counts_is_refused(tmp_path, build, attention, sites):
    pytest.importorskip("transformers")
    pytest.importorskip("compressed_tensors")
    torch.manual_seed(0)
    model = build().eval()
    recipe = qstats.Recipe([qstats.Rule(attention, sites=sites, observer=qstats.minmax,
                                        spec=qstats.QuantSpec(dtype="int8"))])
    batches = [{"input_ids": torch.randint(1, 64, (1, 9), generator=torch.Generator().manual_seed(1))}]
    states = qstats.calibrate(model, batches, recipe, progress=False)
    assert any(set(sites) <= set(found) for found in states.values())  # the sites were calibrated
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    loads = _compressed_tensors_reads_heads(model)
    assert loads == (build is _llama)  # the reference: OPT's config has no num_key_value_heads
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if loads:
            config = qstats.export.compressed_tensors(model, qparams, str(tmp_path), recipe)
            assert config["kv_cache_scheme"] is not None
            return
        with pytest.raises(ValueError) as raised:
            qstats.export.compressed_tensors(model, qparams, str(tmp_path), recipe)
    message = str(raised.value)
    for part in ("kv_cache_scheme", "OPTForCausalLM", "OPTConfig", "'opt'", "get_num_kv_heads",
                 "num_key_value_heads", "drop the q/k/v sites"):
        assert part in message, (part, message)
    assert len(message) < 800  # the config itself is not dumped into it
    assert not os.listdir(tmp_path)  # nothing written


def test_kv_cache_exports_without_compressed_tensors_installed(tmp_path, monkeypatch):
    """compressed-tensors is an optional dependency: without it the head-count check has no loader to
    ask, and a Llama's k/v sites export as before (kv_cache_scheme written)."""
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = _llama().eval()
    recipe = qstats.Recipe([qstats.Rule("LlamaAttention", sites=("k", "v"), observer=qstats.minmax,
                                        spec=qstats.QuantSpec(dtype="int8"))])
    batches = [{"input_ids": torch.randint(1, 64, (1, 9), generator=torch.Generator().manual_seed(1))}]
    qparams = qstats.compute_qparams_tree(qstats.calibrate(model, batches, recipe, progress=False), recipe, model)
    for name in ("compressed_tensors", "compressed_tensors.utils"):
        monkeypatch.setitem(sys.modules, name, None)  # importing it raises ImportError
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = qstats.export.compressed_tensors(model, qparams, str(tmp_path), recipe)
    assert config["kv_cache_scheme"] is not None
