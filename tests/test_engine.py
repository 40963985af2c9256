"""dta_fast.tree_backward: depth-first chunked execution against per-sequence training."""

from __future__ import annotations

import copy
import dataclasses
import functools

import pytest
import torch

import dta_fast
import dta_ref
from dta_fast.chunked import Forest, MemoryModel, checked_options, engine, plan_chunks, plan_for_budget
from dta_fast.chunked.budget import choose_plan, largest_fitting_plan, step_cost
from dta_ref import PolicyGradientLoss, PrefixTree, SFTLoss, agentic_batch, grpo_batch
from tests.helpers import assert_grads_close, param_grads, tiny_decoder, tiny_hf_model

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def batch():
    return (
        agentic_batch(20, 2, 5, 2, 3, 4, 6, vocab_size=64, seed=1)
        + grpo_batch(1, 13, 3, 7, vocab_size=64, seed=2)
        + [[1, 2, 3], [1, 2], [5]]
    )


def flat_reference(model, sequences, loss_of):
    """Logprobs, loss and parameter gradients of plain per-sequence training."""
    flat = dta_ref.flat_logprobs(model, sequences)
    loss = loss_of(flat)
    return flat.detach(), loss.detach(), param_grads(model, loss)


def grads_of(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def pg_setup(tree, flat, seed=0):
    g = torch.Generator().manual_seed(seed)
    old = flat + 0.2 * torch.randn(flat.shape, generator=g, dtype=flat.dtype)
    adv = torch.randn(tree.num_sequences, generator=g, dtype=flat.dtype)
    return old, adv, tree.logprob_mask


@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "keep"])
@pytest.mark.parametrize("chunk", [None, 1, 5, 16, 1000], ids=lambda c: f"B{c}")
@pytest.mark.parametrize("normalization", ["token_mean", "sequence_mean", "sum"])
def test_policy_gradient_float64(chunk, recompute, normalization):
    seqs = batch()
    tree = PrefixTree.from_sequences(seqs)
    model = tiny_decoder(torch.float64)
    flat = dta_ref.flat_logprobs(model, seqs).detach()
    old, adv, mask = pg_setup(tree, flat)
    ref_lp, ref_loss, ref_grads = flat_reference(
        model, seqs, lambda lp: dta_ref.policy_gradient_loss(lp, old, adv, mask, 0.2, 0.28, normalization)
    )
    model.zero_grad(set_to_none=True)
    loss_fn = PolicyGradientLoss(old, adv, mask, 0.2, 0.28, normalization)
    lp, loss = dta_fast.tree_backward(model, tree, loss_fn, max_chunk_tokens=chunk, recompute=recompute)
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-12)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-14)
    assert_grads_close(grads_of(model), ref_grads, rel=1e-11)


@pytest.mark.parametrize("chunk", [None, 7])
def test_generic_sequence_loss(chunk):
    """A loss that is not a sum over tokens (GSPO-like sequence ratio) is linearised exactly."""
    seqs = batch()
    tree = PrefixTree.from_sequences(seqs)
    model = tiny_decoder(torch.float64)
    adv = torch.linspace(-1, 1, tree.num_sequences, dtype=torch.float64)
    lengths = tree.lengths - 1

    def loss_fn(i, lp):
        if lp.numel() == 0:
            return lp.sum()
        return -torch.exp(lp.mean()).clamp(max=2.0) * adv[i] + 0.01 * lp.pow(2).sum()

    def total(lp):
        return sum(loss_fn(i, lp[i, : int(lengths[i])]) for i in range(tree.num_sequences))

    _, ref_loss, ref_grads = flat_reference(model, seqs, total)
    model.zero_grad(set_to_none=True)
    _, loss = dta_fast.tree_backward(model, tree, loss_fn, max_chunk_tokens=chunk)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-14)
    assert_grads_close(grads_of(model), ref_grads, rel=1e-11)


def test_gradients_accumulate_onto_existing():
    seqs = batch()
    tree = PrefixTree.from_sequences(seqs)
    model = tiny_decoder(torch.float64)
    _, _, ref_grads = flat_reference(model, seqs, lambda lp: dta_ref.sft_loss(lp, tree.logprob_mask))
    start = {n: torch.full_like(p, 0.5) for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        p.grad = start[n].clone()
    dta_fast.tree_backward(model, tree, SFTLoss(tree.logprob_mask), max_chunk_tokens=6)
    assert_grads_close({n: p.grad - start[n] for n, p in model.named_parameters()}, ref_grads, rel=1e-11)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("chunk", [None, 6])
def test_hf_models(family, chunk):
    seqs = batch()
    tree = PrefixTree.from_sequences(seqs)
    model = tiny_hf_model(family, torch.float64, "sdpa")
    ref_lp, _, ref_grads = flat_reference(model, seqs, lambda lp: dta_ref.sft_loss(lp, tree.logprob_mask, "sum"))
    model.zero_grad(set_to_none=True)
    lp, _ = dta_fast.tree_backward(model, tree, SFTLoss(tree.logprob_mask, "sum"), max_chunk_tokens=chunk)
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-6)
    assert_grads_close(grads_of(model), ref_grads, rel=1e-6)


@pytest.mark.kernel
@pytest.mark.slow
@pytest.mark.parametrize("chunk", [None, 5, 23])
def test_kernel_path_float32(chunk):
    """The Triton kernel with a cached prefix (Tq < Tk) inside the engine."""
    pytest.importorskip("triton")
    assert_float32_step_matches_flat(DEVICE, max_chunk_tokens=chunk, attention_impl="kernel")


def assert_float32_step_matches_flat(device, **options):
    """tree_backward(**options) of a float32 decoder against each rollout alone in float64."""
    seqs = batch()
    tree = PrefixTree.from_sequences(seqs)
    model = tiny_decoder(torch.float32).to(device)
    exact = copy.deepcopy(model).double()
    ref_lp, _, ref_grads = flat_reference(exact, seqs, lambda lp: dta_ref.sft_loss(lp, tree.logprob_mask.to(device)))
    model.zero_grad(set_to_none=True)
    lp, _ = dta_fast.tree_backward(model, tree, SFTLoss(tree.logprob_mask), **options)
    torch.testing.assert_close(lp.double(), ref_lp, rtol=0, atol=2e-5)
    assert_grads_close({n: g.double() for n, g in grads_of(model).items()}, ref_grads, rel=1e-4)


