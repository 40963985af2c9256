"""Models as trainers hand them over: gradient checkpointing, PEFT LoRA, torch.compile, train and eval mode.

Each case compares the tree path's logprobs and parameter gradients (both
twins) with the same model run on each rollout alone, in float32 (Hugging
Face models compute RMSNorm in float32 anyway), on a batch with a shared
prompt, a branch point, a rollout that is a prefix of another and a second root.
"""

from __future__ import annotations

import copy
import dataclasses
import functools

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import dta_fast
import dta_ref
from dta_ref import PrefixTree
from tests.helpers import HF_FAMILIES, tiny_decoder, tiny_hf_model

pytestmark = pytest.mark.kernel
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

SEQUENCES = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8], [1, 2, 3, 7], [1, 2, 9, 10, 11, 12, 13], [4, 5, 6]]
TREE = PrefixTree.from_sequences(SEQUENCES)
TWINS = {"ref": dta_ref.tree_logprobs, "fast": dta_fast.tree_logprobs}


def loss_of(logprobs):
    weights = torch.randn(logprobs.shape, generator=torch.Generator().manual_seed(0))
    return (logprobs * weights.to(logprobs) * TREE.logprob_mask.to(logprobs.device)).sum()


def grads_by_backward(model, logprobs_fn):
    """Logprobs and d loss / d trainable parameter through ``loss.backward()``.

    ``backward()`` rather than ``autograd.grad``: reentrant checkpointing supports only the former.
    """
    model.zero_grad(set_to_none=True)
    logprobs = logprobs_fn()
    loss_of(logprobs).backward()
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters() if p.requires_grad]
    return logprobs.detach(), torch.cat([g.reshape(-1) for g in grads])


def assert_matches_each_rollout_alone(model, truth_model=None, twins=TWINS):
    """Both twins' logprobs and gradients equal the per-sequence run of ``truth_model`` (default: ``model``)."""
    truth_model = model if truth_model is None else truth_model
    want_lp, want = grads_by_backward(truth_model, lambda: dta_ref.flat_logprobs(truth_model, SEQUENCES))
    assert want.norm() > 0
    for name, fn in twins.items():
        lp, got = grads_by_backward(model, lambda fn=fn: fn(model, TREE))
        torch.testing.assert_close(lp, want_lp, rtol=1e-5, atol=1e-5, msg=f"{name}: logprobs")
        err = float((got - want).norm() / want.norm())
        assert err < 1e-5, f"{name}: parameter gradients {err:.2e} (relative) away from each rollout alone"


def checkpointing(model, reentrant: bool):
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    if reentrant:  # reentrant checkpointing needs an input that requires grad, as trainers arrange
        model.enable_input_require_grads()
    return model.train()


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("family", HF_FAMILIES)
def test_hf_gradient_checkpointing(family, impl, reentrant):
    model = tiny_hf_model(family, torch.float32, impl, seed=3).to(DEVICE)
    truth = copy.deepcopy(model).train()
    assert_matches_each_rollout_alone(checkpointing(model, reentrant), truth)
    assert model.config._attn_implementation == impl  # the route never touches the config


class CheckpointedLayer(torch.nn.Module):
    """A decoder layer under torch.utils.checkpoint, as a user wraps layers by hand."""

    def __init__(self, layer, reentrant: bool):
        super().__init__()
        self.layer, self.reentrant = layer, reentrant

    def forward(self, hidden, *args, **kwargs):
        return checkpoint(functools.partial(self.layer, **kwargs), hidden, *args, use_reentrant=self.reentrant)


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_torch_checkpoint_around_hf_layers(reentrant):
    model = tiny_hf_model("qwen2", torch.float32, "sdpa", seed=4).to(DEVICE).train()
    truth = copy.deepcopy(model)
    layers = model.model.layers
    for i in range(len(layers)):
        layers[i] = CheckpointedLayer(layers[i], reentrant)
    model.model.embed_tokens.register_forward_hook(lambda module, args, out: out.requires_grad_(True))
    assert_matches_each_rollout_alone(model, truth)


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_torch_checkpoint_around_reference_decoder_layers(reentrant):
    model = tiny_decoder(torch.float64, seed=5).to(DEVICE)
    truth = copy.deepcopy(model)
    for i in range(len(model.layers)):
        model.layers[i] = CheckpointedLayer(model.layers[i], reentrant)
    model.embed.register_forward_hook(lambda module, args, out: out.requires_grad_(True))
    assert_matches_each_rollout_alone(model, truth, twins={"ref": dta_ref.tree_logprobs})


