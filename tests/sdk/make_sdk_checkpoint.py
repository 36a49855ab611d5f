#!/usr/bin/env python3
"""Write the SDK check's checkpoint with the real `safetensors` library (scripts/sdk-check.sh).

Four tensors whose every element follows a closed formula, so that the C, C++ and ctypes
consumers (tests/sdk/) check the bytes they read through the daemon element by element:

  embed.weight        F32 [4, 8]  element i = i * 0.25 - 3.0   (exact in binary)
  layers.0.mlp.bias   I32 [10]    element i = 1000 * i - 7
  layers.0.norm.idx   I16 [3, 5]  element i = -3 * i
  lm_head.lut         U8  [256]   element i = 255 - i

Usage: make_sdk_checkpoint.py DIR   (writes DIR/model.safetensors)
"""

import os
import sys

import numpy as np
from safetensors.numpy import save_file


def tensors():
    return {
        "embed.weight": (np.arange(32, dtype=np.float32) * np.float32(0.25) - np.float32(3.0)).reshape(4, 8),
        "layers.0.mlp.bias": np.arange(10, dtype=np.int32) * 1000 - 7,
        "layers.0.norm.idx": (np.arange(15, dtype=np.int16) * -3).reshape(3, 5),
        "lm_head.lut": (255 - np.arange(256)).astype(np.uint8),
    }


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    os.makedirs(sys.argv[1], exist_ok=True)
    save_file(tensors(), os.path.join(sys.argv[1], "model.safetensors"))


if __name__ == "__main__":
    main()
