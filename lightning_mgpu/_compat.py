"""Every private name of torch and Lightning the package touches, and every version difference (the
development page's rules). Nothing else in the package may import a ``_``-prefixed name from torch /
pytorch_lightning / lightning_fabric, or read a ``_``-prefixed attribute their objects define: it goes through a
function or flag here (``tests/meta/test_compat.py`` enforces it).

Each entry says which releases it was checked on and what happens when the name is gone. "Checked" means:
read in the installed sources and exercised by the test suite, on torch 2.13.0 and pytorch-lightning /
lightning-fabric 2.6.6 (the pinned set). Where a public API exists it is used instead (e.g. ``typing`` for
Lightning's ``_PATH``, the BatchNorm classes for torch's ``_BatchNorm``, ``LightningOptimizer.optimizer``).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any, Callable

from lightning_fabric.plugins.precision.utils import _convert_fp_tensor, _DtypeContextManager
from lightning_fabric.utilities.seed import _collect_rng_states, _set_rng_states
from pytorch_lightning.core.optimizer import LightningOptimizer
from pytorch_lightning.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from torch.nn.parallel import DistributedDataParallel

# Lightning's launchers, which ours subclass (its Trainer checks launcher types; pytorch-lightning 2.6.6
# checked). Missing: ImportError when lightning_mgpu is imported, naming them.
MultiProcessingLauncher = _MultiProcessingLauncher
SubprocessScriptLauncher = _SubprocessScriptLauncher
# Lightning Fabric's precision helpers (lightning-fabric 2.6.6 checked): cast a tensor's floating-point
# values; a context manager that sets the default dtype. Missing: ImportError at import.
convert_fp_tensor = _convert_fp_tensor
DtypeContextManager = _DtypeContextManager

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
DDP_HAS_SET_STATIC_GRAPH = _DDP_HAS_SET_STATIC_GRAPH


def enable_static_graph(ddp: DistributedDataParallel) -> None:
    """``ddp._set_static_graph()`` (torch 2.4-2.13 checked). Missing: ``static_graph=True`` is refused at
    construction (``DDP_HAS_SET_STATIC_GRAPH``), so this is never reached."""
    ddp._set_static_graph()


def ddp_ignore(module: Any, names: list[str]) -> None:
    """``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model`` (torch 2.4-2.13 checked), added to
    the names ``module`` already asks DDP to leave alone: DDP neither broadcasts them at construction nor reduces
    their gradients. Missing: AttributeError at wrap time."""
    kept = list(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
    ignored = [*kept, *(n for n in names if n not in kept)]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, ignored)


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


def orthogonalize_accepts_2d() -> bool:
    """Whether torch's ``powerSGD_hook._orthogonalize`` takes a 2-D matrix (torch 2.13: no, see below)."""
    return not _TORCH_BATCHED_POWERSGD_BROKEN


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


# --- Lightning ---------------------------------------------------------------------------------------------
# Strategy attributes Lightning's base classes define and read (pytorch-lightning 2.6.6 checked: Strategy
# ``_checkpoint_io``, ``_precision_plugin``, ``_launcher``, ``_layer_sync``; DDPStrategy ``_ddp_kwargs``). They
# are the storage behind the public properties our strategies override; missing, the AttributeError names them.


def strategy_checkpoint_io(strategy: Any) -> Any:
    """The checkpoint IO plugin given to the strategy (``None``: not chosen yet)."""
    return strategy._checkpoint_io


def set_strategy_checkpoint_io(strategy: Any, io: Any) -> None:
    strategy._checkpoint_io = io


def strategy_precision_plugin(strategy: Any) -> Any:
    """The precision plugin given to the strategy, or ``None`` (the public property makes a default one)."""
    return strategy._precision_plugin


def set_strategy_precision_plugin(strategy: Any, plugin: Any) -> None:
    strategy._precision_plugin = plugin


def set_strategy_launcher(strategy: Any, launcher: Any) -> None:
    """What Lightning's ``_configure_launcher`` hook sets (the Trainer reads ``strategy.launcher``)."""
    strategy._launcher = launcher


def strategy_layer_sync(strategy: Any) -> Any:
    """``Trainer(sync_batchnorm=True)``'s plugin on the strategy, or ``None``. Missing: ``None`` (no check)."""
    return getattr(strategy, "_layer_sync", None)


def set_strategy_layer_sync(strategy: Any, layer_sync: Any) -> None:
    """``Trainer(sync_batchnorm=True)``'s plugin, put on a strategy built after the Trainer (``mgpu_auto``)."""
    strategy._layer_sync = layer_sync


def fit_train_dataloader(trainer: Any) -> Any:
    """``trainer.fit_loop._data_source.dataloader()``: the training loader ``fit`` was given (its argument, the
    datamodule's or the module's ``train_dataloader()``), before Lightning adds its sampler. ``mgpu_auto`` draws
    the sample batch it plans with from it, at set-up, before the fit loop builds its own loader."""
    return trainer.fit_loop._data_source.dataloader()


def strategy_ddp_kwargs(strategy: Any) -> dict[str, Any]:
    """The DistributedDataParallel keyword arguments of a Lightning ``DDPStrategy``. Missing: ``{}``."""
    return dict(getattr(strategy, "_ddp_kwargs", {}) or {})