def lora_model(family, seed=6):
    from peft import LoraConfig, get_peft_model

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0, init_lora_weights=False)
    return get_peft_model(tiny_hf_model(family, torch.float32, "sdpa", seed=seed).to(DEVICE), config)


def test_peft_lora_on_the_embedding():
    """PEFT wraps an adapted embedding in a module of its own; its vocabulary is the base layer's."""
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "embed_tokens"], init_lora_weights=False)
    model = get_peft_model(tiny_hf_model("qwen2", torch.float32, "sdpa", seed=6).to(DEVICE), config)
    assert dta_ref.adapt(model).vocab_size == 64
    assert_matches_each_rollout_alone(model)


def test_sliding_window_flag_without_sliding_layers():
    """Qwen2's use_sliding_window with max_window_layers past the last layer: every layer attends fully
    (config.layer_types says so), so the tree path runs it, and gives each rollout alone's numbers."""
    import transformers

    base = tiny_hf_model("qwen2", torch.float32, "sdpa", seed=6).config.to_dict()
    cfg = transformers.Qwen2Config(
        **{**base, "use_sliding_window": True, "sliding_window": 3, "max_window_layers": 28, "layer_types": None}
    )
    assert "sliding_attention" not in cfg.layer_types
    torch.manual_seed(6)
    assert_matches_each_rollout_alone(transformers.Qwen2ForCausalLM(cfg).to(DEVICE).eval())


def sliding_qwen2(window: int):
    """The tiny Qwen2 with every layer sliding over ``window`` positions."""
    import transformers

    base = tiny_hf_model("qwen2", torch.float32, "sdpa", seed=6).config.to_dict()
    cfg = transformers.Qwen2Config(
        **{**base, "use_sliding_window": True, "sliding_window": window, "max_window_layers": 0, "layer_types": None}
    )
    assert set(cfg.layer_types) == {"sliding_attention"}
    torch.manual_seed(6)
    return transformers.Qwen2ForCausalLM(cfg).to(DEVICE).eval()


def test_sliding_windows_shorter_than_the_rollouts():
    """Sliding layers whose window every rollout outgrows: the tree computes each rollout's own window
    (positions are depths), scoring and chunked training give each rollout alone's numbers, and the
    window matters (a wider one gives other logits)."""
    longest = max(map(len, SEQUENCES))
    narrow, wide = sliding_qwen2(3), sliding_qwen2(longest)
    assert_matches_each_rollout_alone(narrow)
    ids = torch.tensor([max(SEQUENCES, key=len)], device=DEVICE)
    with torch.no_grad():
        assert not torch.allclose(narrow(ids).logits[0, -1], wide(ids).logits[0, -1])
    want_lp, want = grads_by_backward(narrow, lambda: dta_ref.flat_logprobs(narrow, SEQUENCES))
    narrow.zero_grad(set_to_none=True)
    weights = torch.randn(TREE.logprob_mask.shape, generator=torch.Generator().manual_seed(0)) * TREE.logprob_mask
    from dta_fast.trainer_common import LinearizedLoss

    lp, _ = dta_fast.tree_backward(narrow, TREE, LinearizedLoss(weights.double()), max_chunk_tokens=4)
    got = torch.cat([p.grad.reshape(-1) for p in narrow.parameters()])
    torch.testing.assert_close(lp, want_lp, rtol=1e-5, atol=1e-5)
    assert float((got - want).norm() / want.norm()) < 1e-5


