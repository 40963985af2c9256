"""Tree attention forward + backward against its peers, on one GPU.

    python benchmarks/bench_attention.py [--shapes grpo dualkv agentic qwen2 causal qwen2_rest] [--out DIR]
    python benchmarks/bench_attention.py --plot RESULTS.json [--out DIR]   # the table and plot of a run

The cases are shapes.ATTENTION's: a rollout set packed as one tree, at a head layout, bf16. Methods,
each forward + backward:

  tree        dta_fast.tree_attention, its schedule built once outside the timing (as FlexAttention's
              BlockMask is)
  tree_call   the same with the schedule built inside every call (``subtree_end=``): the per-call column
  flex        FlexAttention (compiled), a BlockMask prebuilt from the mask_mod ``dta_ref.tree_mask``
  sdpa        SDPA's default backend on each sequence alone (the flat computation: what a user gets
              without a tree; cuDNN on H100)
  sdpa_flash  the same forced to SDPA's flash backend
  dense       SDPA with the dense bool T x T mask of ``dta_ref.tree_mask`` (trees up to 36K tokens)
and the forward alone of tree and flex (``tree_fwd``, ``flex_fwd``).

Gate, in the same run and before any timing: every method's output (and, but for the flat methods, the
gradients of q, k and v for one upstream gradient) against ``dta_ref.tree_attention`` in float32 (run
over slices of the queries), relative L2 within 2e-2; the flat methods run on the tree's own q, k, v
gathered along each sequence. A method with a red gate gets no timing, and no speedup is given
against a tree with a red gate. Timings (benchmarks/harness.py): do_bench's median, 20th and 80th
percentile, and the median of CUDA-event timings of single calls after warm-up. TFLOP/s count useful
work only: 4 flops per visible query-key pair and head dim forward, 10 backward (14 both). do_bench
runs long enough to meet the GPU's power cap (benchmarks/dev/bench_power.py times full clock and the
cap apart). Writes results/attention_<GPU>.json and its plot; prints the table last.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

import harness
import shapes
import torch
import torch.nn.functional as F

from dta_ref import PrefixTree, tree_mask
from dta_ref import tree_attention as reference_attention

METHODS = ("tree", "tree_call", "flex", "sdpa", "sdpa_flash", "dense", "tree_fwd", "flex_fwd")
PEERS = ("flex", "sdpa", "sdpa_flash", "dense")
DENSE_MAX_T = 36 * 1024
REFERENCE_BYTES = 4 << 30  # the float32 reference's scores per slice of queries, about


@dataclass
class Problem:
    """One case's tree and bf16 inputs: q [1, H, T, D], k, v [1, Hkv, T, D], the upstream gradient do; and
    the variant (shapes.VARIANTS): a sliding window over the depths ``pos``, learned sinks [H]."""

    name: str
    tree: PrefixTree
    heads: shapes.Heads
    end: torch.Tensor  # [T] on the device
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    do: torch.Tensor
    pos: torch.Tensor | None = None  # [T] depths, for a window
    window: int | None = None
    sinks: torch.Tensor | None = None  # [H] float32 leaf

    @property
    def leaves(self):
        return [self.q, self.k, self.v] + ([] if self.sinks is None else [self.sinks])

    @property
    def variant(self) -> dict:
        return dict(window=self.window, sinks=self.sinks)

    @property
    def gqa(self) -> bool:
        return self.heads.kv != self.heads.q


def problem(
    name: str, tree: PrefixTree, heads: shapes.Heads, device="cuda", dtype=torch.bfloat16, seed=0, variant=None
) -> Problem:
    T, (H, Hkv, D) = tree.num_tokens, (heads.q, heads.kv, heads.dim)
    variant = dict(variant or {})
    g = torch.Generator(device=device).manual_seed(seed)

    def rand(*size, grad=True):
        return torch.randn(*size, generator=g, device=device, dtype=dtype).requires_grad_(grad)

    return Problem(
        name,
        tree,
        heads,
        tree.subtree_end.to(device),
        rand(1, H, T, D),
        rand(1, Hkv, T, D),
        rand(1, Hkv, T, D),
        rand(1, H, T, D, grad=False),
        tree.position_ids.to(device) if variant.get("window") else None,
        variant.get("window"),
        torch.randn(H, generator=g, device=device).requires_grad_() if variant.get("sinks") else None,
    )


def reference(p: Problem, budget: int = REFERENCE_BYTES) -> dict:
    """out, dq, dk, dv in float32 from ``dta_ref.tree_attention``, over slices of the queries: the slice
    [a, b) attends keys [0, b), whose subtree ends clamped to b are a preorder forest of their own."""
    q, k, v, *sinks = (x.detach().float().requires_grad_() for x in p.leaves)
    sinks = sinks[0] if sinks else None
    T, H = q.shape[2], q.shape[1]
    rows = max(16, budget // (16 * H * T))
    out = torch.empty_like(q)
    for a in range(0, T, rows):
        b = min(a + rows, T)
        pos = None if p.pos is None else p.pos[:b]
        o = reference_attention(q[:, :, a:b], k[:, :, :b], v[:, :, :b], p.end[:b].clamp(max=b), position_ids=pos,
                                window=p.window, sinks=sinks)  # fmt: skip
        o.backward(p.do[:, :, a:b].float())
        out[:, :, a:b] = o.detach()
    grads = dict(out=out, dq=q.grad, dk=k.grad, dv=v.grad)
    return grads if sinks is None else grads | dict(dsinks=sinks.grad)


def run_grads(fn, p: Problem) -> dict:
    for x in p.leaves:
        x.grad = None
    out = fn(p.q, p.k, p.v)
    out.backward(p.do)
    grads = dict(out=out.detach(), dq=p.q.grad, dk=p.k.grad, dv=p.v.grad)
    if p.sinks is not None:
        grads["dsinks"] = p.sinks.grad
    for x in p.leaves:
        x.grad = None
    return grads


def fwd_bwd(fn, p: Problem):
    def step():
        fn(p.q, p.k, p.v).backward(p.do)

    return step


def forward_only(fn, p: Problem):
    def step():
        with torch.no_grad():
            fn(p.q, p.k, p.v)

    return step


def tree_methods(p: Problem, flex=None, dense: bool = True) -> dict:
    """name -> fn(q, k, v) of the packed methods (flex when ``flex`` is given, ``dense`` on small trees)."""
    from dta_fast import build_schedule, tree_attention

    schedule = build_schedule(p.end, position_ids=p.pos)
    fns = {
        "tree": lambda q, k, v: tree_attention(q, k, v, schedule=schedule, **p.variant),
        "tree_call": lambda q, k, v: tree_attention(q, k, v, subtree_end=p.end, position_ids=p.pos, **p.variant),
    }
    T = p.tree.num_tokens
    if flex is not None:
        from torch.nn.attention.flex_attention import create_block_mask

        def mask_mod(b, h, q_idx, kv_idx):
            return tree_mask(q_idx, kv_idx, p.end, p.pos, p.window)

        block_mask = create_block_mask(mask_mod, None, None, T, T, device=p.end.device)
        if p.sinks is None:
            fns["flex"] = lambda q, k, v: flex(q, k, v, block_mask=block_mask, enable_gqa=p.gqa)
        else:  # a sink joins the denominator: out * exp(lse) / (exp(lse) + exp(sink))

            def flex_with_sinks(q, k, v):
                out, lse = flex(q, k, v, block_mask=block_mask, enable_gqa=p.gqa, return_lse=True)
                return out * torch.sigmoid(lse - p.sinks[None, :, None])[..., None].to(out.dtype)

            fns["flex"] = flex_with_sinks
    if dense and T <= DENSE_MAX_T and p.sinks is None:
        index = torch.arange(T, device=p.end.device)
        mask = tree_mask(index[:, None], index[None, :], p.end, p.pos, p.window)  # [T, T]
        fns["dense"] = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=p.gqa)
    return fns


@dataclass
class FlatGroup:
    """The sequences of one length, each alone: q [n, H, L, D] gathered from the tree's q along their
    paths (``index`` [n, L] packed positions), as leaves of their own."""

    index: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    do: torch.Tensor


def flat_groups(p: Problem) -> list[FlatGroup]:
    lengths = p.tree.lengths.tolist()
    groups = []
    for L in sorted(set(lengths)):
        rows = [i for i, n in enumerate(lengths) if n == L]
        index = p.tree.seq_index[rows, :L].to(p.end.device)

        def gather(x, grad=True, index=index):  # [1, H, T, D] -> [n, H, L, D]
            return x.detach()[0][:, index].transpose(0, 1).contiguous().requires_grad_(grad)

        groups.append(FlatGroup(index, gather(p.q), gather(p.k), gather(p.v), gather(p.do, grad=False)))
    return groups


def flat_step(groups: list[FlatGroup], gqa: bool, backend=None, outputs: list | None = None, window=None, sinks=None):
    """Forward + backward of every sequence alone; ``backend`` None: SDPA's own choice, as a user gets it.
    A window is a boolean mask; sinks are one more key, zero in K and V, whose bias column holds them."""

    def attend(g):
        if window is None and sinks is None:
            return F.scaled_dot_product_attention(g.q, g.k, g.v, is_causal=True, enable_gqa=gqa)
        L = g.q.shape[2]
        i = torch.arange(L, device=g.q.device)
        mask = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < (window or L))  # [L, L]
        if sinks is None:
            return F.scaled_dot_product_attention(g.q, g.k, g.v, attn_mask=mask, enable_gqa=gqa)
        bias = torch.zeros(L, L, device=g.q.device).masked_fill(~mask, float("-inf"))
        bias = torch.cat([bias.expand(sinks.shape[0], L, L), sinks[:, None, None].expand(-1, L, 1)], -1)
        k, v = (F.pad(x, (0, 0, 0, 1)) for x in (g.k, g.v))
        return F.scaled_dot_product_attention(g.q, k, v, attn_mask=bias.to(g.q.dtype), enable_gqa=gqa)

    def step():
        with torch.nn.attention.sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
            for g in groups:
                out = attend(g)
                out.backward(g.do)
                if outputs is not None:
                    outputs.append(out.detach())

    return step


def flat_gate(name, groups, gqa, backend, ref, window=None, sinks=None) -> harness.Gate:
    """The flat outputs against the reference's rows of each sequence."""
    outputs = []
    flat_step(groups, gqa, backend, outputs, window, sinks)()
    want = [ref["out"][0][:, g.index].transpose(0, 1) for g in groups]
    for g in groups:
        for x in (g.q, g.k, g.v):
            x.grad = None
    return harness.gate(name, dict(out=outputs), dict(out=want))


