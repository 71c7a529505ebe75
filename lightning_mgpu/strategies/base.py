"""What every mgpu strategy shares, assembled from parts: the ledger, checkpoint IO choice, precision adoption,
the launcher with its pre-launch check, failure handling, mid-epoch resume and the elastic-restart store.

:class:`MGPUStrategyMixin` goes first in the bases of a Lightning ``ParallelStrategy`` that has DDP's process-group
machinery (``_start_method``, ``_timeout``)."""

from __future__ import annotations

import atexit
import dataclasses
import logging
import math
from collections.abc import Mapping
from datetime import timedelta
from typing import Any, Callable, Optional, Union

import pytorch_lightning as pl
import torch
from lightning_fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning_fabric.utilities.seed import reset_seed
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from pytorch_lightning.plugins.precision import Precision
from pytorch_lightning.strategies import ParallelStrategy
from pytorch_lightning.trainer.states import TrainerFn, TrainerStatus
from pytorch_lightning.utilities.exceptions import MisconfigurationException
from pytorch_lightning.utilities.rank_zero import rank_zero_only
from torch import Tensor
from torch.distributed import ReduceOp
from typing_extensions import override

from lightning_mgpu import _compat, comm
from lightning_mgpu.comm import CommStats, Ledger, attached_trainer, group_is_up
from lightning_mgpu.parts.accumulation import check_accumulate_grad_batches, check_manual_accumulation
from lightning_mgpu.parts.activation_checkpointing import ActivationCheckpointing
from lightning_mgpu.parts.compilation import Compilation
from lightning_mgpu.parts.evaluation import ExactEvaluation
from lightning_mgpu.parts.failures import FailureHandling
from lightning_mgpu.parts.nonfinite import NonFiniteCheck
from lightning_mgpu.parts.predictions import PredictionGathering
from lightning_mgpu.parts.resume import MidEpochResume
from lightning_mgpu.parts.token_loss import LOG_NAME, TokenNormalization
from lightning_mgpu.parts.uneven_inputs import UnevenInputs
from lightning_mgpu.plugins.async_checkpoint import AsyncCheckpointWriter, CheckpointWriteError, failure_message
from lightning_mgpu.plugins.checkpoint_io import choose_checkpoint_io
from lightning_mgpu.plugins.precision import PrecisionAdoption
from lightning_mgpu.settings import CommonSettings
from lightning_mgpu.strategies.launchers import _CheckedMultiProcessingLauncher, _CheckedSubprocessScriptLauncher

log = logging.getLogger(__name__)

#: strategy -> (what the user wrote, the notebook form of the same strategy), as ``Trainer(strategy=...)``
#: arguments. Handed in by ``lightning_mgpu.presets``, which holds the preset table: it imports the strategies, so
#: they cannot import it.
_NOTEBOOK_ADVICE: list[Callable[[Any], tuple[str, str]]] = []


def set_notebook_advice(advice: Callable[[Any], tuple[str, str]]) -> None:
    """Where a notebook refusal finds the notebook preset to suggest (:meth:`MGPUStrategyMixin._check_interactive`)."""
    _NOTEBOOK_ADVICE[:] = [advice]


def _callbacks(trainer: pl.Trainer) -> list[Any]:
    # set on the Trainer at runtime by Lightning's callback connector (not a declared attribute)
    return list(getattr(trainer, "callbacks", []))


