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
    self.log(..., sync_dist=True) would average per-rank means. Here test_step counts, and the counts
    are summed over ranks as in step 3.

Run from the repository root (MNIST is downloaded to ./data; --data-dir DIR reads a copy in DIR/MNIST/raw):
    python src/ch4/mnist_5_lightning.py --devices 2          # Lightning starts 2 processes: 2 GPUs, or 2 on the CPU
    python src/ch4/mnist_5_lightning.py                      # every visible GPU, or one CPU process
    torchrun --nproc_per_node=2 src/ch4/mnist_5_lightning.py # --devices, --num-nodes: what torchrun started
    sbatch -N2 --ntasks-per-node=4 --gpus-per-node=4 slurm/srun_tasks.sbatch src/ch4/mnist_5_lightning.py
Under torchrun and srun every process loads MNIST before the group exists: download it once first
(the python launch does: its first process loads the data before it starts the others). Inside an
interactive salloc shell, name the srun step (srun -J train ...): Lightning ignores SLURM in a job
named "interactive" or "bash". The script ends with dist.destroy_process_group(), as step 3 does:
Lightning destroys only NCCL groups at exit, and a gloo group left alive can abort the process as it
exits. docs/lightning.md lists the other traps.

Lines marked `# STEP` are what this step changes in mnist_3_ddp.py.
"""
import time
from datetime import timedelta  # STEP

import lightning as L  # STEP
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy  # STEP
from torch.utils.data.distributed import DistributedSampler

from common.cli import mnist_parser
from common.cli import per_process_batch
from common.distributed import print0, processes  # STEP
from common.gather import sum_across_ranks
from common.lightning_launch import add_trainer_flags, check_launch, lightning_accelerator  # STEP
from common.mnist import BasicNet, load_mnist, make_loader
from common.precision import lightning_precision  # STEP
from common.samplers import DistributedEvalSampler


class LitBasicNet(L.LightningModule):  # STEP: the model and what one step does; the Trainer runs the loops
    def __init__(self, lr):  # STEP
        super().__init__()  # STEP
        self.model = BasicNet().to(memory_format=torch.channels_last)  # STEP: the Trainer moves it to the device
        self.lr = lr  # STEP
        self.train_seconds, self.correct, self.seen = 0.0, 0, 0  # STEP
        self.allow_zero_length_dataloader_with_multiple_devices = True  # STEP: a rank may have no test image

    def configure_optimizers(self):  # STEP
        return torch.optim.AdamW(self.parameters(), lr=self.lr)  # STEP

    def on_train_epoch_start(self):  # STEP
        self.loss_sum, self.start = torch.zeros((), device=self.device), time.perf_counter()  # STEP

    def training_step(self, batch, batch_index):  # STEP: the Trainer calls backward and step, under autocast
        images, labels = batch  # STEP: already on the device
        loss = F.nll_loss(self.model(images.contiguous(memory_format=torch.channels_last)), labels)  # STEP
        self.loss_sum += loss.detach()  # STEP
        return loss  # STEP

    def on_train_epoch_end(self):  # STEP
        loss = self.loss_sum.item() / self.trainer.num_training_batches  # STEP: waits for the device's queued steps
        self.train_seconds += time.perf_counter() - self.start  # STEP: so the clock stops after them
        loss = sum_across_ranks(loss, device=self.device)[0] / self.trainer.world_size  # STEP: the mean over ranks
        print0(f"epoch {self.current_epoch}: mean training loss {loss:.4f}")  # STEP

    def test_step(self, batch, batch_index):  # STEP: the Trainer sets eval mode and no_grad
        images, labels = batch  # STEP
        predictions = self.model(images.contiguous(memory_format=torch.channels_last)).argmax(dim=1)  # STEP
        self.correct += (predictions == labels).sum().item()  # STEP: counts, not a per-rank mean
        self.seen += labels.numel()  # STEP


def main():
    args = add_trainer_flags(mnist_parser(__doc__)).parse_args()  # STEP: --devices, --num-nodes

    check_launch(args.devices, args.num_nodes)  # STEP: one sentence where Lightning would raise or misread
    precision = lightning_precision(args.precision)  # STEP: "32-true", "bf16-mixed" or "16-mixed"
    trainer = L.Trainer(accelerator=lightning_accelerator(), devices=args.devices, num_nodes=args.num_nodes, precision=precision,  # STEP
                        strategy=DDPStrategy(timeout=timedelta(seconds=args.dist_timeout)),  # STEP: gloo or nccl
                        use_distributed_sampler=False,  # STEP: keep our samplers: the default pads the test set
                        max_epochs=args.epochs, logger=False, enable_checkpointing=False,  # STEP: writes no files
                        enable_progress_bar=False, enable_model_summary=False)  # STEP
    torch.manual_seed(args.seed + trainer.global_rank)  # STEP: own dropout masks; the DDP wrap copies rank 0's weights

    train_set, test_set = load_mnist(args.data_dir, args.loader, trainer.local_rank)  # STEP
    batch_size = per_process_batch(args.batch_size, trainer.world_size)  # STEP
    train_sampler = DistributedSampler(train_set, trainer.world_size, trainer.global_rank, seed=args.seed)  # STEP
    train_loader = make_loader(train_set, batch_size, train_sampler, args.num_workers)
    test_sampler = DistributedEvalSampler(test_set, trainer.world_size, trainer.global_rank)  # STEP
    test_loader = make_loader(test_set, args.eval_batch_size, test_sampler, args.num_workers)  # STEP

    model = LitBasicNet(args.lr)  # STEP

    if trainer.is_global_zero:  # STEP: print0 needs the process group, which fit() creates
        print(f"{processes(trainer.world_size)} on {trainer.strategy.root_device.type}, {precision}, global batch {args.batch_size} = {trainer.world_size} x {batch_size}")  # STEP
    trainer.fit(model, train_loader)  # STEP: every epoch: set_epoch, the loop, DDP's all-reduce in backward
    train_seconds = model.train_seconds  # STEP

    trainer.test(model, test_loader, verbose=False)  # STEP: every rank scores its own share, no DDP wrap
    correct, seen = sum_across_ranks(model.correct, model.seen, device=trainer.strategy.root_device)  # STEP: every image once; test() left the model on the CPU
    print0(f"train time {train_seconds:.1f} s, {args.epochs * len(train_set) / train_seconds:.0f} samples/s")
    print0(f"test accuracy {correct / seen:.2%} over {seen} images")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
