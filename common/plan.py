"""Moved: the planning tools are the package planner/ (docs/plan.md, docs/simulate.md)."""
import sys

MOVED = "the planner moved out of common/: run python -m planner.plan (docs/plan.md)"
if __name__ == "__main__":
    sys.exit(f"error: {MOVED}.")
raise ImportError(MOVED)