def test_peft_trainable_tokens():
    """PEFT's trainable_token_indices wraps the embedding (and a tied head) in a module that keeps the
    original as .original_module: its vocabulary is that one's, and the rows it trains get gradients."""
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj"], trainable_token_indices=[3, 7, 9], init_lora_weights=False
    )
    model = get_peft_model(tiny_hf_model("llama", torch.float32, "sdpa", seed=6).to(DEVICE), config)
    assert dta_ref.adapt(model).vocab_size == 64
    assert_matches_each_rollout_alone(model)


def test_peft_prompt_learning_is_refused():
    """Prompt and prefix tuning add virtual tokens outside the model's modules, which the tree does not
    hold: refused, not silently dropped."""
    pytest.importorskip("peft")
    from peft import PrefixTuningConfig, PromptTuningConfig, get_peft_model

    for config in (
        PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3),
        PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3),
    ):
        model = get_peft_model(tiny_hf_model("qwen2", torch.float32, "sdpa", seed=6), config)
        with pytest.raises(TypeError, match="adds virtual tokens"):
            dta_fast.tree_logprobs(model, TREE, attention_impl="kernel")


@pytest.mark.parametrize("family", HF_FAMILIES)
def test_peft_lora(family):
    pytest.importorskip("peft")
    model = lora_model(family)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert_matches_each_rollout_alone(model)


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_peft_lora_with_gradient_checkpointing(reentrant):
    pytest.importorskip("peft")
    model = lora_model("qwen2", seed=7)
    truth = copy.deepcopy(model).train()
    assert_matches_each_rollout_alone(checkpointing(model, reentrant), truth)


def assert_tree_backward_matches_each_rollout_alone(model, **options):
    """``tree_backward`` with ``options`` on the SFT loss of TREE: the logprobs and trained gradients of
    a copy of ``model`` run on each rollout alone."""
    truth = copy.deepcopy(model)
    mask = TREE.logprob_mask.to(DEVICE)
    flat = dta_ref.flat_logprobs(truth, SEQUENCES)
    dta_ref.sft_loss(flat, mask).backward()
    want = torch.cat([p.grad.reshape(-1) for p in truth.parameters() if p.requires_grad])
    model.zero_grad(set_to_none=True)
    lp, _ = dta_fast.tree_backward(model, TREE, dta_ref.SFTLoss(mask), **options)
    torch.testing.assert_close(lp, flat.detach(), rtol=1e-5, atol=1e-5)
    got = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.requires_grad])
    assert float((got - want).norm() / want.norm()) < 1e-5


def test_lora_checkpointed_tree_backward_with_small_head_windows(monkeypatch):
    """tree_backward as a trainer calls it (LoRA, gradient checkpointing) on a plan whose vocabulary head
    runs windows of 2 rows (what a tight budget may choose): the per-sequence gradients."""
    pytest.importorskip("peft")
    model = checkpointing(lora_model("qwen2", seed=12), reentrant=False)
    choose, windows = dta_fast.chunked.engine.choose_plan, []
    monkeypatch.setattr(
        dta_fast.chunked.engine,
        "choose_plan",
        lambda *args, **kwargs: dataclasses.replace(choose(*args, **kwargs), logits_rows=2),
    )

    def recording(hidden, head, head_rows, *args):
        windows.extend(w.row_hi - w.row_lo for w in head_rows.windows)
        return dta_fast.logprobs.head_logprobs(hidden, head, head_rows, *args)

    monkeypatch.setattr(dta_fast.chunked.engine, "head_logprobs", recording)
    assert_tree_backward_matches_each_rollout_alone(model, max_chunk_tokens=4)
    assert max(windows) == 2


@pytest.mark.parametrize("own", [False, True], ids=["engine", "model-and-engine"])
def test_peft_lora_with_checkpointed_layers(own):
    """LoRA with the engine checkpointing its layers (checkpoint_layers=True), on a model that does not
    checkpoint itself and on one that does (Hugging Face's, non-reentrant): the per-sequence gradients."""
    pytest.importorskip("peft")
    model = lora_model("qwen2", seed=13)
    if own:
        model = checkpointing(model, reentrant=False)
    assert_tree_backward_matches_each_rollout_alone(model, max_chunk_tokens=4, checkpoint_layers=True)


