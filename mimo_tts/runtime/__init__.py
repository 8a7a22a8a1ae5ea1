"""The machine and its files, knowing no model: devices, memory, checkpoints, safetensors,
C kernels, guards."""
