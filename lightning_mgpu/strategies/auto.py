"""``mgpu_auto``: the strategy is chosen at set-up from a memory plan of the model and a sample batch.

Until set-up it is an :class:`~lightning_mgpu.MGPUDDPStrategy` (launch, process group and pre-launch checks are
the same for every candidate). In ``setup``, once the process group is up and the model and data are attached,
rank 0 plans (:func:`lightning_mgpu.plan`) with the Trainer's precision and ``device_memory``, takes the fastest
candidate that fits (DDP before sharding, lower stages before higher, activation checkpointing only when
needed), logs the plan and why, and broadcasts the decision; every rank then re-initialises this object as the
chosen strategy (same launcher, devices, cluster environment, precision and checkpoint plugins) and sets up as
that one. When nothing fits, every rank raises the same :class:`~lightning_mgpu.planning.PlanError`, naming the
smallest plan and by how much it misses.

Example::

    import lightning_mgpu  # registers "mgpu_auto", "mgpu_auto_spawn", "mgpu_auto_notebook"
    from pytorch_lightning import Trainer

    trainer = Trainer(accelerator="cpu", devices=2, strategy=MGPUAutoStrategy(device_memory="8GiB"))
    trainer.fit(model, datamodule)  # in the workers: trainer.strategy is the chosen strategy, .auto_decision why
    print(trainer.strategy.auto_decision.reason)  # also in the main process after a spawn/fork launch
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Optional, Union, cast

import pytorch_lightning as pl
import torch
from lightning_fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning_fabric.plugins.collectives.torch_collective import default_pg_timeout
from pytorch_lightning.plugins.precision import Precision
from pytorch_lightning.trainer.states import TrainerFn
from pytorch_lightning.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_mgpu import _compat
from lightning_mgpu.parts.activation_checkpointing import ActivationCheckpointingPolicy
from lightning_mgpu.planning import NoPlanFits, PlanError, plan_layouts
from lightning_mgpu.planning.choice import (
    AutoDecision,
    decide_layout,
    device_memory_bytes,
    device_memory_source,
    fallback,
    host_memory_bytes,
    planner_precision,
)
from lightning_mgpu.planning.layouts import Layout
from lightning_mgpu.planning.request import parse_memory
from lightning_mgpu.planning.source import default_policy
from lightning_mgpu.planning.stand_in import stand_in_factory
from lightning_mgpu.settings import (
    AutoSettings,
    CheckpointParams,
    CommonSettings,
    CompileSetting,
    LossNormalization,
    MicroBatchSetting,
    NonFinite,
    StartMethod,
    arguments_of,
    from_arguments,
    lightning_arguments,
    strategy_options,
)
from lightning_mgpu.strategies.ddp import MGPUDDPStrategy
from lightning_mgpu.strategies.sharded import MGPUShardedStrategy


@strategy_options(AutoSettings, CommonSettings, var_keyword="")
class MGPUAutoStrategy(MGPUDDPStrategy):
    """Chooses mgpu_ddp, mgpu_zero1, mgpu_sharded, mgpu_hsdp (on several machines: ``num_nodes > 1``) or mgpu_zero3
    (with or without activation checkpointing) at set-up: the fastest that the memory plan says fits (see the
    module docstring).

    ``activation_checkpointing`` names the blocks the "with activation checkpointing" candidates checkpoint;
    default the transformer layers, else every block of the outermost containers; a model with neither (layers
    kept as plain attributes) is planned without activation checkpointing. ``micro_batch_size`` and the options
    every mgpu strategy has (``start_method``, ``process_group_backend``, ``timeout``, ``log_comm_stats``,
    ``loss_normalization``, ``nonfinite``, ``async_checkpoint``, ``checkpoint_params``, ``compile``,
    ``exact_evaluation``, ``check_uneven_inputs``) are passed to the chosen strategy.

    After set-up, in the training processes, ``trainer.strategy`` is the chosen strategy and its
    ``auto_decision`` (an ``AutoDecision``: ``strategy``, ``activation_checkpointing``, ``reason``, ``table``)
    says what and why. After ``fit`` with a spawn or fork launch, the main process's ``trainer.strategy`` (still
    this class) has rank 0's ``auto_decision`` and ``comm_stats`` too.

    Example (``trainer.fit(model, datamodule)`` then plans and logs which strategy was chosen and why):

        >>> from pytorch_lightning import Trainer
        >>> from lightning_mgpu import MGPUAutoStrategy
        >>> strategy = MGPUAutoStrategy(device_memory="8GiB", start_method="fork")  # or strategy="mgpu_auto"
        >>> trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=1, logger=False)
        >>> trainer.strategy is strategy
        True
        >>> MGPUAutoStrategy(strategies=["mgpu_ddp", "deepspeed"])
        Traceback (most recent call last):
        ...
        ValueError: strategies=['mgpu_ddp', 'deepspeed']: ['deepspeed']; choose from ...
    """

    strategy_name = "mgpu_auto"

    def __init__(
        self,
        device_memory: Optional[Union[str, int]] = None,
        headroom: float = 0.10,
        strategies: Optional[Sequence[str]] = None,
        activation_checkpointing: Optional[ActivationCheckpointingPolicy] = None,
        micro_batch_size: Optional[MicroBatchSetting] = None,
        accelerator: Optional[pl.accelerators.Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: StartMethod = "popen",
        log_comm_stats: bool = True,
        loss_normalization: Optional[LossNormalization] = None,
        nonfinite: Optional[NonFinite] = None,
        async_checkpoint: bool = False,
        checkpoint_params: CheckpointParams = "all",
        compile: CompileSetting = False,
        exact_evaluation: bool = True,
        check_uneven_inputs: bool = True,
    ) -> None:
        arguments = dict(locals())
        # validates the common arguments (and micro_batch_size) now, before any process starts
        super().__init__(**lightning_arguments(arguments), **arguments_of(CommonSettings, arguments))
        if device_memory is not None:
            parse_memory(device_memory)  # a bad size is refused now, naming it (the planner's parser)
        auto = from_arguments(AutoSettings, arguments, strategies=tuple(strategies) if strategies is not None else None)
        self._auto: dict[str, Any] = {"settings": auto, "policy": activation_checkpointing}
        self._ddp_part.micro = None  # this object micro-batches nothing itself: the chosen strategy does
        # the compilation check before launch: the sharded stages 2/3 this strategy may still become
        sharded = ("mgpu_sharded", "mgpu_hsdp", "mgpu_zero3")
        self._runtime.sharded_choices = tuple(s for s in auto.strategies or () if s in sharded)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        if trainer.state.fn != TrainerFn.FITTING:
            super().setup(trainer)  # validate/test/predict without a plan: mgpu_ddp
            return
        decision, policy = self._decide(trainer)
        self._become(decision, policy)
        type(self).setup(self, trainer)

    def _decide(self, trainer: pl.Trainer) -> tuple[AutoDecision, Any]:
        """Rank 0 plans; every rank receives its decision (or its error) by broadcast."""
        message: dict[str, Any] = {}
        if self.global_rank == 0:
            try:
                with random_streams_kept(self.root_device):
                    message = self._plan(trainer)
            except NoPlanFits as err:  # a plan that says nothing fits is an answer, not a failure to plan
                message = {"error": str(err)}
            except Exception as err:  # planning never fails the fit: mgpu_ddp, and why in one line
                memory = device_memory_bytes(self._auto["settings"].device_memory, self.root_device, self.num_processes)
                message = {"decision": fallback(err, type(self.lightning_module).__qualname__, memory), "policy": None}
        message = self.broadcast(message, src=0)
        if "error" in message:
            raise PlanError(f"mgpu_auto: {message['error']}")
        decision: AutoDecision = message["decision"]
        rank_zero_info(f"{decision.table}\n{decision.reason}" if decision.table else decision.reason)
        return decision, message["policy"]

    def _plan(self, trainer: pl.Trainer) -> dict[str, Any]:
        module = self.lightning_module
        assert module is not None
        given = self._auto["settings"].device_memory
        memory = device_memory_bytes(given, self.root_device, self.num_processes)
        if not module.automatic_optimization:  # the planner traces automatic optimization only
            reason = "mgpu_auto chose mgpu_ddp: the module uses manual optimization, which only mgpu_ddp supports."
            return {"decision": AutoDecision("mgpu_ddp", False, "32-true", 0, memory, reason), "policy": None}
        try:
            batch = next(iter(_compat.fit_train_dataloader(trainer)))
        except Exception as err:
            raise PlanError(
                f"could not draw a sample batch from the training data to plan with ({type(err).__name__}: {err})."
            ) from None
        # the module itself: the planner steps a stand-in of it (its module tree with fake tensors), never a copy
        policy = self._auto["policy"] or default_policy(stand_in_factory(module))

        def planned(offload: bool) -> Any:
            return plan_layouts(
                module,
                devices=self.world_size,
                num_nodes=self.num_nodes,
                device_memory=memory,
                batch=batch,
                headroom=self._auto["settings"].headroom,
                precisions=(planner_precision(self.precision_plugin),),
                strategies=self._auto["settings"].strategies,
                activation_checkpointing=policy,
                offload=offload,
                host_memory=host_memory_bytes() if offload else None,
            )

        source = device_memory_source(given, self.root_device, self.num_processes)
        try:
            decision = decide_layout(planned(offload=False), layout_arguments, memory_source=source)
        except NoPlanFits as on_device:
            # nothing fits on the device: a sharded candidate with its states in host memory may (the host's own
            # memory checked); where none does either, the error names the smallest plan without offload
            try:
                offloaded = decide_layout(planned(offload=True), layout_arguments, memory_source=source)
            except NoPlanFits as also:
                on_device.args = (f"{on_device.args[0]} Offloaded to host memory, neither: {also.args[0]}",)
                raise on_device from None
            if not offloaded.offload:
                raise on_device from None
            decision = offloaded
        # a policy given by the user is on every rank already (and may not pickle); the default one pickles
        return {"decision": decision, "policy": None if self._auto["policy"] else policy}

    def _become(self, decision: AutoDecision, policy: Any) -> None:
        """Re-initialise this object as the chosen strategy, keeping what Lightning gave it after construction."""
        kept = {
            "accelerator": self.accelerator,
            "parallel_devices": self.parallel_devices,
            "cluster_environment": self.cluster_environment,
            "checkpoint_io": _compat.strategy_checkpoint_io(self),
            "precision_plugin": _compat.strategy_precision_plugin(self),
        }
        launcher, layer_sync = self.launcher, _compat.strategy_layer_sync(self)
        # ``fit(ckpt_path=...)``: Lightning restored the module (and what mid-epoch resume needs) before set-up,
        # as for mgpu_ddp; a sharded choice restores again after its own set-up (restore_checkpoint_after_setup)
        runtime = self._runtime
        num_nodes, module = self.num_nodes, self.lightning_module
        auto = self._auto
        # what every mgpu strategy has is handed on as given; the plan decides activation checkpointing
        handed_on = set(CommonSettings.keywords()) - {
            "activation_checkpointing",
            "activation_checkpointing_reentrant",
            "activation_checkpointing_save",
        }
        kwargs: dict[str, Any] = {**kept, **{name: getattr(self.launch_settings, name) for name in handed_on}}
        kwargs.pop("micro_batch_size")
        if auto["settings"].micro_batch_size is not None:
            kwargs["micro_batch_size"] = auto["settings"].micro_batch_size
        if decision.activation_checkpointing:
            kwargs["activation_checkpointing"] = auto["policy"] or policy
        target: type
        kwargs.update(decision.strategy_arguments)  # a split of the model: the layout's stage and sizes
        if decision.stage is None:
            target = MGPUDDPStrategy
        else:
            if decision.offload:
                kwargs["offload"] = "cpu"
            kwargs["stage"] = decision.stage
            if decision.mesh == "hybrid":
                kwargs["mesh"] = "hybrid"
            target = MGPUShardedStrategy
        self.__dict__.clear()
        self.__class__ = target  # type: ignore[assignment]  # the one class switch: see the class docstring
        target.__init__(self, **kwargs)  # type: ignore[arg-type]  # self is a target now
        _compat.set_strategy_launcher(self, launcher)
        _compat.set_strategy_layer_sync(self, layer_sync)
        self.num_nodes = num_nodes
        # the launcher (made before set-up) hands its checks and results to the runtime it was made with, and to its
        # worker results: those objects become the chosen strategy's, keeping the mid-epoch position Lightning
        # restored into the first (its checkpoint rules too read it there)
        resume, results = runtime.resume, runtime.worker_results
        vars(runtime).update(vars(self._runtime))
        vars(results).update(vars(runtime.worker_results))
        self._runtime = runtime
        if target is MGPUShardedStrategy:  # its model's part (strategies/sharded_model.py) serves the same runtime
            cast(MGPUShardedStrategy, self)._sharded.runtime = runtime
        runtime.resume = runtime.checkpoints.resume = resume
        runtime.worker_results = results
        self.set_world_ranks()
        assert module is not None
        self.connect(module)
        self.auto_decision = decision


def layout_arguments(layout: Layout) -> Optional[dict[str, Any]]:
    """The keywords that build ``layout`` with :class:`~lightning_mgpu.MGPUShardedStrategy`
    (:attr:`Layout.strategy_arguments <lightning_mgpu.planning.layouts.Layout.strategy_arguments>`, checked against
    the strategy's settings when the plan was made), or None where the layout is not buildable
    (:attr:`~lightning_mgpu.planning.layouts.Layout.not_buildable` says why)."""
    return dict(layout.strategy_arguments) if layout.buildable else None


def random_streams_kept(device: torch.device) -> Any:
    """A context that gives torch's random generators back as it found them (the CPU's, and ``device``'s where it is
    a GPU): planning draws a sample batch (a ``DataLoader``'s iterator draws its base seed from torch's generator)
    and builds a stand-in of the module, and none of it may move the streams training then draws from (dropout, the
    seeds of a loader's workers). Otherwise rank 0, which plans, would train on other random numbers than the other
    ranks, and than the strategy it chose run by name."""
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    return torch.random.fork_rng(devices=cuda)
