"""A/B of tree attention: this checkout's dta_fast against another revision's, same trees, inputs, timings.

    python benchmarks/dev/compare_attention.py --base main [--shapes grpo qwen2] [--rounds 2] [--out DIR]

The base revision is checked out with ``git worktree add`` into a temporary directory (removed after)
and each version runs in a subprocess of its own that imports ``dta_fast`` from its tree (its kernels
compile separately; the subprocess checks where it imported from). Both get the same cases
(shapes.ATTENTION groups, bf16): the trees' ``subtree_end`` and the seed of q, k, v and dO are
handed to both. Per case: forward alone and forward + backward, ``triton.testing.do_bench`` medians
and medians of CUDA-event timings of single calls after warm-up (benchmarks/harness.py), the schedule
built once outside the timing. Gate, in the first round and before any timing: this checkout's output
and gradients against ``dta_ref.tree_attention`` (bench_attention.py's gate), the base's against this
checkout's (relative L2 2e-2, and the largest absolute difference, 0 when bitwise equal); a case whose
gate is red is not timed for that version. The versions are timed in ``--rounds`` rounds that
alternate their order (A B, then B A, ...: a drift of the machine's speed over the run favours none);
each time is the mean over rounds, and the JSON keeps every round. An A/B is not a benchmark's current
result: it is written to ``--out`` (default: the current directory), compare_attention_<GPU>.json, and
printed as a table last.

    python benchmarks/dev/compare_attention.py --worker ...   # one version's run (what the parent starts)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

BENCHMARKS = Path(__file__).resolve().parents[1]
REPO = BENCHMARKS.parent
sys.path.insert(0, str(BENCHMARKS))

import harness  # noqa: E402  (imports torch alone: no dta_fast, whichever version runs)


@contextlib.contextmanager
def worktree(rev: str, repo: Path = REPO):
    """A detached checkout of ``rev`` in a temporary directory, removed on exit."""
    tmp = Path(tempfile.mkdtemp(prefix="dta_base_"))
    path = tmp / "tree"
    subprocess.run(["git", "-C", str(repo), "worktree", "add", "--detach", "--quiet", str(path), rev], check=True)
    try:
        yield path
    finally:
        subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(path)], check=False)
        subprocess.run(["git", "-C", str(repo), "worktree", "prune"], check=False)
        with contextlib.suppress(OSError):
            tmp.rmdir()


def write_cases(groups, directory: Path) -> Path:
    """The cases' spec (name, heads, the subtree_end file), built here with this checkout's registry."""
    import shapes

    cases = []
    for group in groups:
        for case in shapes.ATTENTION[group]:
            end_file = directory / f"end_{len(cases)}.pt"
            torch.save(shapes.tree(case.rollouts).subtree_end, end_file)
            heads = shapes.HEADS[case.heads]
            cases.append(dict(name=case.name, end=str(end_file), H=heads.q, Hkv=heads.kv, D=heads.dim))
    spec = directory / "cases.json"
    spec.write_text(json.dumps(cases))
    return spec


def run_version(
    root: Path,
    spec: Path,
    out: Path,
    *,
    reference: bool,
    against: Path | None = None,
    save: Path | None = None,
    timing: bool = True,
    skip=(),
    device: str = "cuda",
) -> list[dict]:
    """A subprocess that imports dta_fast from ``root`` and runs the cases of ``spec`` (see ``worker``)."""
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        "--root",
        str(root),
        "--cases",
        str(spec),
        "--result",
        str(out),
        "--device",
        device,
    ]
    cmd += ["--reference"] if reference else []
    cmd += ["--against", str(against)] if against else []
    cmd += ["--save", str(save)] if save else []
    cmd += [] if timing else ["--no-timing"]
    cmd += [a for name in skip for a in ("--skip", name)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    subprocess.run(cmd, check=True, cwd=root, env=env)
    return json.loads(out.read_text())


def worker(args) -> None:
    """One version: gate every case (``--reference``: against dta_ref; ``--against DIR``: against the
    outputs another version saved there), then time those whose gate is green."""
    root = Path(args.root).resolve()
    sys.path.insert(0, str(root))
    for name in [m for m in sys.modules if m.split(".")[0] in ("dta_ref", "dta_fast")]:  # the harness's
        del sys.modules[name]
    import dta_fast
    import dta_ref

    for package in (dta_fast, dta_ref):
        where = Path(package.__file__).resolve()
        if root not in where.parents:
            raise SystemExit(f"{package.__name__} imported from {where}, not from {root}")
    cases = json.loads(Path(args.cases).read_text())
    rows = [run_case(dta_fast, i, case, args) for i, case in enumerate(cases) if case["name"] not in args.skip]
    Path(args.result).write_text(json.dumps(rows))


def run_case(dta_fast, i: int, case: dict, args) -> dict:
    end = torch.load(case["end"]).to(args.device)
    T, H, Hkv, D = end.numel(), case["H"], case["Hkv"], case["D"]
    g = torch.Generator(device=args.device).manual_seed(0)
    q, k, v, do = (
        torch.randn(1, h, T, D, generator=g, device=args.device, dtype=torch.bfloat16) for h in (H, Hkv, Hkv, H)
    )
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    schedule = dta_fast.build_schedule(end)
    row = dict(shape=case["name"], T=T, H=H, Hkv=Hkv, D=D)
    if args.reference or args.against or args.save:
        out = dta_fast.tree_attention(q, k, v, schedule=schedule)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), do)
        got = dict(out=out.detach(), dq=dq, dk=dk, dv=dv)
        if args.save:
            torch.save({n: x.cpu() for n, x in got.items()}, Path(args.save) / f"{i}.pt")
        if args.reference:
            import bench_attention  # this checkout's dta_ref: the worker of --reference runs in this checkout
            import shapes

            p = bench_attention.Problem(case["name"], None, shapes.Heads(H, Hkv, D), end, q, k, v, do)
            check = harness.gate("reference", got, bench_attention.reference(p))
        else:
            want = {n: x.to(args.device) for n, x in torch.load(Path(args.against) / f"{i}.pt").items()}
            check = harness.gate("against", got, want)
            row["max_abs_diff"] = max(float((got[n].float() - want[n].float()).abs().max()) for n in want)
        row["gate"] = check.as_dict()
        del got
        if not check.ok:
            print(f"{case['name']}: gate {check}", flush=True)
            return row
    if not args.timing:
        return row

    def forward():
        with torch.no_grad():
            dta_fast.tree_attention(q, k, v, schedule=schedule)

    def forward_backward():
        dta_fast.tree_attention(q, k, v, schedule=schedule).backward(do)

    leaves = [q, k, v]
    row.update(
        fwd_ms=harness.bench_ms(forward)["ms"],
        fwd_bwd_ms=harness.bench_ms(forward_backward, leaves)["ms"],
        fwd_event_ms=harness.event_median(forward),
        fwd_bwd_event_ms=harness.event_median(forward_backward, leaves),
    )
    print(f"{args.root}: {case['name']}: fwd {row['fwd_ms']:.3f} ms, fwd+bwd {row['fwd_bwd_ms']:.3f} ms", flush=True)
    return row


TIMES = ("fwd_ms", "fwd_bwd_ms", "fwd_event_ms", "fwd_bwd_event_ms")


def compare(base: str, groups, rounds: int, timing: bool = True, device: str = "cuda") -> list[dict]:
    """Rows of the A/B: per case, each version's gate, mean times and every round's."""
    with tempfile.TemporaryDirectory() as tmp, worktree(base) as base_root:
        tmp = Path(tmp)
        (tmp / "now").mkdir()
        spec = write_cases(groups, tmp)
        roots = {"now": REPO, "base": base_root}
        runs = {name: [] for name in roots}
        red = {name: set() for name in roots}
        for r in range(rounds):
            for name in list(roots)[:: 1 if r % 2 == 0 else -1]:  # round 0: now first (the base is gated on it)
                first = r == 0
                rows = run_version(
                    roots[name],
                    spec,
                    tmp / f"{name}_{r}.json",
                    reference=first and name == "now",
                    against=tmp / "now" if first and name == "base" else None,
                    save=tmp / "now" if first and name == "now" else None,
                    timing=timing,
                    skip=red[name],
                    device=device,
                )
                if first:
                    red[name] = {row["shape"] for row in rows if not row.get("gate", {}).get("ok", True)}
                runs[name].append({row["shape"]: row for row in rows})
    table = []
    for shape, first in runs["now"][0].items():
        row = dict(shape=shape, T=first["T"], H=first["H"], Hkv=first["Hkv"], D=first["D"], base=base)
        for name, rounds_of in runs.items():
            timed = [rd[shape] for rd in rounds_of if shape in rd and "fwd_ms" in rd[shape]]
            entry = dict(gate=rounds_of[0].get(shape, {}).get("gate"), rounds=[[t[k] for k in TIMES] for t in timed])
            if "max_abs_diff" in rounds_of[0].get(shape, {}):
                entry["max_abs_diff"] = rounds_of[0][shape]["max_abs_diff"]
            if timed:
                entry.update({k: sum(t[k] for t in timed) / len(timed) for k in TIMES})
            row[name] = entry
        table.append(row)
    return table


def print_table(rows):
    table = []
    for r in rows:
        for name in ("now", "base"):
            e = r[name]
            ok = e["gate"] is None or e["gate"]["ok"]
            cells = (
                [f"{e['fwd_ms']:.3f}/{e['fwd_event_ms']:.3f}", f"{e['fwd_bwd_ms']:.3f}/{e['fwd_bwd_event_ms']:.3f}"]
                if "fwd_ms" in e
                else ["-", "-"]
            )
            table.append(
                [
                    r["shape"],
                    name if name == "now" else f"base {r['base']}",
                    "ok" if ok else "FAIL",
                    *cells,
                    harness.cell(e.get("max_abs_diff"), ".2e"),
                ]
            )
    harness.print_table(
        ["case", "version", "gate", "fwd ms", "fwd+bwd ms", "max |diff|"],
        table,
        title="ms: do_bench median / CUDA-event median, each the mean over rounds",
    )


def parser() -> argparse.ArgumentParser:
    import shapes

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", help="the git revision to compare this checkout's dta_fast against")
    p.add_argument("--shapes", nargs="+", default=["grpo", "agentic", "causal"], choices=list(shapes.ATTENTION))
    p.add_argument("--rounds", type=int, default=2, help="timing rounds, alternating the versions' order")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    worker_args = p.add_argument_group("worker (one version's subprocess)")
    worker_args.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    worker_args.add_argument("--root", help=argparse.SUPPRESS)
    worker_args.add_argument("--cases", help=argparse.SUPPRESS)
    worker_args.add_argument("--result", help=argparse.SUPPRESS)
    worker_args.add_argument("--reference", action="store_true", help=argparse.SUPPRESS)
    worker_args.add_argument("--against", help=argparse.SUPPRESS)
    worker_args.add_argument("--save", help=argparse.SUPPRESS)
    worker_args.add_argument("--skip", action="append", default=[], help=argparse.SUPPRESS)
    worker_args.add_argument("--no-timing", dest="timing", action="store_false", help=argparse.SUPPRESS)
    worker_args.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    return p


def main(argv=None):
    ap = parser()
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    if not args.base:
        ap.error("--base REV is required: the revision to compare against")
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    rows = compare(args.base, args.shapes, args.rounds)
    harness.write_results("compare_attention", rows, args.out, base=args.base, rounds=args.rounds)
    print_table(rows)


if __name__ == "__main__":
    main()
