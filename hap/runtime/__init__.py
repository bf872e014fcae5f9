"""The runtime: run a Plan SPMD on torch.distributed (gloo on CPU, NCCL on GPUs)."""
