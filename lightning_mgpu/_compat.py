"""Torch / Lightning version differences, each behind one named flag (STYLE.md rule 5).

Nothing else in the package may test a version or probe a private API inline: import a flag from here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch.nn.parallel import DistributedDataParallel

# ``DistributedDataParallel._set_static_graph`` switches static-graph mode on after construction; the
# reducer accepts it until the first *synchronised* forward (its ``num_iterations_`` is still 0, and only
# synced forwards count). We use it to run the ``no_sync`` micro-batches of the first accumulation window
# in normal mode. Constructing DDP with ``static_graph=True`` instead crashes on the first ``no_sync``
# backward: ``_DDPSink`` queues ``reducer._delay_all_reduce`` while the reducer expects no autograd hooks
# (``expect_autograd_hooks_`` INTERNAL ASSERT, reducer.cpp; reproduced with torch 2.13 + Lightning 2.6.6,
# ``DDPStrategy(static_graph=True)``, ``accumulate_grad_batches=2``). Skipping the sink on those
# micro-batches is no fix either: in static mode the reducer counts the hook firings of every micro-batch
# of the first window and afterwards waits for k firings per parameter (weights diverge; measured).
# The method exists in every torch this package supports (>= 2.4); the flag guards against its removal.
_DDP_HAS_SET_STATIC_GRAPH = hasattr(DistributedDataParallel, "_set_static_graph")


def _batched_powersgd_is_broken() -> bool:
    """torch 2.13's ``batched_powerSGD_hook`` hands 2-D matrices to ``_orthogonalize``, which accepts only 3-D
    batches (``AssertionError`` on the first compressed step, also with plain torch DDP; reproduced here)."""
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    try:
        powerSGD_hook._orthogonalize(torch.ones(2, 1))
    except AssertionError:
        return True
    return False


_TORCH_BATCHED_POWERSGD_BROKEN = _batched_powersgd_is_broken()


def patch_batched_powersgd() -> None:
    """Make ``batched_powerSGD_hook`` run where ``_TORCH_BATCHED_POWERSGD_BROKEN``: a 2-D matrix is
    orthogonalised as a batch of one (``unsqueeze(0)`` is a view, so the in-place result lands in the
    caller's tensor). 3-D inputs go to torch's function unchanged; idempotent. Module-wide because torch
    calls it again from a future callback after the hook returns."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    original = powerSGD_hook._orthogonalize
    if not _TORCH_BATCHED_POWERSGD_BROKEN or getattr(original, "_mgpu_shim", False):
        return

    def _orthogonalize(matrices, epsilon=0):  # same signature as torch's
        if matrices.dim() == 2:
            return original(matrices.unsqueeze(0), epsilon)
        return original(matrices, epsilon)

    _orthogonalize._mgpu_shim = True  # type: ignore[attr-defined]
    powerSGD_hook._orthogonalize = _orthogonalize


def should_accumulate(trainer: Any) -> bool:
    """Whether the current training micro-batch only accumulates (does not end an accumulation window).

    Lightning's own rule (``_TrainingEpochLoop._should_accumulate``, private in 2.6): a window ends every
    ``accumulate_grad_batches`` batches and on the last batch of the epoch. Used as-is so that manual
    optimization steps exactly where automatic optimization would.
    """
    return bool(trainer.fit_loop.epoch_loop._should_accumulate())


def init_optimizer_state(optimizer: Any) -> None:
    """Give every parameter of ``optimizer`` its state tensors (zero gradients, one step at lr 0), so that a
    sharded checkpoint can be loaded into them in place. torch's own helper, private in 2.13
    (``torch.distributed.checkpoint.state_dict._init_optim_state``, used by ``get_optimizer_state_dict``);
    does nothing when the optimizer already has state or any gradient."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    _init_optim_state(optimizer)


def _torchelastic_shares_its_store() -> bool:
    """Under torchrun (torch >= 2.5) the workers' ``init_process_group`` uses the elastic agent's own TCPStore
    (``TORCHELASTIC_USE_AGENT_STORE=True``), and that store outlives a restart. The restarted workers then read
    the previous attempt's gloo/NCCL addresses from it and hang in ``init_process_group`` or fail with
    "Connection refused" (https://github.com/pytorch/pytorch/issues/135712; reproduced here with torch 2.13,
    gloo, plain ``torch.distributed`` and ``torchrun --max-restarts 1``, with static and c10d rendezvous).

    Only single-node jobs get the workaround below: ``TORCHELASTIC_RESTART_COUNT`` is counted by each node's
    agent, and after a failure on one node the other node's agent restarts without counting (pytorch#135712),
    so a per-attempt prefix would keep the nodes apart. Multi-node jobs: set
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` with c10d rendezvous (a fresh store per round; seen to work here)."""
    import os

    env = os.environ
    return (
        env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        and "TORCHELASTIC_RESTART_COUNT" in env
        and env.get("LOCAL_WORLD_SIZE") is not None
        and env.get("LOCAL_WORLD_SIZE") == env.get("WORLD_SIZE")
    )


_ELASTIC_INITS = [0]  # process groups this process has initialised on the agent's store, this attempt


def _elastic_attempt_store(timeout: Any) -> Any:
    """A client of the agent's store whose keys are prefixed by the restart attempt and by how many groups this
    process has initialised in it (a script that catches a failed ``fit`` and fits again re-initialises after
    the failure path left the group), so that each group meets only its own addresses."""
    import os

    from torch.distributed import PrefixStore, TCPStore

    store = TCPStore(
        host_name=os.environ["MASTER_ADDR"],
        port=int(os.environ["MASTER_PORT"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        is_master=False,
        timeout=timeout,
    )
    _ELASTIC_INITS[0] += 1
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    return PrefixStore(f"/lightning_mgpu/attempt_{attempt}/group_{_ELASTIC_INITS[0]}", store)


@contextlib.contextmanager
def cpu_fork_despite_cuda_probe() -> Iterator[None]:
    """Lightning's fork launcher without its "Cannot re-initialize CUDA in forked subprocess" refusal, for a
    launch whose workers run on CPU.

    On torch's CUDA wheel without a GPU, ``torch.cuda.device_count()`` (which every ``Trainer`` calls) asks the
    CUDA runtime, because NVML is absent, and torch then marks every process forked afterwards as a "bad fork"
    (``torch.cuda._is_in_bad_fork()``). Lightning's fork launcher refuses to start in such a process
    (``lightning_fabric.strategies.launchers.multiprocessing._check_bad_cuda_fork``, imported by name into
    ``pytorch_lightning.strategies.launchers.multiprocessing``; checked on Lightning 2.6.0 and 2.6.6, torch 2.13.0 and
    2.14.1+cu130): a CPU fit forked from a process that was itself forked after a ``Trainer`` was built fails,
    although its workers never touch CUDA. Where the name is missing (another release), Lightning's check runs
    unchanged."""
    from pytorch_lightning.strategies.launchers import multiprocessing as launchers

    original = getattr(launchers, "_check_bad_cuda_fork", None)
    if original is None:  # pragma: no cover - another Lightning release
        yield
        return
    launchers._check_bad_cuda_fork = lambda: None
    try:
        yield
    finally:
        launchers._check_bad_cuda_fork = original
