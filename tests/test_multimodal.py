"""Vision-language policies on the tree (Qwen2.5-VL, Qwen3-VL with deepstack, Qwen3.5 with Gated DeltaNet
layers): images and videos in a shared prompt encoded once, logprobs and every parameter gradient (the
vision tower's included) those of each rollout run alone through the model's own forward with its own
images and rotary positions."""

from __future__ import annotations

import gc

import pytest
import torch

import dta_fast
import dta_ref
from dta_fast.trainer_common import LinearizedLoss
from tests.helpers import IMAGE, VIDEO, VISION_END, VISION_START, tiny_family_model, tiny_vl_model

FAMILIES = ("qwen2.5-vl", "qwen3-vl", "qwen3.5-vl")  # Qwen3.5: a hybrid (Gated DeltaNet layers) with images
# logprobs and relative gradient error against each rollout alone (float64 models): transformers' RMSNorm rounds
# its backward through float32, and the hybrid's delta rule computes in float32 whatever the model's dtype


def tolerance(family: str) -> tuple[float, float]:
    return (3e-7, 1e-5) if family == "qwen3.5-vl" else (1e-10, 1e-6)


TWINS = {"ref": dta_ref.tree_logprobs, "fast": dta_fast.tree_logprobs}


def image(tokens: int) -> list[int]:
    return [VISION_START] + [IMAGE] * tokens + [VISION_END]


def pictures(seed=0):
    """Three images of 4 x 4, 4 x 4 and 4 x 8 patches (4, 4 and 8 tokens after merging 2 x 2)."""
    g = torch.Generator().manual_seed(seed)
    shapes = ((16, [1, 4, 4]), (16, [1, 4, 4]), (32, [1, 4, 8]))
    return [(torch.randn(n, 12, generator=g, dtype=torch.float64), torch.tensor([grid])) for n, grid in shapes]


def grpo_with_images():
    """Two prompts with an image each, three and two rollouts; and a multi-turn rollout whose second turn
    shows another image (of the first image's size: its placeholders are the same tokens)."""
    a, b, c = pictures()
    p1, p2 = [1, 3] + image(4) + [5, 6], [1, 3] + image(8) + [9]
    rollouts = [(p1 + r, [a]) for r in ([10, 11, 12], [10, 13], [14])]
    rollouts += [(p2 + r, [c]) for r in ([20, 21], [22, 23, 24])]
    rollouts.append((p1 + [10, 11] + image(4) + [30, 31], [a, b]))
    sequences = [s for s, _ in rollouts]
    pixel_values = [torch.cat([img[0] for img in images]) for _, images in rollouts]
    grids = [torch.cat([img[1] for img in images]) for _, images in rollouts]
    return sequences, pixel_values, grids


def each_rollout_alone(model, sequences, pixel_values, grids):
    """The truth: each rollout through the model's own forward, with its images and its processor's token
    types (from which the model computes its rotary positions)."""
    out = torch.zeros(len(sequences), max(map(len, sequences)) - 1, dtype=torch.float64)
    rows = []
    for s, pixels, grid in zip(sequences, pixel_values, grids, strict=True):
        ids = torch.tensor([s])
        logits = model(input_ids=ids, pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=(ids == IMAGE).int())
        rows.append(torch.log_softmax(logits.logits[0, :-1].double(), -1).gather(-1, ids[0, 1:, None])[:, 0])
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return torch.stack([torch.nn.functional.pad(r, (0, out.shape[1] - len(r))) for r in rows])


def weighted(logprobs, tree):
    weights = torch.randn(logprobs.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    return (logprobs.double() * weights * tree.logprob_mask).sum()


def grads(model) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in model.parameters()])


