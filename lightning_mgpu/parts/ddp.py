"""DDP wrapping, the one home of what the pack does with torch's ``DistributedDataParallel``: building it, comm
hooks on every device type, static graph switched on at the first synchronised forward, rank 0's buffers broadcast
by hand where DDP's own forward is kept out of the step, micro-batched steps, the models DDP cannot train and the
errors it raises. Used by ``mgpu_ddp`` (and its periodic-sync family) and by ``MGPUShardedStrategy(stage=1)``."""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import Any, Callable, NamedTuple, Optional

import torch
from pytorch_lightning.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_mgpu import _compat, comm
from lightning_mgpu._compat import enable_static_graph
from lightning_mgpu.comm_hooks import allreduce_gradients, register_comm_hook
from lightning_mgpu.ledger import CommStats, Ledger
from lightning_mgpu.parts.accumulation import DDPSyncControl, ManualGradientSync
from lightning_mgpu.parts.compilation import Compilation
from lightning_mgpu.parts.micro_batching import MicroBatching, agree_across_ranks
from lightning_mgpu.quantization import is_nf4
from lightning_mgpu.settings import DDPSettings


class StepContext(NamedTuple):
    """What a manual or micro-batched DDP step reads, computed only for them: the strategy's ``backward`` of a loss
    already divided by the accumulation, ``accumulate_grad_batches``, the ledger's ``stats``, this ``rank`` of
    ``world_size`` and the ``device``."""

    backward: Callable[[Any], Any]
    accumulate_grad_batches: int
    stats: CommStats
    rank: int
    world_size: int
    device: torch.device