def useful_flops(tree: PrefixTree, heads: shapes.Heads, window: int | None = None) -> dict:
    if window is None:
        pairs = int((tree.subtree_end - torch.arange(tree.num_tokens)).sum())  # key j is seen by end[j] - j queries
    else:  # a query sees its ancestors within the window: min(depth + 1, window) keys
        pairs = int((tree.position_ids + 1).clamp(max=window).sum())
    return dict(fwd=4 * pairs * heads.dim * heads.q, both=14 * pairs * heads.dim * heads.q)


def bench_case(
    name: str,
    tree: PrefixTree,
    heads: shapes.Heads,
    flex=None,
    device="cuda",
    timing=True,
    methods=METHODS,
    variant: dict | None = None,
) -> dict:
    """One row: the gate of every method against the reference, then (``timing``) the timings of
    those whose gate is green. ``variant``: shapes.VARIANTS' keywords (a window, sinks)."""
    p = problem(name, tree, heads, device, variant=variant)
    row = dict(
        name=name,
        T=tree.num_tokens,
        flat_tokens=tree.flat_tokens,
        N=tree.num_sequences,
        H=heads.q,
        Hkv=heads.kv,
        D=heads.dim,
        gate={},
    )
    ref = reference(p)
    fns = {m: fn for m, fn in tree_methods(p, flex, dense="dense" in methods).items() if m in methods}
    gates = {m: harness.gate(m, run_grads(fn, p), ref) for m, fn in fns.items()}
    groups = flat_groups(p) if {"sdpa", "sdpa_flash"} & set(methods) else []
    flat = {"sdpa": None, "sdpa_flash": torch.nn.attention.SDPBackend.FLASH_ATTENTION}
    for m, backend in flat.items():
        if m in methods:
            try:
                gates[m] = flat_gate(m, groups, p.gqa, backend, ref, p.window, p.sinks)
            except RuntimeError as error:  # GQA inputs the flash backend refuses
                row[m] = dict(error=str(error).splitlines()[0])
    for fwd, full in (("tree_fwd", "tree"), ("flex_fwd", "flex")):  # the forward of a gated function
        if fwd in methods and full in gates:
            gates[fwd] = gates[full]
    del ref
    row["gate"] = {m: g.as_dict() for m, g in gates.items()}
    row["gate_ok"] = gates["tree"].ok if "tree" in gates else False
    for g in gates.values():
        if not g.ok:
            print(f"{name}: gate {g}", flush=True)
    if not timing:
        return row
    flops = useful_flops(tree, heads, p.window)
    flat_leaves = [x for grp in groups for x in (grp.q, grp.k, grp.v)]
    for m, g in gates.items():
        if not g.ok or m == "tree_call":
            continue
        work = flops["fwd" if m.endswith("_fwd") else "both"]
        if m == "tree" and "tree_call" in gates and gates["tree_call"].ok:  # beside the schedule built per call
            timed = zip(
                ("tree", "tree_call"),
                harness.measure_per_call(
                    fwd_bwd(fns["tree"], p),
                    fwd_bwd(fns["tree_call"], p),
                    p.leaves,
                    gate=g,
                    per_call_gate=gates["tree_call"],
                ),
            )
        elif m in fns:
            timed = [(m, harness.measure(fwd_bwd(fns[m], p), p.leaves, gate=g))]
        elif m.endswith("_fwd"):
            timed = [(m, harness.measure(forward_only(fns[m[: -len("_fwd")]], p), gate=g))]
        else:
            step = flat_step(groups, p.gqa, flat[m], window=p.window, sinks=p.sinks)
            timed = [(m, harness.measure(step, flat_leaves, gate=g))]
        for method, r in timed:
            row[method] = r | dict(tflops=work / r["ms"] / 1e9, event_tflops=work / r["event_ms"] / 1e9)
    add_speedups(row)
    return row


