"""The tensors calibrate_layerwise and the layer-by-layer export read from a checkpoint, against
those of the model transformers' ``from_pretrained`` loads from it.

- Parameters require gradients as ``from_pretrained``'s do: torch's CPU linear runs another kernel
  for a weight that requires none, whose results differ in the last bits (Jamba's Mamba ``x_proj``
  on two threads), so the states would not be the loaded model's bit for bit.
- A model tying ``lm_head`` to the embeddings over a checkpoint holding both with different values
  is refused by the export given ``weights=`` too, as without it (``from_pretrained`` unties them).
- Each tensor of the decoder layers is read from the checkpoint once (the first layer, which the
  checks of the forward run, was read again for its own run).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import qstats

transformers = pytest.importorskip("transformers")
from _shared import left_padded_id_batches, save_sharded, tiny_llama_config  # noqa: E402

SPEC_W = qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0))
RECIPE = qstats.Recipe([qstats.Rule("Linear", sites=("weight", "input"), spec=SPEC_W)])


def _requires_grad_seen(model: torch.nn.Module, run) -> dict:
    """``{path: requires_grad of its weight}`` of every Linear, as its forward sees it during ``run()``."""
    seen: dict = {}

    def keep(module, args) -> None:
        seen.setdefault(paths[module], module.weight.requires_grad)

    paths = {module: path for path, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
    hooks = [module.register_forward_pre_hook(keep) for module in paths]
    try:
        run()
    finally:
        for hook in hooks:
            hook.remove()
    return seen


@pytest.mark.parametrize("requires_grad", [True, False])
def test_layers_run_with_parameters_requiring_grad_as_from_pretrained_loads_them(tmp_path, requires_grad):
    torch.manual_seed(0)
    checkpoint = save_sharded(tmp_path, transformers.AutoModelForCausalLM.from_config(tiny_llama_config()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(tiny_llama_config()).eval()
    loaded.requires_grad_(requires_grad)
    model.requires_grad_(requires_grad)
    want = _requires_grad_seen(loaded, lambda: qstats.calibrate(loaded, left_padded_id_batches(), RECIPE,
                                                                progress=False))
    got = _requires_grad_seen(model, lambda: qstats.calibrate_layerwise(model, checkpoint, left_padded_id_batches(),
                                                                        RECIPE, progress=False))
    assert got == want and set(want.values()) == {requires_grad} and len(want) == 15
    assert all(p.device.type == "meta" and p.requires_grad == requires_grad for p in model.parameters())


@pytest.mark.parametrize("as_folder", [False, True])
def test_the_export_given_weights_refuses_a_tied_model_over_untied_checkpoint_tensors(tmp_path, as_folder):
    torch.manual_seed(0)
    untied = transformers.AutoModelForCausalLM.from_config(tiny_llama_config(tie_word_embeddings=False))
    checkpoint = save_sharded(tmp_path / "float", untied)
    recipe = qstats.Recipe([qstats.Rule("re:model[.]layers[.].*proj", sites=("weight",), spec=SPEC_W)])
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(tiny_llama_config(tie_word_embeddings=True)).eval()
        as_saved = transformers.AutoModelForCausalLM.from_config(tiny_llama_config(tie_word_embeddings=False)).eval()
    states = qstats.calibrate_layerwise(as_saved, checkpoint, left_padded_id_batches()[:1], recipe, progress=False)
    qparams = qstats.compute_qparams_tree(states, recipe, as_saved)  # the layers' qparams: no tie in them
    name = "model.layers.0.mlp.down_proj.weight"
    weights = {name: untied.get_parameter(name).detach().clone()}
    if as_folder:
        from safetensors.torch import save_file

        (tmp_path / "gptq").mkdir()
        save_file(weights, str(tmp_path / "gptq" / "model.safetensors"))
        weights = str(tmp_path / "gptq")
    for given in (None, weights):
        with pytest.raises(ValueError, match="'model.embed_tokens.weight' and 'lm_head.weight'.*different values"):
            qstats.export.compressed_tensors_layerwise(model, checkpoint, qparams, str(tmp_path / "out"), recipe,
                                                       weights=given, progress=False)  # fmt: skip
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    assert all(p.device.type == "meta" for p in model.parameters())


def test_each_layer_tensor_is_read_from_the_checkpoint_once(tmp_path, monkeypatch):
    from qstats._lazy_checkpoint import LazyCheckpoint

    torch.manual_seed(0)
    checkpoint = save_sharded(tmp_path, transformers.AutoModelForCausalLM.from_config(tiny_llama_config()))
    reads: list = []
    read = LazyCheckpoint.tensor
    monkeypatch.setattr(LazyCheckpoint, "tensor", lambda self, key: reads.append(key) or read(self, key))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(tiny_llama_config()).eval()
    qstats.calibrate_layerwise(model, checkpoint, left_padded_id_batches(), RECIPE, progress=False)
    in_layers = [key for key in reads if key.startswith("model.layers.")]
    assert len(in_layers) == len(set(in_layers)) == 2 * 9
    assert all(p.device.type == "meta" for p in model.parameters())
