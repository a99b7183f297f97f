"""Local SGD and DiLoCo: the replicas train alone for H steps, then meet once.

DDP averages the gradients at every step. Local SGD (Stich 2019; Lin et al. 2020, "Don't use large
mini-batches, use local SGD") lets every replica take H steps of its own optimizer from the same
weights, then averages the weights: one all-reduce of the model every H steps, 1/H of DDP's bytes.
DiLoCo (Douillard et al. 2023, "DiLoCo: distributed low-communication training of language models")
treats what the replicas moved in those H steps as a gradient, the pseudo-gradient

    Δ = start − mean over ranks of the local weights,

and steps an outer optimizer on it from `start`: Nesterov SGD, learning rate 0.7, momentum 0.9 in the
paper. Local SGD is the special case of outer SGD at learning rate 1 without momentum (start − Δ is the
mean of the local weights), and with H = 1, inner SGD and that outer step, DiLoCo is DDP with SGD.
Only parameters are averaged; buffers (BatchNorm's statistics, say) stay each rank's own.
"""
import torch
import torch.distributed as dist


class OuterOptimizer:
    """Synchronise a model's replicas every `sync_every` inner steps with an outer SGD step."""

    def __init__(self, model: torch.nn.Module, sync_every: int, lr: float = 0.7, momentum: float = 0.9):
        self.params = list(model.parameters())
        with torch.no_grad():
            for tensor in model.state_dict().values():  # rank 0's weights everywhere, as DDP's constructor does
                dist.broadcast(tensor, src=0)
        self.start = torch.cat([p.detach().reshape(-1) for p in self.params])  # where every replica starts a round
        self.optimizer = torch.optim.SGD([self.start], lr=lr, momentum=momentum, nesterov=momentum > 0)
        self.sync_every = sync_every
        self.pending = 0  # inner steps since the last synchronisation

    def inner_step_done(self) -> None:
        """Call after each inner optimizer step: every sync_every-th one synchronises."""
        self.pending += 1
        if self.pending == self.sync_every:
            self.sync()

    @torch.no_grad()
    def sync(self) -> None:
        """Average the pseudo-gradient over the ranks (one all-reduce), step the outer optimizer, and
        start every replica from the result; nothing when no inner step was taken since the last sync."""
        if not self.pending:
            return
        self.pending = 0
        pseudo_gradient = self.start - torch.cat([p.reshape(-1) for p in self.params])
        dist.all_reduce(pseudo_gradient)  # the only collective: one tensor the size of the model
        self.start.grad = pseudo_gradient.div_(dist.get_world_size())
        self.optimizer.step()
        for param, start in zip(self.params, self.start.split([p.numel() for p in self.params])):
            param.copy_(start.view_as(param))
