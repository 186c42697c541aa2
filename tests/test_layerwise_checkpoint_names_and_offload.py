"""qstats.calibrate_layerwise's offloaded batches and how it reads checkpoints, against from_pretrained.

- ``offload_dir``: batches sliced from one tokenized data set are views of its storage, which
  ``torch.save`` writes whole; each offloaded batch must hold its own tensors, not the data set.
  The files are measured while the second layer runs, against the size of the data set.
- A task model's checkpoint (``LlamaForCausalLM``, keys ``model.layers.*``) read into its base
  model (``AutoModel``: ``LlamaModel``, keys ``layers.*``) and a base model's checkpoint read into
  the task model with tied embeddings, as transformers' ``from_pretrained`` adds or strips
  ``base_model_prefix``: the states are those of `qstats.calibrate` on ``from_pretrained``'s model.
"""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

import qstats
from _shared import assert_site_states_equal, left_padded_id_batches, save_sharded, tiny_llama_config

transformers = pytest.importorskip("transformers")

SPEC_W = qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0))
SPEC_A = qstats.QuantSpec(dtype="int8", mapping="asymmetric")
RECIPE = qstats.Recipe([qstats.Rule("Linear", sites=("input",), spec=SPEC_A),
                        qstats.Rule("Linear", sites=("weight",), spec=SPEC_W)])  # fmt: skip


def _weight(batch):
    return batch["attention_mask"]


def test_offloaded_batches_sliced_from_one_data_set_do_not_hold_all_of_it(tmp_path):
    torch.manual_seed(0)
    checkpoint = save_sharded(tmp_path / "checkpoint", transformers.AutoModelForCausalLM.from_config(tiny_llama_config()))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(tiny_llama_config()).eval()
    data = torch.randint(0, 96, (4096, 16), generator=torch.Generator().manual_seed(1))  # 512 KiB of tokens
    mask = torch.ones_like(data)
    batches = [{"input_ids": data[start : start + 2], "attention_mask": mask[start : start + 2]}
               for start in range(0, 8, 2)]  # fmt: skip
    spill = tmp_path / "spill"
    spill.mkdir()
    held: list = []

    def measure(module, args, kwargs):  # every batch's inputs of layer 1 are on disk by now
        held.append(sum(entry.stat().st_size for folder in spill.iterdir() for entry in os.scandir(folder)))

    with model.model.layers[1].register_forward_pre_hook(measure, with_kwargs=True):
        offloaded = qstats.calibrate_layerwise(model, checkpoint, batches, RECIPE, progress=False,
                                               offload_dir=spill, observation_weight=_weight)  # fmt: skip
    assert held and max(held) < data.nbytes  # the old files held both data tensors per batch: 4 MiB
    in_memory = qstats.calibrate_layerwise(model, checkpoint, batches, RECIPE, progress=False,
                                           observation_weight=_weight)  # fmt: skip
    assert_site_states_equal(offloaded, in_memory)


@pytest.mark.parametrize("direction", ["task checkpoint into base model", "base checkpoint into task model"])
def test_a_checkpoint_reads_into_the_base_or_task_model_as_from_pretrained(tmp_path, direction):
    torch.manual_seed(0)
    config = tiny_llama_config(tie_word_embeddings=True)
    task = transformers.AutoModelForCausalLM.from_config(config)
    into_base = direction == "task checkpoint into base model"
    checkpoint = save_sharded(tmp_path / "checkpoint", task if into_base else task.model)
    auto = transformers.AutoModel if into_base else transformers.AutoModelForCausalLM
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = auto.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.device("meta"):
        model = auto.from_config(config).eval()
    batches = left_padded_id_batches()
    want = qstats.calibrate(loaded, batches, RECIPE, progress=False, observation_weight=_weight)
    got = qstats.calibrate_layerwise(model, checkpoint, batches, RECIPE, progress=False, observation_weight=_weight)
    assert_site_states_equal(got, want)
    assert ("lm_head" in got) != into_base


def test_checkpoint_tensors_the_model_does_not_read_are_named_as_from_pretrained_reports_them(tmp_path):
    """A model built from a config of fewer layers than the checkpoint's calibrates part of it: a
    warning names the checkpoint's tensors of the layer left out (per expert, as stored), which
    ``from_pretrained`` reports unexpected too."""
    shape = dict(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    checkpoint = save_sharded(tmp_path, transformers.AutoModelForCausalLM.from_config(transformers.Qwen3MoeConfig(**shape)))
    smaller = transformers.Qwen3MoeConfig(**{**shape, "num_hidden_layers": 2})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, info = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, config=smaller, output_loading_info=True)
    assert info["unexpected_keys"] and all(key.startswith("model.layers.2.") for key in info["unexpected_keys"])
    with open(os.path.join(checkpoint, "model.safetensors.index.json")) as file:
        left_out = {key for key in json.load(file)["weight_map"] if key.startswith("model.layers.2.")}
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(smaller).eval()
    with pytest.warns(UserWarning, match=f"holds {len(left_out)} tensor\\(s\\) the model has no tensor for") as caught:
        qstats.calibrate_layerwise(model, checkpoint, left_padded_id_batches(), RECIPE, progress=False)
    message = next(str(w.message) for w in caught if "has no tensor for" in str(w.message))
    named = message.split("not read: ")[1].split(" (")[0].removesuffix(" ...").split(", ")
    assert len(named) == 3 and set(named) <= left_out


@pytest.mark.parametrize("same", [True, False])
def test_a_checkpoint_holding_both_tied_tensors_reads_as_from_pretrained_ties_them(tmp_path, same):
    """A config tying ``lm_head`` to the embeddings over a checkpoint holding both: ``from_pretrained``
    ties them when their values are equal, and unties them (its model has another head) when not;
    the tied model built on meta then cannot hold that head, and the error says so."""
    torch.manual_seed(0)
    untied = transformers.AutoModelForCausalLM.from_config(tiny_llama_config(tie_word_embeddings=False))
    if same:
        untied.lm_head.weight.data.copy_(untied.model.embed_tokens.weight.data)
    checkpoint = save_sharded(tmp_path, untied)
    tied = tiny_llama_config(tie_word_embeddings=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, config=tied, dtype=torch.float32).eval()
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == same
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(tied).eval()
    if not same:
        with pytest.raises(ValueError, match="'model.embed_tokens.weight' and 'lm_head.weight'.*different values"):
            qstats.calibrate_layerwise(model, checkpoint, left_padded_id_batches(), RECIPE, progress=False)
        assert all(p.device.type == "meta" for p in model.parameters())
        return
    want = qstats.calibrate(loaded, left_padded_id_batches(), RECIPE, progress=False)
    assert_site_states_equal(qstats.calibrate_layerwise(model, checkpoint, left_padded_id_batches(), RECIPE, progress=False), want)