class MGPUStrategyMixin(ParallelStrategy):
    """The parts every mgpu strategy has, and the Lightning hooks that hand work to them; subclasses call
    :meth:`_init_parts` in ``__init__``. A ``ParallelStrategy`` itself, so that what it overrides and calls is
    Lightning's, visibly (it goes first in the bases, before ``DDPStrategy`` or as the base of
    :class:`MGPUParallelStrategy`)."""

    _ledger: Ledger
    _failures: FailureHandling
    _resume: MidEpochResume
    _evaluation: ExactEvaluation
    _uneven: UnevenInputs
    _checkpointing: ActivationCheckpointing
    _compilation: Compilation
    _launch: CommonSettings
    _tokens: Optional[TokenNormalization]
    _nonfinite: Optional[NonFiniteCheck]
    _async: Optional[AsyncCheckpointWriter]
    _prediction_gathering: PredictionGathering

    def _init_parts(self, settings: CommonSettings) -> None:
        self._launch = settings
        self._ledger = Ledger(log=settings.log_comm_stats)
        self._failures = FailureHandling(settings.timeout)
        self._resume = MidEpochResume()
        self._evaluation = ExactEvaluation(settings.exact_evaluation)
        self._uneven = UnevenInputs(settings.check_uneven_inputs)
        self._checkpointing = ActivationCheckpointing(
            settings.activation_checkpointing, settings.activation_checkpointing_reentrant
        )
        self._compilation = Compilation(settings.compile)
        tokens = settings.loss_normalization == "tokens"
        self._tokens = TokenNormalization(self._ledger.stats) if tokens else None
        self._nonfinite = NonFiniteCheck(self._ledger.stats) if settings.nonfinite == "error" else None
        self._async = AsyncCheckpointWriter() if settings.async_checkpoint else None
        self._async_unsettled = False  # every rank: an async save was submitted since the last agreement
        self._checkpoint_group: Any = None  # a gloo group for the background writes' collectives (sharded layout)
        self._prediction_gathering = PredictionGathering()

    def _processes_and_nodes(self) -> tuple[int, int]:
        """Processes per node and nodes: DDPStrategy and MGPUParallelStrategy define them, ParallelStrategy
        does not."""
        host: Any = self
        return host.num_processes, host.num_nodes

    def _group_backend(self) -> str:
        """The process-group backend asked for, or the device's default (gloo on CPU, nccl on CUDA), as Lightning's
        DDP chooses it; from the devices' type, not from this rank's device (see :meth:`_device_type`)."""
        return self._launch.process_group_backend or ("nccl" if self._device_type() == "cuda" else "gloo")

    def _device_type(self) -> str:
        """The type of the Trainer's devices. The launch path (Trainer construction, the checks before launch, the
        launcher) asks only for this, never for ``root_device``: that indexes the devices by this process's local
        rank, which a cluster environment may put past the local device count before any worker exists (Lightning's
        DDP reads ``root_device`` only once set up, in the worker)."""
        devices = getattr(self, "parallel_devices", None)
        return devices[0].type if devices else self.root_device.type

    # --- what users read ----------------------------------------------------------------------------------
    @property
    def public_name(self) -> str:
        """The strategy's class as users write it (what summaries and errors print)."""
        return type(self).__name__

    @property
    def launch_settings(self) -> CommonSettings:
        """The settings every mgpu strategy has (launch, process group, ledger, activation checkpointing)."""
        return self._launch

    @property
    def comm_stats(self) -> CommStats:
        """The communication ledger of this rank (see :class:`~lightning_mgpu.comm.CommStats`)."""
        return self._ledger.stats

    @property
    def activation_checkpointing(self) -> Any:
        """The activation-checkpointing policy (``None``: off)."""
        return self._checkpointing.policy

    # --- plugins ------------------------------------------------------------------------------------------
    @property
    @override
    def checkpoint_io(self) -> CheckpointIO:
        """:class:`~lightning_mgpu.AtomicCheckpointIO` unless a plugin was given (then that one, as it is; a
        wrapping plugin without a base, e.g. ``AsyncCheckpointIO()``, gets ``AtomicCheckpointIO`` as its base)."""
        io = choose_checkpoint_io(_compat.strategy_checkpoint_io(self))
        _compat.set_strategy_checkpoint_io(self, io)
        return io

    @checkpoint_io.setter
    def checkpoint_io(self, io: Optional[CheckpointIO]) -> None:
        _compat.set_strategy_checkpoint_io(self, io)

    @property
    @override
    def precision_plugin(self) -> Precision:
        plugin = _compat.strategy_precision_plugin(self)
        return plugin if plugin is not None else Precision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        _compat.set_strategy_precision_plugin(self, PrecisionAdoption.adopt(plugin))

    # --- launch -------------------------------------------------------------------------------------------
    def _check_at_construction(self) -> None:
        """Runs in the main process at Trainer construction, once accelerator and devices are known."""
        PrecisionAdoption.check(_compat.strategy_precision_plugin(self), self.parallel_devices)
        io = _compat.strategy_checkpoint_io(self)
        if self._launch.async_checkpoint and _compat.is_wrapping_checkpoint_io(io):
            raise ValueError(
                f"async_checkpoint=True with {type(io).__name__}: the strategy already writes checkpoints in the "
                f"background, from a copy of the state, and marks them complete only once written; a second "
                f"background plugin would hand it back before the file exists. Remove {type(io).__name__} from the "
                f"plugins (or give its base plugin as checkpoint_io), or drop async_checkpoint=True."
            )

    def _configure_launcher(self) -> None:
        # The last moment to refuse a configuration before any process is started.
        self._check_interactive()
        self._check_at_construction()
        assert self.cluster_environment is not None
        if self._launch.start_method == "popen":
            launcher: Any = _CheckedSubprocessScriptLauncher(
                self._check_before_launch,
                self.cluster_environment,
                *self._processes_and_nodes(),
                on_failure=self._end_group_after,
                grace_s=self._failures.roll_call_s() + 5.0,  # rank 0's roll call, then a margin to raise and print
                finish=self._gather_predictions,
            )
        else:
            launcher = _CheckedMultiProcessingLauncher(
                self._check_before_launch,
                self,
                start_method=self._launch.start_method,
                on_failure=self._end_group_after,
                weights=self._weights_for_main_process,
                results=(self._results_for_main_process, self._restore_results_from_worker),
                returned=(self._prepare_predict_launch, self._gather_predictions),
            )
        _compat.set_strategy_launcher(self, launcher)

    # --- trainer.predict: every prediction once, in dataset order (parts/predictions.py) ---------------------
    def _prepare_predict_launch(
        self, trainer: Optional[pl.Trainer], function: Callable, args: tuple, kwargs: dict
    ) -> tuple[tuple, dict]:
        """Main process of a spawn/fork launch: whether ``trainer.predict`` returns predictions (see
        :meth:`~lightning_mgpu.parts.predictions.PredictionGathering.before_launch`)."""
        return self._prediction_gathering.before_launch(trainer, function, args, kwargs)

    @override
    def on_predict_start(self) -> None:
        self._prediction_gathering.on_predict_start(attached_trainer(self.lightning_module))
        super().on_predict_start()

    def _gather_predictions(self, trainer: pl.Trainer, results: Any) -> Any:
        """Every rank, after a Trainer call: ``trainer.predict``'s predictions of all ranks, each once, in dataset
        order; on every rank under popen (each rank's call returns them), on rank 0 under spawn/fork (its worker
        hands them to the main process; with several nodes, every rank)."""
        to_all = self._launch.start_method == "popen" or self._processes_and_nodes()[1] > 1
        return self._prediction_gathering.gather(trainer, results, to_all=to_all)

    def _results_for_main_process(self, trainer: pl.Trainer) -> dict[str, Any]:
        """After a spawn/fork fit, in rank 0's worker: what the main process's objects get (as Lightning hands
        back ``callback_metrics``): the ledger, ``mgpu_auto``'s decision, and the state of each callback that
        has ``results_for_main_process`` (``DeviceMonitor``'s history), keyed by its place in the callbacks."""
        callbacks = {
            i: (type(c).__name__, c.results_for_main_process())
            for i, c in enumerate(_callbacks(trainer))
            if callable(getattr(c, "results_for_main_process", None))
        }
        decision = getattr(self, "auto_decision", None)
        # dataclasses travel as dicts: Lightning moves the results to the CPU with apply_to_collection, which
        # refuses frozen dataclasses
        return {
            "comm_stats": dataclasses.asdict(self._ledger.stats),
            "auto_decision": (type(decision), dataclasses.asdict(decision)) if decision is not None else None,
            "callbacks": callbacks,
        }

    def _restore_results_from_worker(self, trainer: pl.Trainer, results: dict[str, Any]) -> None:
        """In the main process, after a spawn/fork fit: rank 0's ledger (updated in place: the parts that count
        into it keep their reference), ``auto_decision`` and callback states (see
        :meth:`_results_for_main_process`)."""
        stats = self._ledger.stats
        for name, value in results["comm_stats"].items():
            setattr(stats, name, value)
        if results["auto_decision"] is not None:
            kind, fields = results["auto_decision"]
            self.auto_decision = kind(**fields)
        present = _callbacks(trainer)
        for i, (kind, state) in results["callbacks"].items():
            callback: Any = present[i] if i < len(present) else None
            if type(callback).__name__ == kind and callable(getattr(callback, "restore_results_from_worker", None)):
                callback.restore_results_from_worker(state)

    def _check_interactive(self) -> None:
        """In a notebook, a launch that re-runs the script (popen) or spawns fresh interpreters cannot work.
        Lightning refuses it too, right after this, but suggests its own ``strategy='ddp_notebook'``, which would
        silently drop the pack; the refusal here names the notebook preset of the same strategy."""
        if not _compat.is_interactive() or self._launch.start_method == "fork":
            return
        name = type(self).__name__
        advice = _NOTEBOOK_ADVICE[0] if _NOTEBOOK_ADVICE else None
        flag, choice = advice(self) if advice else (f"{name}(...)", f"{name}(..., start_method='fork')")
        raise MisconfigurationException(
            f"`Trainer(strategy={flag})` is not compatible with an interactive environment. Run your code as a "
            f"script, or choose a notebook-compatible strategy: `Trainer(strategy={choice})` (fork launch; CUDA "
            f"must not be initialised before it). In case you are spawning processes yourself, make sure to "
            f"include the Trainer creation inside the worker function."
        )

    def _weights_for_main_process(self) -> dict[str, Any]:
        """After a spawn/fork fit: the weights the main process's module gets (a collective: every rank)."""
        module = self.lightning_module
        return PrecisionAdoption.with_masters(self.precision_plugin, module, self._full_module_state())

    def _full_module_state(self) -> dict[str, Any]:
        module = self.lightning_module
        assert module is not None
        return module.state_dict()

    def _check_before_launch(self, trainer: pl.Trainer) -> None:
        """Runs in the main process when fit() is called, before any worker starts (and in each torchrun or
        SLURM process before it joins the group)."""
        check_accumulate_grad_batches(trainer.accumulate_grad_batches)
        backend = self._group_backend()
        if backend == "nccl" and self._device_type() != "cuda":
            # torch fails only inside every worker ("Distributed package doesn't have NCCL built in" on a CPU
            # build; NCCL collectives take CUDA tensors only). Refused here, not at Trainer construction, so that
            # a configuration can still be built and inspected on a machine without GPUs.
            raise MisconfigurationException(
                f"process_group_backend={backend!r} needs CUDA devices, but this Trainer runs on "
                f"{self._device_type()!r}. Use process_group_backend='gloo' (or leave it None: gloo on CPU, "
                f"nccl on CUDA), or train on GPUs with Trainer(accelerator='gpu')."
            )
        model = self.lightning_module
        if model is None or trainer.state.fn != TrainerFn.FITTING:
            return
        check_manual_accumulation(trainer, model)
        self._compilation.check(model, self.public_name, self._sharded_choices())
        self._check_model_before_launch(trainer, model)
        self._checkpointing.check(model)  # a policy that matches nothing fails here

    def _sharded_choices(self) -> tuple[str, ...]:
        """The sharded stages 2/3 this strategy may still become (``mgpu_auto`` overrides it)."""
        return ()

    def _check_model_before_launch(self, trainer: pl.Trainer, model: pl.LightningModule) -> None:
        """The strategy's own checks of the model, before launch (fitting only)."""

    def _join_elastic_store(self) -> None:
        if _compat.torchelastic_shares_its_store() and not group_is_up():
            # Lightning's init would use env:// on the agent's store, which keeps the previous attempt's addresses
            # after a torchrun restart (_compat.py); give it a per-attempt prefix. Lightning's setup_distributed
            # then finds the group initialised and only sets the ranks and seed.
            host: Any = self  # DDPStrategy and MGPUParallelStrategy define it; ParallelStrategy does not
            host.set_world_ranks()
            backend = self._group_backend()
            torch.distributed.init_process_group(
                backend,
                store=_compat.elastic_attempt_store(self._launch.timeout),
                rank=self.global_rank,
                world_size=self.world_size,
                timeout=self._launch.timeout,
                device_id=self.root_device if self.root_device.type != "cpu" else None,  # as Lightning does
            )
            if backend == "nccl":  # what Lightning's own connection set-up does for NCCL
                atexit.register(_compat.destroy_dist_connection)

    # --- failures -----------------------------------------------------------------------------------------
    def _end_group_after(self, exception: BaseException) -> list[int]:
        """One rank failed: say which, and leave the group so that no rank waits for it (``parts/failures.py``)."""
        return self._failures.end_group_after(exception, self.global_rank, self.world_size)

    # --- precision --------------------------------------------------------------------------------------
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            PrecisionAdoption.attach_masters(self.precision_plugin, self.optimizers)

    def lightning_module_state_dict(self) -> dict[str, Any]:
        module = self.lightning_module
        return PrecisionAdoption.with_masters(self.precision_plugin, module, self._module_state())

    def _module_state(self) -> dict[str, Any]:
        """The module's weights as this strategy saves them, before the precision plugin puts in its masters."""
        return super().lightning_module_state_dict()

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        self._load_module_state(checkpoint, strict)
        PrecisionAdoption.load_masters(self.precision_plugin, self.lightning_module, checkpoint)

    def _load_module_state(self, checkpoint: Mapping[str, Any], strict: bool) -> None:
        super().load_model_state_dict(checkpoint, strict=strict)

    # --- token-normalised loss (parts/token_loss.py) ------------------------------------------------------
    def add_tokens(self, num_tokens: Any, loss_sum: Any = None) -> None:
        """Manual optimization with ``loss_normalization="tokens"``: count this micro-batch's tokens (and their
        summed loss, for the logged ``loss_per_token``) before its ``opt.step()``.

        Example::

            self.manual_backward(token_losses.sum())
            self.trainer.strategy.add_tokens(mask.sum(), token_losses.sum())
            opt.step()
        """
        if self._tokens is None:
            raise RuntimeError("add_tokens needs the strategy built with loss_normalization='tokens'.")
        self._tokens.add(num_tokens, loss_sum)

    def _count_tokens(self, output: Any) -> Any:
        """A training_step's output, its ``num_tokens`` counted (automatic optimization, tokens mode)."""
        module = self.lightning_module
        if self._tokens is None or module is None or not module.automatic_optimization:
            return output
        return self._tokens.record(output)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._count_tokens(super().training_step(*args, **kwargs))

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        if self._tokens is not None:
            closure = self._token_closure(optimizer, closure)
        if self._nonfinite is not None:
            closure = self._nonfinite_closure(optimizer, closure)
        return super().optimizer_step(optimizer, closure, model, **kwargs)

    def _token_closure(self, optimizer: Any, closure: Any) -> Any:
        # after the step's last backward (gradients synced), before unscaling, clipping and the optimizer step
        tokens = self._tokens
        assert tokens is not None
        to_model = PrecisionAdoption.model_parameter(self.precision_plugin)

        def rescaled() -> Any:
            out = closure()
            trainer = attached_trainer(self.lightning_module)
            accumulate = trainer.accumulate_grad_batches if trainer is not None else 1
            params = [to_model(p) for group in optimizer.param_groups for p in group["params"]]
            mean = tokens.rescale(params, self.world_size, accumulate)
            module = self.lightning_module
            if module is not None and getattr(module, "_current_fx_name", None) is not None:
                module.log(LOG_NAME, mean, on_step=True, on_epoch=False, prog_bar=True)  # the same on every rank
            return out

        return rescaled

    def _nonfinite_closure(self, optimizer: Any, closure: Any) -> Any:
        # after the step's last backward (and the token rescale), before unscaling, clipping and the step
        check = self._nonfinite
        assert check is not None
        plugin = self.precision_plugin

        def checked() -> Any:
            out = closure()
            if getattr(plugin, "uses_scaler", False):
                return out  # fp16: the scaler's agreed inf check skips the step on every rank
            module = self.lightning_module
            assert module is not None
            to_model = PrecisionAdoption.model_parameter(plugin)
            names = {id(p): name for name, p in module.named_parameters()}
            named = [
                (names.get(id(to_model(p)), f"param_groups[{g}][{i}]"), to_model(p))
                for g, group in enumerate(optimizer.param_groups)
                for i, p in enumerate(group["params"])
            ]
            trainer = attached_trainer(module)
            step = trainer.global_step if trainer is not None else 0
            check.check(named, self.global_rank, self.world_size, step)
            return out

        return checked

    # --- checkpoints and mid-epoch resume -------------------------------------------------------------
    def _refuse_main_process_save(self) -> None:
        """Plain Lightning writes a checkpoint with empty optimizer states (and the main process's loop
        counters) when ``trainer.save_checkpoint`` runs in the main process after a spawn/fork fit."""
        if self._launch.start_method != "popen" and not group_is_up() and math.prod(self._processes_and_nodes()) > 1:
            raise RuntimeError(
                f"trainer.save_checkpoint() was called in the main process after a {self._launch.start_method!r} "
                f"launch. Training ran in the worker processes and their optimizer states are gone, so this "
                f"checkpoint could not resume training. Save from inside fit (ModelCheckpoint(save_last=True), or "
                f"trainer.save_checkpoint in a callback's on_train_end), or launch with start_method='popen', where "
                f"trainer.save_checkpoint after fit works."
            )

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        self._before_save(checkpoint)
        self._write_file(checkpoint, filepath, storage_options)

    def _before_save(self, checkpoint: dict[str, Any]) -> None:
        """What every save does first, once: refuse a save that could not resume, wait for the previous background
        write (or raise its error), and put the mid-epoch position into the checkpoint."""
        self._refuse_main_process_save()
        self._settle_async_writes()
        self._resume.before_save(checkpoint, attached_trainer(self.lightning_module))

    def _write_file(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """One checkpoint file, written by rank 0 through the checkpoint IO (atomic by default), in the background
        with ``async_checkpoint=True``."""
        if self._saves_async():
            assert self._async is not None
            self._async_unsettled = True
            if self.is_global_zero:  # one file, written by rank 0 (as Lightning's)
                staged = self._async.stage(checkpoint)
                io = self.checkpoint_io
                self._async.rank = 0
                self._async.submit(str(filepath), lambda: io.save_checkpoint(staged, filepath, storage_options))
            return
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def remove_checkpoint(self, filepath: Any) -> None:
        parent = super().remove_checkpoint
        self._remove_when_written(lambda: parent(filepath))

    # --- asynchronous checkpoints (plugins/async_checkpoint.py) ---------------------------------------------
    @property
    def async_checkpoint(self) -> bool:
        """Whether checkpoints saved during fit are staged and written in the background."""
        return self._launch.async_checkpoint

    @property
    def checkpoint_write_in_flight(self) -> bool:
        """Whether a background checkpoint write of this rank is running now (``async_checkpoint=True``)."""
        return self._async is not None and self._async.in_flight

    def _saves_async(self) -> bool:
        """Async only inside a running fit: a save outside it (after fit, in validate) has no end of fit that
        waits for it, so it is written before it returns."""
        if self._async is None:
            return False
        trainer = attached_trainer(self.lightning_module)
        return (
            trainer is not None
            and trainer.state.fn == TrainerFn.FITTING
            and trainer.state.status == TrainerStatus.RUNNING
        )

    def _settle_async_writes(self) -> None:
        """Every rank, at a save and at the end of fit: wait for the write in flight, and raise
        :class:`~lightning_mgpu.CheckpointWriteError` on every rank if any rank's write failed."""
        if self._async is None or not self._async_unsettled:
            return
        self._async_unsettled = False
        failures = self._async.finish()
        causes = self._async.take_causes()
        if group_is_up() and self.world_size > 1:
            failures = [f for rank_failures in comm.all_gather_object(failures) for f in rank_failures]
        if failures:
            raise CheckpointWriteError(failure_message(failures)) from (causes[0] if causes else None)

    def _remove_when_written(self, remove: Any) -> None:
        """Remove an old checkpoint once the write in flight has succeeded (ModelCheckpoint's top-k and
        ``save_last`` ask right after submitting the replacement), at once without a write in flight."""
        if self._async is not None:
            self._async.remove_after_write(remove)
        else:
            remove()

    def _async_checkpoint_group(self) -> Any:
        """A gloo group of all ranks for the collectives of background writes: they must not interleave with
        the training thread's collectives on the default group (torch's advice for ``dcp.async_save``). Made on
        every rank at the first asynchronous sharded save (a collective)."""
        if self._checkpoint_group is None:
            self._checkpoint_group = comm.new_group(backend="gloo", timeout=self._launch.timeout)
        return self._checkpoint_group

    def _end_async_writes(self) -> None:
        """Teardown: wait for the last write (an error not raised yet, e.g. after another exception, is logged)
        and leave the checkpoint group."""
        if self._async is None:
            return
        for failure in self._async.finish():
            log.error(f"The background write of {failure}")
        self._async.take_causes()
        self._async_unsettled = False
        group, self._checkpoint_group = self._checkpoint_group, None
        if group is not None:
            comm.destroy_group(group, quiet=True)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        checkpoint: dict[str, Any] = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self._resume.after_load(checkpoint, self.world_size, self.global_rank)
        return checkpoint

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        self._sampler_requested()
        return super().distributed_sampler_kwargs

    def _sampler_requested(self) -> None:
        """Lightning is building its automatic sampler for the loader it hands to :meth:`process_dataloader` next."""
        self._resume.sampler_requested()
        self._evaluation.sampler_requested()

    def process_dataloader(self, dataloader: object) -> object:
        dataloader = super().process_dataloader(dataloader)
        trainer = attached_trainer(self.lightning_module)
        dataloader = self._evaluation.process_dataloader(dataloader, trainer)  # validate/test/predict
        dataloader = self._resume.process_dataloader(dataloader, trainer)  # training
        return self._uneven.process_dataloader(dataloader, trainer)  # training

    def reduce(
        self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Union[ReduceOp, str]] = "mean"
    ) -> Any:
        """Lightning's reduce (``self.log(..., sync_dist=True)``); with ``exact_evaluation`` the mean of an integer
        tensor (the summed batch sizes of a logged mean) is not truncated
        (:func:`lightning_mgpu.comm.lightning_reduce`)."""
        if isinstance(tensor, Tensor):
            return comm.lightning_reduce(tensor, group, reduce_op, exact_mean=self._launch.exact_evaluation)
        return tensor

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        trainer = attached_trainer(self.lightning_module)
        self._uneven.on_train_batch_start(trainer)  # once per epoch: the counts
        super().on_train_batch_start(batch, batch_idx)
        self._resume.batch_started(trainer)

    # --- end ----------------------------------------------------------------------------------------------
    def on_train_end(self) -> None:
        self._settle_async_writes()  # fit's end waits for the last write; its failure raises on every rank
        self._ledger.write(self.lightning_module, self.is_global_zero, force=True)
        super().on_train_end()

    def teardown(self) -> None:
        self._end_async_writes()
        self._compilation.remove(self.lightning_module)  # the eager forwards back, then the checkpointed ones
        self._checkpointing.remove(self.lightning_module)  # the user's module back
        if self._module_stays_on_device():
            # Lightning's teardown moves the module and the optimizer states to the CPU. A module sharded in place
            # (FSDP2) must stay where it is, as Lightning's own ModelParallelStrategy leaves it: FSDP keeps its
            # padded shards on the device, so a move leaves the parameters it gathers on the device and the
            # module's buffers on the CPU (a later validate/test/predict then mixes devices).
            assert self.cluster_environment is not None and self.accelerator is not None
            self.cluster_environment.teardown()
            self.precision_plugin.teardown()
            self.accelerator.teardown()
            self.checkpoint_io.teardown()
            return
        super().teardown()

    def _module_stays_on_device(self) -> bool:
        """Whether teardown leaves the module on its device (a module sharded in place); False: to the CPU."""
        return False