def augment_message(exception: BaseException, pattern: str, new_message: str) -> None:
    """Lightning's ``pytorch_lightning.utilities.exceptions._augment_message`` (2.6.6 checked): replaces the
    message of an exception that matches ``pattern``. Missing: the same, done here."""
    try:
        from pytorch_lightning.utilities.exceptions import _augment_message
    except ImportError:  # pragma: no cover - present in every supported Lightning
        import re

        if exception.args and isinstance(exception.args[0], str) and re.match(pattern, exception.args[0], re.DOTALL):
            exception.args = (new_message, *exception.args[1:])
        return
    _augment_message(exception, pattern=pattern, new_message=new_message)


def is_wrapping_checkpoint_io(io: Any) -> bool:
    """Whether ``io`` is one of Lightning's wrapping checkpoint IO plugins (``AsyncCheckpointIO``...), whose
    base is set later (``pytorch_lightning.plugins.io.wrapper._WrappingCheckpointIO``, 2.6.6 checked).
    Missing: False (a wrapping plugin without a base then fails as it does in plain Lightning)."""
    try:
        from pytorch_lightning.plugins.io.wrapper import _WrappingCheckpointIO
    except ImportError:  # pragma: no cover
        return False
    return isinstance(io, _WrappingCheckpointIO)


def worker_output(*fields: Any) -> Any:
    """Lightning's ``_WorkerOutput`` (what a spawn/fork worker hands to the main process; 2.6.6 checked:
    best_model_path, weights_path, trainer_state, trainer_results, extra). Missing: ImportError at the first
    spawn/fork fit, naming it."""
    from pytorch_lightning.strategies.launchers.multiprocessing import _WorkerOutput

    return _WorkerOutput(*fields)


def update_dataloader(dataloader: Any, sampler: Any, mode: Any) -> Any:
    """Lightning's ``pytorch_lightning.utilities.data._update_dataloader`` (2.6.6 checked): the loader re-created
    with another sampler, custom DataLoader subclasses included. Missing: ImportError when a resumable sampler
    is put in."""
    from pytorch_lightning.utilities.data import _update_dataloader

    return _update_dataloader(dataloader, sampler, mode=mode)


def wrapped_sampler(wrapper: Any) -> Any:
    """The sampler inside Lightning's ``DistributedSamplerWrapper`` (its dataset's ``_sampler``: the sampler of the
    user's loader that Lightning wrapped; lightning-fabric 2.6.6 checked). Missing: ``None``, and a
    StatefulDataLoader with Lightning's automatic sampler resumes as in plain Lightning (a warning says so)."""
    return getattr(getattr(wrapper, "dataset", None), "_sampler", None)


def tracked_batch_sampler(batch_sampler: Any) -> Any:
    """The batch sampler inside Lightning's ``pytorch_lightning.overrides.distributed._IndexBatchSamplerWrapper``
    (what a prediction loader gets, so that Lightning records the indices of each batch; 2.6.6 checked: the
    attribute ``_batch_sampler``), or ``None`` for any other object. Missing: ``None`` (prediction keeps
    Lightning's sampler)."""
    try:
        from pytorch_lightning.overrides.distributed import _IndexBatchSamplerWrapper
    except ImportError:  # pragma: no cover
        return None
    if not isinstance(batch_sampler, _IndexBatchSamplerWrapper):
        return None
    return getattr(batch_sampler, "_batch_sampler", None)


def index_tracking_batch_sampler(batch_sampler: Any) -> Any:
    """``batch_sampler`` in Lightning's ``_IndexBatchSamplerWrapper`` (2.6.6 checked), whose recorded indices
    Lightning's prediction loop hands to ``BasePredictionWriter``. Missing: ImportError (only reached where
    :func:`tracked_batch_sampler` found one)."""
    from pytorch_lightning.overrides.distributed import _IndexBatchSamplerWrapper

    return _IndexBatchSamplerWrapper(batch_sampler)


def waited_collective(tensor: Any) -> Any:
    """``tensor`` itself, or the result of the collective it stands for when it is torch's
    ``torch.distributed._functional_collectives.AsyncCollectiveTensor`` (2.13 checked): a gathered tensor subclass
    (torchao's ``NF4Tensor`` after ``DTensor.full_tensor``) holds such unwaited pieces, which neither pickle nor load
    with ``weights_only``. Missing: ``tensor`` as is."""
    try:
        from torch.distributed._functional_collectives import AsyncCollectiveTensor
    except ImportError:  # pragma: no cover
        return tensor
    return tensor.wait() if isinstance(tensor, AsyncCollectiveTensor) else tensor


def destroy_dist_connection() -> None:
    """``lightning_fabric.utilities.distributed._destroy_dist_connection`` (2.6.6 checked). Missing: torch's
    ``destroy_process_group`` when a group exists."""
    try:
        from lightning_fabric.utilities.distributed import _destroy_dist_connection
    except ImportError:  # pragma: no cover
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        return
    _destroy_dist_connection()


def set_num_threads_if_needed(num_processes: int) -> None:
    """``lightning_fabric.utilities.distributed._set_num_threads_if_needed`` (2.6.6 checked): one CPU thread
    per process unless OMP_NUM_THREADS is set. Missing: nothing is changed."""
    try:
        from lightning_fabric.utilities.distributed import _set_num_threads_if_needed
    except ImportError:  # pragma: no cover
        return
    _set_num_threads_if_needed(num_processes=num_processes)