def test_memory_budget_chooses_chunks():
    seqs = batch()
    tree = PrefixTree.from_sequences(seqs)
    model = tiny_decoder(torch.float64)
    for recompute in (True, False):
        for size in (1, 3, 40):
            budget = dta_fast.estimated_step_bytes(model, tree, size, recompute)
            chosen = dta_fast.chunk_tokens_for_budget(model, tree, budget, recompute)
            assert chosen >= size and dta_fast.estimated_step_bytes(model, tree, chosen, recompute) <= budget
            if chosen < tree.num_tokens:
                assert dta_fast.estimated_step_bytes(model, tree, chosen + 1, recompute) > budget
        smallest = min(
            dta_fast.estimated_step_bytes(model, tree, size, recompute) for size in range(1, tree.num_tokens + 1)
        )
        with pytest.raises(ValueError, match="too small"):
            dta_fast.chunk_tokens_for_budget(model, tree, smallest - 1, recompute)
    _, _, ref_grads = flat_reference(model, seqs, lambda lp: dta_ref.sft_loss(lp, tree.logprob_mask))
    model.zero_grad(set_to_none=True)
    budget = dta_fast.estimated_step_bytes(model, tree, 3)
    dta_fast.tree_backward(model, tree, SFTLoss(tree.logprob_mask), memory_budget_bytes=budget)
    assert_grads_close(grads_of(model), ref_grads, rel=1e-11)


def test_budget_sizing_counts_checkpointed_layers():
    """chunk_tokens_for_budget sizes chunks as estimated_step_bytes and tree_backward's budget count them:
    with the model's own gradient checkpointing (Hugging Face's), or checkpoint_layers=True."""
    tree = PrefixTree.from_sequences(batch())
    plain = tiny_decoder(torch.float64)
    hf = tiny_hf_model("qwen2", torch.float64)
    hf.gradient_checkpointing_enable()
    hf.train()
    for model, checkpoint_layers in ((hf, None), (plain, True)):
        for size in (2, 7):
            budget = dta_fast.estimated_step_bytes(model, tree, size, checkpoint_layers=checkpoint_layers)
            chosen = dta_fast.chunk_tokens_for_budget(model, tree, budget, checkpoint_layers=checkpoint_layers)
            assert chosen >= size
            assert dta_fast.estimated_step_bytes(model, tree, chosen, checkpoint_layers=checkpoint_layers) <= budget
            if chosen < tree.num_tokens:
                assert (
                    dta_fast.estimated_step_bytes(model, tree, chosen + 1, checkpoint_layers=checkpoint_layers) > budget
                )
    with pytest.raises(TypeError, match="checkpoint_layers must be True, False or None"):
        dta_fast.chunk_tokens_for_budget(plain, tree, 10**9, checkpoint_layers="yes")


def test_refused_with_gradients_disabled():
    """Under no_grad the chunks' forwards would enable gradients but the loss terms would not, and every
    .grad would come back zero: refused, nothing written."""
    tree = PrefixTree.from_sequences(batch())
    model = tiny_decoder(torch.float64)
    for mode in (torch.no_grad, torch.inference_mode):
        for loss_fn in (SFTLoss(tree.logprob_mask), lambda i, lp: -lp.sum()):
            with mode(), pytest.raises(RuntimeError, match="gradients are disabled here"):
                dta_fast.tree_backward(model, tree, loss_fn)
            assert all(p.grad is None for p in model.parameters())


def test_generic_loss_leaves_the_generator_past_its_draws():
    """A loss_fn that draws random numbers: after the call the generator is past those draws, as after
    per-sequence training, not rewound to hand them out again (the second pass replays the forward's)."""
    tree = PrefixTree.from_sequences(batch())
    model = tiny_decoder(torch.float64)  # no dropout: its forward draws nothing
    drawn = []

    def loss_fn(i, lp):
        drawn.append(torch.rand(()))
        return -(lp.sum() * drawn[-1])

    torch.manual_seed(5)
    dta_fast.tree_backward(model, tree, loss_fn)
    next_draw = torch.rand(())
    torch.manual_seed(5)
    stream = torch.rand(len(drawn) + 1)
    assert torch.equal(torch.stack(drawn), stream[:-1]) and torch.equal(next_draw, stream[-1])


def test_budget_trades_the_head_window_for_larger_chunks(monkeypatch):
    """Where the budget is tight, a smaller logits window leaves room for larger chunks: the automatic
    choice takes one where that makes the plan cheaper, never a costlier plan than the default
    window's, stays within the budget, and the step runs that window to the per-sequence gradients."""
    vocab = 2048  # a window row (16 KiB in float64) outweighs a token's activations (~9 KiB)
    monkeypatch.setattr(dta_fast.logprobs, "LOGITS_CHUNK_ELEMENTS", 64 * vocab)
    seqs = grpo_batch(1, 48, 6, 40, vocab_size=vocab, seed=3)
    tree = PrefixTree.from_sequences(seqs)
    model = tiny_decoder(torch.float64, vocab_size=vocab)
    memory, forest = MemoryModel.of(model), Forest.of(tree)
    assert memory.logits_rows == 64

    def cost(plan):
        return step_cost(memory, plan)

    def default_window_plans(budget):
        for mode in (False, True):
            try:
                yield largest_fitting_plan(
                    memory, forest, budget, recompute=mode, tolerance=1 / 32, logits_rows=memory.logits_rows
                )
            except ValueError:
                pass

    traded = []
    for size in range(8, tree.num_tokens, 8):
        budget = memory.step_bytes(plan_chunks(tree, size, True))
        plan = plan_for_budget(memory, forest, budget)
        default = min(default_window_plans(budget), key=cost)
        assert memory.step_bytes(plan) <= budget and cost(plan) <= cost(default)
        if plan.logits_rows < memory.logits_rows:
            assert plan.num_chunks < default.num_chunks
            traded.append((budget, plan.logits_rows))
    assert traded
    whole = memory.step_bytes(plan_chunks(tree, tree.num_tokens, False))
    assert plan_for_budget(memory, forest, whole).logits_rows == memory.logits_rows

    _, _, ref_grads = flat_reference(model, seqs, lambda lp: dta_ref.sft_loss(lp, tree.logprob_mask))
    model.zero_grad(set_to_none=True)
    windows = []

    def recording(hidden, head, head_rows, *args):
        windows.extend(w.row_hi - w.row_lo for w in head_rows.windows)
        return dta_fast.logprobs.head_logprobs(hidden, head, head_rows, *args)

    monkeypatch.setattr(engine, "head_logprobs", recording)
    budget, rows = traded[0]
    dta_fast.tree_backward(model, tree, SFTLoss(tree.logprob_mask), memory_budget_bytes=budget)
    assert max(windows) == rows  # chunks longer than the window: the plan's window, not the default
    assert_grads_close(grads_of(model), ref_grads, rel=1e-11)


