"""verl's FSDP training engines with each micro-batch scored as one prefix tree.

verl (0.9) runs its actor, reference policy and critic on a training engine:
``forward_step`` turns a micro-batch of rollouts (token ids without padding,
one jagged row per rollout) into per-token outputs, log-probabilities and
entropies for the policy or values for the critic, and hands them to the
loss. The engines here are verl's FSDP engines with ``forward_step``
replaced: the micro-batch's rollouts become one prefix tree, every shared
prompt and turn runs once in the forward and once in the backward, and the
outputs are laid out as verl's own (0 where verl's loss never reads). The
loss, its aggregation, the micro-batching, the backward, gradient clipping
and the optimizer step stay verl's.

Importing this module registers the engines in place of verl's FSDP2 ones
(and refuses FSDP1 by name), which is what verl's ``external_lib`` setting
does in every worker::

    actor_rollout_ref.model.external_lib=dta_fast.verl.engine
    critic.model.external_lib=dta_fast.verl.engine

Images (Qwen-VL's ``multi_modal_inputs``) are packed with the rollouts, each
distinct image encoded once (``dta_ref.pack_images``), verl's multimodal
positions checked to be the model's own. What the tree cannot compute
exactly is refused by name: Ulysses sequence parallelism, videos, top-k
distillation, the sum of squared probabilities, routing replay, positions
that do not count each rollout's tokens from 0, and temperatures that differ
between rollouts of one micro-batch.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from verl.utils import tensordict_utils as tu
from verl.utils.device import get_device_id, get_device_name
from verl.workers.engine.base import EngineRegistry
from verl.workers.engine.fsdp import transformer_impl
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead, FSDPEngineWithValueHead
from verl.workers.engine.utils import detach_tree

from dta_ref.adapter import adapt, call_as_forward
from dta_ref.multimodal import pack_images
from dta_ref.values import gather_tree_values, value_head_of

from ..logprobs import gather_logprobs_chunked, packed_hidden
from ..tree import build_tree
from . import images_of_rows

# flags of a micro-batch naming outputs or inputs the tree does not compute
_REFUSED_FLAGS = {
    "distillation_use_topk": "top-k distillation",
    "calculate_sum_pi_squared": "the sum of squared probabilities (calculate_sum_pi_squared)",
    "enable_routing_replay": "routing replay (recorded expert choices follow the flat token order)",
}


class _TreeForwardStep:
    """What both tree engines share: groups kept whole by dynamic batching, and verl's tail of
    ``forward_step``."""

    def forward_backward_batch(self, data, loss_function, forward_only=False):
        _keep_groups_together(data)
        return super().forward_backward_batch(data, loss_function, forward_only)

    def _build_module(self):
        # verl patches models for its padding-free path (Qwen2-VL's attention with a flash-attention forward
        # of its own, which would keep the decoder's attention off the tree); the tree runs its own packed
        # forward, so the engine builds the model without them
        patch, transformer_impl.apply_monkey_patch = transformer_impl.apply_monkey_patch, lambda **kwargs: None
        try:
            return super()._build_module()
        finally:
            transformer_impl.apply_monkey_patch = patch

    def _autocast(self):
        # as verl's forward_step: autocast to the FSDP parameter dtype, none at float32
        dtype = getattr(self, "_autocast_dtype", torch.bfloat16)
        return nullcontext() if dtype == torch.float32 else torch.autocast(get_device_name(), dtype=dtype)

    def _loss(self, model_output, micro_batch, loss_function, forward_only):
        """verl's tail of ``forward_step``: its loss on the outputs, and what it reports."""
        if loss_function is not None:
            loss, metrics = loss_function(
                model_output=model_output, data=micro_batch, dp_group=self.get_data_parallel_group()
            )
        else:
            assert forward_only, "forward_only must be True when loss_function is None"
            loss, metrics = torch.tensor(1.0, device=get_device_name()), {}
        return loss, {"model_output": detach_tree(model_output), "loss": loss.detach().item(), "metrics": metrics}


class TreeFSDPEngineWithLMHead(_TreeForwardStep, FSDPEngineWithLMHead):
    """verl's FSDP policy engine; each micro-batch's log-probabilities and entropies from one prefix tree."""

    def forward_step(self, micro_batch, loss_function, forward_only):
        micro_batch = micro_batch.to(get_device_id())
        rollouts = _Rollouts.of(micro_batch, self)
        temperature = _one_temperature(micro_batch["temperature"])
        entropy = bool(tu.get_non_tensor_data(data=micro_batch, key="calculate_entropy", default=False))
        model, head = self.module, adapt(self.module).head  # FSDP2 shards the model in place

        def tree_forward():
            hidden, tree, _ = packed_hidden(model, rollouts.tree, images=rollouts.images)
            return gather_logprobs_chunked(
                hidden, head, tree, temperature=temperature, entropy=entropy, mask=rollouts.scored
            )

        with self._autocast():
            out = call_as_forward(self.module, tree_forward)
            # [N, Lmax-1] entry t scores token t+1, as verl's entry t; verl's last entry is never read
            model_output = {"log_probs": rollouts.jagged(out.logprobs if entropy else out, pad=1)}
            if entropy:
                model_output["entropy"] = rollouts.jagged(out.entropy, pad=1)
            return self._loss(model_output, micro_batch, loss_function, forward_only)


