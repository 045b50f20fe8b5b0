"""Where a staged pull's scatter spends host time inside real pulls (bench/pull_path.py's, staged fragmented pools).

``services.kv.ranks.staging_area.scatter`` is wrapped step by step (row views, row numbers, their upload, the copy
call) and the pulls of ``bench/pull_path.py`` run as usual; at exit the median of each step over the pulls (the first
left out) is printed. The steps are host time only: on a GPU the copy itself runs later, queued on the side stream.

    python bench/profile_staged_scatter.py --device cuda --tokens 2048,8192
"""

from __future__ import annotations

import argparse
import atexit
import runpy
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import services.kv.plan.staging as staging  # noqa: E402
import services.kv.ranks.kv_rank as rank_module  # noqa: E402
import services.kv.ranks.staging_area as staging_area  # noqa: E402

STEPS: dict[str, list[float]] = {}


def timed_scatter(layout, buffers, area, offset, ids) -> None:  # noqa: ANN001 - staging_area.scatter's arguments
    """``staging_area.scatter``, its steps timed."""
    spans, _ = staging.staged_spans(layout, tuple(len(i) for i in ids))
    for s in spans:
        if s.num_blocks:
            t0 = time.perf_counter()
            pool, span = staging_area._views(layout, buffers, area, offset, s)
            t1 = time.perf_counter()
            rows = staging_area._rows(s, ids[s.group_id], layout.num_blocks)
            t2 = time.perf_counter()
            index = staging_area._index(rows, pool.device)
            t3 = time.perf_counter()
            pool.index_copy_(0, index, span)
            t4 = time.perf_counter()
            for name, seconds in (("views", t1 - t0), ("rows", t2 - t1), ("upload", t3 - t2), ("copy call", t4 - t3)):
                STEPS.setdefault(name, []).append(seconds)


@atexit.register
def report() -> None:
    print("\n# a staged pull's scatter, host time per step (us, median over the pulls after the first)")
    for name, seconds in STEPS.items():
        print(f"  {name:>10}: {statistics.median(seconds[1:]) * 1e6:8.0f}   (max {max(seconds[1:]) * 1e6:.0f}, "
              f"{len(seconds)} scatters)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", default="2048")
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    rank_module.scatter = timed_scatter  # LocalKVRank.scatter queues this one
    sys.argv = ["pull_path.py", "--device", args.device, "--tokens", args.tokens, "--pools", "fragmented",
                "--repeats", str(args.repeats)]
    runpy.run_path(str(Path(__file__).resolve().parent / "pull_path.py"), run_name="__main__")


if __name__ == "__main__":
    main()
