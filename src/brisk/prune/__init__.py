"""Pruning: masks and metrics (masks.py), magnitude / Wanda / SparseGPT (unstructured.py, sparsegpt.py), structured
pruning (structured.py), pruned checkpoints (checkpoint.py) and `brisk prune` (cli.py)."""
