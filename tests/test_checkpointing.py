"""dta_fast.checkpointing: the layers a model checkpoints itself, and the engine's checkpointed layers, run
under reentrant checkpointing inside the trainers and tree_backward, with the gradients of the model's own
checkpointing; and the cases where that could lose gradients fall back to it."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint

import dta_fast
import dta_fast.checkpointing as checkpointing
import dta_ref
from dta_fast.checkpointing import model_checkpointing_reentrant, reentrant_applies
from dta_fast.trainer_common import block_logprobs_and_entropy
from dta_ref import PrefixTree, SFTLoss
from tests.helpers import assert_grads_close, tiny_family_model, tiny_hf_model

SEQUENCES = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8], [1, 2, 9], [10, 11, 12, 13]]


@pytest.fixture
def reentrant_calls(monkeypatch):
    """The calls of torch's reentrant checkpoint (its autograd Function) while the test runs."""
    calls = []
    apply = torch_checkpoint.CheckpointFunction.apply

    def counted(*args):
        calls.append(1)
        return apply(*args)

    monkeypatch.setattr(torch_checkpoint.CheckpointFunction, "apply", counted)
    return calls


def checkpointed(model):
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()  # transformers checkpoints in training mode only; the tiny models have no dropout


def step(model, tree, context=None):
    """Logprobs and gradients of a weighted sum of the tree's logprobs, under ``context`` if given."""
    model.zero_grad(set_to_none=True)
    with context or torch.enable_grad():
        lp = dta_fast.tree_logprobs(model, tree)
    weights = torch.arange(lp.numel(), dtype=lp.dtype).reshape(lp.shape) / lp.numel()
    (lp * weights).sum().backward()
    return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_model_checkpointing_runs_reentrant_with_its_gradients(reentrant_calls):
    """Hugging Face's non-reentrant checkpointing replaced by the reentrant form for the call: every layer
    through it, the same logprobs (bitwise on the CPU: the same ops on the same inputs) and gradients,
    and each layer's own function put back after."""
    tree = PrefixTree.from_sequences(SEQUENCES)
    model = tiny_hf_model("qwen2", torch.float64, "sdpa")
    plain = step(model.train(), tree)
    model = checkpointed(model)
    layers = dta_ref.adapt(model).layers
    own = [layer._gradient_checkpointing_func for layer in layers]
    theirs = step(model, tree)
    assert not reentrant_calls
    ours = step(model, tree, model_checkpointing_reentrant(model))
    assert len(reentrant_calls) == len(layers)
    assert [layer._gradient_checkpointing_func for layer in layers] == own
    for other in (theirs, plain):
        torch.testing.assert_close(ours[0], other[0], rtol=0, atol=0)
        assert ours[1].keys() == other[1].keys()
        assert_grads_close(ours[1], other[1], rel=1e-13)


def test_frozen_inputs_still_get_their_layers_gradients(reentrant_calls):
    """LoRA: the embedding is frozen, so no layer input requires gradients (without transformers' input
    hook); reentrant checkpointing alone would give the adapters none. The anchor keeps them."""
    from peft import LoraConfig, get_peft_model

    tree = PrefixTree.from_sequences(SEQUENCES)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = checkpointed(get_peft_model(tiny_hf_model("qwen2", torch.float64, "sdpa"), config))
    model.base_model.model.disable_input_require_grads()
    theirs = step(model, tree)
    ours = step(model, tree, model_checkpointing_reentrant(model))
    assert len(reentrant_calls) == 2
    assert theirs[1] and all("lora" in name for name in theirs[1])
    assert ours[1].keys() == theirs[1].keys()
    assert_grads_close(ours[1], theirs[1], rel=1e-13)


def test_keyword_tensors_that_require_gradients_keep_the_models_function():
    """A keyword tensor that requires gradients would get none from the reentrant form: the layer's call
    goes to the model's own function."""
    seen = []

    def own(function, *args):
        seen.append("own")
        return function(*args)

    def layer(hidden, scale):
        return hidden * scale

    hidden = torch.ones(3, requires_grad=True)
    scale = torch.full((3,), 2.0, requires_grad=True)
    out = checkpointing._model_checkpoint(own, functools.partial(layer, scale=scale), hidden)
    out.sum().backward()
    assert seen == ["own"] and scale.grad is not None
    frozen = functools.partial(layer, scale=scale.detach())
    assert torch.equal(checkpointing._model_checkpoint(own, frozen, hidden), hidden * 2) and seen == ["own"]