# ----------------------------------------------------------------------------------------------------
# ``MGPUParallelStrategy``: one process per device in a torch process group, without DistributedDataParallel.
#
# The base of the strategies that are not Lightning ``DDPStrategy`` subclasses (``MGPUShardedStrategy``: FSDP2 or
# fairscale's ShardedDataParallel at stages 2 and 3, a DDP wrapper composed from ``parts/ddp.py`` at stage 1).
# What Lightning's ``DDPStrategy`` does for the process group, without its DDP wrapping, comm hooks and
# static-graph handling (Lightning's own ``FSDPStrategy`` is built the same way).


class MGPUParallelStrategy(MGPUStrategyMixin):
    """Distributed training without DDP: the process group, ranks, collectives and launch of the mgpu family.

    Not used directly: :class:`~lightning_mgpu.MGPUShardedStrategy` (every stage) is built on it.

    Example::

        strategy = MGPUShardedStrategy(stage=3)   # an MGPUParallelStrategy, not a DDP strategy
        assert isinstance(strategy, MGPUParallelStrategy)
    """

    def __init__(
        self,
        accelerator: Optional[pl.accelerators.Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        settings: Optional[CommonSettings] = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._node_count = 1
        self._init_parts(settings or CommonSettings())

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def is_distributed(self) -> bool:
        """Read by Lightning's accelerator connector (its list of distributed strategies names only its own
        classes): True, so that Lightning puts in its DistributedSampler and syncs logged metrics."""
        return True

    @property
    def num_nodes(self) -> int:
        return self._node_count

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._node_count = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        self._sampler_requested()  # Lightning builds its DistributedSampler with these (see the mixin)
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def process_group_backend(self) -> Optional[str]:
        return self._launch.process_group_backend

    @property
    def timeout(self) -> Optional[timedelta]:
        return self._launch.timeout

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.setup_distributed()

    def setup_distributed(self) -> None:
        self._join_elastic_store()  # when torchrun restarted this job (_compat.torchelastic_shares_its_store)
        reset_seed()
        self.set_world_ranks()
        if not group_is_up():
            assert self.cluster_environment is not None
            _compat.init_dist_connection(
                self.cluster_environment,
                self._group_backend(),
                timeout=self._launch.timeout,
                device_id=self.root_device if self.root_device.type != "cpu" else None,  # as Lightning passes it
            )

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        # both copies of rank_zero_only (Lightning's and lightning_utilities'), as Lightning's DDPStrategy does
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]  # a function attribute

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if not group_is_up():
            return
        comm.barrier(device=self.root_device)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not group_is_up():
            return obj
        return comm.broadcast_object(obj, src, group=torch.distributed.group.WORLD)

    @override
    def reduce(
        self, tensor: Tensor, group: Optional[Any] = None, reduce_op: Optional[Union[ReduceOp, str]] = "mean"
    ) -> Tensor:
        if isinstance(tensor, Tensor):
            return comm.lightning_reduce(tensor, group, reduce_op, exact_mean=self._launch.exact_evaluation)
        return tensor