def default_store() -> Any:
    """torch's ``distributed_c10d._get_default_store()`` (2.13 checked): the rendezvous store behind the default
    group, which the failure roll call uses. Missing: AttributeError, which the caller treats as "no store"."""
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()


def leaf_specs_without_warning() -> None:
    """Lightning's ``utilities._pytree._tree_flatten`` (pytorch-lightning / lightning 2.6.6 checked) builds torch's
    ``LeafSpec()`` for every loader it flattens (``CombinedLoader``: train, val, test, predict), which torch 2.13
    deprecates with a FutureWarning ("`isinstance(treespec, LeafSpec)` is deprecated"): every rank printed it at the
    first loader, and again at the next one after any change of the warning filters. torch's own ``tree_flatten``
    takes ``treespec_leaf()`` instead, the same leaf spec built once without the warning; Lightning's module gets it
    in place of the class (its one use of the name is that call). Missing (a torch without ``treespec_leaf`` does not
    deprecate ``LeafSpec``; a Lightning that does not import it): nothing is changed."""
    import torch.utils._pytree as torch_pytree
    from pytorch_lightning.utilities import _pytree as lightning_pytree

    leaf = getattr(torch_pytree, "treespec_leaf", None)
    if leaf is not None and getattr(lightning_pytree, "LeafSpec", None) is getattr(torch_pytree, "LeafSpec", leaf):
        lightning_pytree.LeafSpec = leaf  # type: ignore[misc]


def process_groups() -> list[Any]:
    """Every process group this process is in (the default one and the subgroups made since), from torch's
    ``distributed_c10d._world.pg_map`` (2.13 checked; torch has no public list). Missing: AttributeError (the
    tests that count the groups a device mesh makes fail)."""
    import torch.distributed as dist

    return list(dist.distributed_c10d._world.pg_map)


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


def torchelastic_shares_its_store() -> bool:
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


def elastic_attempt_store(timeout: Any) -> Any:
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


def forget_inherited_compile_threads() -> None:
    """In a forked child, forget torch inductor's compile thread pool inherited from the parent.

    Inductor compiles kernels through ``torch._inductor.async_compile.AsyncCompile.pool()``, a
    ``functools.lru_cache``'d ``ThreadPoolExecutor``. torch's own at-fork hook (``async_compile.after_fork``) resets
    its process pool but not this one (torch 2.11.0 and 2.13.0 checked; 2.15.0 resets a ``thread_pool`` of the same
    kind and not ``pool``). In a fork child the executor's threads do not exist while its idle count says they do, so
    the first kernel the child compiles is queued to no thread and the rank hangs in its first forward: a notebook
    that compiled a model with inductor, then ``Trainer(strategy="mgpu_ddp_notebook")`` with ``compile=True``
    (reproduced here with a bare ``os.fork``, and in the suite before compiling tests ran in subprocesses). Clearing
    the caches makes the child build its own pool. Where the names are missing (another torch), nothing happens; where
    inductor never ran in the parent, its module is not loaded and nothing was inherited."""
    module = sys.modules.get("torch._inductor.async_compile")
    compile_pools = getattr(module, "AsyncCompile", None)
    for name in ("pool", "thread_pool"):
        _clear_cache(compile_pools, name)


def _clear_cache(owner: Any, name: str) -> None:
    """Empty ``owner.name``'s ``functools`` cache; nothing where ``owner`` or the name is missing (another torch)."""
    cache_clear = getattr(getattr(owner, name, None), "cache_clear", None)
    if cache_clear is not None:
        cache_clear()


def forget_inherited_dtensor_caches() -> None:
    """In a forked child, forget the DTensor sharding-propagation caches inherited from the parent.

    torch caches, per operator and input specs, the specs of a DTensor operator's outputs: in C++
    (``torch._C._clear_DTensor_sharding_propagator_cache`` empties it) and in Python (the ``lru_cache`` of
    ``DTensor._op_dispatcher.sharding_propagator``'s ``propagate_op_sharding`` and ``_propagate_tensor_meta_cached``;
    torch 2.13.0 checked). The key compares device meshes by their layout, not by the rank that built them, and the
    cached specs hold the parent's mesh object, whose coordinate is the parent's rank. A rank forked from a process
    that ran DTensor operators over a mesh of the same layout (rank 0 of a fake or real two-rank group, as the
    planner's measurements and their tests do) then gets specs saying it holds rank 0's shard: FSDP2's parameters of
    rank 1 claimed offset 0, and ``torch.distributed.checkpoint`` saved half of every tensor ("invalid fill ...
    chunks-volume"; reproduced here with a bare fork after a fake process group). The redistribution plans are cached
    the same way (``torch.distributed.tensor._redistribute``: ``_gen_transform_infos``, keyed by the two specs, and
    the planners of ``_planner_cache``, keyed by a reference to a layout-equal mesh and holding it) and hold the
    shapes of this rank's chunks under nested uneven sharding (a 2-D mesh), read from the parent's coordinate: they
    are forgotten too. Where a name is missing (another torch), that cache is left; where DTensor never ran in the
    parent, the caches are empty."""
    import torch

    clear = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear is not None:
        clear()
    if "torch.distributed.tensor" not in sys.modules:
        return
    from torch.distributed.tensor import DTensor

    propagator = getattr(getattr(DTensor, "_op_dispatcher", None), "sharding_propagator", None)
    for name in ("propagate_op_sharding", "_propagate_tensor_meta_cached"):
        _clear_cache(propagator, name)
    redistribute = sys.modules.get("torch.distributed.tensor._redistribute")
    _clear_cache(redistribute, "_gen_transform_infos")
    planners = getattr(redistribute, "_planner_cache", None)
    if isinstance(planners, dict):
        planners.clear()