def test_where_the_reentrant_form_is_not_used(reentrant_calls, monkeypatch):
    """Left to the model's own checkpointing: a layer with module hooks (FSDP's gathers, transformers'
    recording of router logits run inside it), a checkpoint function with options (offloading to the
    host), linear-attention layers, and DTA_REENTRANT_CHECKPOINT=0."""
    tree = PrefixTree.from_sequences(SEQUENCES)
    model = checkpointed(tiny_hf_model("qwen2", torch.float64, "sdpa"))
    handle = dta_ref.adapt(model).layers[1].mlp.register_forward_hook(lambda *args: None)
    assert not reentrant_applies(model)
    step(model, tree, model_checkpointing_reentrant(model))
    handle.remove()
    assert not reentrant_calls and reentrant_applies(model)

    offloading = functools.partial(torch_checkpoint.checkpoint, use_reentrant=False, preserve_rng_state=False)
    for layer in dta_ref.adapt(model).layers:
        layer._gradient_checkpointing_func = offloading
    step(model, tree, model_checkpointing_reentrant(model))
    assert not reentrant_calls

    with torch.enable_grad():
        assert not reentrant_applies(checkpointed(tiny_family_model("qwen3.5")))
    monkeypatch.setattr(checkpointing, "ENABLED", False)
    model = checkpointed(tiny_hf_model("qwen2", torch.float64, "sdpa"))
    step(model, tree, model_checkpointing_reentrant(model))
    assert not reentrant_calls


def test_ddp(one_rank_group, reentrant_calls):
    """Under DDP the layers run reentrant and its reduction gets every gradient, those of the model alone;
    a DDP looking for unused parameters (it would find the layers' unused) keeps the model's own."""
    ids = torch.tensor([[1, 2, 3, 4], [1, 2, 5, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    grads = []
    for ddp in (False, True):
        model = checkpointed(tiny_hf_model("qwen2", torch.float64, "sdpa"))
        wrapped = torch.nn.parallel.DistributedDataParallel(model) if ddp else model
        reentrant_calls.clear()
        lp, _, _, _ = block_logprobs_and_entropy(wrapped, ids, mask, 2)
        lp.sum().backward()
        assert len(reentrant_calls) == 2
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert_grads_close(grads[1], grads[0], rel=1e-13)
    looking = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    with torch.enable_grad():
        assert reentrant_applies(wrapped) and not reentrant_applies(looking)


def test_trainers_forward_runs_reentrant(reentrant_calls):
    """The trainers' packed forward (dta_fast.trainer_common) takes the reentrant form."""
    model = checkpointed(tiny_hf_model("qwen2", torch.float64, "sdpa"))
    ids = torch.tensor([[1, 2, 3, 4], [1, 2, 5, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    lp, _, _, _ = block_logprobs_and_entropy(model, ids, mask, 2)
    lp.sum().backward()
    assert len(reentrant_calls) == len(dta_ref.adapt(model).layers)


def test_router_logits_keep_their_gradients(reentrant_calls):
    """A forward that records MoE router logits (through hooks transformers installs on the first call that
    asks, so none is there before it) keeps the model's own checkpointing: the router's auxiliary loss
    has its gradients, as without checkpointing."""
    ids = torch.tensor([[1, 2, 3, 4], [1, 2, 5, 6]])
    mask = torch.ones_like(ids)
    grads = []
    for checkpoints in (False, True):
        model = tiny_family_model("qwen3-moe").train()
        if checkpoints:
            model = checkpointed(model)
        lp, _, _, aux = block_logprobs_and_entropy(model, ids, mask, 2, router_aux_loss=True)
        (lp.sum() + aux).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert not reentrant_calls
    assert any("gate" in name for name in grads[0])
    assert_grads_close(grads[1], grads[0], rel=1e-12)


@pytest.mark.parametrize("own", [False, True], ids=["engine_checkpoints", "model_checkpoints"])
def test_tree_backward_checkpoints_reentrant(reentrant_calls, own):
    """tree_backward's checkpointed layers (checkpoint_layers=True, or the model's own) run reentrant, one
    call per layer per chunk forward with a graph, and train to the per-sequence gradients."""
    tree = PrefixTree.from_sequences(SEQUENCES)
    model = tiny_hf_model("qwen2", torch.float64, "sdpa").train()
    flat = dta_ref.flat_logprobs(model, SEQUENCES)
    dta_ref.sft_loss(flat, tree.logprob_mask, "sum").backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    if own:
        model = checkpointed(model)
    model.zero_grad(set_to_none=True)
    dta_fast.tree_backward(
        model, tree, SFTLoss(tree.logprob_mask, "sum"), max_chunk_tokens=5, checkpoint_layers=not own
    )  # fmt: skip
    assert reentrant_calls
    assert len(reentrant_calls) % len(dta_ref.adapt(model).layers) == 0
    assert_grads_close({n: p.grad for n, p in model.named_parameters()}, ref, rel=1e-6)
