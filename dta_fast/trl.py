"""TRL's GRPOTrainer, scoring each micro-batch as one prefix tree.

:class:`TreeGRPOTrainer` is ``trl.GRPOTrainer`` with one method replaced:
``_get_per_token_logps_and_entropies``, through which GRPOTrainer computes
the policy's, the old policy's and the reference model's per-token logprobs
(and the entropies). Given the micro-batch's ``[prompt | completion]`` rows
(left-padded prompts, right-padded completions, multi-turn tool output
included), it builds one prefix tree of the rows, runs one packed forward
over it and returns the same ``[B, logits_to_keep]`` tensors. Everything
else (generation, rewards, advantages, the loss and its options, logging) is
GRPOTrainer's own, so the loss and the gradients are GRPOTrainer's up to
float rounding. The trainer logs the micro-batch's compression ratio as
``tree/compression_ratio``.

Sharing happens inside a micro-batch: the G generations of a prompt are
contiguous in TRL's batches, so a ``per_device_train_batch_size`` that is a
multiple of ``num_generations`` keeps every group in one tree.

With ``TreeGRPOConfig(tree_memory_budget_bytes=...)`` (or
``tree_max_chunk_tokens=...``) the training forward and backward run depth-first in chunks
(``dta_fast.tree_backward``) within
that activation budget (``tree_checkpoint_layers`` says whether the layers run under activation
checkpointing; by default the budget's plan decides): the logprobs are computed without a graph, GRPO's
own loss gives d loss / d logprob, and the chunked pass backpropagates
``sum(g * logprob)``, which has the same parameter gradient (one extra forward).
"""

from __future__ import annotations

import functools
import warnings
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from trl import GRPOConfig, GRPOTrainer
from trl.kernels import ChunkedLogProbFunction

from dta_ref.hf import ATTENTION_DROPOUT_REFUSED, attention_dropout_in
from dta_ref.multimodal import pack_images
from dta_ref.padded import PaddedLayout
from dta_ref.rollout import RolloutCache

from .chunked import tree_backward
from .chunked.options import checked_chunking
from .rollout import speculative_sample
from .trainer_common import LinearizedLoss, block_logprobs_and_entropy, dropout_in
from .tree import build_tree


@dataclass
class TreeGRPOConfig(GRPOConfig):
    """GRPOConfig with the tree path's own option."""

    tree_memory_budget_bytes: int | None = field(
        default=None,
        metadata={
            "help": "Activation-memory budget of the training forward + backward: train depth-first in chunks "
            "through dta_fast.tree_backward instead of one packed forward (None: one packed forward)."
        },
    )
    tree_max_chunk_tokens: int | None = field(
        default=None,
        metadata={"help": "Train depth-first in chunks of at most this many tree tokens (instead of a budget)."},
    )
    tree_checkpoint_layers: bool | None = field(
        default=None,
        metadata={
            "help": "With chunks: run the layers under activation checkpointing (True), not (False), or as the "
            "budget's plan decides (None). Layers the model checkpoints itself (gradient_checkpointing) stay so."
        },
    )
    tree_scope: str = field(
        default="micro_batch",
        metadata={
            "help": "What one training tree holds: 'micro_batch' (each micro-batch, GRPOTrainer's own split) or "
            "'optimizer_step' (every micro-batch of one optimizer step as one forest, trained depth-first within "
            "the memory budget: a group cut by a micro-batch boundary shares its prompt again)."
        },
    )

    tree_generation: bool = field(
        default=False,
        metadata={
            "help": "Sample completions with dta_fast.speculative_sample, earlier completions of a prompt (kept "
            "across steps in a RolloutCache) drafting for it, instead of transformers' generate: the same "
            "sampling distribution (temperature, top-k, top-p), fewer forwards once completions repeat."
        },
    )

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.tree_generation, bool):
            raise TypeError(f"tree_generation must be True or False, got {self.tree_generation!r}")
        if self.tree_generation and self.use_vllm:
            raise ValueError("tree_generation replaces transformers' generate; it does not combine with use_vllm")
        if self.tree_scope not in ("micro_batch", "optimizer_step"):
            raise ValueError(f"tree_scope must be 'micro_batch' or 'optimizer_step', got {self.tree_scope!r}")
        if self.tree_scope == "optimizer_step" and self.steps_per_generation % self.gradient_accumulation_steps:
            raise ValueError(
                f"tree_scope='optimizer_step' trains an optimizer step's micro-batches together, so they must come "
                f"from one generation: steps_per_generation ({self.steps_per_generation}) must be a multiple of "
                f"gradient_accumulation_steps ({self.gradient_accumulation_steps})"
            )
        # checked here rather than at the first training step, after a round of generation
        chunk, budget, _ = checked_chunking(self.tree_max_chunk_tokens, self.tree_memory_budget_bytes, None, "tree_")
        if self.tree_checkpoint_layers is not None:
            if not isinstance(self.tree_checkpoint_layers, bool):
                got = self.tree_checkpoint_layers
                raise TypeError(f"tree_checkpoint_layers must be True, False or None, got {got!r}")
            if chunk is None and budget is None:
                raise ValueError(
                    "tree_checkpoint_layers applies to chunks: set tree_max_chunk_tokens or "
                    "tree_memory_budget_bytes too"
                )