def _count_layer_forwards(model):
    """A list that grows by one at every forward of a decoder layer's attention module, inside the
    layer's ``forward`` (a checkpointed layer runs it twice: once more in its backward)."""
    calls = []
    for layer in dta_ref.adapt(model).layers:
        attention = layer.self_attn if hasattr(layer, "self_attn") else layer.attn
        attention.register_forward_hook(lambda *args: calls.append(1))
    return calls


@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "keep"])
@pytest.mark.parametrize("chunk", [None, 5])
@pytest.mark.parametrize("kind", ["decoder", "qwen3"])
def test_engine_checkpoints_layers(kind, chunk, recompute):
    """checkpoint_layers=True: every layer's forward runs once more in its chunk's backward, the
    gradients stay exact, and the layers are left as they were."""
    seqs = batch()
    tree = PrefixTree.from_sequences(seqs)
    model = tiny_decoder(torch.float64) if kind == "decoder" else tiny_hf_model(kind, torch.float64, "sdpa")
    rel = 1e-11 if kind == "decoder" else 1e-6  # Hugging Face models take RMSNorm through float32
    ref_lp, _, ref_grads = flat_reference(model, seqs, lambda lp: dta_ref.sft_loss(lp, tree.logprob_mask, "sum"))
    layers = dta_ref.adapt(model).layers
    calls = _count_layer_forwards(model)
    hooked = layers[0].forward = functools.partial(type(layers[0]).forward, layers[0])  # as accelerate's hooks do
    runs = {}
    for checkpoint in (False, True):
        calls.clear()
        model.zero_grad(set_to_none=True)
        lp, _ = dta_fast.tree_backward(
            model,
            tree,
            SFTLoss(tree.logprob_mask, "sum"),
            max_chunk_tokens=chunk,
            recompute=recompute,
            checkpoint_layers=checkpoint,
        )
        runs[checkpoint] = len(calls)
        torch.testing.assert_close(lp, ref_lp, rtol=0, atol=rel)
        assert_grads_close(grads_of(model), ref_grads, rel=rel)
        assert layers[0].forward is hooked and all("forward" not in layer.__dict__ for layer in layers[1:])
    # one more forward of every layer for each chunk that runs a backward
    plan = plan_chunks(tree, chunk or tree.num_tokens, recompute)
    assert runs[True] - runs[False] == len(layers) * plan.num_chunks


def test_layers_the_model_checkpoints_are_counted():
    """A Hugging Face model with gradient_checkpointing_enable() in training mode keeps only its layers'
    inputs: its estimate is that of checkpointed layers, every plan is one, and the engine wraps no
    layer a second time."""
    tree = PrefixTree.from_sequences(batch())
    model = tiny_hf_model("qwen2", torch.float64, "sdpa")
    plain = {c: dta_fast.estimated_step_bytes(model, tree, 5, True, c) for c in (False, True)}
    assert plain[True] < plain[False] and dta_fast.estimated_step_bytes(model, tree, 5) == plain[False]
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert dta_ref.adapt(model).checkpointed_layers == 0  # transformers checkpoints in training mode only
    model.train()
    assert dta_ref.adapt(model).checkpointed_layers == len(dta_ref.adapt(model).layers)
    memory = MemoryModel.of(model)
    assert memory.model_checkpoints and memory.activation < MemoryModel.of(tiny_hf_model("qwen2")).activation
    for checkpoint in (None, False, True):
        assert dta_fast.estimated_step_bytes(model, tree, 5, True, checkpoint) == plain[True]
    plan = choose_plan(
        model, tree, torch.device("cpu"), checked_options(memory_budget_bytes=10**9, checkpoint_layers=False)
    )
    assert plan.checkpoint_layers
    calls = _count_layer_forwards(model)
    dta_fast.tree_backward(model, tree, SFTLoss(tree.logprob_mask), max_chunk_tokens=5, checkpoint_layers=True)
    # the model's own checkpointing, not nested in ours: each layer once more per chunk's backward
    plan = plan_chunks(tree, 5, True)
    assert len(calls) == len(dta_ref.adapt(model).layers) * (2 * plan.num_chunks + int((~plan.keeps_graph).sum()))


def test_budget_checkpoints_layers_where_that_is_cheaper():
    """Where the budget cuts the forest into many chunks, checkpointed layers fit few large ones: the
    automatic choice takes them when the cost model says the second forward costs less than the chunks
    it saves, stays within the budget, picks the cheaper of the best plans with and without them, and
    the step runs it to the per-sequence gradients. checkpoint_layers=False keeps them out."""
    seqs = grpo_batch(1, 48, 6, 40, vocab_size=64, seed=4)
    tree = PrefixTree.from_sequences(seqs)
    model = tiny_decoder(torch.float64)
    memory, forest = MemoryModel.of(model), Forest.of(tree)
    assert memory.checkpointed < memory.activation
    chosen = []
    for size in range(4, tree.num_tokens, 6):
        budget = memory.step_bytes(plan_chunks(tree, size, True))
        plan = plan_for_budget(memory, forest, budget)
        without = plan_for_budget(memory, forest, budget, checkpoint_layers=False)
        with_them = plan_for_budget(memory, forest, budget, checkpoint_layers=True)
        assert not without.checkpoint_layers and with_them.checkpoint_layers and memory.step_bytes(plan) <= budget
        # the search without them, bounded below by the plan with them, loses nothing
        assert step_cost(memory, plan) == min(step_cost(memory, p) for p in (without, with_them))
        if plan.checkpoint_layers:
            assert plan.num_chunks < without.num_chunks
            chosen.append(budget)
    assert chosen
    whole = memory.step_bytes(plan_chunks(tree, tree.num_tokens, False))
    assert not plan_for_budget(memory, forest, whole).checkpoint_layers

    _, _, ref_grads = flat_reference(model, seqs, lambda lp: dta_ref.sft_loss(lp, tree.logprob_mask))
    calls = _count_layer_forwards(model)
    for checkpoint in (None, False):
        calls.clear()
        model.zero_grad(set_to_none=True)
        options = dict(memory_budget_bytes=chosen[0], checkpoint_layers=checkpoint)
        dta_fast.tree_backward(model, tree, SFTLoss(tree.logprob_mask), **options)
        plan = choose_plan(
            model,
            tree,
            torch.device("cpu"),
            checked_options(memory_budget_bytes=chosen[0], checkpoint_layers=checkpoint),
        )
        passes = plan.num_chunks * (2 if checkpoint is None else 1) + int((~plan.keeps_graph).sum())
        assert plan.checkpoint_layers == (checkpoint is None) and len(calls) == passes * len(model.layers)
        assert_grads_close(grads_of(model), ref_grads, rel=1e-11)


