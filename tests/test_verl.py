"""verl_log_probs on tensors laid out exactly as verl's actor receives them, against verl's own padded forward."""

from __future__ import annotations

import pytest
import torch

from dta_fast.verl import verl_log_probs
from tests.helpers import tiny_family_model, tiny_hf_model

PAD = 0
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.kernel


def verl_micro_batch(prompts, responses):
    """input_ids / attention_mask / position_ids [B, P+R] and responses [B, R] as verl builds them.

    Prompts are left-padded to the longest prompt, responses right-padded to
    the longest response; positions are ``clip(cumsum(mask) - 1, min=0)``.
    """
    P, R = max(map(len, prompts)), max(map(len, responses))
    ids, mask = [], []
    for p, r in zip(prompts, responses, strict=True):
        ids.append([PAD] * (P - len(p)) + p + r + [PAD] * (R - len(r)))
        mask.append([0] * (P - len(p)) + [1] * (len(p) + len(r)) + [0] * (R - len(r)))
    input_ids, attention_mask = torch.tensor(ids), torch.tensor(mask)
    position_ids = torch.clip(torch.cumsum(attention_mask, dim=-1) - 1, min=0)
    return input_ids, attention_mask, position_ids, input_ids[:, P:]


def verl_reference(model, input_ids, attention_mask, position_ids, responses, temperature):
    """verl's actor without padding removal: one padded forward, logits of the response block."""
    R = responses.shape[1]
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    logp = torch.log_softmax(logits[:, -R - 1 : -1].float() / temperature, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(-1, responses[..., None])[..., 0], entropy


PROMPTS = [[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8], [9, 10], [9, 10], [11]]
RESPONSES = [[20, 21, 22], [20, 21, 23, 24, 25], [30], [20, 21, 22], [40, 41], [50, 51, 52, 53]]


@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3.5", "gpt-oss"])  # a hybrid; sinks, windows, MoE
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_verl_log_probs_equal_verls_padded_forward(family, temperature):
    if family in ("qwen2", "llama"):
        model = tiny_hf_model(family, torch.float32, "sdpa", seed=2).to(DEVICE).train()
    else:
        model = tiny_family_model(family, torch.float32, seed=2).to(DEVICE).train()  # eager: GPT-OSS has no sdpa
    batch = tuple(x.to(DEVICE) for x in verl_micro_batch(PROMPTS, RESPONSES))
    response_mask = batch[1][:, -batch[3].shape[1] :].bool()
    out = verl_log_probs(model, *batch, temperature=temperature, calculate_entropy=True)
    want_lp, want_entropy = verl_reference(model, *batch, temperature)
    torch.testing.assert_close(out.log_probs[response_mask], want_lp[response_mask], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.entropy[response_mask], want_entropy[response_mask], rtol=1e-5, atol=1e-5)
    assert (out.log_probs[~response_mask] == 0).all() and (out.entropy[~response_mask] == 0).all()
    # and the same gradient for a loss over the response tokens
    weights = torch.randn(response_mask.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE) * response_mask
    got = torch.autograd.grad((out.log_probs * weights).sum(), list(model.parameters()))
    want = torch.autograd.grad((want_lp * weights).sum(), list(model.parameters()))
    got, want = torch.cat([g.flatten() for g in got]), torch.cat([g.flatten() for g in want])
    assert float((got - want).norm() / want.norm()) < 1e-5
    assert verl_log_probs(model, *batch).entropy is None


def _without_a_prompt(batch, row=5):
    """Row ``row``'s prompt masked out, its positions recounted: a response with nothing before it."""
    mask = batch[1].clone()
    mask[row, : -batch[3].shape[1]] = 0
    return batch[0], mask, torch.clip(mask.cumsum(-1) - 1, min=0), batch[3]


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda b: (b[0], b[1], b[2], b[3].roll(1, 0)), "last response_length columns"),
        (lambda b: (b[0], b[1], b[2] + 1, b[3]), "count the tokens of each row"),
        (lambda b: (b[0], b[1], b[2][:, None].expand(-1, 3, -1), b[3]), "multimodal positions need multi_modal_inputs"),
        (lambda b: (b[0], b[1], b[2], b[3][0]), "responses must be a 2-D tensor"),
        (lambda b: (b[0], torch.where(b[1] == 1, 1, 0).index_fill(1, torch.tensor([5]), 0), b[2], b[3]), "contiguous"),
        (lambda b: (b[0], b[1][:, 1:], b[2], b[3]), "attention_mask must be .batch, length. like input_ids"),
        (lambda b: (b[0][0], b[1][0], b[2][0], b[3]), "input_ids must be a 2-D tensor"),
        (_without_a_prompt, "row 5 has no prompt token"),
    ],
    ids=[
        "responses-not-the-tail",
        "shifted-positions",
        "mrope-positions",
        "1-d-responses",
        "gap-in-mask",
        "mask-shape",
        "1-d-input-ids",
        "no-prompt",
    ],
)
def test_verl_layout_errors(change, message):
    model = tiny_hf_model("qwen2", torch.float32, "sdpa")
    with pytest.raises(ValueError, match=message):
        verl_log_probs(model, *change(verl_micro_batch(PROMPTS, RESPONSES)))