VOCAB_CHUNK = 32768  # vocabulary columns per tile of TRL's fused head


def trl_vocab_head(hidden_rows, weight, targets, temperature, float32=False):
    """(logprob, entropy) of each row through TRL's own fused head: GRPOTrainer's numerics, no [rows, V] logits.
    ``float32``: GRPOConfig's cast_lm_head_to_fp32, the projection in float32 outside autocast, as TRL's head."""
    with torch.autocast(hidden_rows.device.type, enabled=False) if float32 else nullcontext():
        logprobs, entropy, *_ = ChunkedLogProbFunction.apply(
            hidden_rows.float() if float32 else hidden_rows,
            weight,
            None,
            targets,
            temperature,
            VOCAB_CHUNK,
            None,
            1.0,
            ("entropy",),
        )
    return logprobs, entropy


def behaviour_logprobs(kept, input_ids, logits_to_keep) -> torch.Tensor | None:
    """The sampler's logprobs of ``kept`` ((prompt, completion, logprobs) per row) as GRPOTrainer lays out
    its old logprobs: [B, logits_to_keep], 0 past each completion. None unless ``input_ids`` holds exactly
    those rows, in order (left-padded prompts, then the completions)."""
    if len(kept) != input_ids.size(0):
        return None
    ids, first = input_ids.cpu(), input_ids.size(1) - logits_to_keep
    out = torch.zeros(len(kept), logits_to_keep, dtype=kept[0][2].dtype if kept else torch.float32)
    for r, (prompt, completion, logprobs) in enumerate(kept):
        n = len(completion)
        if (
            n > logits_to_keep
            or len(prompt) > first
            or ids[r, first - len(prompt) : first].tolist() != list(prompt)
            or ids[r, first : first + n].tolist() != list(completion)
        ):
            return None
        out[r, :n] = logprobs
    return out.to(input_ids.device)