def test_checkpoint_layers_must_be_a_bool():
    tree = PrefixTree.from_sequences(batch())
    model = tiny_decoder(torch.float64)
    for bad in (1, "yes"):
        with pytest.raises(TypeError, match="checkpoint_layers must be True, False or None"):
            dta_fast.tree_backward(model, tree, SFTLoss(tree.logprob_mask), checkpoint_layers=bad)
        with pytest.raises(TypeError, match="checkpoint_layers"):
            dta_fast.estimated_step_bytes(model, tree, 4, True, bad)


def test_memory_model_of_moe_and_hybrids():
    """A mixture of experts keeps each token's dispatch to its k experts; a hybrid's linear-attention layers
    hold convolution inputs, not K/V, and what their mixer saves is measured: the same for a weightless
    (meta) model, measured on a CPU copy, as for the model itself, and more than nothing."""
    import transformers

    from dta_fast.chunked.memory import linear_mixer_bytes
    from tests.helpers import tiny_family_model

    moe, dense = tiny_family_model("qwen3-moe"), tiny_family_model("llama")
    k = moe.config.num_experts_per_tok
    shape = dta_ref.adapter.adapt(moe).shape
    assert shape.experts_per_token == k and shape.intermediate == k * moe.config.moe_intermediate_size
    hybrid = tiny_family_model("qwen3.5")
    shape = dta_ref.adapter.adapt(hybrid).shape
    mixer, conv = linear_mixer_bytes(hybrid)
    assert shape.linear_layers == 1 and conv == hybrid.model.layers[0].linear_attn.conv1d.weight.shape[0]
    assert mixer > conv * shape.bytes_per_element  # at least the convolution's input
    with torch.device("meta"):
        weightless = transformers.AutoModelForCausalLM.from_config(hybrid.config).to(torch.float64)
    assert linear_mixer_bytes(weightless) == (mixer, conv)
    memory = MemoryModel.of(hybrid)
    attention_kv = shape.kv_heads * (shape.head_dim + shape.value_dim)
    assert memory.kv == (attention_kv + conv) * shape.bytes_per_element  # one attention, one linear layer
    assert memory.linear_backward == 2 * mixer and MemoryModel.of(dense).linear_backward == 0
    # each token a later chunk continues from keeps its float32 state [value heads, key dim, value dim] and
    # its gradient; a plan whose chunks hand states on costs at most that many more bytes than without
    mixer_module = hybrid.model.layers[0].linear_attn
    state = mixer_module.num_v_heads * mixer_module.head_k_dim * mixer_module.head_v_dim * 4
    assert memory.linear_state == 2 * state and MemoryModel.of(dense).linear_state == 0
    tree = PrefixTree.from_sequences(dta_ref.grpo_batch(2, 12, 3, 8, vocab_size=60, seed=0))
    plan = plan_chunks(tree, 10)
    stateless = dataclasses.replace(memory, linear_state=0)
    extra = memory.step_bytes(plan) - stateless.step_bytes(plan)
    assert plan.exported_held.max() > 0 and 0 < extra <= memory.linear_state * plan.exported_held.max()


def test_estimate_counts_gradients_from_the_first_backward():
    """Gradients the step creates (unset before it) are left out of the first close's moment only:
    the estimate from unset gradients is at most the one with them set, and less by at most their
    bytes."""
    tree = PrefixTree.from_sequences(batch())
    model = tiny_decoder(torch.float64)
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    model.zero_grad(set_to_none=True)
    assert MemoryModel.of(model).new_grads == grads
    unset = {(s, r): dta_fast.estimated_step_bytes(model, tree, s, r) for s in (1, 3, 40) for r in (True, False)}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    assert MemoryModel.of(model).new_grads == 0
    lower = 0
    for (size, recompute), estimate in unset.items():
        with_grads = dta_fast.estimated_step_bytes(model, tree, size, recompute)
        assert with_grads - grads <= estimate <= with_grads
        lower += estimate < with_grads
    assert lower  # one chunk: its close is the first, and its peak
    model.zero_grad(set_to_none=True)


def test_bad_input():
    tree = PrefixTree.from_sequences([[1, 2, 3], [1, 2, 4]])
    model = tiny_decoder(torch.float64)
    sft = SFTLoss(tree.logprob_mask)
    with pytest.raises(ValueError, match="scalar"):
        dta_fast.tree_backward(model, tree, lambda i, lp: lp * 2)
    with pytest.raises(ValueError, match="max_chunk_tokens must be >= 1"):
        dta_fast.tree_backward(model, tree, sft, max_chunk_tokens=0)
    with pytest.raises(TypeError, match="max_chunk_tokens must be an int"):
        dta_fast.tree_backward(model, tree, sft, max_chunk_tokens=2.5)
    with pytest.raises(ValueError, match="too small"):
        dta_fast.tree_backward(model, tree, sft, memory_budget_bytes=1000)
    with pytest.raises(ValueError, match="not both"):
        dta_fast.tree_backward(model, tree, sft, max_chunk_tokens=4, memory_budget_bytes=2**33)
    with pytest.raises(ValueError, match="memory_margin_bytes sets memory aside"):
        dta_fast.tree_backward(model, tree, sft, max_chunk_tokens=4, memory_margin_bytes=2**30)
    with pytest.raises(TypeError, match="unsupported model"):
        dta_fast.tree_backward(torch.nn.Linear(3, 3), tree, sft)
    with pytest.raises(TypeError, match="callable"):
        dta_fast.tree_backward(model, tree, "sft")
    with pytest.raises(TypeError, match="PrefixTree"):
        dta_fast.tree_backward(model, [[1, 2]], sft)
    with pytest.raises(ValueError, match="built for logprobs of shape"):
        dta_fast.tree_backward(model, tree, SFTLoss(torch.ones(3, 2, dtype=torch.bool)))
    with pytest.raises(ValueError, match="attention_impl"):
        dta_fast.tree_backward(model, tree, sft, attention_impl="flash")


