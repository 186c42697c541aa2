"""qstats' attention functions, registered in transformers' ``AttentionInterface`` once, when this
module is imported (`qstats._attention` imports it on meeting a transformers attention module).

``"qstats:<name>"`` runs the hooks its attention module's call hands it by keyword
(`SITES_KEYWORD`: a tuple of ``hook(query, key, value) -> (query, key, value)``) on the
query, key and value, then the implementation ``<name>`` the model was using; its attention mask
is ``<name>``'s. compressed-tensors' ``ct_hooked_attention`` reads and quantizes the same tensors.
"""

from __future__ import annotations

import inspect

from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

__all__ = ["PREFIX", "SITES_KEYWORD", "WRAPPED"]

PREFIX = "qstats:"
SITES_KEYWORD = "qstats_attention_sites"
# the implementations run behind a qstats counterpart: the flash kernels read the implementation's
# name from the config (``module.config._attn_implementation``), which names the counterpart then
WRAPPED = ("eager", "sdpa")


def _original(module, name: str):
    """The attention function ``module`` calls under ``name``: the registered one, or for
    ``"eager"`` the model's own (`_eager`), which ``AttentionInterface`` does not hold."""
    if name != "eager":
        return ALL_ATTENTION_FUNCTIONS[name]
    found = _eager(module)
    if found is None:
        raise ValueError(f"qstats: the attention module {type(module).__name__} runs eager attention, but its "
                         "modeling file defines no eager_attention_forward to run behind qstats' hooks")
    return found


def _eager(module):
    """The eager attention function ``module``'s forward passes ``get_interface`` as its default: the
    ``*eager_attention_forward`` of its modeling file that the forward names (Llama 4's vision
    attention names ``vision_eager_attention_forward``, Phi-4-multimodal's ``simple_eager_attention_forward``),
    else the file's ``eager_attention_forward``; None where there is none. Read under any decorator of
    forward (``@deprecate_kwarg``)."""
    forward = inspect.unwrap(type(module).forward)
    functions = getattr(forward, "__globals__", {})
    names = [name for name in getattr(getattr(forward, "__code__", None), "co_names", ())
             if name.endswith("eager_attention_forward") and callable(functions.get(name))]
    return functions.get(names[0] if len(names) == 1 else "eager_attention_forward")


def _attention_function(name: str):
    def attention(module, query, key, value, *args, **kwargs):
        for hook in kwargs.pop(SITES_KEYWORD, ()):
            query, key, value = hook(query, key, value)
        return _original(module, name)(module, query, key, value, *args, **kwargs)

    attention.__name__ = attention.__qualname__ = f"qstats_{name}_attention"
    return attention


for _name in WRAPPED:
    AttentionInterface.register(PREFIX + _name, _attention_function(_name))
    AttentionMaskInterface.register(PREFIX + _name, ALL_MASK_ATTENTION_FUNCTIONS[_name])