class TreeFSDPEngineWithValueHead(_TreeForwardStep, FSDPEngineWithValueHead):
    """verl's FSDP critic engine; each micro-batch's values from one prefix tree."""

    def forward_step(self, micro_batch, loss_function, forward_only):
        micro_batch = micro_batch.to(get_device_id())
        rollouts = _Rollouts.of(micro_batch, self)
        model = self.module
        head = value_head_of(model)

        def tree_forward():
            hidden, tree, _ = packed_hidden(model, rollouts.tree, images=rollouts.images)
            return gather_tree_values(hidden, head, tree)

        with self._autocast():
            values = call_as_forward(self.module, tree_forward)  # [N, Lmax]: entry t is token t's value
            return self._loss({"values": rollouts.jagged(values)}, micro_batch, loss_function, forward_only)


class _Rollouts:
    """A micro-batch's rollouts: their prefix tree (and images), the (rollout, step) entries its loss reads,
    and the way back to verl's jagged layout."""

    def __init__(self, tree, lengths, offsets, scored, images=None):
        self.tree, self.lengths, self.offsets, self.scored, self.images = tree, lengths, offsets, scored, images

    @classmethod
    def of(cls, micro_batch, engine) -> _Rollouts:
        _refuse_what_the_tree_cannot_compute(micro_batch, engine)
        input_ids, position_ids = micro_batch["input_ids"], micro_batch["position_ids"]
        if not getattr(input_ids, "is_nested", False):
            raise ValueError("the tree engines read verl's no-padding micro-batches: input_ids must be jagged")
        offsets = input_ids.offsets()
        lengths = offsets.diff()
        sequences = [row.tolist() for row in input_ids.unbind()]
        images = _images_per_row(micro_batch)
        if images is None:
            tree, packed = build_tree(sequences), None
        else:
            tree, packed = pack_images(engine.module, sequences, *images)
        _check_positions(position_ids, offsets, lengths, tree, packed)
        return cls(tree, lengths, offsets, _response_steps(micro_batch, lengths, tree.max_length - 1), packed)

    def jagged(self, values: torch.Tensor, pad: int = 0) -> torch.Tensor:
        """Per-(rollout, step) ``values`` [N, W] as verl's jagged [N, length_i], ``pad`` zero columns added."""
        values = torch.nn.functional.pad(values, (0, pad))
        lengths = self.lengths.to(values.device)
        keep = torch.arange(values.shape[1], device=values.device) < lengths[:, None]
        return torch.nested.nested_tensor_from_jagged(values[keep], self.offsets.to(values.device))


def _images_per_row(micro_batch):
    """verl's ``multi_modal_inputs`` (one dict per rollout) as each rollout's (pixel_values, image_grid_thw);
    None for a text micro-batch. Videos are refused."""
    rows = micro_batch.get("multi_modal_inputs", None) if "multi_modal_inputs" in micro_batch.keys() else None
    return None if rows is None else images_of_rows(rows)


def _check_positions(position_ids, offsets, lengths, tree, images) -> None:
    """verl's positions must be the tree's: each rollout's token count (text), or for a vision-language
    micro-batch its text count over the model's multimodal rotary positions ([4, length] per rollout)."""
    count = torch.arange(int(offsets[-1]), device=offsets.device) - torch.repeat_interleave(offsets[:-1], lengths)
    if images is None:  # text: each position counts the rollout's tokens (on every axis of a VLM's)
        rows = [position_ids.values()] if position_ids.dim() == 2 else position_ids.unbind()
        spans = [count] if position_ids.dim() == 2 else [count[offsets[i] : offsets[i + 1]] for i in range(len(rows))]
        if not all(bool((given == span.to(given.device)).all()) for given, span in zip(rows, spans, strict=True)):
            raise ValueError("position_ids must count the tokens of each rollout from 0 (verl's text positions)")
        return
    if position_ids.dim() != 3:
        raise ValueError("a micro-batch with images needs verl's multimodal positions [batch, 4, length]")
    for i, given in enumerate(position_ids.unbind()):
        given = given.to(images.position_ids.device)
        want = images.position_ids[:, tree.seq_index[i, : int(lengths[i])].to(images.position_ids.device)]
        if given.shape[0] == 4:  # verl's text positions over the three rotary axes
            text, given = given[0], given[1:]
            if not torch.equal(text, count[offsets[i] : offsets[i + 1]].to(text.device)):
                raise ValueError(f"rollout {i}: its text positions do not count its tokens from 0")
        if not torch.equal(given, want):
            raise ValueError(f"rollout {i}: verl's multimodal positions are not the model's own (get_rope_index)")


