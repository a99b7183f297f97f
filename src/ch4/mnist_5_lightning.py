"""MNIST, step 5 of 5: the DDP training of step 3, with PyTorch Lightning's Trainer doing the plumbing.

A LightningModule holds the model and says what one training step and one test step do; the Trainer
runs the loops, starts the processes (or joins those torchrun or srun started), creates the process
group, wraps the model in DDP, moves each batch to the device, applies mixed precision and calls
backward and the optimizer. What changes from step 3:
  - train_epoch and evaluate become training_step and test_step of a LightningModule, and
    configure_optimizers makes the AdamW;
  - Trainer(accelerator, devices, num_nodes, strategy=DDPStrategy, precision) replaces the
    launcher checks, the device choice, init_process_group and the DDP wrap; it calls set_epoch on the
    training sampler itself, every epoch;
  - the ranks come from the Trainer, which knows them before fit() creates the process group, so the
    samplers are given them explicitly;
  - exact evaluation needs use_distributed_sampler=False: by default Lightning gives the test loader a
    DistributedSampler, which pads (101 test images on 2 ranks: 102 scored, one of them twice), and
    self.log(..., sync_dist=True) would score and count the padding's duplicates too. Here test_step
    counts, and the counts are summed over ranks as in step 3.

Run from the repository root (MNIST is downloaded to ./data; --data-dir DIR reads a copy in DIR/MNIST/raw):
    python src/ch4/mnist_5_lightning.py --devices 2          # Lightning starts 2 processes: 2 GPUs,
                                                             # or 2 on the CPU
    python src/ch4/mnist_5_lightning.py                      # every visible GPU, or one CPU process
    torchrun --nproc_per_node=2 src/ch4/mnist_5_lightning.py # --devices, --num-nodes: what torchrun started
    sbatch -N2 --ntasks-per-node=4 --gpus-per-node=4 slurm/srun_tasks.sbatch src/ch4/mnist_5_lightning.py
Under torchrun and srun every process loads MNIST before the group exists: download it once first
(the python launch does: its first process loads the data before it starts the others). Inside an
interactive salloc shell, name the srun step (srun -J train ...): Lightning ignores SLURM in a job
named "interactive" or "bash". The script ends with dist.destroy_process_group(), as step 3 does:
Lightning destroys only NCCL groups at exit, and a gloo group left alive can abort the process as it
exits. docs/lightning.md lists the other traps.

It rewrites much of mnist_3_ddp.py, so its page shows it whole;
`python tools/stepdiff.py src/ch4/mnist_3_ddp.py src/ch4/mnist_5_lightning.py` shows the change.
"""
import time
from datetime import timedelta

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data.distributed import DistributedSampler

from common.cli import add_lightning_flags, mnist_parser, per_process_batch
from common.distributed import print0, processes
from common.gather import sum_across_ranks
from common.lightning_launch import check_launch, lightning_accelerator
from common.mnist import BasicNet, load_mnist, mnist_loader
from common.precision import lightning_precision
from common.samplers import DistributedEvalSampler


class LitBasicNet(L.LightningModule):  # the model and what one step does; the Trainer runs the loops
    def __init__(self, lr):
        super().__init__()
        self.model = BasicNet().to(memory_format=torch.channels_last)  # the Trainer moves it to the device
        self.lr = lr
        self.train_seconds, self.correct, self.seen = 0.0, 0, 0
        self.allow_zero_length_dataloader_with_multiple_devices = True  # a rank may have no test image

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)

    def on_train_epoch_start(self):
        self.loss_sum, self.start = torch.zeros((), device=self.device), time.perf_counter()

    def training_step(self, batch, batch_index):  # the Trainer calls backward and step, under autocast
        images, labels = batch  # already on the device
        loss = F.nll_loss(self.model(images.contiguous(memory_format=torch.channels_last)), labels)
        self.loss_sum += loss.detach()
        return loss

    def on_train_epoch_end(self):
        loss = self.loss_sum.item() / self.trainer.num_training_batches  # waits for the device's queued steps
        self.train_seconds += time.perf_counter() - self.start  # so the clock stops after them
        loss = sum_across_ranks(loss, device=self.device)[0] / self.trainer.world_size  # the mean over ranks
        print0(f"epoch {self.current_epoch}: mean training loss {loss:.4f}")

    def test_step(self, batch, batch_index):  # the Trainer sets eval mode and no_grad (inference_mode on NCCL)
        images, labels = batch
        predictions = self.model(images.contiguous(memory_format=torch.channels_last)).argmax(dim=1)
        self.correct += (predictions == labels).sum().item()  # counts, not a per-rank mean
        self.seen += labels.numel()


def main():
    args = add_lightning_flags(mnist_parser(__doc__)).parse_args()  # --devices, --num-nodes

    check_launch(args.devices, args.num_nodes)  # one sentence where Lightning would raise or misread
    precision = lightning_precision(args.precision)  # "32-true", "bf16-mixed" or "16-mixed"
    trainer = L.Trainer(accelerator=lightning_accelerator(), devices=args.devices, num_nodes=args.num_nodes,
                        precision=precision,
                        strategy=DDPStrategy(timeout=timedelta(seconds=args.dist_timeout)),  # gloo or nccl
                        use_distributed_sampler=False,  # keep our samplers: the default pads the test set
                        max_epochs=args.epochs, logger=False, enable_checkpointing=False,  # writes no files
                        enable_progress_bar=False, enable_model_summary=False)
    torch.manual_seed(args.seed + trainer.global_rank)  # own dropout masks; the DDP wrap copies rank 0's weights

    train_set, test_set = load_mnist(args.data_dir, args.loader, trainer.local_rank)
    batch_size = per_process_batch(args.batch_size, trainer.world_size)
    train_sampler = DistributedSampler(train_set, trainer.world_size, trainer.global_rank, seed=args.seed)
    train_loader = mnist_loader(train_set, batch_size, train_sampler, args.num_workers)
    test_sampler = DistributedEvalSampler(test_set, trainer.world_size, trainer.global_rank)
    test_loader = mnist_loader(test_set, args.eval_batch_size, test_sampler, args.num_workers)

    model = LitBasicNet(args.lr)

    if trainer.is_global_zero:  # print0 needs the process group, which fit() creates
        print(f"{processes(trainer.world_size)} on {trainer.strategy.root_device.type}, {precision}, "
              f"global batch {args.batch_size} = {trainer.world_size} x {batch_size}")
    trainer.fit(model, train_loader)  # every epoch: set_epoch, the loop, DDP's all-reduce in backward
    train_seconds = model.train_seconds

    trainer.test(model, test_loader, verbose=False)  # every rank scores its own share, no DDP wrap
    correct, seen = sum_across_ranks(model.correct, model.seen, device=trainer.strategy.root_device)  # every image once; test() left the model on the CPU
    print0(f"train time {train_seconds:.1f} s, {args.epochs * len(train_set) / train_seconds:.0f} samples/s")
    print0(f"test accuracy {correct / seen:.2%} over {seen} images")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
