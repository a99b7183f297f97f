"""The lessons written out from scratch, each tested equal to what PyTorch does: the ring all-reduce, gradient
buckets, accumulation, ZeRO, the token-weighted loss, BatchNorm across ranks, local SGD, communication hooks,
uneven inputs, and what the "Inside DDP" notebooks run in each process.

A lesson may use what the scripts run on (common/); nothing in common/ outside this folder imports a lesson,
so editing one changes only the runs that really use it (tests/test_layout.py).
"""