def test_a_layer_the_tree_does_not_compute_is_refused_by_name():
    from tests.test_bad_input import short_convolution_model

    tree = PrefixTree.from_sequences([[1, 2, 3]])
    with pytest.raises(ValueError, match="layer 0 of Lfm2ForCausalLM is a 'conv' layer"):
        dta_fast.tree_backward(short_convolution_model(), tree, SFTLoss(tree.logprob_mask))


def _chunks(tree, size, recompute=False):
    return plan_chunks(tree, size, recompute).chunks


def _max_open_chunks(tree, size):
    """Open chunks at the worst moment of the engine's last-in first-out schedule."""
    end, open_ends, worst = tree.subtree_end, [], 0
    for a, b in _chunks(tree, size):
        while open_ends and open_ends[-1] <= a:
            open_ends.pop()
        open_ends.append(int(end[a:b].max()))
        worst = max(worst, len(open_ends))
    return worst


def test_open_chunks_do_not_grow_with_the_forest():
    """Regression: chunks that ran from one branch into its sibling kept every earlier chunk open."""
    small = PrefixTree.from_sequences(agentic_batch(300, 1, 20, 4, 12, 15, 30, every_turn=False))
    large = PrefixTree.from_sequences(agentic_batch(300, 6, 20, 4, 12, 15, 30, every_turn=False))
    assert large.num_tokens > 5 * small.num_tokens
    for size in (64, 200):
        assert _max_open_chunks(large, size) <= _max_open_chunks(small, size) + 1


@pytest.mark.parametrize("recompute", [False, True])
def test_open_chunks_hold_the_current_path(recompute):
    """Up the stack, max_end never grows, and every open chunk holds an ancestor of the next chunk's start."""
    tree = PrefixTree.from_sequences(agentic_batch(40, 3, 8, 3, 6, 9, 5, vocab_size=64, seed=1))
    end, parent = tree.subtree_end.tolist(), tree.parent.tolist()
    for size in (1, 5, 16, 50, 400):
        stack = []  # (start, stop, max_end)
        for a, b in _chunks(tree, size, recompute):
            while stack and stack[-1][2] <= a:
                stack.pop()
            ancestors, p = set(), parent[a]
            while p >= 0:
                ancestors.add(p)
                p = parent[p]
            for start, stop, _ in stack:
                assert ancestors & set(range(start, stop))
            stack.append((a, b, max(end[a:b])))
            assert all(lo[2] >= hi[2] for lo, hi in zip(stack, stack[1:]))


def test_chunks_cross_into_the_next_branch():
    """A chunk starting inside a branch runs on into the next one when the chunk under it stays open anyway."""
    tree = PrefixTree.from_sequences([[1] * 10 + [2] * 6, [1] * 10 + [3] * 6, [1] * 10 + [4] * 6])
    # [0, 12) holds the shared prefix (open to the end); the next chunk crosses from branch 2 into branch 3
    assert _chunks(tree, 12) == [(0, 12), (12, 24), (24, 28)]


def test_recompute_skips_chunks_that_close_at_once(monkeypatch):
    """Recompute mode redoes the forward only of chunks that stay open across others."""
    from dta_fast.chunked.engine import ChunkEngine

    seqs = [[1] * 4 + [2] * 4, [1] * 4 + [3] * 4]
    tree = PrefixTree.from_sequences(seqs)
    model = tiny_decoder(torch.float64)
    calls = []
    run_chunk = ChunkEngine.run_chunk

    def counted(self, c, *args, **kwargs):
        calls.append(int(self.plan.start[c]))
        return run_chunk(self, c, *args, **kwargs)

    monkeypatch.setattr(ChunkEngine, "run_chunk", counted)
    _, _, ref_grads = flat_reference(model, seqs, lambda lp: dta_ref.sft_loss(lp, tree.logprob_mask))
    model.zero_grad(set_to_none=True)
    dta_fast.tree_backward(model, tree, SFTLoss(tree.logprob_mask), max_chunk_tokens=4, recompute=True)
    assert calls == [0, 4, 8, 0]  # the branches [4, 8) and [8, 12) close at once; the prefix is redone
    assert_grads_close(grads_of(model), ref_grads, rel=1e-11)


def test_recompute_chunks_leave_only_shared_prefixes_long_lived():
    """With recompute, chunk ends move so that the chunks staying open (recomputed) are the shared prompts."""
    prompt, task = [1] * 8, [[2] * 3, [3] * 3]
    seqs = [prompt + t + [r] * 5 for t in task for r in (4, 5)]  # prompt -> 2 tasks -> 2 rollouts each
    tree = PrefixTree.from_sequences(seqs)
    end = tree.subtree_end.tolist()

    def long_lived(chunks):
        return [(a, b) for a, b in chunks if max(end[a:b]) > b]

    assert long_lived(_chunks(tree, 12)) == [(0, 12), (12, 24)]  # runs of prompt and rollouts
    # with recompute: the prompt and task prompts alone stay open; the rollout pairs close at once
    assert _chunks(tree, 12, recompute=True) == [(0, 11), (11, 21), (21, 24), (24, 34)]
    assert long_lived(_chunks(tree, 12, recompute=True)) == [(0, 11), (21, 24)]


@pytest.mark.parametrize("recompute", [False, True])
def test_chunks_cover_the_forest_in_order(recompute):
    tree = PrefixTree.from_sequences(batch())
    for size in (1, 3, 17, 10**6):
        chunks = _chunks(tree, size, recompute)
        assert chunks[0][0] == 0 and chunks[-1][1] == tree.num_tokens
        assert all(b1 == a2 for (_, b1), (a2, _) in zip(chunks, chunks[1:]))
        assert all(0 < b - a <= size for a, b in chunks)


def test_token_ids_outside_the_vocabulary():
    model = tiny_decoder(torch.float64)
    tree = PrefixTree.from_sequences([[1, 2, 3], [1, 64]])
    with pytest.raises(ValueError, match="out of range"):
        dta_fast.tree_backward(model, tree, SFTLoss(tree.logprob_mask))
    with pytest.raises(ValueError, match="out of range"):
        dta_fast.tree_logprobs(model, tree)


