"""Compute the loss inside forward, so that DataParallel gathers scalars instead of outputs.

nn.DataParallel runs a replica per GPU and gathers what forward returns onto the output device
(GPU 0), where the loss is then computed. For a classifier that gather is small (batch x labels);
for a language-model head it is batch x sequence x vocabulary and fills GPU 0 first. Wrapping model
and criterion together makes each replica return its own loss: only one number per GPU travels.

HuggingFace models compute the loss per replica when given labels: model(**batch, labels=labels).loss,
gathered by DataParallel into a vector (take .mean()); but DataParallel gathers the logits they return
beside it too, so only a wrapper that returns the loss alone saves that gather.
Either way the mean of per-replica means equals the batch mean only when DataParallel splits the
batch evenly; with an uneven last chunk the difference is small but real.
"""
import torch.nn as nn


class LossInForward(nn.Module):
    def __init__(self, model: nn.Module, criterion: nn.Module):
        super().__init__()
        self.model, self.criterion = model, criterion

    def forward(self, *args, labels=None, **kwargs):
        """With labels: this replica's loss, shape (1,) so that replicas stack. Without: the model's output."""
        output = self.model(*args, **kwargs)
        if labels is None:
            return output
        logits = output.logits if hasattr(output, "logits") else output
        return self.criterion(logits, labels).unsqueeze(0)