@pytest.mark.parametrize("twin", TWINS)
@pytest.mark.parametrize("family", FAMILIES)
def test_images_in_the_tree_equal_each_rollout_alone(family, twin, monkeypatch):
    """Logprobs and every parameter gradient, the vision tower's included; the tower runs once, on the
    three distinct images (the shared prompts' images once, not once per rollout)."""
    model = tiny_vl_model(family)
    sequences, pixel_values, grids = grpo_with_images()
    tree, images = dta_ref.pack_images(model, sequences, pixel_values, grids)
    assert tree.num_tokens < sum(map(len, sequences)) // 2
    assert images.image_grid_thw.tolist() == [[1, 4, 4], [1, 4, 4], [1, 4, 8]]

    want = each_rollout_alone(model, sequences, pixel_values, grids)
    weighted(want, tree).backward()
    want_grads = grads(model)
    vision = [p for p in model.model.visual.parameters()]
    assert all(p.grad is not None and p.grad.norm() > 0 for p in vision[:1])
    model.zero_grad(set_to_none=True)

    seen = []
    forward = model.model.visual.forward
    monkeypatch.setattr(model.model.visual, "forward", lambda x, **kw: seen.append(len(x)) or forward(x, **kw))
    got = TWINS[twin](model, tree, images=images)
    assert seen == [16 + 16 + 32]  # one call, every distinct image's patches once
    lp_tol, grad_tol = tolerance(family)
    torch.testing.assert_close(got.double(), want.detach(), rtol=lp_tol, atol=lp_tol)
    weighted(got, tree).backward()
    err = float((grads(model) - want_grads).norm() / want_grads.norm())
    assert err < grad_tol, err


def test_text_only_rollouts_of_a_vision_language_model():
    """No image at all: the tree of a VLM's text rollouts, positions counted per token as the model does."""
    model = tiny_vl_model("qwen2.5-vl")
    sequences = [[1, 3, 5, 6], [1, 3, 7], [1, 8, 9, 10]]
    tree = dta_ref.PrefixTree.from_sequences(sequences)
    got = dta_fast.tree_logprobs(model, tree)
    want = each_rollout_alone(model, sequences, [None] * 3, [None] * 3)
    torch.testing.assert_close(got.double(), want.detach(), rtol=1e-10, atol=1e-10)


def test_what_pack_images_refuses():
    model = tiny_vl_model("qwen2.5-vl")
    (a, grid_a), _, (c, grid_c) = pictures()
    prompt = [1, 3] + image(4) + [5]
    with pytest.raises(ValueError, match=r"placeholder runs of \[4\] tokens, its grids need \[8\]"):
        dta_ref.pack_images(model, [prompt], [c], [grid_c])
    with pytest.raises(ValueError, match="its image grids hold 16 patches, its pixel_values 32"):
        dta_ref.pack_images(model, [prompt], [c], [grid_a])
    with pytest.raises(ValueError, match="one image pixel_values and one image_grid_thw per rollout"):
        dta_ref.pack_images(model, [prompt, prompt], [a], [grid_a])
    with pytest.raises(TypeError, match="not a vision-language model"):
        from tests.helpers import tiny_family_model

        dta_ref.pack_images(tiny_family_model("llama"), [prompt], [a], [grid_a])
    tree, images = dta_ref.pack_images(model, [prompt], [a], [grid_a])
    other = dta_ref.PrefixTree.from_sequences([prompt + [6]])
    with pytest.raises(ValueError, match="pack the images with the tree"):
        dta_fast.tree_logprobs(model, other, images=images)
    with pytest.raises(TypeError, match="TreeImages of dta_ref.pack_images"):
        dta_ref.tree_logprobs(model, tree, images={"pixel_values": a})