def sync_param_groups(wrapper: Any, local: Any) -> None:
    """The wrapper's ``param_groups`` hyper-parameters -> its local optimizer's: what torch's
    ``ZeroRedundancyOptimizer.step`` does first (``_sync_param_groups``, a staticmethod, torch 2.13 checked) and
    fairscale's ``OSS._sync_param_groups`` (0.4.13). Missing: the same copy, done here."""
    method = getattr(type(wrapper), "_sync_param_groups", None)
    if method is not None:
        method(wrapper.param_groups, local.param_groups)
        return
    for src, dst in zip(wrapper.param_groups, local.param_groups):  # pragma: no cover
        for key, value in src.items():
            if key != "params":
                dst[key] = value


def copy_lr_scheduler_step_tracking(old: Any, new: Any) -> None:
    """torch's LR schedulers wrap ``optimizer.step`` to record that it was called (``_wrapped_by_lr_sched`` on
    the wrapper, ``_opt_called`` on the optimizer; torch 2.13 checked), and warn "lr_scheduler.step() before
    optimizer.step()" otherwise. A scheduler re-pointed at a wrapping optimizer gets the same tracking, so no
    spurious warning appears. Missing (torch renamed them): at worst that warning."""
    import functools

    if hasattr(old.step, "_wrapped_by_lr_sched") and not hasattr(new.step, "_wrapped_by_lr_sched"):
        step = new.step

        @functools.wraps(step)
        def tracked(*args: Any, **kwargs: Any) -> Any:
            new._opt_called = True
            return step(*args, **kwargs)

        tracked._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
        new.step = tracked


def record_module_device(module: Any, device: Any) -> None:
    """Set the device Lightning's modules report (``LightningModule.device``, for ``self.device`` in user code)
    without moving any tensor: ``lightning_fabric.utilities.device_dtype_mixin._update_properties``, what
    ``module.to()`` records (lightning-fabric 2.6.6 checked). For a model whose shards are stored on the host but
    compute on ``device`` (``offload="cpu"``). Missing: the module keeps reporting where it was built."""
    try:
        from lightning_fabric.utilities.device_dtype_mixin import _update_properties
    except ImportError:
        return
    _update_properties(module, device=device)


def in_lightning_hook(module: Any) -> bool:
    """Whether Lightning is running one of ``module``'s hooks now, where ``self.log`` may be called: Lightning sets the
    LightningModule's ``_current_fx_name`` around each hook it calls (pytorch-lightning 2.6.6 checked). False for an
    ``nn.Module`` or ``None``."""
    return getattr(module, "_current_fx_name", None) is not None


def attached_trainer(module: Any) -> Any:
    """The Trainer ``module`` (a LightningModule) is attached to, or None: the public ``module.trainer`` raises a
    ``RuntimeError`` when there is none (pytorch-lightning 2.6.6 checked), and a plain ``nn.Module`` has no such
    attribute."""
    if module is None:
        return None
    try:
        return module.trainer
    except (RuntimeError, AttributeError):
        return None


# --- Lightning launchers, strategy and optimizer internals (pytorch-lightning 2.6.6 checked) -----------------


def call_children_scripts(launcher: Any) -> None:
    """``_SubprocessScriptLauncher._call_children_scripts``: start the other local ranks (re-run the command)."""
    launcher._call_children_scripts()


def reset_optimizers_and_schedulers(strategy: Any) -> None:
    """``Strategy._reset_optimizers_and_schedulers()``: a second fit starts from the module's own optimizers."""
    strategy._reset_optimizers_and_schedulers()


def forward_redirection(strategy: Any) -> Any:
    """``DDPStrategy._forward_redirection``: runs a LightningModule step method through the wrapper's forward."""
    return strategy._forward_redirection


def share_optimizer_strategy(source: Any, target: Any) -> None:
    """``LightningOptimizer._strategy`` (which its step machinery calls): ``target`` steps through ``source``'s
    strategy."""
    target._strategy = source._strategy


# --- torch internals (torch 2.13.0 checked) ---------------------------------------------------------------
def unflatten_mesh(mesh: Any, dim: str, sizes: tuple[int, ...], names: tuple[str, ...]) -> Any:
    """``DeviceMesh._unflatten``: a mesh in which the dimension ``dim`` of ``mesh`` is split into dimensions
    ``names`` of ``sizes`` (their process groups created; ``mesh`` itself is unchanged). torch 2.13 checked; it has
    no public way yet (its flattening counterpart, ``_flatten``, is how torchtitan and Accelerate name their
    ``"dp"`` dimension, and slicing a flattened dimension from the root mesh warns of its deprecation on torch
    2.13). The dimension is passed by its index: torch 2.11 refuses a name that the mesh has (its check is
    inverted: "dim data_parallel specified in `_unflatten` is not in ('data_parallel', 'tensor_parallel')"), and
    2.11 and 2.13 accept the index alike. Missing: AttributeError at set-up of a hybrid mesh, naming it."""
    return mesh._unflatten(list(mesh.mesh_dim_names).index(dim), sizes, names)