class DDPWrapping:
    """Everything the pack does with torch's ``DistributedDataParallel``, and its state: the wrap, the comm hook
    (and its state), the micro-batching state, the manual-optimization gradient sync and the ``no_sync`` control.
    ``mgpu_ddp`` (and its periodic-sync family) and ``MGPUShardedStrategy(stage=1)`` hold one each.

    Example::

        wrapping = DDPWrapping(DDPSettings(comm_hook="fp16"))
        state = wrapping.register_hooks(ddp_model, ledger, manual=False)
    """

    def __init__(self, settings: DDPSettings) -> None:
        self.settings = settings
        self.micro: Optional[MicroBatching] = (
            MicroBatching(settings.micro_batch_size) if settings.micro_batch_size is not None else None
        )
        """The micro-batching state (``micro_batch_size`` given): ``.size`` in use and ``.backoffs``; else None."""
        self.manual = ManualGradientSync(settings.comm_hook, bucket_cap_mb=self.bucket_cap_mb)
        self.hook_state: Any = None
        """The registered comm hook's state (e.g. torch's ``PowerSGDState``), once registered."""
        self._sync_control = DDPSyncControl()

    @property
    def bucket_cap_mb(self) -> float:
        return float(self.settings.ddp_kwargs.get("bucket_cap_mb") or 25.0)

    def wrap(self, module: nn.Module, device: torch.device) -> DistributedDataParallel:
        """``module`` in torch's DistributedDataParallel with the settings' keywords, built on the stream the
        forwards and backwards run on (the current one, normally the default stream), as Lightning's ``DDPStrategy``
        builds it since Lightning's fix for the "AccumulateGrad stream mismatch": built in a side stream, DDP's
        gradient accumulators belong to that stream and torch >= 2.10 warns on every backward. A 4-bit frozen base
        is left out of DDP and broadcast by the pack."""
        device_ids = None if device.type == "cpu" else [device.index]
        packed = [name for name, p in module.named_parameters() if is_nf4(p)]
        if packed:
            # a 4-bit base (torchao's NF4Tensor): DDP's construction-time broadcast writes through the wrapper and
            # corrupts its packed bytes on every rank (reproduced with torch DDP alone); DDP leaves it alone, and
            # the pack broadcasts its plain parts. Frozen, it has no gradient to reduce.
            _compat.ddp_ignore(module, packed)
            comm.broadcast_start_weights(module, select=is_nf4)
        return DistributedDataParallel(module=module, device_ids=device_ids, **self.settings.all_ddp_kwargs)

    def check_model(self, model: Any, device_type: str, sync_batchnorm: bool, micro: Optional[MicroBatching]) -> None:
        """What DDP (with these settings) cannot train, refused before any process starts."""
        if sync_batchnorm and device_type == "cpu":
            raise MisconfigurationException(
                "sync_batchnorm=True on CPU: torch's DistributedDataParallel refuses SyncBatchNorm layers in CPU "
                "modules ('SyncBatchNorm layers only work with GPU modules'). Train on GPUs, drop sync_batchnorm, or "
                "use strategy=MGPUShardedStrategy(activation_checkpointing=...) with the BatchNorm layers inside "
                "checkpointed blocks (mgpu_sharded, stage 2 or 3), where lightning_mgpu synchronises them on CPU."
            )
        if not model.automatic_optimization and self.settings.comm_hook in ("powersgd", "batched_powersgd"):
            raise MisconfigurationException(
                f"comm_hook={self.settings.comm_hook!r} needs automatic optimization: with manual optimization "
                f"mgpu_ddp averages each optimizer's gradients itself when it steps, outside DDP's buckets, where "
                f"PowerSGD cannot run. Use comm_hook='fp16' (half the bytes) or None for {type(model).__name__}."
            )
        if micro is not None and not model.automatic_optimization:
            raise MisconfigurationException(
                f"micro_batch_size={micro.setting!r} needs automatic optimization: {type(model).__name__} "
                f"runs its own backward and optimizer steps in training_step, which the strategy cannot split or "
                f"redo. Leave micro_batch_size=None and split the batch in training_step (with "
                f"lightning_mgpu.ManualAccumulation), or use automatic optimization."
            )

    def training_step(
        self,
        ddp: DistributedDataParallel,
        step: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        manual: bool,
        context: Callable[[], StepContext],
    ) -> Any:
        """One ``training_step`` of the DDP model: ``step(*args, **kwargs)`` runs the LightningModule's.

        Manual optimization: DDP's reducer would sync every backward (and, without ``find_unused_parameters``,
        wait forever for the toggled-off optimizer's gradients); it stays out of the whole step, and the step's
        optimizer syncs what it needs (:attr:`manual`). Otherwise static graph is switched on before the first
        synchronised forward.

        ``micro_batch_size``: every micro-batch runs forward and backward under ``no_sync`` (an out-of-memory
        error in any of them, on any rank, is then recoverable: no rank is inside a collective); the gradients are
        averaged once, after the last micro-batch, unless Lightning is accumulating (``parts/micro_batching.py``).
        ``context()`` gives what only manual optimization and micro-batching read (the strategy's backward, the
        accumulation, the ranks, the device): the plain step computes none of it."""
        if manual:
            self.broadcast_buffers(ddp, context().world_size)
            with ddp.no_sync():
                return step(*args, **kwargs)
        micro = self.micro
        if micro is None:
            self.before_training_step(ddp)
            return step(*args, **kwargs)
        batch, rest = (args[0], args[1:]) if args else (kwargs.pop("batch"), ())
        backward, accumulate_grad_batches, stats, rank, world_size, device = context()
        syncs = ddp.require_backward_grad_sync  # False inside Lightning's block_backward_sync
        params = [p for p in ddp.module.parameters() if p.requires_grad]
        micro.rank = rank
        bucket_cap_mb = self.settings.ddp_kwargs.get("bucket_cap_mb") or 25.0
        compress = self.settings.comm_hook if self.settings.comm_hook in ("fp16", "bf16") else None

        def sync() -> None:
            if syncs:
                allreduce_gradients(
                    params, group=ddp.process_group, compress=compress, ledger=stats, bucket_cap_mb=bucket_cap_mb
                )

        batch_idx = rest[0] if rest else None
        window_starts = isinstance(batch_idx, int) and batch_idx % accumulate_grad_batches == 0
        return micro.run(
            batch,
            forward=lambda micro_batch: step(micro_batch, *rest, **kwargs),
            backward=backward,
            no_sync=ddp.no_sync,
            agree=agree_across_ranks(ddp.process_group, rank, world_size, device),
            params=params,
            after_backward=sync,
            keep_gradients=not window_starts,  # Lightning zeroes them after this training_step
        )

    @staticmethod
    def explain(exception: BaseException, find_unused_parameters_fix: str) -> None:
        """DDP's two classic errors, rewritten to name the fix (``find_unused_parameters_fix``: the strategy as
        the user writes it with ``find_unused_parameters=True``)."""
        _compat.augment_message(
            exception,
            pattern=".*Expected to have finished reduction in the prior iteration.*",
            new_message=(
                f"Some parameters of your LightningModule were not used to produce the loss returned by "
                f"training_step. If that is intended, pass `{find_unused_parameters_fix}` "
                "(slower: a graph traversal per step); better, remove or freeze (requires_grad=False) the unused "
                "parameters."
            ),
        )
        _compat.augment_message(
            exception,
            pattern=".*Expected to mark a variable ready only once.*",
            new_message=(
                "DDP saw a parameter's gradient twice in one backward. With reentrant activation checkpointing "
                "(torch.utils.checkpoint(use_reentrant=True), or activation_checkpointing_reentrant=True) use the "
                "non-reentrant mode instead: MGPUDDPStrategy(activation_checkpointing=...) is non-reentrant by "
                "default. Otherwise a parameter is used outside forward or shared across checkpointed blocks; "
                "static_graph=True can help when the graph is the same every step."
            ),
        )

    def dimension(self, device: torch.device, ledger: Ledger, world_size: int, manual: bool) -> DDPDimension:
        """This part as the data dimension of :func:`~lightning_mgpu.parts.parallelize.parallelize`: the wrap on
        ``device``, counted by ``ledger``, with the comm hook (``manual``: manual optimization, synced outside
        DDP's reducer), then the compilation of the module's ``forward``."""
        return DDPDimension(self, device, ledger, world_size, manual)

    def register_hooks(self, ddp: DistributedDataParallel, ledger: Ledger, manual: bool) -> Any:
        """Register the comm hook (Lightning registers hooks only when the device is CUDA; the torch hooks used
        here run on gloo too). Returns the hook's state (e.g. ``PowerSGDState``), or None.

        Plain all-reduce with bucket views is counted from the buckets, and manual optimization syncs outside
        DDP's reducer: neither needs a hook."""
        if self.settings.count_from_buckets or manual:
            self.hook_state = None
        else:
            self.hook_state = register_comm_hook(ddp, self.settings.comm_hook, self.settings.comm_state, ledger.stats)
        return self.hook_state

    def after_backward(self, ddp: DistributedDataParallel, ledger: Ledger, synced: bool) -> None:
        """After a backward that all-reduced (``synced``): plain all-reduce with bucket views is counted from the
        buckets (a micro-batched step counts its own all-reduce)."""
        if self.settings.count_from_buckets and synced and self.micro is None:
            ledger.record_buckets(ddp)

    @contextmanager
    def no_backward_sync(self, model: nn.Module) -> Generator[None, None, None]:
        """Lightning's ``block_backward_sync``: the backwards of the micro-batches before the step do not sync."""
        with self._sync_control.no_backward_sync(model, enabled=True):
            yield

    def before_training_step(self, ddp: DistributedDataParallel) -> None:
        """Static graph: switched on just before the first synchronised forward (see ``_compat``)."""
        if (
            self.settings.static_graph
            and not ddp.static_graph
            and ddp.require_backward_grad_sync
            and torch.is_grad_enabled()
        ):
            enable_static_graph(ddp)

    def broadcast_buffers(self, ddp: DistributedDataParallel, world_size: int) -> None:
        """What DDP does before a synchronised forward (``broadcast_buffers=True``, its default): rank 0's
        buffers (BatchNorm statistics) overwrite the others', one broadcast per dtype."""
        if self.settings.ddp_kwargs.get("broadcast_buffers", True) is False or world_size == 1:
            return
        by_dtype: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for b in ddp.module.buffers():
            by_dtype.setdefault((b.device, b.dtype), []).append(b)
        for buffers in by_dtype.values():
            flat = torch.cat([b.reshape(-1) for b in buffers])
            comm.broadcast(flat, src=0, group=ddp.process_group)
            offset = 0
            for b in buffers:
                b.copy_(flat[offset : offset + b.numel()].view_as(b))
                offset += b.numel()


class DDPDimension:
    """DDP as the data dimension of :func:`~lightning_mgpu.parts.parallelize.parallelize` (see
    :meth:`DDPWrapping.dimension`)."""

    def __init__(self, part: DDPWrapping, device: torch.device, ledger: Ledger, world_size: int, manual: bool) -> None:
        self.part = part
        self.device = device
        self.ledger = ledger
        self.world_size = world_size
        self.manual = manual

    def apply(self, module: nn.Module) -> DistributedDataParallel:
        ddp = self.part.wrap(module, self.device)
        self.ledger.start(ddp, self.world_size)
        self.part.register_hooks(ddp, self.ledger, self.manual)
        return ddp

    def compile(self, compilation: Compilation, module: nn.Module) -> None:
        compilation.compile_model(module)  # the whole model's forward, after the wrap