def test_shared_scoring_refuses_a_row_without_a_prompt():
    """The scoring TreeGRPOTrainer shares with verl (block_logprobs_and_entropy) refuses a completion with
    nothing before it, as verl_log_probs does: its first token has no context, and a logprob of 0 would
    read as a certain token (ratio 1, no gradient)."""
    from dta_fast.trainer_common import block_logprobs_and_entropy

    model = tiny_hf_model("qwen2", torch.float32, "sdpa")
    input_ids, mask, _, responses = _without_a_prompt(verl_micro_batch(PROMPTS, RESPONSES))
    with pytest.raises(ValueError, match="row 5 has no prompt token"):
        block_logprobs_and_entropy(model, input_ids, mask, input_ids.shape[1] - responses.shape[1])


@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3"])
def test_verl_log_probs_under_autocast(family):
    """verl's actor (and TRL with bf16=True) scores a float32 model under bfloat16 autocast, where RoPE
    turns q and k back to float32 and v stays bfloat16: tree attention casts them as SDPA does, and the
    result is as close to the float32 computation as the model's own padded forward under autocast."""
    model = tiny_hf_model(family, torch.float32, "sdpa", seed=2).to(DEVICE).train()
    batch = tuple(x.to(DEVICE) for x in verl_micro_batch(PROMPTS, RESPONSES))
    response_mask = batch[1][:, -batch[3].shape[1] :].bool()
    exact = verl_reference(model, *batch, 1.0)[0][response_mask].detach()
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        own = verl_reference(model, *batch, 1.0)[0][response_mask]
        out = verl_log_probs(model, *batch).log_probs[response_mask]
    own_error, error = (own - exact).abs().max(), (out - exact).abs().max()
    assert 0 < own_error < 0.1 and error <= 2 * own_error, (float(own_error), float(error))
    (grad,) = torch.autograd.grad(out.sum(), model.model.embed_tokens.weight)  # the backward runs too
    assert grad.dtype == torch.float32 and grad.isfinite().all()


