"""accelerate launch, each worker a fork of the warm server instead of a new interpreter (tests/warm_worker.py).

    python tests/warm_accelerate.py --config_file CONFIG src/ch4/mnist_4_accelerate.py FLAGS...

accelerate launch's own code, unchanged but for one call: where it starts several processes on one machine
(its multi-GPU launcher, which the CPU configs select, and its DeepSpeed launcher) it hands torchrun's `run` an
arguments namespace, and that namespace gets the change tests/warm_torchrun.py makes. A single process
(accelerate's simple launcher) is started afresh, as accelerate starts it.
"""
import torch.distributed.run
from accelerate.commands.launch import main
from warm_torchrun import forked

if __name__ == "__main__":
    torchs_run = torch.distributed.run.run  # accelerate imports the module and calls its run when it launches
    torch.distributed.run.run = lambda args: torchs_run(forked(args))
    main()