def _response_steps(micro_batch, lengths, width: int) -> torch.Tensor | None:
    """[N, width] True at the steps that predict a response token (what verl's losses read), or None (all
    steps) when the micro-batch does not say where its responses start."""
    if "prompts" not in micro_batch.keys():
        return None
    prompts = micro_batch["prompts"]
    if getattr(prompts, "is_nested", False):
        prompt_lengths = prompts.offsets().diff()
    else:
        prompt_lengths = micro_batch["attention_mask"][:, : prompts.shape[1]].sum(1)
    prompt_lengths = prompt_lengths.to(lengths.device)
    if (prompt_lengths < 1).any():
        row = int((prompt_lengths < 1).nonzero()[0])
        raise ValueError(f"rollout {row} has no prompt token: its first response token has no context")
    steps = torch.arange(width, device=lengths.device)
    return (steps >= prompt_lengths[:, None] - 1) & (steps < lengths[:, None] - 1)


def _keep_groups_together(data) -> None:
    """With dynamic batching, verl packs rollouts into micro-batches by length, which cuts a prompt's
    group (its rollouts, consecutive in verl's batch) over several trees. Where the batch is made of
    consecutive groups of one size, each within ``max_token_len_per_gpu``, verl's ``force_group_size``
    keeps each group in one micro-batch (the loss is normalised over the whole mini-batch, so how the
    rows are batched does not change it)."""
    dynamic = tu.get_non_tensor_data(data=data, key="use_dynamic_bsz", default=True)
    if not dynamic or tu.get_non_tensor_data(data=data, key="force_group_size", default=1) != 1:
        return
    if "prompts" not in data.keys() or len(data) < 2:
        return
    prompts = data["prompts"]
    if getattr(prompts, "is_nested", False):
        prompts = torch.nested.to_padded_tensor(prompts, padding=-1)
    new_group = torch.ones(len(data), dtype=torch.bool)
    new_group[1:] = (prompts[1:] != prompts[:-1]).any(-1).cpu()
    starts = new_group.nonzero()[:, 0]
    sizes = torch.diff(torch.cat([starts, torch.tensor([len(data)])]))
    if not bool((sizes == sizes[0]).all()) or int(sizes[0]) < 2:
        return
    # verl refuses a forced group of more (flat) tokens than a micro-batch may hold: then groups are cut
    group_tokens = data["input_ids"].offsets().diff().view(-1, int(sizes[0])).sum(1)
    if int(group_tokens.max()) <= tu.get_non_tensor_data(data=data, key="max_token_len_per_gpu", default=0):
        tu.assign_non_tensor(data, force_group_size=int(sizes[0]))


def _refuse_what_the_tree_cannot_compute(micro_batch, engine) -> None:
    if getattr(engine, "ulysses_sequence_parallel_size", 1) > 1:
        raise ValueError("Ulysses sequence parallelism is not supported by the tree engines (set it to 1)")
    for flag, what in _REFUSED_FLAGS.items():
        if tu.get_non_tensor_data(data=micro_batch, key=flag, default=False):
            raise ValueError(f"the tree engines do not compute {what}")


def _one_temperature(temperature) -> float:
    """The micro-batch's temperature: one number, or a per-rollout tensor holding one value."""
    if isinstance(temperature, torch.Tensor):
        values = temperature.flatten().unique()
        if values.numel() != 1:
            raise ValueError(f"the tree engines score a micro-batch at one temperature, got {sorted(values.tolist())}")
        return float(values[0])
    return float(temperature)


class _FSDP1Refused:
    """In place of verl's FSDP1 engines, which the tree engines do not run on."""

    def __init__(self, *args, **kwargs):
        raise ValueError(
            "dta's tree engines run on FSDP2: set strategy=fsdp2 for the actor, the reference policy and the "
            "critic (verl's FSDP1 strategy, 'fsdp', is not supported)"
        )


def register() -> None:
    """The tree engines in place of verl's FSDP2 engines, for policies and critics, wherever verl registered
    those (importing this module does it); verl's FSDP1 engines are refused by name."""
    engines = EngineRegistry._engines  # verl's registry asserts a key is new; replacing means writing it
    for model_type, tree_engine, base in (
        ("language_model", TreeFSDPEngineWithLMHead, FSDPEngineWithLMHead),
        ("value_model", TreeFSDPEngineWithValueHead, FSDPEngineWithValueHead),
    ):
        for backend, replacement in (("fsdp2", tree_engine), ("fsdp", _FSDP1Refused)):
            by_device = engines.get(model_type, {}).get(backend, {})
            for device, engine in list(by_device.items()):
                if engine is base:
                    by_device[device] = replacement


register()
