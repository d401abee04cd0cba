"""Triton kernels, each beside its plain-PyTorch reference (see each op folder)."""