class _CheckpointedLayer(torch.nn.Module):
    """A decoder layer whose forward runs under torch.utils.checkpoint (recomputed in the backward)."""

    def __init__(self, layer, use_reentrant):
        super().__init__()
        self.layer, self.use_reentrant = layer, use_reentrant

    def forward(self, x, position_ids, attend):
        return torch.utils.checkpoint.checkpoint(self.layer, x, position_ids, attend, use_reentrant=self.use_reentrant)


@pytest.mark.parametrize("trained", ["lm_head", "embed", "layers.0", "layers.1.attn.k_proj", "layers.1.mlp"])
@pytest.mark.parametrize("chunk", [None, 5])
@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "keep"])
def test_partly_frozen_models(trained, chunk, recompute):
    """Only some parameters train (a head, the embedding, one layer, one projection): the gradients of
    those are per-sequence training's, the frozen ones get none. With only the head training, no
    hidden state needs a gradient, and the head's must still come."""
    seqs = batch()
    tree = PrefixTree.from_sequences(seqs)
    model = tiny_decoder(torch.float64)
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith(trained))
    assert any(p.requires_grad for p in model.parameters())
    _, _, expected = flat_reference(model, seqs, lambda lp: dta_ref.sft_loss(lp, tree.logprob_mask))
    dta_fast.tree_backward(model, tree, SFTLoss(tree.logprob_mask), max_chunk_tokens=chunk, recompute=recompute)
    got = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    assert_grads_close(got, expected, rel=1e-10)


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non_reentrant"])
@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "keep"])
@pytest.mark.parametrize("chunk", [None, 5])
def test_checkpointed_layers(use_reentrant, recompute, chunk):
    """Each layer's forward runs twice (the first under no_grad when reentrant): gradients stay exact."""
    seqs = batch()
    tree = PrefixTree.from_sequences(seqs)
    model = tiny_decoder(torch.float64)
    ref_lp, _, ref_grads = flat_reference(model, seqs, lambda lp: dta_ref.sft_loss(lp, tree.logprob_mask))
    model.layers = torch.nn.ModuleList(_CheckpointedLayer(layer, use_reentrant) for layer in model.layers)
    model.zero_grad(set_to_none=True)
    lp, _ = dta_fast.tree_backward(model, tree, SFTLoss(tree.logprob_mask), max_chunk_tokens=chunk, recompute=recompute)
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-12)
    grads = {name.replace(".layer.", "."): g for name, g in grads_of(model).items()}
    assert_grads_close(grads, ref_grads, rel=1e-11)


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_hf_gradient_checkpointing(use_reentrant):
    """A Hugging Face model with gradient_checkpointing_enable() trains to the per-sequence gradients."""
    seqs = batch()
    tree = PrefixTree.from_sequences(seqs)
    model = tiny_hf_model("qwen2", torch.float64, "sdpa")
    ref_lp, _, ref_grads = flat_reference(model, seqs, lambda lp: dta_ref.sft_loss(lp, tree.logprob_mask, "sum"))
    model.train()  # transformers checkpoints only in training mode; the tiny model has no dropout
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    model.zero_grad(set_to_none=True)
    lp, _ = dta_fast.tree_backward(model, tree, SFTLoss(tree.logprob_mask, "sum"), max_chunk_tokens=6)
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-6)
    assert_grads_close(grads_of(model), ref_grads, rel=1e-6)


def test_loss_with_a_direct_parameter_term():
    """A generic loss term that also depends on parameters directly gets that gradient too, exactly."""
    seqs = batch()
    tree = PrefixTree.from_sequences(seqs)
    model = tiny_decoder(torch.float64)
    lengths = tree.lengths - 1
    weight = model.lm_head.weight

    def loss_fn(i, lp):
        return -lp.sum() + 0.01 * (i + 1) * weight.pow(2).sum()

    def total(lp):
        return sum(loss_fn(i, lp[i, : int(lengths[i])]) for i in range(tree.num_sequences))

    _, ref_loss, ref_grads = flat_reference(model, seqs, total)
    model.zero_grad(set_to_none=True)
    _, loss = dta_fast.tree_backward(model, tree, loss_fn, max_chunk_tokens=7)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-14)
    assert_grads_close(grads_of(model), ref_grads, rel=1e-11)


@pytest.mark.parametrize("loss", ["token", "generic"])
def test_a_module_the_forward_does_not_run_keeps_no_gradient(loss):
    """As loss.backward() leaves it: None for a value head beside the model (an optimizer then skips it, where
    a zero gradient would move it through momentum or weight decay), a zero gradient for a parameter the
    forward runs that no term reaches (nothing to score in a chunk, a frozen path)."""
    seqs = [[1, 2, 3, 4], [1, 2, 5], [6, 7]]
    tree = PrefixTree.from_sequences(seqs)
    model = tiny_decoder(torch.float64)
    model.value_head = torch.nn.Linear(32, 1, dtype=torch.float64)
    mask = torch.zeros_like(tree.logprob_mask)
    mask[1, 0] = True  # one term only

    def generic(i, lp):
        return -lp[:1].sum() if i == 1 else lp.sum() * 0

    loss_fn = SFTLoss(mask, "sum") if loss == "token" else generic
    dta_fast.tree_backward(model, tree, loss_fn, max_chunk_tokens=2)
    assert model.value_head.weight.grad is None and model.value_head.bias.grad is None
    assert all(p.grad is not None for n, p in model.named_parameters() if not n.startswith("value_head"))
    flat = dta_ref.flat_logprobs(model, seqs)
    want = torch.autograd.grad(-flat[1, 0], [p for n, p in model.named_parameters() if not n.startswith("value")])
    assert_grads_close(
        {n: p.grad for n, p in model.named_parameters() if not n.startswith("value")},
        dict(zip([n for n, _ in model.named_parameters() if not n.startswith("value")], want)),
        rel=1e-11,
    )


def test_a_generic_loss_may_change_its_argument_in_place():
    seqs = batch()
    tree = PrefixTree.from_sequences(seqs)
    model = tiny_decoder(torch.float64)
    lengths = tree.lengths - 1

    def loss_fn(i, lp):
        lp.clamp_(min=-3.0)  # in place, as on a slice of per-sequence logprobs
        return -lp.sum()

    def total(lp):
        return sum(loss_fn(i, lp[i, : int(lengths[i])].clone()) for i in range(tree.num_sequences))

    _, ref_loss, ref_grads = flat_reference(model, seqs, total)
    model.zero_grad(set_to_none=True)
    _, loss = dta_fast.tree_backward(model, tree, loss_fn, max_chunk_tokens=7)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-14)
    assert_grads_close(grads_of(model), ref_grads, rel=1e-11)


