"""Tools to plan a job before renting it: `python -m planner.plan` (memory and time per step from arithmetic)
and `python -m planner.simulate` (one real step of the repo's wrapping at a simulated world size)."""