@pytest.mark.parametrize("family", FAMILIES)
def test_images_in_depth_first_chunks(family, monkeypatch):
    """tree_backward with images, in one chunk and in chunks that cut through an image's placeholders, with
    and without recompute: each rollout alone's logprobs and every gradient (the vision tower's included,
    Qwen3-VL's deepstack features too); the tower runs once per step."""
    model = tiny_vl_model(family)
    sequences, pixel_values, grids = grpo_with_images()
    tree, images = dta_ref.pack_images(model, sequences, pixel_values, grids)
    want = each_rollout_alone(model, sequences, pixel_values, grids)
    weighted(want, tree).backward()
    want_grads = grads(model)
    g = torch.randn(want.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    loss = LinearizedLoss(g * tree.logprob_mask)  # the gradient of weighted(): the same weights
    seen = []
    forward = model.model.visual.forward
    monkeypatch.setattr(model.model.visual, "forward", lambda x, **kw: seen.append(len(x)) or forward(x, **kw))
    for chunk, recompute in ((None, None), (3, True), (5, False), (9, True)):
        model.zero_grad(set_to_none=True)
        seen.clear()
        got, _ = dta_fast.tree_backward(model, tree, loss, max_chunk_tokens=chunk, recompute=recompute, images=images)
        assert seen == [16 + 16 + 32], (chunk, seen)
        lp_tol, grad_tol = tolerance(family)
        torch.testing.assert_close(got.double(), want.detach(), rtol=lp_tol, atol=lp_tol)
        err = float((grads(model) - want_grads).norm() / want_grads.norm())
        assert err < grad_tol, (chunk, recompute, err)


def test_images_in_chunks_are_checked():
    """Images for another tree, or for a text model, are refused by name."""
    model = tiny_vl_model("qwen2.5-vl")
    sequences, pixel_values, grids = grpo_with_images()
    tree, images = dta_ref.pack_images(model, sequences, pixel_values, grids)
    loss = dta_ref.SFTLoss(tree.logprob_mask)
    other = dta_ref.PrefixTree.from_sequences(sequences[:2])
    with pytest.raises(ValueError, match="images belong to a tree of"):
        dta_fast.tree_backward(model, other, dta_ref.SFTLoss(other.logprob_mask), images=images)
    import transformers

    config = tiny_family_model("llama").config
    config.vocab_size = model.config.get_text_config().vocab_size
    text_model = transformers.AutoModelForCausalLM.from_config(config).double()
    with pytest.raises(TypeError, match="takes no images"):
        dta_fast.tree_backward(text_model, tree, loss, images=images)


def video(family: str, frames: int, tokens: int) -> list[int]:
    """A video's placeholders: one run (Qwen2.5-VL), or one run per frame after its timestamp (Qwen3-VL)."""
    if family == "qwen2.5-vl":
        return [VISION_START] + [VIDEO] * frames * tokens + [VISION_END]
    return [t for f in range(frames) for t in [60 + f, VISION_START] + [VIDEO] * tokens + [VISION_END]]


def rollouts_with_videos(family: str):
    """A prompt showing an image and a video (3 rollouts), and a prompt showing the same image after other
    tokens, then another video (2)."""
    g = torch.Generator().manual_seed(7)
    (a, grid_a), _, _ = pictures()
    v1, v2 = ((torch.randn(f * 16, 12, generator=g, dtype=torch.float64), torch.tensor([[f, 4, 4]])) for f in (2, 3))
    p1 = [1, 3] + image(4) + video(family, 2, 4) + [5]  # image a also in p2: two places of the forest
    p2 = [1, 4] + image(4) + [7] + video(family, 3, 4) + [8]
    rows = [(p1 + r, (a, grid_a), v1, [0.5]) for r in ([10, 11], [10, 12], [13])]
    rows += [(p2 + r, (a, grid_a), v2, [1.0]) for r in ([20], [21, 22])]
    sequences = [r[0] for r in rows]
    images = ([r[1][0] for r in rows], [r[1][1] for r in rows])
    videos = [[r[2][0] for r in rows], [r[2][1] for r in rows]]
    if family == "qwen2.5-vl":
        videos.append([torch.tensor(r[3]) for r in rows])
    return sequences, images, tuple(videos)


def each_rollout_alone_with_videos(model, family, sequences, images, videos):
    rows = []
    for i, s in enumerate(sequences):
        ids = torch.tensor([s])
        kw = dict(pixel_values_videos=videos[0][i], video_grid_thw=videos[1][i])
        if len(images[1][i]):
            kw.update(pixel_values=images[0][i], image_grid_thw=images[1][i])
        if family == "qwen2.5-vl":
            kw["second_per_grid_ts"] = videos[2][i]
        types = (ids == IMAGE).int() + 2 * (ids == VIDEO).int()
        logits = model(input_ids=ids, mm_token_type_ids=types, **kw).logits[0, :-1].double()
        rows.append(torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0])
    width = max(map(len, sequences)) - 1
    return torch.stack([torch.nn.functional.pad(r, (0, width - len(r))) for r in rows])