def add_speedups(row: dict) -> None:
    """Peer ms over tree ms (do_bench and CUDA events), only where the tree's gate is green."""
    if not row.get("gate_ok") or "ms" not in row.get("tree", {}):
        return
    for peer in PEERS:
        if "ms" in row.get(peer, {}):
            row[f"speedup_vs_{peer}"] = row[peer]["ms"] / row["tree"]["ms"]
            row[f"event_speedup_vs_{peer}"] = row[peer]["event_ms"] / row["tree"]["event_ms"]
    if "ms" in row.get("flex_fwd", {}) and "ms" in row.get("tree_fwd", {}):
        row["fwd_speedup_vs_flex"] = row["flex_fwd"]["ms"] / row["tree_fwd"]["ms"]


def print_table(rows) -> None:
    """ms as do_bench / CUDA-event medians; TF/s from do_bench; "x" = peer ms / tree ms."""
    cols = ("tree", "tree_call", "flex", "sdpa", "sdpa_flash", "tree_fwd", "flex_fwd")

    def ms(r, m):
        return f"{r[m]['ms']:.2f}/{r[m]['event_ms']:.2f}" if "ms" in r.get(m, {}) else "-"

    def x(r, peer):
        key = f"speedup_vs_{peer}"
        return f"{r[key]:.2f}/{r['event_' + key]:.2f}" if key in r else "-"

    table = [
        [
            r["name"],
            r["T"],
            "ok" if r.get("gate_ok") else "FAIL",
            *(ms(r, m) for m in cols),
            harness.cell(r.get("tree", {}).get("tflops"), ".0f"),
            x(r, "flex"),
            x(r, "sdpa"),
        ]
        for r in rows
    ]
    harness.print_table(
        ["case", "T", "gate", *cols, "tree TF/s", "x flex", "x sdpa"],
        table,
        title="ms: do_bench median / CUDA-event median; TF/s of useful work from do_bench",
    )


