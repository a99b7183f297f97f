"""Bytes a rank holds, counted the way the sharded chapter counts them: distinct storages, once each."""
import torch


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind these tensors (views of one buffer count once; a DTensor by its
    local piece). Keyed by the storage itself, not its address: fake tensors (planner/simulate.py) have none."""
    storages = {}
    for tensor in tensors:
        if tensor is not None:
            storage = (tensor.to_local() if hasattr(tensor, "to_local") else tensor).untyped_storage()
            storages[storage._cdata] = max(storages.get(storage._cdata, 0), storage.nbytes())
    return sum(storages.values())


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's state tensors (AdamW: each parameter's two moments and its step)."""
    return [value for state in optimizer.state.values() for value in state.values() if torch.is_tensor(value)]
