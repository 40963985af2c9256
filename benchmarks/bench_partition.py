"""Load balance of dta_fast.partition against its baselines, under the cost model (CPU only).

    python benchmarks/bench_partition.py [--batches ...] [--ranks 2 4 8] [--out DIR]

For agentic and GRPO batches of shapes.ROLLOUTS (sequences shuffled, as a sampler delivers them) and
2, 4 and 8 ranks, prints each candidate's maximum shard cost, the winner, max/mean balance, max/lower
bound, the gain of the winner over the token-count greedy split and the time to partition. Gate: the
winner's shards hold every sequence exactly once. Predicted costs, not measured step times: fit a
CostModel to measured times (CostModel.fit) to use real ones. Writes results/partition_CPU.json.
"""

from __future__ import annotations

import argparse
import os
import random
import time

import harness
import shapes

from dta_fast import partition

BATCHES = ["agentic_8x4x8", "agentic_16x8x8", "grpo_8x_p2k_n8_r1k", "grpo_mixed_16"]  # shapes.ROLLOUTS keys


def shards_cover(shards, num_sequences: int) -> harness.Gate:
    """Every sequence in exactly one shard: the share of sequences missing or repeated (0 when right)."""
    seen = sorted(int(i) for shard in shards for i in shard)
    wrong = sum(a != b for a, b in zip(seen, range(num_sequences))) + abs(len(seen) - num_sequences)
    return harness.Gate("shards", dict(misplaced=wrong / max(num_sequences, 1)), 0.0)


def run(batches, ranks) -> list[dict]:
    rows = []
    for key in batches:
        rollouts = shapes.ROLLOUTS[key]
        sequences = rollouts.sequences()
        random.Random(0).shuffle(sequences)
        for world in ranks:
            t0 = time.perf_counter()
            part = partition(sequences, world)
            seconds = time.perf_counter() - t0
            check = shards_cover(part.shards, len(sequences))
            row = dict(
                batch=rollouts.name, rollouts=key, world_size=world, sequences=len(sequences), gate=check.as_dict()
            )
            if check.ok:
                row.update(
                    method=part.method,
                    candidates=part.candidates,
                    balance=part.balance,
                    max_over_lower_bound=part.max_cost / part.lower_bound,
                    gain_over_token_greedy=part.candidates["token_greedy"] / part.max_cost - 1,
                    compression=part.compression,
                    seconds=seconds,
                )
            else:
                print(f"{rollouts.name}, {world} ranks: gate {check}", flush=True)
            rows.append(row)
    return rows


def print_table(rows):
    table = []
    for r in rows:
        if "candidates" not in r:
            table.append([r["batch"][:42], r["world_size"], "-", "-", "-", "FAIL"])
            continue
        c = r["candidates"]
        table.append(
            [
                r["batch"][:42],
                r["world_size"],
                f"{c['lpt']:.0f}",
                f"{c['dfs_contiguous']:.0f}",
                f"{c['token_greedy']:.0f}",
                r["method"],
                f"{r['balance']:.3f}",
                f"{r['max_over_lower_bound']:.3f}",
                f"{100 * r['gain_over_token_greedy']:.1f}%",
                f"{r['seconds']:.2f}",
            ]
        )
    harness.print_table(["batch", "W", "lpt", "dfs", "tokens", "best", "max/mean", "max/LB", "gain", "s"], table)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", nargs="+", default=BATCHES, choices=list(shapes.ROLLOUTS), help="shapes.ROLLOUTS keys")
    p.add_argument("--ranks", nargs="+", type=int, default=[2, 4, 8])
    p.add_argument("--out", default=os.environ.get("OUT", str(harness.RESULTS)))
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    rows = run(args.batches, args.ranks)
    harness.write_results("partition", rows, args.out, gpu="CPU", key=lambda r: (r["batch"], r["world_size"]))
    print_table(rows)


if __name__ == "__main__":
    main()
