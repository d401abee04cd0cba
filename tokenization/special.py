"""The special tokens of the token layout, in id order (a trained default tokenizer gives them ids 0..5)."""
from __future__ import annotations

BOS = "<|bos|>"
EOS = "<|eos|>"
PAD = "<|pad|>"
IMAGE_START = "<|image_start|>"
IMAGE_PAD = "<|image_pad|>"
IMAGE_END = "<|image_end|>"
SPECIAL_TOKENS = (BOS, EOS, PAD, IMAGE_START, IMAGE_PAD, IMAGE_END)
