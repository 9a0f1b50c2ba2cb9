"""Writes a vLLM-like schedule for `bench --trace`: each submitter (a scheduler thread)
alternates decode steps, which offload 1-4 blocks, with prefix hits, which onboard a few
to hundreds of blocks (sizes drawn from a heavy-tailed distribution).

    python3 cpp_examples/make_trace.py --submitters 4 --steps 200 > trace.txt
    ./cpp_examples/bench --trace trace.txt --num-blocks 1024 --dir /dev/shm --buffered ...

Format, one request per line: `<submitter> onboard|offload <blocks>`; `#` comments.
"""

import argparse
import random


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--submitters", type=int, default=4)
    ap.add_argument("--steps", type=int, default=200, help="requests per submitter")
    ap.add_argument("--hit-rate", type=float, default=0.15, help="share of requests that are prefix-hit onboards")
    ap.add_argument("--max-onboard", type=int, default=256)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    print(f"# vLLM-like schedule: {a.submitters} submitters x {a.steps} requests, hit rate {a.hit_rate}, seed {a.seed}")
    for step in range(a.steps):
        for s in range(a.submitters):
            if rng.random() < a.hit_rate:
                n = min(a.max_onboard, max(2, int(rng.paretovariate(1.2) * 4)))
                print(f"{s} onboard {n}")
            else:
                print(f"{s} offload {rng.randint(1, 4)}")


if __name__ == "__main__":
    main()
