"""One GRPO training step of a vision-language policy: each rollout alone against the packed tree.

    python benchmarks/bench_vl.py [--prompts 2] [--group 8] [--response 1024] [--image 448]

The policy is Qwen2.5-VL-3B-shaped (random weights, bfloat16, SDPA): a 32-block vision tower of
hidden 1280 and 36 text layers of hidden 2048 (16/2 heads of 128). Each prompt shows one image
(``--image`` pixels square: patches of 14, merged 2 x 2, so 448 pixels give 256 image tokens) and 64
text tokens; ``--group`` responses of ``--response`` random tokens each. The loss is the token-mean SFT
loss over every next-token logprob. Methods:

  flat   each rollout alone through the model's forward with its image (the vision tower encodes the
         prompt's image once per rollout), one backward per rollout (gradient accumulation)
  tree   ``dta_ref.pack_images`` then ``dta_fast.tree_logprobs(images=)``: every shared token once, each
         distinct image encoded once; one backward

One warm-up step of each (result, gradients, peak), then ``--repeats`` timed steps round-robin; gate:
logprobs and gradients against flat in the same run (bench_training.py's tolerances). Writes
results/vl_<GPU>.json (one row per shape) and prints a table.
"""

from __future__ import annotations

import argparse
import os

import bench_training
import harness
import torch

import dta_fast
from dta_ref import PrefixTree, SFTLoss, pack_images, sft_loss

PATCH, MERGE = 14, 2  # Qwen2.5-VL's vision patches and their merging into tokens


def build_model(device="cuda"):
    """Qwen2.5-VL-3B's shape with random weights, bfloat16, in training mode."""
    import transformers

    text = dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
        num_key_value_heads=2, max_position_embeddings=32768, tie_word_embeddings=True, attention_dropout=0.0,
        rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]},
    )  # fmt: skip
    vision = dict(
        depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048, patch_size=PATCH,
        spatial_merge_size=MERGE, temporal_patch_size=2, window_size=112, fullatt_block_indexes=[7, 15, 23, 31],
    )  # fmt: skip
    config = transformers.Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, image_token_id=151655, video_token_id=151656,
        vision_start_token_id=151652, vision_end_token_id=151653,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForImageTextToText.from_config(
            config, attn_implementation="sdpa", dtype=torch.bfloat16
        )
    return model.train()


def rollouts(config, prompts: int, group: int, response: int, side: int, seed: int = 0):
    """(sequences, pixel_values, image_grid_thw) of ``prompts`` x ``group`` rollouts, one image of ``side`` x
    ``side`` patches per prompt, random text tokens (above the model's special tokens)."""
    g = torch.Generator().manual_seed(seed)
    vision = config.vision_config
    grid = torch.tensor([[1, side, side]])
    placeholders = side * side // vision.spatial_merge_size**2
    special = [config.image_token_id, config.video_token_id, config.vision_start_token_id, config.vision_end_token_id]
    low, high = max(special) + 1, config.get_text_config().vocab_size
    if low >= high:  # the special tokens at the vocabulary's end, as in Qwen's
        low, high = 3, min(special)
    sequences, pixel_values, grids = [], [], []
    for _ in range(prompts):
        text = torch.randint(low, high, (64,), generator=g).tolist()
        prompt = text[:8] + [config.vision_start_token_id] + [config.image_token_id] * placeholders
        prompt += [config.vision_end_token_id] + text[8:]
        volume = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
        image = torch.randn(side * side, volume, generator=g)
        for _ in range(group):
            sequences.append(prompt + torch.randint(low, high, (response,), generator=g).tolist())
            pixel_values.append(image)
            grids.append(grid)
    return sequences, pixel_values, grids


