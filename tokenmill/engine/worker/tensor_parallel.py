"""Tensor-parallel execution (`--tensor-parallel-size N`): one process per rank, one box.

Rank 0 is the engine's own process: it schedules, prepares each step's inputs, broadcasts them,
runs its shard of the model and alone samples. Ranks 1..N-1 are spawned worker processes that
hold their shard of the weights and of the KV cache (their share of the KV heads, the same block
ids) and replay every step. torch.distributed carries it: gloo on CPU, NCCL on CUDA (one GPU per
rank). The all-reduces inside the layers keep the ranks in lock step.
"""

from __future__ import annotations

import atexit
import ctypes
import datetime
import logging
import os
import signal
import socket
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tokenmill.engine.config import EngineConfig
from tokenmill.engine.precision import resolve_kv_cache_dtype, resolve_precision
from tokenmill.engine.setup import load_prepared_model, resolve_device
from tokenmill.engine.worker.kv_cache import KVCache
from tokenmill.engine.worker.tensors import to_device
from tokenmill.models.model_loader.hub import resolve_model

logger = logging.getLogger(__name__)

_INIT_TIMEOUT = datetime.timedelta(minutes=10)  # covers the slowest rank loading its weights


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device: torch.device, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device.type == "cuda" else device


def threads_per_rank(world_size: int) -> int:
    return max(1, (os.cpu_count() or 1) // world_size)


class TensorParallelGroup:
    """Rank 0's side: starts the workers, joins the process group, broadcasts steps."""

    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        self.world_size = config.tensor_parallel_size
        self.device = device
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        ctx = mp.get_context("spawn")
        self.workers = [
            ctx.Process(target=worker_main, args=(rank, config, init_method), name=f"tokenmill-tp{rank}", daemon=True)
            for rank in range(1, self.world_size)
        ]
        for proc in self.workers:
            proc.start()
        if device.type == "cpu":
            torch.set_num_threads(threads_per_rank(self.world_size))
        dist.init_process_group(
            backend_for(device), init_method=init_method, rank=0, world_size=self.world_size, timeout=_INIT_TIMEOUT
        )
        self._closed = False
        atexit.register(self.close)
        logger.info("tensor parallel: %d ranks over %s", self.world_size, backend_for(device))

    def broadcast(self, payload: Any) -> None:
        if self.device.type == "cuda":
            payload = to_device(payload, torch.device("cpu"))  # each worker moves it to its own GPU
        dist.broadcast_object_list([payload], src=0)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.broadcast(None)  # the workers' signal to exit
        except Exception:
            logger.warning("tensor parallel: could not reach every worker at shutdown")
        for proc in self.workers:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        if dist.is_initialized():
            dist.destroy_process_group()


def _die_with_parent() -> None:
    """Linux: SIGKILL this worker when the engine process dies, however it dies."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def worker_main(rank: int, config: EngineConfig, init_method: str) -> None:
    """A worker rank: load the shard, size the cache as rank 0 says, replay steps until told to stop."""
    _die_with_parent()
    world = config.tensor_parallel_size
    device = rank_device(resolve_device(config.device), rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(threads_per_rank(world))
    model_dir = resolve_model(config.model, config.hub_options())  # (in the cache: rank 0 fetched it)
    precision = resolve_precision(config.dtype, device, model_dir)
    dist.init_process_group(
        backend_for(device), init_method=init_method, rank=rank, world_size=world, timeout=_INIT_TIMEOUT
    )
    model, spec = load_prepared_model(config, model_dir, precision, device, rank=rank)
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0)
    num_blocks = box[0]
    kv = KVCache(
        spec.num_layers,
        num_blocks,
        config.block_size,
        spec.num_kv_heads,
        spec.head_dim,
        resolve_kv_cache_dtype(config.kv_cache_dtype, precision.weights),
        device,
    )
    with torch.inference_mode():
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0)
            if box[0] is None:
                break
            fresh, input_ids, positions, meta = to_device(box[0], device)
            kv.zero_blocks(fresh)
            model(input_ids, positions, kv.layers, meta)
    dist.destroy_process_group()