def set_module_device_mesh(module: Any, mesh: Any) -> None:
    """``LightningModule._device_mesh``, what its public ``device_mesh`` property returns; Lightning's
    ``ModelParallelStrategy.setup_environment`` sets it the same way (pytorch-lightning / lightning 2.6.0 and
    2.6.6 checked). Missing: ``self.device_mesh`` reads None in ``configure_model`` (the integration test of the
    mesh fails)."""
    module._device_mesh = mesh


def foreach_norm(tensors: Any, ord: float) -> Any:
    """``torch._foreach_norm`` (one kernel for many norms). Missing: one ``torch.linalg.vector_norm`` each."""
    import torch

    fn = getattr(torch, "_foreach_norm", None)
    if fn is None:  # pragma: no cover
        return [torch.linalg.vector_norm(t, ord) for t in tensors]
    return fn(tensors, ord)


def steps_on_found_inf(optimizer: Any) -> bool:
    """Whether ``optimizer.step`` reads torch's ``found_inf`` and ``grad_scale`` attributes and, given ``found_inf``
    1, leaves the parameters and the state as they were, on the device (``_step_supports_amp_scaling``: the fused
    Adam, AdamW, SGD and Adagrad, what ``GradScaler.step`` relies on; torch 2.13 checked). Missing: False, and the
    caller decides on the host."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def tensor_version(tensor: Any) -> int:
    """``Tensor._version``: the in-place modification counter (autograd's saved-tensor check reads it).
    Missing: -1, which makes every buffer look modified (safe: it is then restored after a recompute)."""
    return int(getattr(tensor, "_version", -1))


def check_norm_input_dim(norm: Any, x: Any) -> None:
    """``_BatchNorm._check_input_dim``: the layer's own input-shape check. Missing: no check."""
    check = getattr(norm, "_check_input_dim", None)
    if check is not None:
        check(x)


def scaler_init_scale(scaler: Any) -> float:
    """``GradScaler._init_scale`` (the scale it started from; there is no public getter). Missing: the current
    scale."""
    value = getattr(scaler, "_init_scale", None)
    return float(value if value is not None else scaler.get_scale())


def precision_after_closure(plugin: Any, model: Any, optimizer: Any) -> None:
    """Lightning's ``Precision._after_closure``: ``on_before_optimizer_step`` hooks, then gradient clipping
    (pytorch-lightning 2.6.6 checked). Missing: AttributeError naming it at the first step."""
    plugin._after_closure(model, optimizer)


def init_dist_connection(cluster_environment: Any, backend: str, **kwargs: Any) -> None:
    """``lightning_fabric.utilities.distributed._init_dist_connection`` (2.6.6 checked): reads MASTER_ADDR/PORT,
    rank and world size from the cluster environment and calls ``init_process_group``. Missing: ImportError at
    set-up, naming it."""
    from lightning_fabric.utilities.distributed import _init_dist_connection

    _init_dist_connection(cluster_environment, backend, **kwargs)


def sync_ddp_if_available(tensor: Any, group: Any, reduce_op: Any) -> Any:
    """``lightning_fabric.utilities.distributed._sync_ddp_if_available`` (2.6.6 checked): all-reduce with
    Lightning's "mean"/"sum" semantics when a group is up. Missing: ImportError at the first reduce."""
    from lightning_fabric.utilities.distributed import _sync_ddp_if_available

    return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)


def sync_module_states(module: Any) -> None:
    """``pytorch_lightning.overrides.distributed._sync_module_states`` (2.6.6 checked): rank 0's parameters and
    buffers broadcast to all ranks (what DDP does at construction), for evaluation without a wrapper. Missing:
    ImportError, naming it."""
    from pytorch_lightning.overrides.distributed import _sync_module_states

    _sync_module_states(module)


def optimizers_to_device(optimizers: Any, device: Any) -> None:
    """``lightning_fabric.utilities.optimizer._optimizers_to_device`` (2.6.6 checked): optimizer state tensors
    moved to ``device``. Missing: ImportError, naming it."""
    from lightning_fabric.utilities.optimizer import _optimizers_to_device

    _optimizers_to_device(optimizers, device)


def torch_layout_decoder() -> Any:
    """``torch.serialization._get_layout`` (torch 2.13.0 and 2.14.1 checked): how a pickle names a ``torch.layout``
    (``torch.strided`` is written as ``_get_layout("torch.strided")``); the metadata file of a
    ``torch.distributed.checkpoint`` directory holds one per tensor. It looks the name up among torch's layouts and
    runs nothing else. Missing: ``None``, and a sharded checkpoint is then refused under ``weights_only=True``
    with the message that names this global (load it with ``weights_only=False`` once you trust it)."""
    import torch.serialization

    return getattr(torch.serialization, "_get_layout", None)


def dcp_fsspec_storage(path: str, reader: bool) -> Any:
    """``torch.distributed.checkpoint._fsspec_filesystem``'s ``FsspecReader`` / ``FsspecWriter`` for ``path`` (torch
    2.11.0, 2.13.0 and 2.14.1 checked): the storage of a sharded checkpoint at an fsspec URL (``s3://...``), which
    ``torch.distributed.checkpoint`` exports only in some releases. Missing: ImportError when such a checkpoint is
    saved or loaded, naming the module; local directories are unaffected."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    return FsspecReader(path) if reader else FsspecWriter(path)


# --- the memory planner's torch internals (lightning_mgpu/planning), checked on torch 2.13.0 and 2.14.1 ---------
# torch has no public fake-tensor, memory-tracker or fake-process-group API yet; torchtitan's memory estimation
# (scripts/estimate/estimation.py) uses the same three. Imported when the planner runs, never at package import:
# where one is missing, `lightning-mgpu plan` fails with the ImportError and training is unaffected.


def fake_tensor_mode() -> Any:
    """``torch._subclasses.fake_tensor.FakeTensorMode(allow_non_fake_inputs=True)``: tensors with shape, dtype
    and device but no storage."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def tree_map_tensors(fn: Any, tree: Any) -> Any:
    """``torch.utils._pytree.tree_map_only(torch.Tensor, fn, tree)``: ``fn`` on every tensor of a nested batch."""
    import torch
    from torch.utils._pytree import tree_map_only

    return tree_map_only(torch.Tensor, fn, tree)


