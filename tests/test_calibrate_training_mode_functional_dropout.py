"""torch's ``nn.MultiheadAttention`` drops attention weights out in training mode through its
``dropout`` float (no ``nn.Dropout`` child), as multi-layer ``RNN``/``LSTM``/``GRU`` do between their
layers, stochastic-depth modules drop residual branches through ``drop_prob`` and BART-family layers
drop out through ``dropout``/``activation_dropout`` floats: calibrating them
in training mode warns, naming them, as for dropout modules, and in eval mode or without dropout it
does not. (The recipes observe
``head`` only: the attention's functional forward reads ``out_proj``'s weights without calling it.)"""

from __future__ import annotations

import warnings

import pytest
import torch

import qstats


def _calibrates_without_warning(model, batches, recipe) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        qstats.calibrate(model, batches, recipe, progress=False)


def _warns_in_training_mode_only(model, batches, recipe, match: str) -> None:
    """calibrate warns (``match``) with the model in training mode, and not once it is in eval mode."""
    with pytest.warns(UserWarning, match=match):
        qstats.calibrate(model, batches, recipe, progress=False)
    model.eval()
    _calibrates_without_warning(model, batches, recipe)


class SelfAttention(torch.nn.Module):
    def __init__(self, dropout: float):
        super().__init__()
        self.attention = torch.nn.MultiheadAttention(16, 2, dropout=dropout, batch_first=True)
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.attention(x, x, x, need_weights=False)[0])


def test_multihead_attention_dropout_in_training_mode_warns():
    torch.manual_seed(0)
    model = SelfAttention(dropout=0.5)
    assert not any(isinstance(m, torch.nn.Dropout) for m in model.modules())
    x = torch.randn(2, 5, 16)
    with torch.no_grad():  # training mode is random in torch itself: the warning is due
        assert not torch.equal(model(x), model(x))
    recipe = qstats.Recipe([qstats.Rule("head", sites=("input",))])
    _warns_in_training_mode_only(model, [x], recipe, r"module 'attention' \(MultiheadAttention\) is in training mode")


def test_multihead_attention_without_dropout_does_not_warn():
    torch.manual_seed(0)
    model = SelfAttention(dropout=0.0)  # training mode: the same outputs as in eval mode
    x = torch.randn(2, 5, 16)
    with torch.no_grad():  # (eval mode runs torch's fused fast path: equal to the last bits)
        torch.testing.assert_close(model(x), model.eval()(x))
    model.train()
    _calibrates_without_warning(model, [x], qstats.Recipe([qstats.Rule("head", sites=("input",))]))


class Recurrent(torch.nn.Module):
    def __init__(self, kind, num_layers: int):
        super().__init__()
        self.rnn = kind(16, 16, num_layers=num_layers, dropout=0.5, batch_first=True)
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.rnn(x)[0])


@pytest.mark.parametrize("kind", [torch.nn.RNN, torch.nn.LSTM, torch.nn.GRU])
def test_recurrent_dropout_between_layers_in_training_mode_warns(kind):
    torch.manual_seed(0)
    model = Recurrent(kind, num_layers=2)
    x = torch.randn(2, 5, 16)
    with torch.no_grad():  # dropout between the layers in training mode, in torch itself
        assert not torch.equal(model(x), model(x))
    recipe = qstats.Recipe([qstats.Rule("head", sites=("input",))])
    with pytest.warns(UserWarning, match=rf"module 'rnn' \({kind.__name__}\) is in training mode"):
        qstats.calibrate(model, [x], recipe, progress=False)

    with warnings.catch_warnings():  # one layer: torch applies no dropout (and warns itself at construction)
        warnings.simplefilter("ignore")
        single = Recurrent(kind, num_layers=1)
    with torch.no_grad():
        assert torch.equal(single(x), single(x))
    _calibrates_without_warning(single, [x], recipe)


def test_stochastic_depth_in_training_mode_warns():
    """transformers' DropPath modules (ConvNeXt, Swin, BEiT, ...) drop residual branches per sample
    while training with probability ``drop_prob``: a model built from a config is in training mode."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.ConvNextConfig(num_channels=3, patch_size=2, num_stages=2, hidden_sizes=[8, 16], depths=[1, 1],
                                         image_size=8, drop_path_rate=0.5)
    model = transformers.ConvNextModel(config)
    assert model.training and not any(isinstance(m, torch.nn.Dropout) for m in model.modules())
    pixels = torch.randn(4, 3, 8, 8)
    with torch.no_grad():  # random in training mode, in transformers itself
        assert not torch.equal(model(pixels).last_hidden_state, model(pixels).last_hidden_state)
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("input",))])
    _warns_in_training_mode_only(model, [pixels], recipe, r"\(ConvNextDropPath\) is in training mode")


def test_functional_dropout_and_layerdrop_of_bart_in_training_mode_warn():
    """BART's layers (as Whisper's, Marian's, mBART's) drop out through float attributes
    (``dropout``, ``activation_dropout``) and skip whole layers (``layerdrop``) while training, with
    no ``nn.Dropout`` module: a model built from a config is in training mode."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BartConfig(vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1,
                                     encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                                     decoder_ffn_dim=32, max_position_embeddings=32, dropout=0.3)
    model = transformers.BartModel(config)
    assert model.training and not any(isinstance(m, torch.nn.Dropout) for m in model.modules())
    ids = torch.randint(3, 64, (2, 6))
    with torch.no_grad():  # random in training mode, in transformers itself
        assert not torch.equal(model(input_ids=ids).last_hidden_state, model(input_ids=ids).last_hidden_state)
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("input",))])
    _warns_in_training_mode_only(model, [ids], recipe, r"module 'encoder' \(BartEncoder\) is in training mode")
