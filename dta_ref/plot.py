"""Pictures of a small prefix tree and its attention mask.

Left panel: the forest as a node-link drawing. x is the depth (= position id);
rows follow the preorder, a node continuing its parent's row when it is the
parent's first child, so each subtree occupies consecutive rows. Every node
shows its token and, above it, its packed index; a node where a rollout ends
is drawn with a thick edge and the ids of the rollouts ending there.

Right panel: the T x T mask of :func:`dta_ref.tree_attention_mask`. Column j
is lit exactly on rows ``[j, subtree_end[j])``; the packed index j is written
above the image and ``subtree_end[j]`` below it.

    python -m dta_ref.plot [path]      # draws the example to path, by default ./prefix_tree.png
    python -m dta_ref.plot docs/images/prefix_tree.png   # the picture of docs/prefix_tree.md
    python -m dta_ref.plot --states docs/images/forked_states.png   # a linear-attention layer on the tree
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from .attention import tree_attention_mask
from .tree import PrefixTree

MAX_TOKENS = 200
_TREE_COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c")


def _new_figure(**kwargs):
    """A matplotlib Figure on an Agg canvas (no pyplot, so the caller's backend is left alone)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError("dta_ref.draw_tree needs matplotlib: pip install 'dta-prefix-tree[plot]'") from None
    fig = Figure(**kwargs)
    FigureCanvasAgg(fig)
    return fig


def label_fn(token_labels):
    if token_labels is None:
        return str
    if callable(token_labels):
        return lambda t: str(token_labels(t))
    if isinstance(token_labels, dict):
        return lambda t: str(token_labels.get(t, t))
    if not (hasattr(token_labels, "__len__") and hasattr(token_labels, "__getitem__")):
        raise TypeError(
            f"token_labels must be a dict, a sequence or a function of the token id, got {type(token_labels).__name__}"
        )
    return lambda t: str(token_labels[t]) if 0 <= t < len(token_labels) else str(t)


def _layout(parent: list[int]) -> tuple[list[int], list[int]]:
    """Row of every node (first child stays on its parent's row) and root index of every node."""
    rows, roots = [], []
    used_children: set[int] = set()
    next_row = 0
    for p in parent:
        if p >= 0 and p not in used_children:
            used_children.add(p)
            rows.append(rows[p])
            roots.append(roots[p])
        else:
            rows.append(next_row)
            roots.append(roots[p] if p >= 0 else (roots[-1] + 1 if roots else 0))
        next_row = max(next_row, rows[-1] + 1)
    return rows, roots


def draw_tree(tree_or_sequences, path, *, title=None, token_labels=None):
    """Draw a prefix tree (or the tree of a list of sequences) and its mask to ``path``; returns ``path``.

    ``token_labels`` maps token ids to the strings shown on the nodes: a dict,
    a list indexed by id, or a callable. Trees of more than 200 packed tokens
    are refused (the picture would not be legible).
    """
    tree = (
        tree_or_sequences if isinstance(tree_or_sequences, PrefixTree) else PrefixTree.from_sequences(tree_or_sequences)
    )
    T = tree.num_tokens
    if T > MAX_TOKENS:
        raise ValueError(f"tree has {T} packed tokens; draw_tree draws at most {MAX_TOKENS} legibly")
    fig = _new_figure()
    from matplotlib.colors import ListedColormap

    tree = tree.to("cpu")
    label = label_fn(token_labels)
    tokens = tree.tokens.tolist()
    depth = tree.position_ids.tolist()
    parent = tree.parent.tolist()
    subtree_end = tree.subtree_end.tolist()
    rows, roots = _layout(parent)
    ends: dict[int, list[int]] = {}
    for s in range(tree.num_sequences):
        ends.setdefault(int(tree.seq_index[s, int(tree.lengths[s]) - 1]), []).append(s)

    max_depth, num_rows = max(depth), max(rows) + 1
    # Inches per depth step and per row; shrunk (with the fonts) for large trees.
    dx = min(0.75, 15.0 / (max_depth + 1))
    dy = min(0.62, 16.0 / num_rows)
    font = max(4.0, 9.0 * min(dx / 0.75, dy / 0.62))
    tree_w = max(4.5, 1.2 + dx * (max_depth + 1))
    tree_h = 1.6 + dy * num_rows
    mask_side = max(3.5, min(12.0, 0.26 * T + 1.5))
    fig.set_size_inches(tree_w + mask_side + 1.0, max(tree_h, mask_side + 1.2))
    ax_tree, ax_mask = fig.subplots(1, 2, gridspec_kw={"width_ratios": [tree_w, mask_side]})

    # Left: node-link drawing.
    for i, p in enumerate(parent):
        if p >= 0:
            ax_tree.plot([depth[p], depth[i]], [rows[p], rows[i]], color="#b0b0b0", lw=1.2, zorder=1)
    small = max(3.0, font - 2)
    for i in range(T):
        color = _TREE_COLORS[roots[i] % len(_TREE_COLORS)]
        is_end = i in ends
        box = dict(boxstyle="round,pad=0.3", fc=color if is_end else "white", ec=color, lw=2.2 if is_end else 1.2)
        ax_tree.text(
            depth[i],
            rows[i],
            label(tokens[i]),
            ha="center",
            va="center",
            fontsize=font,
            zorder=3,
            color="white" if is_end else "black",
            bbox=box,
        )
        ax_tree.text(depth[i], rows[i] - 0.33, str(i), ha="center", va="bottom", fontsize=small, color="#555555")
        if is_end:
            ax_tree.text(
                depth[i],
                rows[i] + 0.33,
                ",".join(f"s{s}" for s in ends[i]),
                ha="center",
                va="top",
                fontsize=small,
                color=color,
                fontweight="bold",
            )
    ax_tree.set_xlim(-0.6, max_depth + 0.6)
    ax_tree.set_ylim(num_rows - 0.4, -0.7)
    ax_tree.set_xticks(range(max_depth + 1))
    ax_tree.set_yticks([])
    for side in ("left", "right", "top"):
        ax_tree.spines[side].set_visible(False)
    ax_tree.set_xlabel("depth = position id")
    ax_tree.set_title(
        f"{tree.num_sequences} rollouts, {tree.flat_tokens} tokens -> {T} packed "
        f"({tree.compression_ratio:.2f}x)\nsmall: packed index; filled: rollout s ends here",
        fontsize=9,
    )

    # Right: the mask, each lit cell coloured by the tree of its key.
    mask = tree_attention_mask(tree)
    colors = ["#ffffff"] + [_TREE_COLORS[r % len(_TREE_COLORS)] for r in range(max(roots) + 1)]
    image = (mask.long() * (torch.tensor(roots) + 1)[None, :]).numpy()  # [T, T]: 0 masked, else 1 + tree of key
    ax_mask.imshow(image, cmap=ListedColormap(colors), vmin=0, vmax=len(colors) - 1, interpolation="nearest")
    ax_mask.set_xticks([x - 0.5 for x in range(T + 1)], minor=True)
    ax_mask.set_yticks([y - 0.5 for y in range(T + 1)], minor=True)
    ax_mask.grid(which="minor", color="#e0e0e0", lw=0.5)
    ax_mask.tick_params(which="minor", length=0)
    cell = mask_side / T  # inches per mask cell
    step = next(k for k in (1, 2, 5, 10, 20, 50) if k * cell >= 0.2)
    ticks = list(range(0, T, step))
    tick_font = min(8.0, max(5.0, 30 * cell * step))
    ax_mask.set_yticks(ticks, labels=[str(i) for i in ticks], fontsize=tick_font)
    ax_mask.xaxis.tick_top()
    ax_mask.set_xticks(ticks, labels=[str(j) for j in ticks], fontsize=tick_font)
    ax_mask.xaxis.set_label_position("top")
    ax_mask.set_xlabel("key j (packed index)", fontsize=9)
    ax_mask.set_ylabel("query i (packed index)", fontsize=9)
    below = ax_mask.secondary_xaxis("bottom")
    below.set_xticks(ticks, labels=[str(subtree_end[j]) for j in ticks], fontsize=tick_font)
    below.set_xlabel("subtree_end[j]: column j is lit on rows j .. subtree_end[j]-1", fontsize=9)

    if title:
        fig.suptitle(title, fontsize=12)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    return path


def draw_states(tree_or_sequences, path, *, title=None, token_labels=None, conv_width: int = 4):
    """Draw how a linear-attention layer (Gated DeltaNet) runs on a prefix tree to ``path``; returns it.

    Each unbranched segment has a colour and its level (the kernel runs a level's segments together);
    an arrow carries a segment's final state to the segments that start from it (a fork: the state is
    read twice, its gradient is the sum); the last token's convolution window (its ``conv_width - 1``
    nearest ancestors and itself) is outlined."""
    from .linear_attention import levels, path_ancestors, segments

    tree = (
        tree_or_sequences if isinstance(tree_or_sequences, PrefixTree) else PrefixTree.from_sequences(tree_or_sequences)
    ).to("cpu")
    if tree.num_tokens > MAX_TOKENS:
        raise ValueError(f"tree has {tree.num_tokens} packed tokens; draw_states draws at most {MAX_TOKENS} legibly")
    label, tokens = label_fn(token_labels), tree.tokens.tolist()
    depth, parent = tree.position_ids.tolist(), tree.parent.tolist()
    rows, _ = _layout(parent)
    segs = segments(tree.parent)
    level_of = {i: k for k, level in enumerate(levels(segs)) for i in level}
    fig = _new_figure()
    width, height = 1.5 + 0.8 * (max(depth) + 1), 1.8 + 0.7 * (max(rows) + 1)
    fig.set_size_inches(width, height)
    ax = fig.subplots()
    for i, p in enumerate(parent):
        if p >= 0:
            ax.plot([depth[p], depth[i]], [rows[p], rows[i]], color="#b0b0b0", lw=1.2, zorder=1)
    for k, (start, end, up) in enumerate(segs):
        color = _TREE_COLORS[k % len(_TREE_COLORS)]
        for i in range(start, end):
            box = dict(boxstyle="round,pad=0.3", fc="white", ec=color, lw=2.0)
            ax.text(depth[i], rows[i], label(tokens[i]), ha="center", va="center", fontsize=9, zorder=3, bbox=box)
        ax.text(depth[start], rows[start] - 0.38, f"level {level_of[k]}", ha="center", fontsize=7, color=color)
        if up >= 0:  # the parent segment's final state starts this one
            last = segs[up][1] - 1
            ax.annotate(
                "", xy=(depth[start] - 0.18, rows[start]), xytext=(depth[last] + 0.18, rows[last]),
                arrowprops=dict(arrowstyle="->", color=_TREE_COLORS[up % len(_TREE_COLORS)], lw=1.8), zorder=2,
            )  # fmt: skip
            ax.text((depth[last] + depth[start]) / 2, (rows[last] + rows[start]) / 2 - 0.15,
                    f"S{label(tokens[last])}", fontsize=7, ha="center", color="#444444")  # fmt: skip
    window = path_ancestors(tree.parent, conv_width)[-1].tolist()  # the last token's convolution inputs
    for i in window:
        if i >= 0:
            ax.add_patch(_dashed_box(depth[i], rows[i]))
    ax.set_xlim(-0.7, max(depth) + 0.7)
    ax.set_ylim(max(rows) + 0.7, -0.9)
    ax.set_yticks([])
    ax.set_xticks(range(max(depth) + 1))
    ax.set_xlabel("depth = position id")
    for side in ("left", "right", "top"):
        ax.spines[side].set_visible(False)
    ax.set_title(
        title
        or "colour: a segment (one kernel call per level); arrow: its final state starts the next;\n"
        f"dashed: the last token's convolution window ({conv_width} tokens of its path)",
        fontsize=9,
    )
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    return path


def _dashed_box(x, y):
    from matplotlib.patches import FancyBboxPatch

    return FancyBboxPatch((x - 0.32, y - 0.3), 0.64, 0.6, boxstyle="round,pad=0.02", fill=False, ls="--",
                          ec="#222222", lw=1.0, zorder=4)  # fmt: skip


def example_sequences():
    """A forest of three trees: a GRPO group, an agent's multi-turn samples, a lone SFT-like sample."""
    words: list[str] = []

    def ids(text: str) -> list[int]:
        out = []
        for w in text.split():
            if w not in words:
                words.append(w)
            out.append(words.index(w))
        return out

    grpo_prompt = "<q> 2+2 ?"
    agent_turn1 = "<sys> find x <a> call( db )"
    agent_turn2 = agent_turn1 + " <tool> x=4 <a> done"
    sequences = [
        ids(grpo_prompt + " 4 </s>"),
        ids(grpo_prompt + " = 4 </s>"),
        ids(grpo_prompt + " = 5 </s>"),
        ids(agent_turn1),
        ids(agent_turn2),
        ids("<sys> find x <a> guess 3"),
        ids("<u> hi <a> hello"),
    ]
    return sequences, words


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m dta_ref.plot",
        description="Draw the example forest (a GRPO group, an agent's turns, a lone sample) and its mask.",
    )
    # in the working directory: the tracked docs/images picture is redrawn only when named
    parser.add_argument("path", nargs="?", default="prefix_tree.png", help="PNG to write (%(default)s)")
    parser.add_argument("--states", action="store_true", help="draw a linear-attention layer's forked states")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.states:  # docs/images/forked_states.png: a prompt, two branches, a fork inside the first
        words = ["a", "b", "c", "d", "e", "f", "g"]
        print(draw_states([[0, 1, 2, 3, 4], [0, 1, 2, 3, 6], [0, 1, 2, 5]], args.path, token_labels=words))
        return
    sequences, words = example_sequences()
    out = draw_tree(
        sequences, args.path, title="Rollouts packed as a preorder forest, and its tree attention mask",
        token_labels=words,
    )  # fmt: skip
    print(out)


if __name__ == "__main__":
    main()