@pytest.mark.parametrize(
    "dtype,accumulator", [(torch.bfloat16, 4), (torch.float16, 4), (torch.float32, 4), (torch.float64, 8)]
)
def test_estimate_counts_kv_gradients_in_float32_at_least(dtype, accumulator):
    """An open chunk's K/V per token: 2 layers x (K, V) x 2 KV heads x head dim 8 elements, in the model's
    dtype, and their gradient accumulators in float32 at least (half-precision models included)."""
    memory = MemoryModel.of(tiny_decoder(dtype))
    elements = 2 * 2 * 2 * 8
    assert memory.kv == elements * torch.empty(0, dtype=dtype).element_size()
    assert memory.kv_grad == elements * accumulator


def test_a_head_without_a_weight_is_named():
    """The fast path sizes its logits windows by the head's weight; another head is refused by name."""
    model = tiny_decoder(torch.float64)
    model.lm_head = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 64, bias=False)).double()
    tree = PrefixTree.from_sequences([[1, 2, 3], [1, 2, 4]])
    assert dta_ref.tree_logprobs(model, tree).shape == (2, 2)  # the reference runs any head
    with pytest.raises(TypeError, match="output head must be a linear layer .* got Sequential"):
        dta_fast.tree_backward(model, tree, SFTLoss(tree.logprob_mask))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0, -5.0])
def test_bad_budgets_and_sizes(bad):
    tree = PrefixTree.from_sequences([[1, 2, 3], [1, 2, 4]])
    model = tiny_decoder(torch.float64)
    with pytest.raises(ValueError, match="memory_budget_bytes must be a finite positive"):
        dta_fast.chunk_tokens_for_budget(model, tree, bad)
    with pytest.raises(ValueError, match="memory_budget_bytes must be a finite positive"):
        dta_fast.tree_backward(model, tree, SFTLoss(tree.logprob_mask), memory_budget_bytes=bad)
    if bad != 0:
        with pytest.raises(ValueError, match="memory_margin_bytes must be a finite non-negative"):
            dta_fast.tree_backward(model, tree, SFTLoss(tree.logprob_mask), memory_margin_bytes=bad)
    if not isinstance(bad, float) or bad.is_integer():
        with pytest.raises(ValueError, match="chunk_tokens must be >= 1"):
            dta_fast.estimated_step_bytes(model, tree, int(bad))
    with pytest.raises(TypeError, match="chunk_tokens must be an int"):
        dta_fast.estimated_step_bytes(model, tree, 2.5)
    with pytest.raises(TypeError, match="memory_budget_bytes must be a number of bytes"):
        dta_fast.chunk_tokens_for_budget(model, tree, "8GiB")


def test_cpu_default_is_one_chunk(monkeypatch):
    """Without chunk size or budget, a CPU model runs the forest as one chunk, with no budget search."""
    from dta_fast.chunked import budget

    tree = PrefixTree.from_sequences(batch())
    model = tiny_decoder(torch.float64)
    chosen = []
    original = engine.ChunkEngine.__init__

    def spy(self, model, tree, plan, *args):
        chosen.append(plan)
        original(self, model, tree, plan, *args)

    monkeypatch.setattr(engine.ChunkEngine, "__init__", spy)
    monkeypatch.setattr(budget, "largest_fitting_plan", None)  # any budget search would fail
    dta_fast.tree_backward(model, tree, SFTLoss(tree.logprob_mask))
    assert [p.chunks for p in chosen] == [[(0, tree.num_tokens)]]


def _recompute_length_by_scan(parent, end, a, n):
    """The recompute rule's chunk length, token by token: the last point where the chunk closes at once;
    else, when its leading tokens' subtrees reach past it, the end of that run, or of its last token
    with two children when the run fills the chunk."""
    close = [k for k in range(1, n + 1) if max(end[a : a + k]) <= a + k]
    if close:
        return close[-1]
    run = next((k for k in range(n) if end[a + k] <= a + n), n)
    if run < n:
        return run
    branching = [k for k in range(n) if parent[a + k + 1 :].count(a + k) >= 2]
    return branching[-1] + 1 if branching else n


def check_plan(tree, size, recompute):
    """Each chunk ends where the size, the chunk under it and (with recompute) the recompute rule say;
    its prefix pieces are exactly the ancestors of its first token, in open chunks, in
    packed order; held and saved count the open chunks; steps close last-in first-out; graded counts
    the open chunks whose K/V some closed chunk read as its prefix (their gradient accumulators exist)."""
    parent, end = tree.parent.tolist(), tree.subtree_end.tolist()
    plan = plan_chunks(tree, size, recompute)
    chunks = plan.chunks
    open_, order, graded, closes = [], [], set(), []
    for step in plan.steps:
        if not step.forward:
            assert open_[-1] == step.chunk
            assert plan.graded[step.chunk] == sum(chunks[o][1] - chunks[o][0] for o in open_ if o in graded)
            graded |= {piece.owner for piece in plan.prefix(step.chunk)}
            closes.append(open_.pop())
            continue
        c = step.chunk
        a, b = chunks[c]
        assert plan.max_end[c] == max(end[a:b])
        n = min(size, (plan.max_end[open_[-1]] if open_ else len(end)) - a)  # the size, or the chunk under's reach
        assert b - a == (_recompute_length_by_scan(parent, end, a, n) if recompute and a + n < len(end) else n)
        ancestors, p = [], parent[a]
        while p >= 0:
            ancestors.append(p)
            p = parent[p]
        got = []
        for piece in plan.prefix(c):
            owner_start, owner_stop = chunks[piece.owner]
            assert piece.owner in open_ and 0 <= piece.lo < piece.hi <= owner_stop - owner_start
            got += range(owner_start + piece.lo, owner_start + piece.hi)
        assert got == sorted(ancestors) and plan.prefix_tokens[c] == len(ancestors)
        open_.append(c)
        order.append(c)
        assert plan.held[c] == sum(chunks[o][1] - chunks[o][0] for o in open_)
        assert plan.saved[c] == sum(plan.prefix_tokens[o] for o in open_)
        assert plan.keeps_graph[c] == (not recompute or plan.max_end[c] <= b)
    assert order == list(range(plan.num_chunks)) and not open_
    assert plan.first_close == closes[0]


