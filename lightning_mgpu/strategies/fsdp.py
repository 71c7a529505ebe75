"""ZeRO stages 2 and 3 without DDP: torch FSDP2 (``fully_shard``), or fairscale ``OSS`` + ``ShardedDataParallel``
at stage 2. Built on :class:`MGPUParallelStrategy` (process group, launch, ledger, failures, resume) and the
sharded strategy's optimizer and checkpoint handling; the backend (``_sharding.py``) shards the model and says how
its gradient sync is blocked.

Users write ``MGPUShardedStrategy(stage=2|3)`` or ``strategy="mgpu_sharded"`` / ``"mgpu_zero3"``; this is the
class they get.

Example::

    strategy = MGPUShardedStrategy(stage=3, wrap_modules=[nn.TransformerEncoderLayer])
    assert isinstance(strategy, MGPUShardedStrategy) and not isinstance(strategy, MGPUDDPStrategy)
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.trainer.states import TrainerFn
from pytorch_lightning.utilities.types import STEP_OUTPUT
from typing_extensions import override

from lightning_mgpu import _compat
from lightning_mgpu.parts.ledger import attached_trainer
from lightning_mgpu.parts.module_mode import follow_module_mode
from lightning_mgpu.parts.precision import PrecisionAdoption
from lightning_mgpu.strategies._process_group import MGPUParallelStrategy
from lightning_mgpu.strategies.sharded import MGPUShardedStrategy


class MGPUFSDPStrategy(MGPUShardedStrategy, MGPUParallelStrategy):
    """Stages 2 and 3 of :class:`~lightning_mgpu.MGPUShardedStrategy` (see there for the arguments)."""

    _sync_blocked = False  # inside block_backward_sync: the backward's gradients are not reduced

    # --- set-up -------------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if not fitting and self._sharding.is_sharded(self.model):
            # validate/test/predict after fit in the same process: the module stays sharded (FSDP2 cannot be
            # undone) and its shards agree; a broadcast of module states cannot take DTensors.
            self.setup_precision_plugin()
            return
        layer_sync = _compat.strategy_layer_sync(self)
        if fitting and layer_sync is not None:
            self.model = layer_sync.apply(self.model)  # SyncBatchNorm, as Lightning's DDPStrategy converts it
        # before convert_module: in master modes FSDP2's sharded FP32 parameters are the master copy, so the
        # plugin must not cast the module's parameters to half itself
        policy = self._sharding.mixed_precision_policy(self.precision_plugin) if fitting else None
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if fitting:
            self._shard_model(policy)
            self.setup_optimizers(trainer)  # after the model is sharded: the optimizers hold the shards
        else:
            _compat.sync_module_states(self.model)  # evaluation without a wrapper: rank 0's weights everywhere
        self.setup_precision_plugin()
        if fitting:
            clipping = self._sharding.norm_clipping(self._process_group(), self._ledger.stats)
            PrecisionAdoption.connect_norm_clipping(self.precision_plugin, clipping)  # shards: the global norm
            _compat.optimizers_to_device(self.optimizers, self.root_device)

    def _shard_model(self, policy: Any) -> None:
        # Order (torchtitan's parallelize): SyncBatchNorm conversion -> activation checkpointing -> sharding, so
        # that FSDP's hooks stay outside the recompute.
        module = self.lightning_module
        assert module is not None
        self._checkpointing.apply(module)
        mesh = self._sharding.device_mesh(self.root_device.type, self.world_size)
        sharded = self._sharding.shard_model(module, mesh, policy)
        if sharded is not None:
            self.model = sharded
        assert self.model is not None
        self._ledger.start(self.model, self.world_size)

    # --- steps --------------------------------------------------------------------------------------------
    def _redirect(self, method: str, *args: Any, **kwargs: Any) -> Any:
        # FSDP2 shards the LightningModule itself: its pre-forward hook (gather the root's parameters, lazy init)
        # only runs through __call__, so every step goes through forward, as for a wrapper (fairscale's SDP).
        assert self.model is not None and self.lightning_module is not None
        return _compat.forward_redirection(self)(self.model, self.lightning_module, method, *args, **kwargs)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        follow_module_mode(self.model, self.lightning_module)  # after validation: fairscale's SDP hooks need it
        with self.precision_plugin.train_step_context():
            return self._count_tokens(self._redirect("training_step", *args, **kwargs))

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self._redirect("validation_step", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self._redirect("test_step", *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._redirect("predict_step", *args, **kwargs)

    @override
    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        assert self.model is not None
        self._sync_blocked = True
        try:
            with self._sharding.sync_control.no_backward_sync(self.model, enabled=True):
                yield
        finally:
            self._sync_blocked = False

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        super().post_backward(closure_loss)
        trainer = attached_trainer(self.lightning_module)
        if self._sync_blocked or self.model is None or trainer is None or trainer.state.fn != TrainerFn.FITTING:
            return
        self._ledger.record_round(self._sharding.sync_layout(self.model))

    @override
    def optimizer_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().optimizer_step(*args, **kwargs)
        self._ledger.optimizer_stepped(self.lightning_module, self.is_global_zero)
        return output

    # --- end ----------------------------------------------------------------------------------------------
    @override
    def teardown(self) -> None:
        module = self.lightning_module
        if module is not None:
            PrecisionAdoption.connect_norm_clipping(self.precision_plugin, None)
            self.model = module  # unwrap fairscale's ShardedDataParallel (FSDP2 shards the module in place)
            trainer = attached_trainer(module)
            layer_sync = _compat.strategy_layer_sync(self)
            if layer_sync is not None and trainer is not None and trainer.state.fn == TrainerFn.FITTING:
                self.model = layer_sync.revert(self.model)
        super().teardown()