def test_peft_adapter_disabled_is_the_base_model():
    """TRL scores the reference policy of a LoRA model with its adapter disabled."""
    pytest.importorskip("peft")
    model = lora_model("llama", seed=8)
    with model.disable_adapter():
        want = dta_ref.flat_logprobs(model.get_base_model(), SEQUENCES)
        for fn in TWINS.values():
            torch.testing.assert_close(fn(model, TREE), want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(dta_fast.tree_logprobs(model, TREE, attention_impl="kernel"), want, atol=1e-3)


def test_torch_compiled_model():
    model = tiny_hf_model("qwen3", torch.float32, "sdpa", seed=9).to(DEVICE)
    compiled = torch.compile(model)
    assert isinstance(compiled, torch._dynamo.eval_frame.OptimizedModule)
    assert dta_ref.adapt(compiled).core is model
    assert_matches_each_rollout_alone(compiled, model)


@pytest.mark.slow
@pytest.mark.parametrize("compile_, fullgraph", [("torch.compile", True), ("Module.compile", False)])
def test_layers_compiled_one_by_one(compile_, fullgraph):
    """Layers the user compiled one by one (the whole model's compile is unwrapped instead): the attention
    call stays outside their graphs, which would otherwise trace the chunked engine's K/V stores into them
    and freeze at trace time what the backward reads there (the gradients then were 20-100% off); layers
    compiled with fullgraph=True, which cannot leave it out, run eagerly, the engine's recomputes too.
    Kept and recomputed prefixes and checkpointed layers give the per-sequence gradients."""
    model = tiny_hf_model("qwen2", torch.float32, "eager", seed=14).to(DEVICE).train()
    for i, layer in enumerate(model.model.layers):
        if compile_ == "torch.compile":
            model.model.layers[i] = torch.compile(layer, backend="eager", fullgraph=fullgraph)
        else:
            layer.compile(backend="eager", fullgraph=fullgraph)
    assert dta_ref.adapt(model).compiled_whole_graph == fullgraph
    torch._dynamo.reset()
    for options in (
        dict(max_chunk_tokens=4, recompute=False),
        dict(max_chunk_tokens=4, recompute=True),
        dict(max_chunk_tokens=7, recompute=False, checkpoint_layers=True),
    ):
        assert_tree_backward_matches_each_rollout_alone(model, **options)
    assert_matches_each_rollout_alone(model)


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("family", ["decoder", *HF_FAMILIES])
def test_train_and_eval_mode(family, mode):
    model = tiny_decoder(torch.float32, seed=10) if family == "decoder" else tiny_hf_model(family, torch.float32)
    getattr(model.to(DEVICE), mode)()
    assert_matches_each_rollout_alone(model)


def test_adapter_answers_for_every_wrapper():
    pytest.importorskip("peft")
    model = lora_model("qwen2", seed=11)
    for wrapped in (model, torch.compile(model)):
        adapter = dta_ref.adapt(wrapped)
        assert adapter.core is model.get_base_model()
        assert adapter.head is adapter.core.lm_head
        assert adapter.embedding is adapter.core.model.embed_tokens
        assert adapter.vocab_size == 64
        assert adapter.shape.layers == 2 and adapter.shape.kv_heads == 2 and adapter.shape.head_dim == 8
        assert repr(adapter).startswith("ModelAdapter(Qwen2ForCausalLM inside PeftModel")
        assert "4/2 heads of 8, vocabulary 64" in repr(adapter)
    assert dta_ref.adapt(adapter) is adapter


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: torch.nn.Linear(4, 4), "unsupported model Linear"),
        (lambda: "qwen2", "must be a torch.nn.Module"),
        (lambda: tiny_hf_model("qwen2").model, "has no language-model head"),
        (lambda: torch.nn.DataParallel(tiny_decoder()), "DataParallel is not supported"),
    ],
    ids=["plain-module", "a-string", "base-model-without-head", "data-parallel"],
)
def test_models_that_are_refused(build, message):
    with pytest.raises(TypeError, match=message):
        dta_fast.tree_logprobs(build(), TREE, attention_impl="kernel")