def flat_step(model, sequences, pixel_values, grids, loss_fn):
    device = bench_training.device_of(model)
    out = torch.zeros(len(sequences), max(map(len, sequences)) - 1, device=device)
    for i, (s, pixels, grid) in enumerate(zip(sequences, pixel_values, grids, strict=True)):
        ids = torch.tensor([s], device=device)
        logits = model(
            input_ids=ids, pixel_values=pixels.to(device), image_grid_thw=grid.to(device),
            mm_token_type_ids=(ids == model.config.image_token_id).int(), use_cache=False,
        ).logits[0, :-1]  # fmt: skip
        lp = torch.log_softmax(logits.float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
        del logits
        loss_fn(i, lp).backward()
        out[i, : lp.numel()] = lp.detach()
    return out


def tree_step(model, tree: PrefixTree, images):
    lp = dta_fast.tree_logprobs(model, tree, images=images)
    sft_loss(lp, tree.logprob_mask.to(lp.device)).backward()
    return lp.detach()


def run(model, args) -> dict:
    device = bench_training.device_of(model)
    side = args.image // model.config.vision_config.patch_size
    sequences, pixel_values, grids = rollouts(model.config, args.prompts, args.group, args.response, side)
    tree, images = pack_images(model, sequences, pixel_values, grids)
    tree, images = tree.to(device), images.to(device)
    loss_fn = SFTLoss(tree.logprob_mask)
    methods = {
        "flat": lambda: flat_step(model, sequences, pixel_values, grids, loss_fn),
        "tree": lambda: tree_step(model, tree, images),
    }
    row = dict(
        model=args.model, prompts=args.prompts, group=args.group, response=args.response, image=args.image,
        sequences=tree.num_sequences, flat_tokens=tree.flat_tokens, tree_tokens=tree.num_tokens, methods={},
    )  # fmt: skip
    reference = None
    for label, fn in methods.items():  # warm-up: result, gradients, peak; the gate against flat
        seconds, peak, lp = bench_training.timed_step(model, fn)
        grads = bench_training.model_grads(model)
        entry = dict(seconds=seconds, peak_gib=peak)
        if reference is None:
            reference = (lp.float().cpu(), grads.cpu())
        else:
            bench_training.gate_entry(label, entry, lp, grads, reference, 0.0)
        row["methods"][label] = entry
        del grads
        harness.empty_cache()
        print(f"{label} warm-up {seconds:.3f} s, {peak:.1f} GiB", flush=True)
    times = {label: [] for label in methods}
    for _ in range(args.repeats):
        for label, fn in methods.items():
            seconds, peak, _ = bench_training.timed_step(model, fn)
            times[label].append(seconds)
            row["methods"][label]["peak_gib"] = max(row["methods"][label]["peak_gib"], peak)
    for label, values in times.items():
        if values:
            row["methods"][label].update(seconds=harness.median(values), step_seconds=values)
    tree_entry = row["methods"]["tree"]
    if tree_entry.get("gate_ok"):
        tree_entry["speedup"] = row["methods"]["flat"]["seconds"] / tree_entry["seconds"]
    model.zero_grad(set_to_none=True)
    return row


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--response", type=int, default=1024)
    p.add_argument("--image", type=int, default=448, help="image side in pixels (a multiple of 28)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=os.environ.get("OUT", str(harness.RESULTS)))
    p.set_defaults(model="qwen2.5-vl-3b")
    return p


def print_row(row: dict) -> None:
    table = [
        [f"P={row['prompts']} G={row['group']} R={row['response']}, {row['image']}px", label,
         harness.cell(e.get("seconds"), ".3f"), harness.cell(e.get("peak_gib"), ".1f"),
         harness.cell(e.get("speedup")), harness.cell(e.get("grad_rel_err"), ".1e")]
        for label, e in row["methods"].items()
    ]  # fmt: skip
    harness.print_table(["batch", "method", "s/step", "peak GiB", "speedup", "grad err"], table, "VL training step")


def main(argv=None):
    args = parser().parse_args(argv)
    if args.image % (PATCH * MERGE):
        raise ValueError(f"--image must be a multiple of {PATCH * MERGE} pixels, got {args.image}")
    row = run(build_model(), args)
    key = ("model", "prompts", "group", "response", "image")
    harness.write_results("vl", [row], args.out, key=lambda r: [r[k] for k in key])
    print_row(row)


if __name__ == "__main__":
    main()