def fake_store() -> Any:
    """``torch.testing._internal.distributed.fake_pg.FakeStore()``: the store of torch's ``"fake"`` backend (a
    process group of any size in one process, whose collectives allocate their buffers but talk to no one)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


class _NoHook:
    """A hook handle for a frozen parameter, which has no gradient hook to remove."""

    def remove(self) -> None:
        pass


def _frozen_safe_mem_tracker() -> type:
    """``MemTracker`` that leaves frozen parameters (``requires_grad=False``) alone: torch 2.13's registers a
    gradient hook on every parameter of a module it enters, which raises "cannot register a hook on a tensor
    that doesn't require gradient" for a frozen one (reproduced here with a frozen ``nn.Linear``). Its private
    ``_param_to_grad_hook_handles`` marks a parameter as hooked already; a frozen one gets a handle that removes
    nothing. Missing: the frozen parameters raise as in plain torch."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class FrozenSafeMemTracker(MemTracker):
        def _track_module_params_and_buffers(self, module: Any, install_grad_hooks: bool = True) -> Any:
            handles = getattr(self, "_param_to_grad_hook_handles", None)
            if handles is not None:
                for param in module.parameters():
                    if not param.requires_grad and handles.get(param, None) is None:
                        handles[param] = (_NoHook(), _NoHook())
            return super()._track_module_params_and_buffers(module, install_grad_hooks)

    return FrozenSafeMemTracker


def mem_tracker() -> Any:
    """``torch.distributed._tools.mem_tracker.MemTracker()``: sorts every storage a step allocates into
    parameters, buffers, gradients, activations, temporaries and optimizer state (frozen parameters included)."""
    return _frozen_safe_mem_tracker()()


def timeline_mem_tracker() -> Any:
    """A ``MemTracker`` that also records, after every op, ``(activations + temporaries, gradients)`` bytes in its
    ``timeline`` list. ``MemTracker``'s own peak is the peak of the *total*; the planner needs the activations on
    their own, beside the gradients in time (a sharded rank keeps 1/N of each gradient). Overrides its private
    ``_update_peak_stats`` (called after every dispatched op), whose own version also walks every module's stats
    on every op (a minute for a 1B model), and reads its ``_curr_mem_snap`` / ``_peak_mem`` / ``_peak_mem_snap``."""
    from torch.distributed._tools.mem_tracker import _MemRefType

    live = (_MemRefType.ACT, _MemRefType.TEMP, _MemRefType.OTH)

    class TimelineTracker(_frozen_safe_mem_tracker()):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.timeline: list[tuple[int, int]] = []

        def _update_peak_stats(self, peak_state: Any) -> None:
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap["Total"]:
                    self._peak_mem[dev] = snap["Total"]
                    self._peak_mem_snap[dev] = dict(snap)
                self.timeline.append((sum(snap.get(k, 0) for k in live), snap.get(_MemRefType.GRAD, 0)))

    return TimelineTracker()


def unwrap_optimizer(optimizer: Any) -> Any:
    """``optimizer`` itself, or the torch optimizer a Lightning ``LightningOptimizer`` wraps (public
    ``.optimizer``; kept here as the one place the pack sees through Lightning's wrapper).

    Example::

        opt = unwrap_optimizer(self.optimizers())  # in a LightningModule: the torch.optim object
    """
    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def is_interactive() -> bool:
    """``accelerator_connector._IS_INTERACTIVE``: whether Lightning's Trainer sees an interactive session (a
    notebook, ``python -i``), read from the connector's module at call time as Lightning's own check reads it
    (pytorch-lightning 2.6.0 and 2.6.6 checked). Missing: False (no interactive check of our own; Lightning's
    still runs)."""
    from pytorch_lightning.trainer.connectors import accelerator_connector

    return bool(getattr(accelerator_connector, "_IS_INTERACTIVE", False))


def compiled_by_user(module: Any) -> bool:
    """Whether ``module`` is a LightningModule that ``Trainer.fit`` unwrapped from the user's
    ``torch.compile(module)``: Lightning's ``from_compiled`` sets ``module._compiler_ctx`` and wraps the module's
    ``forward`` and ``*_step`` methods in the user's compile context (pytorch-lightning 2.6.0 and 2.6.6 checked).
    Missing: False (a user-compiled model then meets no check of ours; Lightning's own check still runs)."""
    return getattr(module, "_compiler_ctx", None) is not None