@pytest.mark.parametrize("recompute", [False, True])
def test_plan_facts(recompute):
    tree = PrefixTree.from_sequences(agentic_batch(40, 3, 8, 3, 6, 9, 5, vocab_size=64, seed=1) + batch())
    for size in (1, 4, 17, 60, 10**4):
        check_plan(tree, size, recompute)


@pytest.mark.gpu
@pytest.mark.parametrize("margin", [None, 2**50], ids=["default_margin", "margin_larger_than_the_device"])
def test_cuda_default_budget(margin):
    """On CUDA with no chunking options the budget comes from the free memory; a margin that leaves
    nothing still trains (the plan with the smallest estimate), to the per-sequence gradients."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    assert_float32_step_matches_flat("cuda", memory_margin_bytes=margin)


def test_frozen_model_scores_without_backward():
    """A model with nothing to train still gets its logprobs and loss (no backward to run)."""
    seqs = batch()
    tree = PrefixTree.from_sequences(seqs)
    model = tiny_decoder(torch.float64)
    for p in model.parameters():
        p.requires_grad_(False)
    flat = dta_ref.flat_logprobs(model, seqs)
    lp, loss = dta_fast.tree_backward(model, tree, SFTLoss(tree.logprob_mask), max_chunk_tokens=5)
    torch.testing.assert_close(lp, flat, rtol=0, atol=1e-12)
    torch.testing.assert_close(loss, dta_ref.sft_loss(flat, tree.logprob_mask), rtol=1e-12, atol=1e-14)
    assert all(p.grad is None for p in model.parameters())


def _lora_with_dropout(p=0.3):
    """A tiny Qwen2 with PEFT LoRA whose dropout (p) is active: training mode."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=p, init_lora_weights=False
    )
    dtype = torch.float32 if DEVICE == "cuda" else torch.float64  # on a GPU: the kernels and CUDA's generator
    model = peft.get_peft_model(tiny_hf_model("qwen2", dtype, "eager", seed=3).to(DEVICE), config)
    return model.train()


def _dropout_step(loss_fn, tree, seed, **options):
    model = _lora_with_dropout()
    torch.manual_seed(seed)
    logprobs, loss = dta_fast.tree_backward(model, tree, loss_fn, **options)
    return logprobs, loss, {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def test_dropout_masks_replayed_when_a_chunk_is_redone():
    """With dropout active, a chunk redone at its close (recompute) draws its first forward's masks, and
    the generators go on as if it had run once: logprobs and gradients bitwise those of keeping every
    graph (the same chunks). A generic loss's two passes draw the same masks too: the gradient is that
    of the logprobs it returns (bitwise the one-pass TokenLoss's)."""
    tree = PrefixTree.from_sequences(grpo_batch(1, 24, 4, 10, vocab_size=64))
    size = 8
    a, b = plan_chunks(tree, size, True), plan_chunks(tree, size, False)
    assert list(a.start) == list(b.start) and list(a.stop) == list(b.stop)  # the same chunks: the same draws
    assert not a.keeps_graph.all()  # and some are redone
    loss = SFTLoss(tree.logprob_mask)
    redone = _dropout_step(loss, tree, 1, max_chunk_tokens=size, recompute=True)
    kept = _dropout_step(loss, tree, 1, max_chunk_tokens=size, recompute=False)
    assert torch.equal(redone[0], kept[0]) and torch.equal(redone[1], kept[1])
    assert all(torch.equal(redone[2][n], kept[2][n]) for n in kept[2])
    assert not torch.equal(redone[0], _dropout_step(loss, tree, 2, max_chunk_tokens=size)[0])  # dropout draws

    from dta_fast.trainer_common import LinearizedLoss

    weights = torch.randn(tree.num_sequences, tree.max_length - 1, dtype=torch.float64) * tree.logprob_mask
    one_pass = _dropout_step(LinearizedLoss(weights), tree, 1, max_chunk_tokens=size)
    weights = weights.to(DEVICE)
    two_passes = _dropout_step(lambda i, lp: (weights[i, : lp.numel()] * lp).sum(), tree, 1, max_chunk_tokens=size)
    assert torch.equal(one_pass[0], two_passes[0])
    assert_grads_close(two_passes[2], one_pass[2], rel=1e-12 if DEVICE == "cpu" else 1e-5)


@pytest.mark.parametrize("generic", [False, True], ids=["token_loss", "generic_loss"])
def test_grad_scaler_scales_the_backward(generic):
    """float16 mixed precision's GradScaler: the backward runs on the scaled loss, as
    scaler.scale(loss).backward() would, so the gradients are plain training's times the scale and
    scaler.step applies plain training's step; the returned loss is unscaled."""
    from dta_fast.trainer_common import LinearizedLoss

    seqs = batch()
    tree = PrefixTree.from_sequences(seqs)
    weights = torch.randn(tree.num_sequences, tree.max_length - 1, generator=torch.Generator().manual_seed(0))
    weights = weights * tree.logprob_mask
    model = tiny_decoder(torch.float32)
    flat_model = copy.deepcopy(model)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**10) for _ in range(2)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, flat_model)]

    flat_loss = (dta_ref.flat_logprobs(flat_model, seqs) * weights).sum()
    scalers[1].scale(flat_loss).backward()
    if generic:
        loss_fn = lambda i, lp: (weights[i, : lp.numel()] * lp).sum()  # noqa: E731
    else:
        loss_fn = LinearizedLoss(weights)
    _, loss = dta_fast.tree_backward(model, tree, loss_fn, max_chunk_tokens=5, grad_scaler=scalers[0])
    torch.testing.assert_close(loss, flat_loss.detach(), rtol=1e-5, atol=1e-5)
    assert_grads_close(grads_of(model), grads_of(flat_model), rel=1e-4)
    assert max(p.grad.abs().max() for p in flat_model.parameters()) > 100  # scaled: 2**10 times the gradient
    for scaler, optimizer in zip(scalers, optimizers):
        scaler.step(optimizer)
        scaler.update()
    for p, q in zip(model.parameters(), flat_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    with pytest.raises(TypeError, match="grad_scaler must be a torch.amp.GradScaler"):
        dta_fast.tree_backward(model, tree, loss_fn, grad_scaler=1024.0)