def plot(rows, path, gpu):
    methods = ("tree", "tree_call", "flex", "sdpa", "sdpa_flash")
    series = {m: [r.get(m, {}).get("tflops") for r in rows] for m in methods}
    return harness.plot_bars(
        path,
        [r["name"] for r in rows],
        series,
        ylabel="TFLOP/s of useful tree work (fwd+bwd)",
        title=f"Tree attention, {gpu}, bf16 (do_bench medians)",
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--shapes",
        nargs="+",
        default=list(shapes.ATTENTION),
        choices=list(shapes.ATTENTION),
        help="groups of cases (shapes.ATTENTION)",
    )
    p.add_argument("--out", default=os.environ.get("OUT", str(harness.RESULTS)))
    p.add_argument("--plot", metavar="JSON", help="print the table and draw the plot of an earlier run's JSON")
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    if args.plot:
        meta, rows = harness.read_results(args.plot)
        plot(rows, Path(args.out) / f"attention_{harness.short_name(meta['gpu'])}.png", meta["gpu"])
        print_table(rows)
        return
    from torch.nn.attention.flex_attention import flex_attention

    flex = torch.compile(flex_attention)
    rows = []
    for group in args.shapes:
        for case in shapes.ATTENTION[group]:
            tree = shapes.tree(case.rollouts)
            variant = shapes.VARIANTS.get(case.variant)
            row = bench_case(case.name, tree, shapes.HEADS[case.heads], flex, variant=variant)
            row = dict(rollouts=case.rollouts, heads=case.heads, variant=case.variant, **row)
            rows.append(row)
            print(f"done: {case.name}", flush=True)
            torch.cuda.empty_cache()
            # after each case, so a cut-off run keeps what it measured; other trees and head layouts stay
            path = harness.write_results(
                "attention",
                rows,
                args.out,
                key=lambda r: (r.get("rollouts"), r.get("heads"), r.get("variant")),
                harness="do_bench quantiles and CUDA-event medians, gated on dta_ref",
            )
    _, rows = harness.read_results(path)
    plot(rows, path.with_suffix(".png"), harness.device_name())
    print_table(rows)


if __name__ == "__main__":
    main()