def verl_critic_reference(critic, input_ids, attention_mask, position_ids, responses, value_head=None):
    """verl's critic without padding removal: one padded forward, the output before each response token."""
    R = responses.shape[1]
    if value_head is None:
        values = critic(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    else:
        out = critic(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                     output_hidden_states=True)  # fmt: skip
        values = value_head(out.hidden_states[-1])
    return values[:, -R - 1 : -1, 0] * attention_mask[:, -R:]


@pytest.mark.parametrize("critic", ["token-classifier", "lm+value-head"])
def test_verl_values_equal_verls_padded_critic(critic):
    """Values [B, R] and the gradient of a value loss: those of verl's critic on the padded micro-batch."""
    from dta_fast.verl import verl_values
    from tests.test_values import token_classifier

    head = None
    if critic == "token-classifier":
        model = token_classifier("qwen2-sliding", torch.float32)
    else:
        model = tiny_hf_model("llama", torch.float32, "sdpa", seed=2)
        head = torch.nn.Linear(model.config.hidden_size, 1)
    model = model.to(DEVICE).train()
    head = head and head.to(DEVICE)
    batch = tuple(x.to(DEVICE) for x in verl_micro_batch(PROMPTS, RESPONSES))
    response_mask = batch[1][:, -batch[3].shape[1] :].bool()
    got = verl_values(model, *batch, value_head=head)
    want = verl_critic_reference(model, *batch, value_head=head)
    assert got.shape == batch[3].shape and (got[~response_mask] == 0).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    returns = torch.randn(got.shape, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    params = list(model.parameters()) + ([] if head is None else list(head.parameters()))
    loss = [((v - returns) ** 2 * response_mask).sum() for v in (got, want)]
    grads = [torch.autograd.grad(x, params, allow_unused=True) for x in loss]  # an LM's own head is unused
    got_g, want_g = (torch.cat([g.flatten() for g in gs if g is not None]) for gs in grads)
    assert [g is None for g in grads[0]] == [g is None for g in grads[1]]
    assert want_g.norm() > 0 and float((got_g - want_g).norm() / want_g.norm()) < 1e-5


def test_verl_values_checks_the_micro_batch():
    """The critic's micro-batch gets the actor's checks, and a row with no state before its response is refused."""
    from dta_fast.verl import verl_values
    from tests.test_values import token_classifier

    critic = token_classifier("qwen2-sliding", torch.float32)
    batch = verl_micro_batch(PROMPTS, RESPONSES)
    with pytest.raises(ValueError, match="count the tokens of each row"):
        verl_values(critic, batch[0], batch[1], batch[2] + 1, batch[3])
    with pytest.raises(ValueError, match="row 5 has no prompt token"):
        verl_values(critic, *_without_a_prompt(batch))
    with pytest.raises(TypeError, match="no value head"):
        verl_values(tiny_hf_model("qwen2", torch.float32, "sdpa"), *batch)


def test_verl_log_probs_with_images():
    """A Qwen2.5-VL micro-batch as verl lays it out (multi_modal_inputs per row, positions [B, 4, L]: the
    text count over the model's own rotary positions): each response token's logprob and gradient are
    each rollout alone's, each distinct image encoded once; wrong positions and videos are refused."""
    from tests.helpers import IMAGE, VISION_END, VISION_START, tiny_vl_model

    model = tiny_vl_model("qwen2.5-vl")
    g = torch.Generator().manual_seed(3)
    pictures = [(torch.randn(16, 12, generator=g, dtype=torch.float64), torch.tensor([[1, 4, 4]])) for _ in range(2)]
    prompt = [[1, 3, VISION_START] + [IMAGE] * 4 + [VISION_END, 5 + k] for k in range(2)]
    prompts, responses = [prompt[0]] * 3 + [prompt[1]] * 2, [[10, 11], [10, 12, 13], [14], [20, 21], [22]]
    rows = [pictures[0]] * 3 + [pictures[1]] * 2
    input_ids, attention_mask, text, responses_t = verl_micro_batch(prompts, responses)
    positions = torch.zeros(len(rows), 4, input_ids.shape[1], dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        ids = torch.tensor([p + r])
        rope, _ = model.model.get_rope_index(ids, (ids == IMAGE).int(), image_grid_thw=rows[i][1])
        real = attention_mask[i].bool()
        positions[i, 0], positions[i, 1:, real] = text[i], rope[:, 0]
    inputs = [{"pixel_values": x, "image_grid_thw": grid} for x, grid in rows]
    seen = []
    forward = model.model.visual.forward
    model.model.visual.forward = lambda x, **kw: seen.append(len(x)) or forward(x, **kw)
    out = verl_log_probs(model, input_ids, attention_mask, positions, responses_t, multi_modal_inputs=inputs)
    assert seen == [32]  # two distinct images, 16 patches each, once
    got_loss, want_loss = 0, 0
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        ids = torch.tensor([p + r])
        logits = model(input_ids=ids, pixel_values=rows[i][0], image_grid_thw=rows[i][1],
                       mm_token_type_ids=(ids == IMAGE).int()).logits[0, len(p) - 1 : -1]  # fmt: skip
        want = torch.log_softmax(logits.double(), -1).gather(-1, ids[0, len(p) :, None])[:, 0]
        torch.testing.assert_close(out.log_probs[i, : len(r)].double(), want.detach(), rtol=1e-10, atol=1e-10)
        w = torch.randn(len(r), generator=g, dtype=torch.float64)
        got_loss, want_loss = got_loss + (out.log_probs[i, : len(r)] * w).sum(), want_loss + (want * w).sum()
    params = list(model.parameters())
    got = torch.cat([x.flatten() for x in torch.autograd.grad(got_loss, params)])
    want = torch.cat([x.flatten() for x in torch.autograd.grad(want_loss, params)])
    assert float((got - want).norm() / want.norm()) < 1e-6  # the vision tower's gradient included
    wrong = positions.clone()
    wrong[0, 2, -3] += 1
    with pytest.raises(ValueError, match="not the model's own"):
        verl_log_probs(model, input_ids, attention_mask, wrong, responses_t, multi_modal_inputs=inputs)
    with pytest.raises(ValueError, match="position_ids must be \\[batch, 3 or 4, length\\] with images"):
        verl_log_probs(model, input_ids, attention_mask, text, responses_t, multi_modal_inputs=inputs)
    videos = [dict(row, pixel_values_videos=row["pixel_values"]) for row in inputs]
    with pytest.raises(ValueError, match="not \\['pixel_values_videos'\\]"):
        verl_log_probs(model, input_ids, attention_mask, positions, responses_t, multi_modal_inputs=videos)