def compiled_graph_count() -> int:
    """How many graphs torch.compile has compiled in this process so far (``torch._dynamo.utils.counters``,
    ``["stats"]["unique_graphs"]``; torch 2.4-2.13 checked): a recompilation adds one. Missing: KeyError or
    ImportError, raised where it is read (tests and benchmarks only)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def keep_predictions(loop: Any) -> None:
    """Make Lightning's prediction loop keep and return each batch's predictions (its ``_return_predictions``;
    pytorch-lightning 2.6.6 checked: ``_predict_step`` appends a batch's output when it is set, and
    ``_on_predict_epoch_end`` returns them). Its public setter refuses ``True`` under a spawn/fork launcher; the
    strategy sets it in each worker, at ``on_predict_start``, and gathers the predictions after the loop.
    Missing: RuntimeError naming it at the first spawn/fork ``trainer.predict``."""
    if not hasattr(loop, "_return_predictions"):  # pragma: no cover - guards a future Lightning
        raise RuntimeError(
            "lightning_mgpu cannot make Lightning's prediction loop keep its predictions in spawn/fork workers "
            "(_PredictionLoop._return_predictions is gone in this Lightning). Pass "
            "trainer.predict(..., return_predictions=False) and write predictions with a BasePredictionWriter."
        )
    loop._return_predictions = True


# --- the ledger's count of the tensor dimension's collectives (lightning_mgpu/ledger.py, CollectiveCounter) ----------
# DTensor issues its collectives (a Partial placement made Replicate, a Shard gathered, ...) as torch's functional
# collectives, the ops of the ``_c10d_functional`` namespace (and ``_dtensor.shard_dim_alltoall``), never through
# the pack's comm.py. torch has no public hook on them; its own ``CommDebugMode``
# (torch/distributed/tensor/debug/_comm_mode.py) counts them with a ``TorchDispatchMode`` of the private module
# ``torch.utils._python_dispatch``, as this does (torch 2.13.0 checked: the ops' last argument is the group's
# name). Imported when a strategy is asked to count them (``tensor_comm_stats=True``), never at package import.
# Missing: the ImportError or AttributeError at set-up of such a strategy; training without the count is
# unaffected.

#: functional collective -> its kind, for the bytes one rank sends (see ledger.CollectiveCounter)
_FUNCTIONAL_COLLECTIVES = {
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
}


def collective_dispatch_mode(record: Any) -> Any:
    """A ``TorchDispatchMode`` that calls ``record(kind, inputs, group_name)`` for every functional collective
    dispatched while it is active (``kind``: ``"all_reduce"``, ``"all_gather"``, ``"reduce_scatter"``,
    ``"all_to_all"``, ``"broadcast"``; ``inputs``: the tensors handed to it), forward and backward alike. An op on
    a ``DTensor`` is handed back to it (``NotImplemented``), which runs it as the plain ops and collectives this
    mode then sees, as ``CommDebugMode`` does; other tensor subclasses run as they would without the mode."""
    import torch
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    functional = torch.ops._c10d_functional
    kinds = {getattr(functional, name): kind for name, kind in _FUNCTIONAL_COLLECTIVES.items()}
    kinds[torch.ops._dtensor.shard_dim_alltoall] = "all_to_all"

    class CollectiveMode(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            if isinstance(func, torch._ops.HigherOrderOperator):
                return func(*args, **kwargs)
            if any(t is DTensor for t in types):  # DTensor runs it: its collectives come back here
                return NotImplemented
            kind = kinds.get(func._overloadpacket)
            if kind is not None:
                inputs = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
                record(kind, inputs, kwargs.get("group_name", args[-1]))
            return func(*args, **kwargs)

    return CollectiveMode()


def strided_shard(dim: int, split_factor: int) -> Any:
    """``torch.distributed.tensor.placement_types._StridedShard(dim, split_factor=k)``: a placement that splits dim
    ``dim`` into ``k`` equal chunks and shards each chunk over the mesh dimension, so that rank ``r`` holds the
    ``r``-th piece of every chunk, side by side (torch 2.13 checked: what FSDP2 uses for a tensor-parallel weight,
    and what a packed query/key/value projection needs, each rank holding its heads' query, key and value).
    Missing: ImportError, raised when a plan splits a packed projection (tensor parallelism only)."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard(dim, split_factor=split_factor)


def is_strided_shard(placement: Any) -> bool:
    """Whether ``placement`` is a ``_StridedShard`` (see :func:`strided_shard`; torch 2.13 checked). Missing: False."""
    try:
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:  # pragma: no cover - guards a future torch
        return False
    return isinstance(placement, _StridedShard)


def local_storage(tensor: Any) -> Any:
    """``DTensor._local_tensor``: the tensor holding a ``DTensor``'s local shard, whose ``.data`` can be swapped
    (torch 2.13 checked: ``to_local()`` of a ``Parameter`` ``DTensor`` returns a new view, whose ``.data`` is its
    own); a plain tensor itself. Missing: ``to_local()`` (freeing the other stages' tensor-parallel blocks then
    frees nothing)."""
    local = getattr(tensor, "_local_tensor", None)
    if local is not None:
        return local
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def dtensor_around(template: Any, local: Any) -> Any:
    """A ``DTensor`` laid out as the ``DTensor`` ``template`` (its mesh, placements, global shape, stride and dtype)
    whose local shard is ``local``, left where it is: ``DTensor(local, template._spec, requires_grad=False)``.
    ``DTensor.from_local`` moves its argument to the mesh's device type (torch 2.13 checked, ``_api.py``): given
    the pinned CPU copy of a CUDA shard it would copy it back to the GPU (a synchronous copy per tensor, a second
    copy of the state in GPU memory). ``torch.distributed.checkpoint`` writes such a ``DTensor`` as any other (a
    CPU-local ``DTensor`` on a mesh of another device type, torch 2.13 checked); the source of an earlier torch
    (with ``shard_order``, before 2.13) has the same constructor and the same move, read, not run. Missing
    ``_spec``: AttributeError at the first asynchronous save of a ``DTensor`` whose shard is not on its mesh's
    device type."""
    from torch.distributed.tensor import DTensor

    cls: Any = DTensor
    return cls(local, template._spec, requires_grad=False)


def outside_dispatch_modes() -> Any:
    """``torch.utils._python_dispatch._disable_current_modes()``: run tensor operations past the Python dispatch
    modes active now (selective activation checkpointing's recording and replaying modes, which must see only the
    block's own operations). Checked on torch 2.11 and 2.13. Missing: a no-op context (the operations are then
    seen by the modes, and selective checkpointing of a block with BatchNorm fails with torch's mismatch error)."""
    from torch.utils import _python_dispatch

    disable = getattr(_python_dispatch, "_disable_current_modes", None)
    return disable() if disable is not None else contextlib.nullcontext()


def dispatch_mode_base() -> Any:
    """``torch.utils._python_dispatch.TorchDispatchMode``: the base class of an operator-level recorder (selective
    checkpointing's memory budget measures each operator's output with one). Checked on torch 2.11 and 2.13."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


def operator_schema(op: Any) -> Any:
    """``OpOverload._schema``: an operator's schema (whether it mutates an input, whether an output aliases one;
    there is no public getter). Checked on torch 2.11 and 2.13."""
    return op._schema


def _optimizer_step_progress(trainer: Any) -> Any:
    # Lightning 2.6: global_step is automatic optimization's optimizer-step progress (total.completed)
    return trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step


def drop_optimizer_step(trainer: Any) -> Callable[[], None]:
    """Fault tolerance: the optimizer step Lightning is taking now (called inside ``Strategy.optimizer_step``) was
    not committed. Its progress is taken back at once (Lightning marks the step ready before the hook and completed
    after it, so ``global_step`` stays where it was); returns the undo of what Lightning does after the hook, to run
    once the batch is over: the step's scheduler steps (``interval="step"`` schedulers: state and learning rates
    restored; an epoch's scheduler step after the epoch's last batch is kept) and the logging step
    (``_TrainingEpochLoop._batches_that_stepped``, private in 2.6)."""
    step = _optimizer_step_progress(trainer)
    for tracker in (step.total, step.current):
        tracker.ready -= 1
        tracker.completed -= 1  # Lightning's increment_completed follows the hook
    configs = [c for c in trainer.lr_scheduler_configs if c.interval == "step"]
    schedulers = [(c.scheduler, c.scheduler.state_dict()) for c in configs]
    loop = trainer.fit_loop.epoch_loop

    def undo() -> None:
        for scheduler, saved in schedulers:
            scheduler.load_state_dict(saved)
            for group, lr in zip(scheduler.optimizer.param_groups, scheduler.get_last_lr()):
                group["lr"] = lr
        loop._batches_that_stepped -= 1

    return undo


def rng_states() -> dict[str, Any]:
    """This process's random states (torch, CUDA, numpy, Python): Lightning Fabric's ``_collect_rng_states``
    (lightning-fabric 2.6.6 checked; what its checkpoints save). Missing: ImportError at import."""
    return _collect_rng_states(include_cuda=True)


def set_rng_states(states: dict[str, Any]) -> None:
    """Set :func:`rng_states` (Fabric's ``_set_rng_states``)."""
    _set_rng_states(states)


def fit_loop_state(trainer: Any) -> dict[str, Any]:
    """Lightning's fit loop state as its checkpoints hold it (``loops.fit_loop``: the progress counters, the
    logging step and the training loaders' states, the resumable sampler's position among them)."""
    return dict(trainer.fit_loop.state_dict())


def restart_fit_loop(trainer: Any, state: dict[str, Any]) -> None:
    """Fault tolerance, in ``on_train_start`` (inside ``_FitLoop.on_run_start``, after its ``reset``): make the fit
    loop go on from :func:`fit_loop_state` of a live group as a resume from a checkpoint of that state would
    (``load_state_dict``, then ``reset``'s restart stages and the loaders' states, as ``_FitLoop.setup_data`` gives
    them; Lightning 2.6.6 checked)."""
    loop = trainer.fit_loop
    loop.load_state_dict(state)
    loop.reset()
    if not loop._iteration_based_training():  # what on_run_start did before this hook
        loop.epoch_progress.current.completed = loop.epoch_progress.current.processed
    loop._load_combined_loader_states()


def committed_loop_state(trainer: Any) -> dict[str, int]:
    """The loop counters a healing replica group takes from a live one: ``global_step`` and the logging step."""
    loop = trainer.fit_loop.epoch_loop
    return {"global_step": trainer.global_step, "batches_that_stepped": loop._batches_that_stepped}


def load_committed_loop_state(trainer: Any, state: dict[str, int]) -> None:
    """Set the loop counters of :func:`committed_loop_state` (before a batch starts: nothing is in flight)."""
    step = _optimizer_step_progress(trainer)
    step.total.ready = step.total.completed = state["global_step"]
    trainer.fit_loop.epoch_loop._batches_that_stepped = state["batches_that_stepped"]
