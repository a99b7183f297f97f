"""FSDP2's fully_shard under one import for every supported torch.

torch 2.6 made it public as torch.distributed.fsdp.fully_shard; torch 2.4 and 2.5 ship the same
function as torch.distributed._composable.fsdp.fully_shard.
"""
try:
    from torch.distributed.fsdp import fully_shard
except ImportError:  # torch < 2.6
    from torch.distributed._composable.fsdp import fully_shard

__all__ = ["fully_shard"]