class TreeGRPOTrainer(GRPOTrainer):
    """``trl.GRPOTrainer`` whose per-token logprobs come from one prefix tree per micro-batch (same constructor)."""

    _UNSUPPORTED_INPUTS = (
        "pixel_values",
        "image_grid_thw",
        "num_images",
        "pixel_attention_mask",
        "spatial_shapes",
        "num_tiles",
        "image_sizes",
        "token_type_ids",
        "mm_token_type_ids",
        "image_position_ids",
    )

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if attention_dropout_in(self.model) > 0:  # TRL's disable_dropout leaves this rate; training would refuse it
            raise ValueError(ATTENTION_DROPOUT_REFUSED)
        self._step_losses = None  # tree_scope="optimizer_step": each micro-batch's loss of the current step
        self._rollout_cache = RolloutCache() if getattr(self.args, "tree_generation", False) else None
        self._sampling = self._tree_sampling() if self._rollout_cache is not None else None
        self._behaviour = None  # the last generation's (prompt, completion, logprobs), while GRPOTrainer wants them
        if self._chunking is not None and self.aux_loss_enabled:
            raise ValueError(
                "tree_memory_budget_bytes / tree_max_chunk_tokens train through d loss / d logprob only, and the MoE "
                "router's auxiliary loss is a loss on router logits: leave the tree_ chunking options unset (one "
                "packed forward computes both) or set router_aux_loss_coef=0"
            )
        dropout = dropout_in(self.model) if self._chunking is not None else None
        if dropout is not None:
            raise ValueError(
                "tree_memory_budget_bytes / tree_max_chunk_tokens score GRPO's loss in one pass and train in "
                f"another, whose dropout masks would differ from the first's (dropout in {dropout}): the "
                "gradient would not be GRPO's. Set the dropout to 0 (LoraConfig(lora_dropout=0.0)) or leave "
                "the tree_ chunking options unset (one packed forward, GRPO's own gradient)"
            )

    @property
    def _whole_step(self) -> bool:
        return getattr(self.args, "tree_scope", "micro_batch") == "optimizer_step"

    @property
    def _chunking(self) -> dict | None:
        """tree_backward's chunking options, or None for one packed forward (with tree_scope="optimizer_step",
        the automatic budget)."""
        budget = getattr(self.args, "tree_memory_budget_bytes", None)
        size = getattr(self.args, "tree_max_chunk_tokens", None)
        if budget is None and size is None:
            return {} if self._whole_step else None
        checkpoint = getattr(self.args, "tree_checkpoint_layers", None)
        return dict(memory_budget_bytes=budget, max_chunk_tokens=size, checkpoint_layers=checkpoint)

    def _log_compression(self, tree) -> None:
        mode = "train" if self.model.training else "eval"
        self._metrics[mode]["tree/compression_ratio"].append(tree.compression_ratio)

    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **multimodal,
    ):
        behaviour, self._behaviour = self._behaviour, None  # kept for the first scoring after generation only
        if behaviour is not None and model is self.model and not (torch.is_grad_enabled() or compute_entropy):
            logps = behaviour_logprobs(behaviour, input_ids, logits_to_keep)
            if logps is not None:
                return logps, None, None
        images = self._images_per_row(input_ids, **multimodal)
        if images is None and any(multimodal.get(name) is not None for name in self._UNSUPPORTED_INPUTS):
            warnings.warn(
                "TreeGRPOTrainer: these multimodal inputs are not on the tree path (it takes Qwen-VL's "
                "pixel_values, image_grid_thw and num_images); this batch is scored by GRPOTrainer's own path",
                stacklevel=2,
            )
            return super()._get_per_token_logps_and_entropies(
                model,
                input_ids,
                attention_mask,
                logits_to_keep,
                batch_size,
                compute_entropy,
                compute_aux_loss,
                **multimodal,
            )
        batch_size = batch_size or input_ids.size(0)
        first = input_ids.size(1) - logits_to_keep  # the completion block's first column
        head = functools.partial(trl_vocab_head, float32=self.args.cast_lm_head_to_fp32)
        logps, entropies, aux_losses = [], [], []
        for start in range(0, input_ids.size(0), batch_size):
            rows = slice(start, start + batch_size)
            with self.accelerator.autocast():
                lp, ent, tree, aux = block_logprobs_and_entropy(
                    model, input_ids[rows], attention_mask[rows], first, self.temperature, head, compute_aux_loss,
                    images=None if images is None else tuple(x[rows] for x in images),
                )  # fmt: skip
            self._log_compression(tree)
            logps.append(lp)
            entropies.append(ent)
            aux_losses.append(aux)
        aux_loss = torch.stack(aux_losses).mean() if compute_aux_loss else None  # per slice, as GRPOTrainer
        return torch.cat(logps), torch.cat(entropies) if compute_entropy else None, aux_loss

    _QWEN_VL_INPUTS = ("pixel_values", "image_grid_thw", "num_images", "mm_token_type_ids")

    def _images_per_row(self, input_ids, **multimodal):
        """Qwen-VL's image inputs (one pixel_values and image_grid_thw for the batch, num_images per row)
        split per row, for the tree; None when the batch has none, or inputs of another kind."""
        if multimodal.get("pixel_values") is None or multimodal.get("image_grid_thw") is None:
            return None
        if any(multimodal.get(n) is not None for n in self._UNSUPPORTED_INPUTS if n not in self._QWEN_VL_INPUTS):
            return None
        types = multimodal.get("mm_token_type_ids")
        if types is not None and bool((types > 1).any()):
            raise ValueError("TreeGRPOTrainer takes images on the tree path, not videos")
        grids, counts = multimodal["image_grid_thw"], multimodal.get("num_images")
        counts = [len(grids)] if counts is None and input_ids.size(0) == 1 else list(counts)
        grids_per_row = list(torch.split(grids, counts))
        patches = torch.split(multimodal["pixel_values"], [int(g.prod(-1).sum()) for g in grids_per_row])
        return list(patches), grids_per_row

    def _tree_sampling(self) -> dict:
        """speculative_sample's arguments from GRPOTrainer's generation config; what it cannot draw exactly
        is refused by name."""
        g = self.generation_config
        refused = {
            "min_p": g.min_p,
            "repetition_penalty": None if g.repetition_penalty in (None, 1.0) else g.repetition_penalty,
            "num_beams": None if g.num_beams in (None, 1) else g.num_beams,
            "suppress_tokens": g.suppress_tokens or None,
            "no_repeat_ngram_size": g.no_repeat_ngram_size or None,
        }
        refused = {name: value for name, value in refused.items() if value is not None}
        if refused:
            raise ValueError(
                f"tree_generation draws with temperature, top_k and top_p only; the generation config sets {refused}"
            )
        greedy = not g.do_sample
        return dict(
            temperature=0.0 if greedy else g.temperature,
            top_k=None if greedy or not g.top_k else g.top_k,
            top_p=None if greedy or g.top_p in (None, 1.0) else g.top_p,
            eos_token_id=list(self.eos_token_ids),
        )

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if self._rollout_cache is None or images is not None or multimodal_fields:
            return super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        model = self.accelerator.unwrap_model(self.model)
        with self.accelerator.autocast():
            out = speculative_sample(
                model, [list(p) for p in prompt_ids], self.max_completion_length, cache=self._rollout_cache,
                **self._sampling,
            )  # fmt: skip
        if self._behaviour_wanted():
            self._behaviour = list(zip(prompt_ids, out.completions, out.logprobs, strict=True))
        mode = "train" if self.model.training else "eval"
        stats = out.stats
        self._metrics[mode]["tree/accepted_draft_tokens"].append(stats.get("accepted_tokens", 0))
        self._metrics[mode]["tree/tokens_per_verify_step"].append(
            stats.get("generated_tokens", 0) / max(1, stats.get("verify_steps", 0))
        )
        return out.completions, None

    def _behaviour_wanted(self) -> bool:
        """Whether GRPOTrainer will next score the new completions with the policy that drew them (its old
        logprobs, when generation is out of step with the optimizer), and the sampler's own logprobs are
        those numbers: drawn from the whole softmax at GRPOTrainer's temperature (no top-k, no top-p), with
        no tool inserting tokens the policy did not draw."""
        every = self.args.steps_per_generation * self.num_iterations
        s = self._sampling
        return (
            self.args.gradient_accumulation_steps % every != 0
            and s["temperature"] == self.temperature
            and s["top_k"] is None
            and s["top_p"] is None
            and not getattr(self, "tools", None)
        )

    def _compute_loss(self, model, inputs):
        chunking = self._chunking
        # evaluation (prediction_step, under no_grad) only scores: GRPOTrainer's loss on the packed logprobs
        if chunking is None or not torch.is_grad_enabled():
            return super()._compute_loss(model, inputs)
        if self._entropy_bonus_enabled:
            raise ValueError(
                "tree_memory_budget_bytes / tree_max_chunk_tokens / tree_scope='optimizer_step' train through "
                "d loss / d logprob only: an entropy bonus (entropy_coef != 0 or adaptive entropy) is not "
                "supported with them"
            )
        if self.accelerator.num_processes > 1:
            raise ValueError("tree_memory_budget_bytes / tree_max_chunk_tokens / tree_scope run on one process only")
        if not self._whole_step:
            batches = [inputs]
        elif self._step % self.current_gradient_accumulation_steps == 0 or self._step_losses is None:
            # the step's first micro-batch: the whole step's micro-batches (all in the generation's buffer)
            first, spg = self._step, self.args.steps_per_generation
            batches = [
                self._buffered_inputs[s % spg] for s in range(first, first + self.current_gradient_accumulation_steps)
            ]
        else:  # trained with the step's first micro-batch; this is its loss, which GRPOTrainer logged then
            return self._step_losses[self._step % self.current_gradient_accumulation_steps]
        losses = self._train_as_one_tree(model, batches, chunking)
        self._step_losses = losses if self._whole_step else None
        return losses[0]

    def _train_as_one_tree(self, model, batches: list[dict], chunking: dict) -> list[torch.Tensor]:
        """GRPOTrainer's own loss on each micro-batch of ``batches``, from logprobs that are leaves (their
        normalisation as GRPOTrainer gives it, micro-batch by micro-batch), then one backward of all the
        micro-batches' rows as one tree, depth-first within the budget, of ``sum(g * logprob)``: the
        parameter gradient GRPOTrainer accumulates over them. Returns each micro-batch's loss, which
        depends on its leaf only (the trainer's backward of it leaves the parameters alone)."""
        rows = [torch.cat([b["prompt_ids"], b["completion_ids"]], dim=1) for b in batches]
        masks = [torch.cat([b["prompt_mask"], b["completion_mask"]], dim=1) for b in batches]
        input_ids, attention_mask = torch.cat(rows), torch.cat(masks)  # one generation: the same widths
        completion = batches[0]["completion_ids"].size(1)
        multimodal = [{k: b[k] for k in self._QWEN_VL_INPUTS if b.get(k) is not None} for b in batches]
        parts = [(input_ids, attention_mask, {})]  # one packed scoring of every row
        if any(multimodal):  # ... or each micro-batch's rows with their images
            parts = list(zip(rows, masks, multimodal, strict=True))
        with torch.no_grad():
            scored = [
                self._get_per_token_logps_and_entropies(
                    model, ids, mask, completion, batch_size=ids.size(0), compute_entropy=True, **mm
                )
                for ids, mask, mm in parts
            ]
        logps, entropies = (torch.cat([x[i] for x in scored]) for i in (0, 1))
        losses, grads, start = [], [], 0
        original = self._get_per_token_logps_and_entropies
        for batch, ids in zip(batches, rows):
            stop = start + ids.size(0)
            leaf = logps[start:stop].detach().requires_grad_(True)
            self._get_per_token_logps_and_entropies = lambda *a, leaf=leaf, e=entropies[start:stop], **k: (
                leaf,
                e,
                None,
            )
            try:
                loss = super()._compute_loss(model, batch)
            finally:
                self._get_per_token_logps_and_entropies = original
            grads.append(torch.autograd.grad(loss, leaf, retain_graph=True)[0])
            losses.append(loss)
            start = stop

        layout = PaddedLayout.of(attention_mask)
        unwrapped = self.accelerator.unwrap_model(model)
        packed = None
        if any(multimodal):  # each row's images, packed with the rows: the vision tower runs once
            per_row = [self._images_per_row(ids, **mm) for ids, mm in zip(rows, multimodal, strict=True)]
            if any(images is None for images in per_row):
                raise ValueError("TreeGRPOTrainer's chunked options take Qwen-VL images in every micro-batch")
            patches, grids = ([x for images in per_row for x in images[i]] for i in (0, 1))
            tree, packed = pack_images(unwrapped, layout.sequences(input_ids), patches, grids)
        else:
            tree = build_tree(layout.sequences(input_ids))
        weights = layout.to_tree(torch.cat(grads).double(), input_ids.size(1) - completion)
        with self.accelerator.autocast():
            # float16's loss scaling: GRPOTrainer scales the loss it backpropagates; this backward runs here
            tree_backward(
                unwrapped,
                tree,
                LinearizedLoss(weights),
                temperature=self.temperature,
                grad_scaler=self.accelerator.scaler,
                images=packed,
                **chunking,
            )
        return losses
