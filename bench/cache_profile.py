"""Where the engine's request path spends its time: a cProfile of one ``bench/cache_ops.py`` case.

The compiled core is one opaque call per request to the profiler (``Engine.open`` and
friends); what stays in Python around it (the façade, validation, packing the tokens) shows
function by function (the row of ``cache_ops.py``'s list comprehension is the bench building
its token lists before its timed loop, not the engine). Use it to see what a change to the
hot path moved:

    python bench/cache_profile.py                       # default policy, distinct+evict, native
    python bench/cache_profile.py --case shared --policy lru --core python --top 25
"""

from __future__ import annotations

import argparse
import cProfile
import pstats

from cache_ops import capacity, engine_runner, hash_ids  # bench/cache_ops.py, beside this script

from kvpool_agent.cache.gc_tuning import tune_gc

CASES = ("distinct", "shared", "distinct+evict", "half-shared+evict")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=CASES, default="distinct+evict")
    parser.add_argument("--policy", default="mixture")
    parser.add_argument("--core", choices=("native", "python"), default="native")
    parser.add_argument("--sequences", type=int, default=1000)
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--top", type=int, default=15, help="rows of the table, by own time")
    args = parser.parse_args()

    tune_gc()
    seqs = hash_ids(args.case, args.sequences, args.blocks)
    cap = capacity(args.case, args.sequences, args.blocks)
    run = engine_runner(args.policy, args.core)
    run(args.case, seqs, False, cap)  # warm-up: imports, first allocations
    profiler = cProfile.Profile()
    profiler.enable()
    seconds = run(args.case, seqs, False, cap)
    profiler.disable()
    blocks = args.sequences * args.blocks
    print(
        f"{args.case}, {args.policy} on the {args.core} core: {seconds * 1e6 / blocks:.2f} µs "
        f"per block under the profiler ({blocks} blocks)"
    )
    pstats.Stats(profiler).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