def test_sequence_classification_model_is_refused():
    import transformers

    config = tiny_hf_model("qwen2").config
    config.num_labels = 2
    model = transformers.Qwen2ForSequenceClassification(config)
    with pytest.raises(TypeError, match="has no language-model head"):
        dta_ref.tree_logprobs(model, TREE)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_and_entropy_with_a_mask(temperature):
    """Both twins: logprobs and entropies at the sampling temperature, only where the mask asks, exact gradients."""
    model = tiny_hf_model("qwen2", torch.float32, "sdpa", seed=12).to(DEVICE)
    mask = TREE.response_mask([3, 3, 3, 2, 1]) | ~TREE.logprob_mask  # True past the ends too: nothing there to score
    assert (mask & ~TREE.logprob_mask).any()
    w_lp, w_ent = (torch.randn(mask.shape, generator=torch.Generator().manual_seed(s)).to(DEVICE) for s in (1, 2))
    want_lp = torch.zeros(mask.shape, device=DEVICE)
    want_ent = torch.zeros(mask.shape, device=DEVICE)
    for i, seq in enumerate(SEQUENCES):  # each rollout alone
        ids = torch.tensor(seq, device=DEVICE)[None]
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float() / temperature, -1)
        want_lp[i, : len(seq) - 1] = logp.gather(-1, ids[0, 1:, None])[:, 0]
        want_ent[i, : len(seq) - 1] = -(logp.exp() * logp).sum(-1)
    m = mask.to(DEVICE)
    want_lp, want_ent = want_lp * m, want_ent * m
    want = torch.autograd.grad((want_lp * w_lp + want_ent * w_ent).sum(), list(model.parameters()))
    fast = functools.partial(dta_fast.tree_logprobs_and_entropy, attention_impl="kernel")
    for twin in (dta_ref.tree_logprobs_and_entropy, fast):
        out = twin(model, TREE, temperature=temperature, mask=mask)
        torch.testing.assert_close(out.logprobs, want_lp, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out.entropy, want_ent, rtol=1e-5, atol=1e-5)
        got = torch.autograd.grad((out.logprobs * w_lp + out.entropy * w_ent).sum(), list(model.parameters()))
        got, flat = torch.cat([g.flatten() for g in got]), torch.cat([g.flatten() for g in want])
        assert float((got - flat).norm() / flat.norm()) < 1e-5, getattr(twin, "func", twin).__module__
    with pytest.raises(ValueError, match="mask has shape"):
        dta_fast.tree_logprobs(model, TREE, mask=mask[:, 1:], attention_impl="kernel")
    with pytest.raises(TypeError, match="bool tensor"):
        dta_ref.tree_logprobs(model, TREE, mask=mask.float())
    with pytest.raises(ValueError, match="temperature must be positive"):
        dta_fast.tree_logprobs(model, TREE, temperature=0.0, attention_impl="kernel")