@pytest.mark.parametrize("family", FAMILIES)
def test_videos_in_the_tree_equal_each_rollout_alone(family, monkeypatch):
    """Videos (Qwen3-VL's split into a run per frame by timestamps) beside images: both twins and
    tree_backward in chunks give each rollout alone's logprobs and every gradient; the tower runs once on
    the images and once on the videos, each distinct one once."""
    model = tiny_vl_model(family)
    sequences, images, videos = rollouts_with_videos(family)
    tree, packed = dta_ref.pack_images(model, sequences, *images, videos=videos)
    assert packed.video_grid_thw.tolist() == [[2, 4, 4], [3, 4, 4]]
    assert packed.image_grid_thw.tolist() == [[1, 4, 4]] * 2  # one image at two places of the forest
    want = each_rollout_alone_with_videos(model, family, sequences, images, videos)
    weighted(want, tree).backward()
    want_grads = grads(model)
    seen = []
    forward = model.model.visual.forward
    monkeypatch.setattr(model.model.visual, "forward", lambda x, **kw: seen.append(len(x)) or forward(x, **kw))
    for name, twin in TWINS.items():
        model.zero_grad(set_to_none=True)
        seen.clear()
        got = twin(model, tree, images=packed)
        assert sorted(seen) == [16 + 16, 32 + 48], (name, seen)
        lp_tol, grad_tol = tolerance(family)
        torch.testing.assert_close(got.double(), want.detach(), rtol=lp_tol, atol=lp_tol)
        weighted(got, tree).backward()
        assert float((grads(model) - want_grads).norm() / want_grads.norm()) < grad_tol, name
    g = torch.randn(want.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    for chunk in (3, 7):
        model.zero_grad(set_to_none=True)
        loss = LinearizedLoss(g * tree.logprob_mask)
        got, _ = dta_fast.tree_backward(model, tree, loss, max_chunk_tokens=chunk, images=packed)
        torch.testing.assert_close(got.double(), want.detach(), rtol=lp_tol, atol=lp_tol)
        assert float((grads(model) - want_grads).norm() / want_grads.norm()) < grad_tol, chunk


def _distributed_images_worker(rank, world, init_file, family, want_lp, want_grads):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model = tiny_vl_model(family)
        sequences, pixel_values, grids = grpo_with_images()
        tree = dta_ref.PrefixTree.from_sequences(sequences)
        g = torch.randn(want_lp.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
        loss = LinearizedLoss(g * tree.logprob_mask)
        with pytest.raises(ValueError, match="images must be"):
            dta_fast.distributed_tree_backward(model, sequences, loss, images=(pixel_values, grids[:2]))
        lp, _, indices = dta_fast.distributed_tree_backward(
            model, sequences, loss, images=(pixel_values, grids), max_chunk_tokens=5
        )
        mine = want_lp[indices]  # this rank's rollouts, as wide as its longest
        assert not mine[:, lp.shape[1] :].any()
        lp_tol, grad_tol = tolerance(family)
        torch.testing.assert_close(lp.double(), mine[:, : lp.shape[1]], rtol=lp_tol, atol=lp_tol)
        err = float((grads(model) - want_grads).norm() / want_grads.norm())
        assert err < grad_tol, err
        dist.barrier()
    finally:
        dist.destroy_process_group()
        # a gloo work still referenced at interpreter shutdown can abort the process (tests/test_distributed.py)
        gc.collect()


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_distributed_tree_backward_with_images(tmp_path, family):
    """Two gloo ranks, each packing its shard's images (chunks of 5): every rank's gradient is the whole
    batch's, each rollout alone through the model's own forward, the vision tower's included."""
    import torch.multiprocessing as mp

    model = tiny_vl_model(family)
    sequences, pixel_values, grids = grpo_with_images()
    tree = dta_ref.PrefixTree.from_sequences(sequences)
    want = each_rollout_alone(model, sequences, pixel_values, grids)
    weighted(want, tree).backward()
    args = (2, str(tmp_path / "init"), family, want.detach(), grads(model))
    mp.spawn(_distributed_images_worker, args=args, nprocs=2, join=True)
