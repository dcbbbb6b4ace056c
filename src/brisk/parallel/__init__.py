"""Tensor and pipeline parallelism over torch.distributed, and data-parallel replicas (docs/parallel.md).

    launch.py    starting the ranks (spawned here, torchrun, several nodes) and the process group
    comm.py      the collectives and the driver's messages
    shard.py     tensor-parallel sharding of a loaded model (column / row / vocab parallel)
    pipeline.py  layer stages and the engine step that keeps several micro-batches in flight
    runner.py    the driver's and the workers' model runners
"""
