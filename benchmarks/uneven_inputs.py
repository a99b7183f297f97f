"""Uneven inputs under DDP: rank 0 has one batch more than the others. Plain DDP hangs until the
process group's timeout; Join, and Accelerate's join_uneven_inputs, let every rank finish.

    python benchmarks/uneven_inputs.py                 # 2 processes, 4 batches (rank 0: 5), 10 s timeout

The three ways are in common/lessons/uneven.py; each runs in fresh gloo processes. Prints a table.
"""
import argparse

from common.cli import positive_int
from common.lessons.uneven import HOW, train_uneven
from common.spawn import run_in_process_group


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=positive_int, default=2)
    parser.add_argument("--batches", type=positive_int, default=4, help="batches of every rank but rank 0, which has one more")
    parser.add_argument("--timeout", type=float, default=10, help="process-group timeout in seconds (default: 10)")
    args = parser.parse_args()
    if args.processes < 2:
        parser.error("--processes must be at least 2: uneven inputs need two ranks")
    print(f"{args.processes} processes, rank 0: {args.batches + 1} batches, the others: {args.batches}; "
          f"process-group timeout {args.timeout:g} s")
    print(f"{'how':<32} {'seconds':>8}  {'replicas equal':<14}  outcome")
    for how in HOW:
        result = run_in_process_group(train_uneven, args.processes, how, args.batches, args.timeout,
                                      timeout=args.timeout * 3 + 120)
        print(f"{how:<32} {result['seconds']:>8.1f}  {str(result['replicas equal']):<14}  {result['outcome']}")


if __name__ == "__main__":
    main()
