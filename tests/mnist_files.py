"""Tiny MNIST-format datasets written by the tests, so no test needs the real MNIST or the network."""
import struct
from pathlib import Path

import numpy as np


def _write_idx(path: Path, array: np.ndarray) -> None:
    """The idx format: a zero word, a type byte (0x08 = uint8), the rank, each dimension, then the bytes."""
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    path.write_bytes(header + array.astype(np.uint8).tobytes())


def write_tiny_mnist(root: Path, train_size: int = 256, test_size: int = 101, seed: int = 0) -> Path:
    """Write root/MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte with learnable labels.

    Each image is noise plus a bright bar whose row encodes its label, so a few steps learn something.
    """
    rng = np.random.default_rng(seed)
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for prefix, size in (("train", train_size), ("t10k", test_size)):
        labels = rng.integers(0, 10, size)
        images = rng.integers(0, 60, (size, 28, 28))
        for image, label in zip(images, labels):
            image[2 + 2 * label, :] = 255
        _write_idx(raw / f"{prefix}-images-idx3-ubyte", images)
        _write_idx(raw / f"{prefix}-labels-idx1-ubyte", labels)
    return root
