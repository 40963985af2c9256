"""Load balance of dta_fast.partition against its baselines, under the cost model (CPU only).

    python benchmarks/bench_partition.py [--out DIR]

For agentic and GRPO batches (sequences shuffled, as a sampler delivers
them) and 2, 4 and 8 ranks, prints each candidate's maximum shard cost, the
winner, max/mean balance, max/lower bound, and the gain of the winner over
the token-count greedy split. Writes JSON. Predicted costs, not measured step
times: fit a CostModel to measured times (CostModel.fit) to use real ones.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

from dta_fast import partition
from dta_ref import agentic_batch, grpo_batch

BATCHES = {
    "agentic 8 tasks x 4 rollouts x 8 turns": lambda: agentic_batch(num_tasks=8),
    "agentic 16 tasks x 8 rollouts x 8 turns": lambda: agentic_batch(num_tasks=16, rollouts_per_task=8),
    "GRPO 8 groups, P=2K N=8 R=1K": lambda: grpo_batch(8, 2048, 8, 1024),
    "GRPO 16 groups, P in 512..8K, N=16, R=1K": lambda: sum(
        (grpo_batch(1, 512 * (1 + g % 16), 16, 1024, seed=g) for g in range(16)), []
    ),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = parser.parse_args()
    rows = []
    for name, make in BATCHES.items():
        sequences = make()
        random.Random(0).shuffle(sequences)
        for world in (2, 4, 8):
            t0 = time.perf_counter()
            part = partition(sequences, world)
            seconds = time.perf_counter() - t0
            rows.append(dict(batch=name, world_size=world, sequences=len(sequences), method=part.method,
                             candidates=part.candidates, balance=part.balance,
                             max_over_lower_bound=part.max_cost / part.lower_bound,
                             gain_over_token_greedy=part.candidates["token_greedy"] / part.max_cost - 1,
                             compression=part.compression, seconds=seconds))  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "partition.json").write_text(json.dumps(rows, indent=1))
    print(f"{'batch':<42} {'W':>2} {'lpt':>10} {'dfs':>10} {'tokens':>10} {'best':>15} {'max/mean':>8} {'max/LB':>7} {'gain':>6} {'s':>5}")
    for r in rows:
        c = r["candidates"]
        print(f"{r['batch']:<42} {r['world_size']:>2} {c['lpt']:>10.0f} {c['dfs_contiguous']:>10.0f} {c['token_greedy']:>10.0f} "
              f"{r['method']:>15} {r['balance']:>8.3f} {r['max_over_lower_bound']:>7.3f} {100 * r['gain_over_token_greedy']:>5.1f}% {r['seconds']:>5.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
