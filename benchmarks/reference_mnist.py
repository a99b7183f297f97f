"""The original loop the MNIST benchmark compares against: the classic single-device tutorial code.

Per-sample PIL -> ToTensor -> Normalize transforms, a DataLoader that stacks 64 samples per batch,
fp32, the default (NCHW) memory layout. Same model, optimizer and hyper-parameters as the chapter, the
model run as the seed's code ran it (SeedNet).
"""
import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torchvision import datasets, transforms

from common.mnist import MEAN, STD, BasicNet


class SeedNet(BasicNet):
    """BasicNet as the seed's code computes it: ReLU before pooling, and nn.Dropout's masks. The same
    function as BasicNet (tests/test_benchmarks.py checks it), at the seed's cost."""

    def __init__(self):
        super().__init__()
        self.dropout1, self.dropout2 = nn.Dropout(0.25), nn.Dropout(0.5)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        return F.log_softmax(self.fc2(x), dim=1)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data-dir", default="data")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((MEAN,), (STD,))])
    train = datasets.MNIST(args.data_dir, train=True, download=True, transform=transform)
    test = datasets.MNIST(args.data_dir, train=False, transform=transform)
    train_loader = torch.utils.data.DataLoader(train, batch_size=64, shuffle=True)
    test_loader = torch.utils.data.DataLoader(test, batch_size=1000)
    model = SeedNet().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    start = time.perf_counter()
    model.train()
    for data, target in train_loader:
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        loss = F.nll_loss(model(data), target)
        loss.backward()
        optimizer.step()
    loss.item()
    seconds = time.perf_counter() - start

    model.eval()
    correct = 0
    with torch.no_grad():
        for data, target in test_loader:
            correct += (model(data.to(device)).argmax(1) == target.to(device)).sum().item()
    print(f"train time {seconds:.1f} s, {len(train) / seconds:.0f} samples/s")
    print(f"test accuracy {correct / len(test):.2%} over {len(test)} images")


if __name__ == "__main__":
    main()