def test_float64_head_keeps_float64():
    """The fused vocabulary head computes in the model's precision (float64 stays float64)."""
    from dta_fast.logprobs import rows_logprobs

    model = tiny_decoder(torch.float64, seed=13)
    hidden = torch.randn(6, 32, dtype=torch.float64, requires_grad=True)
    rows, targets = torch.tensor([0, 2, 2, 5]), torch.tensor([3, 4, 9, 1])
    got = rows_logprobs(hidden, model.lm_head, rows, targets, temperature=0.5)
    want = torch.log_softmax(model.lm_head(hidden) / 0.5, -1)[rows, targets]
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13)
    g_got, g_want = (torch.autograd.grad(x.sum(), hidden)[0] for x in (got, want))
    torch.testing.assert_close(g_got, g_want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("entropy", [False, True], ids=["logprobs", "with_entropy"])
def test_fused_head_over_windows(entropy):
    """The fused head over several windows (rows read by several pairs, as at a branch point): the
    logprobs, entropies and both gradients of a plain log_softmax, one autograd node for all windows,
    and no window of logits saved for the backward."""
    from dta_fast.logprobs import rows_logprobs

    torch.manual_seed(16)
    V, n = 300, 23
    head = torch.nn.Linear(32, V, bias=False).double()
    hidden = torch.randn(n, 32, dtype=torch.float64, requires_grad=True)
    rows = torch.tensor(sorted(torch.randint(0, n, (40,)).tolist()))
    targets = torch.randint(0, V, (40,))
    saved = []

    def pack(x):
        saved.append(tuple(x.shape))
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        got = rows_logprobs(hidden, head, rows, targets, chunk_rows=4, temperature=0.7, entropy=entropy)
    assert all(shape[-1:] != (V,) for shape in saved)  # no logits are kept (the weight is [V, 32])
    heads = [node for node in _graph_nodes(got.grad_fn) if "HeadLogprobs" in type(node).__name__]
    assert len(heads) == 1
    logp = torch.log_softmax(head(hidden) / 0.7, -1)
    want = logp[rows, targets]
    if entropy:
        want = torch.stack([want, -(logp.exp() * logp).sum(-1)[rows]])
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    weights = torch.randn_like(want)  # a loss that reads every output differently
    for g_got, g_want in zip(
        torch.autograd.grad((got * weights).sum(), [hidden, head.weight]),
        torch.autograd.grad((want * weights).sum(), [hidden, head.weight]),
    ):
        torch.testing.assert_close(g_got, g_want, rtol=1e-11, atol=1e-11)


def test_fused_head_refuses_unsorted_rows_and_takes_any_window():
    """Its backward writes each window's row gradients in place, so the rows must be sorted (a row read
    again later would lose a gradient); a window larger than all rows is one window."""
    import sys

    from dta_fast.logprobs import rows_logprobs

    torch.manual_seed(17)
    head = torch.nn.Linear(8, 30, bias=False).double()
    hidden = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([1, 2, 3, 4])
    with pytest.raises(ValueError, match="rows must be sorted ascending"):
        rows_logprobs(hidden, head, torch.tensor([3, 0, 2, 0]), targets)
    rows = torch.tensor([0, 0, 2, 3])
    want = torch.log_softmax(head(hidden), -1)[rows, targets]
    for chunk_rows in (2**62, sys.maxsize):
        torch.testing.assert_close(rows_logprobs(hidden, head, rows, targets, chunk_rows=chunk_rows), want)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_no_pair_to_score_still_gives_every_gradient(fused):
    """Nothing to score (a mask with no token): every trainable tensor gets a zero gradient, as from
    dta_ref's head, not None (DDP without find_unused_parameters needs each one)."""
    from dta_fast.logprobs import rows_logprobs

    head = torch.nn.Linear(8, 30, bias=not fused).double()
    hidden = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    got = rows_logprobs(hidden, head, torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))
    assert got.shape == (0,)
    got.sum().backward()
    for x in (hidden, *head.parameters()):
        assert x.grad is not None and not x.grad.any()


def _graph_nodes(root):
    seen, stack = set(), [root]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return seen


@pytest.mark.parametrize("hidden_trains", [True, False], ids=["hidden_trains", "head_only"])
def test_unfused_head_keeps_no_logits_for_the_backward(hidden_trains):
    """A head the fused path does not take (a bias here, LoRA in practice) keeps at most one window of
    logits alive: none is saved for the backward, also when only the head trains."""
    from dta_fast.logprobs import rows_logprobs

    torch.manual_seed(15)
    V, rows = 512, torch.arange(40)
    head = torch.nn.Linear(32, V, bias=True).double()
    hidden = torch.randn(40, 32, dtype=torch.float64, requires_grad=hidden_trains)
    targets = torch.randint(0, V, (40,))
    saved = []

    def pack(x):
        saved.append(x.numel())
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        got = rows_logprobs(hidden, head, rows, targets, chunk_rows=8)
    assert max(saved) < 8 * V  # under one window of logits: the windows are recomputed, not kept
    want = torch.log_softmax(head(hidden), -1)[rows, targets]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for g_got, g_want in zip(
        torch.autograd.grad(got.sum(), head.parameters()), torch.autograd.grad(want.sum(), head.parameters())
    ):
        torch.testing.assert_close(g_got, g_want, rtol=1e-11, atol=1e-11)


