"""Training on the CPU with plain PyTorch autograd: one trainer (trainer.py) and what it trains (distill.py).

The training forward (forward.py) runs a brisk model's own weights over [B, T] batches with causal attention
and no KV cache, so the inference path (model/llama.py, the paged cache, the executors) stays untouched.
"""
