"""The machine as the node finds it: GPUs (NVML or simulated), processes and their
identity as the kernel knows them, Unix sockets, the real clock and the virtual-time
loop. Imports nothing else of the node."""