@pytest.mark.parametrize("reentrant", [None, True, False], ids=["plain", "reentrant", "non-reentrant"])
def test_tree_backward_at_a_temperature(reentrant):
    """tree_backward scores at the sampling temperature, chunked, under checkpointing too."""
    model = tiny_hf_model("llama", torch.float32, "sdpa", seed=14).to(DEVICE)
    truth = copy.deepcopy(model).train()
    if reentrant is not None:
        checkpointing(model, reentrant)
    mask = TREE.response_mask([3, 3, 3, 2, 1])
    loss_fn = dta_ref.SFTLoss(mask)
    flat = dta_ref.flat_logprobs(truth, SEQUENCES, temperature=0.7)
    want = torch.autograd.grad(dta_ref.sft_loss(flat, mask.to(DEVICE)), list(truth.parameters()))
    model.zero_grad(set_to_none=True)
    logprobs, loss = dta_fast.tree_backward(model, TREE, loss_fn, max_chunk_tokens=5, temperature=0.7)
    torch.testing.assert_close(logprobs, flat.detach(), rtol=1e-5, atol=1e-5)
    got = torch.cat([p.grad.flatten() for p in model.parameters()])
    want = torch.cat([g.flatten() for g in want])
    assert float((got - want).norm() / want.norm()) < 1e-5


@pytest.mark.parametrize("find_unused", [False, True], ids=["ddp", "ddp_find_unused"])
def test_ddp_model(one_rank_group, find_unused):
    """A DDP model scores through DDP's own call (its reduction prepared), also one that looks for unused
    parameters (the head, run after the call, is not taken for unused); tree_backward points elsewhere."""
    model = tiny_hf_model("qwen2", torch.float32, "sdpa", seed=15)
    assert model.lm_head.weight is not model.model.embed_tokens.weight  # a head only the head uses
    ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=find_unused)
    assert dta_ref.adapt(ddp).core is model and dta_ref.adapt(ddp).data_parallel is ddp
    truth = copy.deepcopy(model)
    assert_matches_each_rollout_alone(ddp, truth, twins={"ref": dta_ref.tree_logprobs})
    with pytest.raises(TypeError, match="distributed_tree_backward"):
        dta_fast.tree_backward(ddp, TREE, dta_ref.SFTLoss(TREE.logprob_mask))


def test_call_as_forward_gives_the_call_an_input_to_move():
    """FSDP2's root pre-forward on CUDA (torch 2.11) moves a call's inputs with DDP's ``_to_kwargs`` and
    indexes what it moved, which fails for a call without inputs: ``call_as_forward`` (verl's tree engines
    run their packed forward through it) passes its function as the call's keyword, and returns its result."""
    from torch.distributed.utils import _to_kwargs

    from dta_ref.adapter import call_as_forward

    module = torch.nn.Linear(2, 2)
    moved = []

    def as_fsdp2_root(mod, args, kwargs):
        args_tuple, kwargs_tuple = _to_kwargs(args, kwargs, torch.device("cpu"), False)
        moved.append((args_tuple[0], kwargs_tuple[0]))

    module.register_forward_pre_hook(as_fsdp2_root, with_kwargs=True)
    out = call_as_forward(module, lambda: module.weight.sum() * 2)
    assert len(moved) == 1 and torch.equal(out, module.weight.sum() * 2)
    assert "forward" not in module.__dict__  # the module's own forward is back
    assert torch.equal(module(torch.ones(2)), torch.nn.functional.linear(torch.ones(2), module.weight, module.bias))
