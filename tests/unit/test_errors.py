"""Bad input gets a clear error naming the bad value and the fix, before any process starts.

THE table of invalid configurations across the public API: strategies (instances and presets), precision,
callbacks, accumulation, activation checkpointing, schedules and the distributed helpers. Each row builds the
object -- or the Trainer, or calls ``Trainer.fit`` -- and gives the exception type and the fragments the message
must contain: the bad value as written (its repr) and the fix (the valid choice, the argument to change). Rows
that reach ``fit`` are refused by our pre-launch check in the main process; every row also proves that no
process group was started.
"""

from __future__ import annotations

from typing import Any

import psutil
import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import StochasticWeightAveraging
from pytorch_lightning.strategies.launchers import _SubprocessScriptLauncher
from pytorch_lightning.utilities.exceptions import MisconfigurationException
from torch import nn

from lightning_mgpu import (
    EMA,
    DeviceMonitor,
    EveryNth,
    ManualAccumulation,
    MGPUAutoStrategy,
    MGPUDDPStrategy,
    MGPUPrecision,
    MGPUShardedStrategy,
    ScaleLR,
    apply_activation_checkpointing,
    distributed,
    effective_batch_size,
    total_steps,
    warmup_schedule,
)
from tests.helpers import WORLD
from tests.models import BlockRegressor, ManualRegressor, NormedRegressor, RankData, Regressor, make_data


class Unsplittable(Regressor):
    """Layers as plain attributes: no nn.Sequential or nn.ModuleList of blocks to split into pipeline stages."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(6, 3)  # type: ignore[assignment]


def trainer(strategy: Any = "mgpu_ddp_fork", **kwargs: Any) -> pl.Trainer:
    flags: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": WORLD,
        "strategy": strategy,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    return pl.Trainer(**{**flags, **kwargs})


def fit(model: pl.LightningModule, strategy: Any = "mgpu_ddp_fork", **kwargs: Any) -> None:
    trainer(strategy, **kwargs).fit(model, datamodule=RankData(make_data(), 4))


def _first_layer_frozen() -> Regressor:
    model = Regressor()
    model.net[0].requires_grad_(False)
    return model


def _four_bit_base(scaler_block_size: int = 64) -> Regressor:
    """The regressor with its first layer (128 x 128) frozen and packed in 4 bits (torchao's NF4)."""
    from lightning_mgpu import quantize_frozen

    model = Regressor(d_in=128, hidden=128)
    model.net[0].requires_grad_(False)
    quantize_frozen(model, scaler_block_size=scaler_block_size)
    return model


def _lora_regressor() -> Regressor:
    """The regressor with peft LoRA adapters on its linear layers (a module stands in where peft is missing: a
    layer holding the layer it adapts as ``base_layer``, as peft's tuner layers do)."""
    model = Regressor()
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError:
        adapted = nn.Module()
        adapted.base_layer = model.net[0]
        model.net[0] = adapted
        return model
    inject_adapter_in_model(LoraConfig(r=2, target_modules=["0", "2"]), model.net)
    return model


def sgd() -> torch.optim.Optimizer:
    return torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)


class TiedOutsideTheBlocks(Regressor):
    """The last block's weight tied to a head outside the blocks (``net`` is the pipeline's blocks)."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(16, 3)
        self.head.weight = self.net[2].weight


class AutomaticWithMixin(ManualAccumulation, Regressor):
    """The accumulation mixin on a module that keeps automatic optimization."""


CASES = [
    # (zero-arg call, exception type, fragments the message must contain: the bad value and the fix)
    # --- compile (every strategy) ----------------------------------------------------------------------------
    pytest.param(
        lambda: MGPUDDPStrategy(compile={"mdoe": "max-autotune"}),
        TypeError,
        ["'mdoe'", "did you mean 'mode'?", "backend", "fullgraph"],
        id="compile-unknown-option-names-the-valid-ones",
    ),
    pytest.param(
        lambda: MGPUShardedStrategy(stage=3, compile="inductor"),
        TypeError,
        ["compile='inductor'", "{'backend': 'aot_eager'}", "True, False"],
        id="compile-not-a-bool-or-dict",
    ),
    pytest.param(
        lambda: fit(torch.compile(Regressor(), backend="eager"), MGPUDDPStrategy(start_method="fork", compile=True)),
        ValueError,
        ["compiled with torch.compile", "trainer.fit(model)", "MGPUDDPStrategy(compile=", "compile=False"],
        id="compile-true-with-a-user-compiled-model",
    ),
    pytest.param(
        lambda: fit(torch.compile(Regressor(), backend="eager"), MGPUAutoStrategy(start_method="fork")),
        ValueError,
        ["compiled with torch.compile", "may choose a sharded stage", "compile=True", "['mgpu_ddp', 'mgpu_zero1']"],
        id="compile-mgpu-auto-may-shard-a-user-compiled-model",
    ),
    # --- checkpoint_params (every strategy) ------------------------------------------------------------------
    pytest.param(
        lambda: MGPUShardedStrategy(checkpoint_params="adapters"),
        ValueError,
        ["checkpoint_params='adapters'", "'all'", "'trainable'", "'auto'"],
        id="checkpoint_params-unknown-lists-the-choices",
    ),
    # --- MGPUDDPStrategy -------------------------------------------------------------------------------------
    pytest.param(
        lambda: MGPUDDPStrategy(comm_hook="fp8"),
        ValueError,
        ["'fp8'", "'powersgd'", "'fp16'"],
        id="ddp-unknown-comm_hook-lists-the-hooks",
    ),
    pytest.param(
        lambda: MGPUDDPStrategy(comm_hook="PowerSGD"),
        ValueError,
        ["'PowerSGD'", "'powersgd'"],
        id="ddp-comm_hook-names-are-lower-case",
    ),
    pytest.param(
        lambda: MGPUDDPStrategy(comm_hook="powersgd", comm_state={"matrix_approximation_rank": -1}),
        ValueError,
        ["matrix_approximation_rank']=-1", "positive int"],
        id="ddp-powersgd-negative-rank-needs-a-positive-int",
    ),
    pytest.param(
        lambda: MGPUDDPStrategy(comm_hook="powersgd", comm_state={"matrix_approximation_rank": 0}),
        ValueError,
        ["matrix_approximation_rank']=0", "positive int"],
        id="ddp-powersgd-rank-0-needs-a-positive-int",
    ),
    pytest.param(
        lambda: MGPUDDPStrategy(comm_hook="powersgd", comm_state={"start_powerSGD_iter": 1}),
        ValueError,
        ["start_powerSGD_iter']=1", "start_powerSGD_iter=2"],
        id="ddp-powersgd-start-iter-1-with-error-feedback-needs-2",
    ),
    pytest.param(
        lambda: MGPUDDPStrategy(comm_hook="powersgd", comm_state={"rank": 2}),
        ValueError,
        ["['rank']", "matrix_approximation_rank"],
        id="ddp-powersgd-unknown-state-key-lists-the-accepted-keys",
    ),
    pytest.param(
        lambda: MGPUDDPStrategy(comm_hook="fp16", comm_state={"matrix_approximation_rank": 2}),
        ValueError,
        ["['matrix_approximation_rank']", "comm_hook='fp16'", "takes no state"],
        id="ddp-fp16-hook-takes-no-state",
    ),
    pytest.param(
        lambda: MGPUDDPStrategy(comm_state={"matrix_approximation_rank": 2}),
        ValueError,
        ["comm_state={'matrix_approximation_rank': 2}", "without a comm_hook", "comm_hook='powersgd'"],
        id="ddp-comm_state-without-a-hook-names-the-hook-to-add",
    ),
    pytest.param(
        lambda: MGPUDDPStrategy(comm_hook="powersgd", comm_state=[1]),
        TypeError,
        ["[1]", "dict"],
        id="ddp-comm_state-must-be-a-dict",
    ),
    pytest.param(
        lambda: MGPUDDPStrategy(start_method="threads"),
        ValueError,
        ["'threads'", "'fork'", "mgpu_ddp_notebook"],
        id="ddp-unknown-start_method-lists-the-launchers",
    ),
    pytest.param(
        lambda: MGPUDDPStrategy(static_graph="yes"),
        TypeError,
        ["static_graph", "'yes'", "True or False"],
        id="ddp-static_graph-must-be-a-bool",
    ),
    pytest.param(
        lambda: MGPUDDPStrategy(ddp_comm_hook=print),
        TypeError,
        ["['ddp_comm_hook']", "comm_hook='fp16'"],
        id="ddp-lightning-ddp_comm_hook-is-replaced-by-comm_hook",
    ),
    pytest.param(
        lambda: MGPUDDPStrategy(activation_checkpointing="torch.nn.NoSuchLayer"),
        ValueError,
        ["'torch.nn.NoSuchLayer'", "'torch.nn.TransformerEncoderLayer'", "bare class name"],
        id="ddp-activation-checkpointing-class-path-that-does-not-import",
    ),
    pytest.param(
        lambda: MGPUDDPStrategy(activation_checkpointing=3),
        TypeError,
        ["activation_checkpointing=3", "EveryNth(n)", "callable"],
        id="ddp-activation-checkpointing-policy-of-the-wrong-type",
    ),
    pytest.param(
        lambda: MGPUDDPStrategy(activation_checkpointing=[]),
        ValueError,
        ["activation_checkpointing=[]", "Pass None"],
        id="ddp-activation-checkpointing-empty-collection-checkpoints-nothing",
    ),
    pytest.param(
        lambda: MGPUDDPStrategy(
            activation_checkpointing="Block", activation_checkpointing_reentrant=True, find_unused_parameters=True
        ),
        ValueError,
        [
            "activation_checkpointing_reentrant=True",
            "find_unused_parameters=True",
            "activation_checkpointing_reentrant=False",
        ],
        id="ddp-reentrant-checkpointing-with-find_unused_parameters-is-incompatible",
    ),
    pytest.param(
        lambda: fit(BlockRegressor(), MGPUDDPStrategy(activation_checkpointing="ConvBlock", start_method="fork")),
        ValueError,
        ["no module class named 'ConvBlock' in BlockRegressor", "'Block'"],
        id="ddp-activation-checkpointing-naming-no-module-of-the-model-is-refused-before-launch",
    ),
    pytest.param(
        lambda: fit(Regressor(), MGPUDDPStrategy(process_group_backend="nccl", start_method="fork")),
        MisconfigurationException,
        ["process_group_backend='nccl'", "'cpu'", "process_group_backend='gloo'"],
        id="ddp-nccl-backend-on-cpu-is-refused-before-launch",
    ),
    pytest.param(
        lambda: MGPUDDPStrategy(bogus_flag=3),
        TypeError,
        ["unknown keyword argument 'bogus_flag'.", "Its options: ", "comm_hook", "DistributedDataParallel's: ", "dim"],
        id="ddp-unknown-keyword-lists-the-options",
    ),
    pytest.param(
        lambda: MGPUDDPStrategy(bucket_cap_mbs=10),
        TypeError,
        ["'bucket_cap_mbs' (did you mean 'bucket_cap_mb'"],
        id="ddp-misspelt-ddp-keyword-names-the-torch-one",
    ),
    pytest.param(
        lambda: MGPUDDPStrategy(gradient_as_bucket_view="x"),
        TypeError,
        ["gradient_as_bucket_view='x'", "True or False"],
        id="ddp-gradient_as_bucket_view-must-be-a-bool",
    ),
    pytest.param(
        lambda: MGPUDDPStrategy(timeout=30),  # type: ignore[arg-type]
        TypeError,
        ["timeout=30", "datetime.timedelta", "timedelta(seconds=30)"],
        id="ddp-timeout-must-be-a-timedelta",
    ),
    pytest.param(
        lambda: MGPUDDPStrategy(log_comm_stats="no"),  # type: ignore[arg-type]
        TypeError,
        ["log_comm_stats='no'", "True or False"],
        id="ddp-log_comm_stats-must-be-a-bool",
    ),
    pytest.param(
        lambda: MGPUShardedStrategy(stage=3, tensor_comm_stats="yes"),  # type: ignore[arg-type]
        TypeError,
        ["tensor_comm_stats='yes'", "True or False"],
        id="sharded-tensor_comm_stats-must-be-a-bool",
    ),
    pytest.param(
        lambda: MGPUShardedStrategy(stage=3, exact_evaluation="yes"),  # type: ignore[arg-type]
        TypeError,
        ["exact_evaluation='yes'", "True or False"],
        id="sharded-exact_evaluation-must-be-a-bool",
    ),
    pytest.param(
        lambda: MGPUDDPStrategy(check_uneven_inputs=1),  # type: ignore[arg-type]
        TypeError,
        ["check_uneven_inputs=1", "True or False"],
        id="ddp-check_uneven_inputs-must-be-a-bool",
    ),
    pytest.param(
        lambda: _load_sharded_directory_with(MGPUDDPStrategy()),
        IsADirectoryError,
        ["last.ckpt", "sharded checkpoint", "MGPUShardedStrategy(stage=3, checkpoint='sharded')", "'mgpu_zero3'"],
        id="ddp-resuming-a-sharded-checkpoint-directory-names-the-strategy-that-wrote-it",
    ),
    # --- MGPUShardedStrategy ---------------------------------------------------------------------------------
    pytest.param(
        lambda: MGPUShardedStrategy(stage=4),
        ValueError,
        ["stage=4", "stage=1", "or 3"],
        id="sharded-stage-4-is-not-a-zero-stage",
    ),
    pytest.param(
        lambda: MGPUShardedStrategy(stage="2"), ValueError, ["stage='2'", "stage=1"], id="sharded-stage-must-be-an-int"
    ),
    pytest.param(
        lambda: MGPUShardedStrategy(backend="deepspeed"),
        ValueError,
        ["backend='deepspeed'", "backend='torch'", "'fairscale'"],
        id="sharded-unknown-backend-lists-the-backends",
    ),
    pytest.param(
        lambda: MGPUShardedStrategy(checkpoint="zip"),
        ValueError,
        ["checkpoint='zip'", "'consolidated'", "'sharded'"],
        id="sharded-unknown-checkpoint-layout-lists-the-layouts",
    ),
    pytest.param(
        lambda: MGPUShardedStrategy(stage=3, backend="fairscale"),
        ValueError,
        ["stage=3", "backend='fairscale'", "MGPUShardedStrategy(stage=3)", "'mgpu_zero3'"],
        id="sharded-fairscale-has-no-stage-3-use-fsdp2",
    ),
    pytest.param(
        lambda: MGPUShardedStrategy(stage=2, bogus_flag=3),
        TypeError,
        ["unknown keyword argument 'bogus_flag'.", "Its options: ", "wrap_modules"],
        id="sharded-unknown-keyword-lists-the-options",
    ),
    pytest.param(
        lambda: MGPUShardedStrategy(pipline_parallel_size=2),
        TypeError,
        ["'pipline_parallel_size' (did you mean 'pipeline_parallel_size'?)", "Its options: ", "pipeline_schedule"],
        id="sharded-misspelt-pipeline-option-names-the-right-one",
    ),
    pytest.param(
        lambda: MGPUShardedStrategy(stage=2, wrap_module=[nn.Linear]),
        TypeError,
        ["'wrap_module'", "did you mean 'wrap_modules'?"],
        id="sharded-misspelt-keyword-names-the-right-one",
    ),
    pytest.param(
        lambda: MGPUShardedStrategy(stage=2, bucket_cap_mb=10),
        ValueError,
        ["bucket_cap_mb=10", "stage 2", "stage=1"],
        id="sharded-ddp-keyword-needs-stage-1",
    ),
    pytest.param(
        lambda: MGPUShardedStrategy(stage=2.0),  # type: ignore[arg-type]
        ValueError,
        ["stage=2.0", "stage=1", "as an int"],
        id="sharded-stage-float-is-not-a-zero-stage",
    ),
    pytest.param(
        lambda: fit(BlockRegressor(), MGPUShardedStrategy(wrap_modules=[nn.Conv2d], start_method="fork")),
        ValueError,
        ["wrap_modules=['Conv2d']", "matches no module of BlockRegressor", "'Block'", "wrap_modules=None"],
        id="sharded-wrap_modules-matching-no-module-is-refused-before-launch",
    ),
    pytest.param(
        lambda: _rewritten_by_on_exception(
            MGPUShardedStrategy(stage=1),
            RuntimeError("Expected to have finished reduction in the prior iteration before starting a new one."),
        ),
        RuntimeError,
        ["MGPUShardedStrategy(stage=1, find_unused_parameters=True)", "not used to produce the loss"],
        id="sharded-zero1-unused-parameter-hint-names-the-sharded-flag",
    ),
    pytest.param(
        lambda: _rewritten_by_on_exception(
            MGPUDDPStrategy(),
            RuntimeError("Expected to have finished reduction in the prior iteration before starting a new one."),
        ),
        RuntimeError,
        ["MGPUDDPStrategy(find_unused_parameters=True)"],
        id="ddp-unused-parameter-hint-names-the-ddp-flag",
    ),
    pytest.param(
        lambda: MGPUShardedStrategy(wrap_modules=[int]),
        TypeError,
        ["[<class 'int'>]", "[nn.TransformerEncoderLayer]"],
        id="sharded-wrap_modules-must-be-module-classes",
    ),
    pytest.param(
        lambda: MGPUShardedStrategy(stage=1, wrap_modules=[nn.Linear]),
        ValueError,
        ["stage=1", "wrap_modules", "stage=2 or 3"],
        id="sharded-wrap_modules-needs-fsdp-stages",
    ),
    pytest.param(
        lambda: MGPUShardedStrategy(stage=3, mesh="2d"),  # type: ignore[arg-type]
        ValueError,
        ["mesh='2d'", "mesh='flat'", "'hybrid'"],
        id="sharded-unknown-mesh-lists-the-meshes",
    ),
    pytest.param(
        lambda: MGPUShardedStrategy(stage=1, mesh="hybrid"),
        ValueError,
        ["mesh='hybrid'", "stage=1", "MGPUShardedStrategy(stage=3, mesh='hybrid')", "'mgpu_hsdp'"],
        id="sharded-hybrid-mesh-needs-fsdp2-stages",
    ),
    pytest.param(
        lambda: MGPUShardedStrategy(stage=3, shard_size=2),
        ValueError,
        ["shard_size=2", "mesh='flat'", "mesh='hybrid'"],
        id="sharded-shard_size-needs-the-hybrid-mesh",
    ),
    pytest.param(
        lambda: MGPUShardedStrategy(stage=3, mesh="hybrid", shard_size=0),
        ValueError,
        ["shard_size=0", ">= 1", "None"],
        id="sharded-shard_size-must-be-a-positive-int",
    ),
    pytest.param(
        lambda: trainer(MGPUShardedStrategy(stage=3, mesh="hybrid", shard_size=3, start_method="fork")),
        ValueError,
        ["shard_size=3", "does not divide the world size 2", "mesh='flat'"],
        id="sharded-shard_size-not-dividing-the-world-size-is-refused-at-trainer-construction",
    ),
    pytest.param(
        lambda: MGPUShardedStrategy(stage=3, tensor_parallel_size=0),
        ValueError,
        ["tensor_parallel_size=0", ">= 1"],
        id="sharded-tensor_parallel_size-must-be-a-positive-int",
    ),
    pytest.param(
        lambda: MGPUShardedStrategy(stage=1, tensor_parallel_size=2),
        ValueError,
        ["tensor_parallel_size=2", "stage=1", "MGPUShardedStrategy(stage=3, tensor_parallel_size=2)"],
        id="sharded-tensor-parallelism-needs-fsdp2-stages",
    ),
    pytest.param(
        lambda: MGPUShardedStrategy(stage=3, tensor_parallel_size=2, tensor_parallel_plan={"layers.*.w1": "diagonal"}),
        ValueError,
        ["tensor_parallel_plan['layers.*.w1']='diagonal'", "'colwise'", "RowwiseParallel"],
        id="sharded-tensor_parallel_plan-unknown-style",
    ),
    pytest.param(
        lambda: MGPUShardedStrategy(
            stage=3, tensor_parallel_size=2, tensor_parallel_plan="auto+sequence", pipeline_parallel_size=2
        ),
        ValueError,
        ["tensor_parallel_plan='auto+sequence'", "pipeline_parallel_size=2", "tensor_parallel_plan='auto'"],
        id="sharded-auto-sequence-with-a-pipeline",
    ),
    pytest.param(
        lambda: MGPUShardedStrategy(stage=3, offload="disk"),
        ValueError,
        ["offload='disk'", "offload='cpu'", "or None"],
        id="sharded-offload-unknown",
    ),
    pytest.param(
        lambda: MGPUShardedStrategy(stage=1, offload="cpu"),
        ValueError,
        ["got stage=1", "MGPUShardedStrategy(stage=3, offload='cpu')", "mgpu_zero3_offload"],
        id="sharded-offload-at-stage-1",
    ),
    pytest.param(
        lambda: MGPUShardedStrategy(stage=3, offload="cpu", pipeline_parallel_size=2),
        ValueError,
        ["offload='cpu' with pipeline_parallel_size=2 is not built yet", "pipeline_parallel_size=1"],
        id="sharded-offload-with-a-pipeline",
    ),
    pytest.param(
        lambda: fit(
            Regressor(),
            MGPUShardedStrategy(
                stage=3, tensor_parallel_size=2, tensor_parallel_plan="auto+sequence", start_method="fork"
            ),
        ),
        ValueError,
        ["tensor_parallel_plan='auto+sequence' needs a Llama-style model", "Regressor is none of these", "plan='auto'"],
        id="sharded-auto-sequence-on-a-model-of-another-shape-is-refused-before-launch",
    ),
    pytest.param(
        lambda: MGPUShardedStrategy(stage=3, tensor_parallel_plan={"layers.*.w1": "colwise"}),
        ValueError,
        ["tensor_parallel_size=1", "tensor_parallel_size=2"],
        id="sharded-tensor_parallel_plan-needs-a-tensor-size",
    ),
    pytest.param(
        lambda: trainer(MGPUShardedStrategy(stage=3, tensor_parallel_size=3, start_method="fork")),
        ValueError,
        ["tensor_parallel_size=3", "does not divide the world size 2", "tensor_parallel_size=2"],
        id="sharded-tensor_parallel_size-not-dividing-the-world-size-is-refused-at-trainer-construction",
    ),
    pytest.param(
        lambda: MGPUShardedStrategy(stage=2, comm_hook="fp16"),
        ValueError,
        ["comm_hook='fp16'", "stage 2", "stage=1"],
        id="sharded-comm_hook-needs-stage-1",
    ),
    pytest.param(
        lambda: trainer("mgpu_sharded_fairscale", plugins=[MGPUPrecision("bf16-master")]),
        ValueError,
        [
            "MGPUPrecision('bf16-master')",
            "backend='fairscale'",
            "strategy='mgpu_sharded'",
            "MGPUPrecision('bf16-mixed')",
        ],
        id="sharded-fairscale-preset-with-master-precision-is-incompatible",
    ),
    pytest.param(
        lambda: trainer(
            MGPUShardedStrategy(stage=1, checkpoint="sharded", start_method="fork"),
            plugins=[MGPUPrecision("16-master")],
        ),
        ValueError,
        ["MGPUPrecision('16-master')", "checkpoint='sharded'", "checkpoint='consolidated'"],
        id="sharded-zero1-sharded-checkpoint-with-master-precision-is-incompatible",
    ),
    pytest.param(
        lambda: fit(ManualRegressor(), "mgpu_sharded_notebook"),
        MisconfigurationException,
        ["ManualRegressor uses manual optimization", "MGPUShardedStrategy", "strategy='mgpu_ddp'"],
        id="sharded-preset-refuses-manual-optimization-before-launch",
    ),
    # --- MGPUPrecision ---------------------------------------------------------------------------------------
    pytest.param(
        lambda: MGPUPrecision("bf16-true"),  # type: ignore[arg-type]
        ValueError,
        ["mode='bf16-true'", "Did you mean 'bf16-master'?"],
        id="precision-lightning-true-mode-suggests-the-master-mode",
    ),
    pytest.param(
        lambda: MGPUPrecision("fp8"),  # type: ignore[arg-type]
        ValueError,
        ["mode='fp8'", "'bf16-mixed'", "'16-master'"],
        id="precision-unknown-mode-lists-the-modes",
    ),
    pytest.param(
        lambda: MGPUPrecision(16),  # type: ignore[arg-type]
        ValueError,
        ["mode=16", "Did you mean '16-mixed'?"],
        id="precision-int-mode-suggests-the-string",
    ),
    pytest.param(
        lambda: MGPUPrecision(init_scale=0),
        ValueError,
        ["init_scale", "got 0", "> 0"],
        id="precision-init_scale-must-be-positive",
    ),
    pytest.param(
        lambda: MGPUPrecision(growth_factor=1.0),
        ValueError,
        ["growth_factor", "got 1.0", "> 1"],
        id="precision-growth_factor-must-exceed-1",
    ),
    pytest.param(
        lambda: MGPUPrecision(backoff_factor=1.5),
        ValueError,
        ["backoff_factor", "got 1.5", "between 0 and 1"],
        id="precision-backoff_factor-must-be-a-fraction",
    ),
    pytest.param(
        lambda: MGPUPrecision(growth_interval=0),
        ValueError,
        ["growth_interval", "got 0", "int >= 1"],
        id="precision-growth_interval-must-be-at-least-1",
    ),
    pytest.param(
        lambda: MGPUPrecision(device=0),  # type: ignore[arg-type]
        TypeError,
        ["device", "got 0", "'cuda' or 'cpu'"],
        id="precision-device-is-a-device-type-string",
    ),
    pytest.param(
        lambda: trainer(plugins=[MGPUPrecision("16-mixed", device="cuda")]),
        ValueError,
        ["device='cuda'", "runs on 'cpu'", "device=None", "device='cpu'"],
        id="precision-cuda-device-on-a-cpu-trainer-is-refused-at-construction",
    ),
    # --- Trainer(strategy=<preset>) with arguments this run cannot honour -------------------------------------
    pytest.param(
        lambda: fit(Regressor(), "mgpu_ddp_fork", accumulate_grad_batches=0),
        MisconfigurationException,
        ["accumulate_grad_batches=0", "int >= 1"],
        id="preset-accumulate_grad_batches-0-is-refused-before-launch",
    ),
    pytest.param(
        lambda: fit(BlockRegressor(), "mgpu_ddp_fork", sync_batchnorm=True),
        MisconfigurationException,
        ["sync_batchnorm=True on CPU", "drop sync_batchnorm", "MGPUShardedStrategy(activation_checkpointing=...)"],
        id="preset-sync_batchnorm-on-cpu-is-refused-before-launch",
    ),
    # Lightning's own refusals (its accelerator connector, before our strategy is asked): only the type and
    # "nothing launched" are asserted, not its wording.
    pytest.param(
        lambda: trainer(accelerator="gpu"),
        MisconfigurationException,
        [],
        id="preset-accelerator-gpu-without-a-gpu-lightning-refuses",
    ),
    pytest.param(
        lambda: trainer("mgpu_sharded_notebook", accelerator="cuda", devices=[0, 1]),
        MisconfigurationException,
        [],
        id="preset-cuda-devices-the-machine-lacks-lightning-refuses",
    ),
    # --- ManualAccumulation ----------------------------------------------------------------------------------
    pytest.param(
        lambda: fit(ManualRegressor(), "mgpu_ddp_fork", accumulate_grad_batches=2),
        MisconfigurationException,
        ["accumulate_grad_batches=2", "class ManualRegressor(lightning_mgpu.ManualAccumulation, LightningModule)"],
        id="accumulation-manual-optimization-needs-the-mixin",
    ),
    pytest.param(
        lambda: fit(AutomaticWithMixin(), "mgpu_ddp_fork", accumulate_grad_batches=2),
        MisconfigurationException,
        ["AutomaticWithMixin inherits lightning_mgpu.ManualAccumulation", "self.automatic_optimization = False"],
        id="accumulation-mixin-with-automatic-optimization-is-refused",
    ),
    pytest.param(
        lambda: fit(ManualRegressor(), MGPUDDPStrategy(comm_hook="powersgd", start_method="fork")),
        MisconfigurationException,
        ["comm_hook='powersgd'", "comm_hook='fp16'"],
        id="accumulation-manual-optimization-cannot-run-powersgd",
    ),
    # --- DeviceMonitor, ScaleLR ------------------------------------------------------------------------------
    pytest.param(
        lambda: DeviceMonitor(every_n_steps=0),
        ValueError,
        ["every_n_steps=0", "int >= 1", "None"],
        id="monitor-every_n_steps-must-be-at-least-1",
    ),
    pytest.param(
        lambda: DeviceMonitor(straggler_warn=0.5),
        ValueError,
        ["straggler_warn=0.5", "ratio >= 1.0", "float('inf')"],
        id="monitor-straggler-ratio-below-1",
    ),
    pytest.param(
        lambda: DeviceMonitor(memory_warn="2"),  # type: ignore[arg-type]
        ValueError,
        ["memory_warn='2'", "ratio >= 1.0"],
        id="monitor-memory-ratio-must-be-a-number",
    ),
    pytest.param(
        lambda: DeviceMonitor(prefix="device/gpu"),
        ValueError,
        ["prefix='device/gpu'", "without '/'"],
        id="monitor-prefix-without-slash",
    ),
    pytest.param(
        lambda: ScaleLR(base_batch_size=0),
        ValueError,
        ["base_batch_size=0", "int >= 1"],
        id="scale-lr-base-batch-must-be-positive",
    ),
    pytest.param(
        lambda: ScaleLR(256, rule="log"),  # type: ignore[arg-type]
        ValueError,
        ["rule='log'", "'linear'", "'sqrt'"],
        id="scale-lr-unknown-rule-lists-the-rules",
    ),
    pytest.param(
        lambda: ScaleLR(256, warmup_steps=-1),
        ValueError,
        ["warmup_steps=-1", "int >= 0"],
        id="scale-lr-negative-warmup",
    ),
    pytest.param(
        lambda: ScaleLR(256, batch_size=-1),
        ValueError,
        ["batch_size=-1", "int >= 1"],
        id="scale-lr-negative-batch-size",
    ),
    pytest.param(lambda: EMA(decay=1.0), ValueError, ["EMA(decay=1.0)", "[0, 1)", "EMA(decay=0.999)"], id="ema-decay"),
    pytest.param(
        lambda: EMA(update_every_n_steps=0),
        ValueError,
        ["update_every_n_steps=0", "positive integer"],
        id="ema-update-every-n-steps-must-be-positive",
    ),
    pytest.param(
        lambda: EMA(update_starting_at_step=-1),
        ValueError,
        ["update_starting_at_step=-1", ">= 0"],
        id="ema-start-step-must-be-non-negative",
    ),
    # --- EveryNth and activation-checkpointing targets ---------------------------------------------------------
    pytest.param(lambda: EveryNth(0), ValueError, ["EveryNth(n=0)", "EveryNth(2)"], id="every-nth-n-must-be-positive"),
    pytest.param(
        lambda: EveryNth(2, container=3),  # type: ignore[arg-type]
        TypeError,
        ["container=3", "'blocks'"],
        id="every-nth-container-is-a-dotted-name",
    ),
    pytest.param(
        lambda: apply_activation_checkpointing(BlockRegressor(), "ConvBlock"),
        ValueError,
        ["'ConvBlock'", "BlockRegressor", "'Block'"],
        id="checkpointing-class-name-naming-no-module-lists-the-classes-present",
    ),
    pytest.param(
        lambda: apply_activation_checkpointing(BlockRegressor(), nn.Conv2d),
        ValueError,
        ["Conv2d", "matches no module", "'Block'"],
        id="checkpointing-class-matching-no-module-lists-the-classes-present",
    ),
    pytest.param(
        lambda: apply_activation_checkpointing(BlockRegressor(), EveryNth(2, container="blocks")),
        ValueError,
        ["container='blocks'", "['net']"],
        id="checkpointing-every-nth-container-naming-no-module-lists-the-containers",
    ),
    pytest.param(
        lambda: apply_activation_checkpointing(BlockRegressor(), BlockRegressor),
        ValueError,
        ["activation_checkpointing=BlockRegressor", "root module", "'Block'"],
        id="checkpointing-the-root-module-frees-nothing",
    ),
    pytest.param(
        lambda: apply_activation_checkpointing(BlockRegressor(), "Block", use_reentrant="yes"),  # type: ignore[arg-type]
        TypeError,
        ["use_reentrant", "'yes'", "True or False"],
        id="checkpointing-use_reentrant-must-be-a-bool",
    ),
    # --- schedules and distributed helpers ------------------------------------------------------------------
    pytest.param(
        lambda: warmup_schedule(sgd(), trainer(), decay="step"),  # type: ignore[arg-type]
        ValueError,
        ["decay='step'", "'cosine'", "'linear'"],
        id="schedule-unknown-decay-lists-the-decays",
    ),
    pytest.param(
        lambda: warmup_schedule(sgd(), trainer(), final_lr_ratio=1.5),
        ValueError,
        ["final_lr_ratio=1.5", "[0, 1]"],
        id="schedule-final-ratio-above-1",
    ),
    pytest.param(
        lambda: total_steps(trainer(max_epochs=-1)),
        ValueError,
        ["max_epochs=-1 and max_steps=-1", "Trainer(max_steps=...)"],
        id="schedule-endless-run-has-no-length",
    ),
    pytest.param(
        lambda: effective_batch_size(trainer(), batch_size=0),
        ValueError,
        ["batch_size=0", "int >= 1"],
        id="effective-batch-size-must-be-positive",
    ),
    pytest.param(
        lambda: distributed.mean(torch.ones(1), dst=5),
        ValueError,
        ["dst=5", "[0, 1)", "None for every rank"],
        id="distributed-mean-dst-outside-the-ranks",
    ),
    # --- pipeline parallelism (MGPUShardedStrategy(pipeline_parallel_size=P)) --------------------------------
    pytest.param(
        lambda: fit(
            Regressor(), MGPUShardedStrategy(pipeline_parallel_size=2, pipeline_split=["net.9"], start_method="fork")
        ),
        ValueError,
        ["pipeline_split=['net.9']", "no module named 'net.9'", "named_modules()"],
        id="pipeline-split-name-that-does-not-exist",
    ),
    pytest.param(
        lambda: fit(Regressor(), MGPUShardedStrategy(pipeline_parallel_size=4, start_method="fork"), devices=4),
        ValueError,
        ["at least 4 children", "the largest has 3", "Use fewer stages"],
        id="pipeline-more-stages-than-blocks",
    ),
    pytest.param(
        lambda: fit(Regressor(), MGPUShardedStrategy(pipeline_parallel_size=3, start_method="fork")),
        ValueError,
        ["pipeline_parallel_size=3", "does not divide the world size 2", "pipeline_parallel_size=1"],
        id="pipeline-size-must-divide-the-world-size",
    ),
    pytest.param(
        lambda: fit(
            _first_layer_frozen(),
            MGPUShardedStrategy(pipeline_parallel_size=2, checkpoint_params="trainable", start_method="fork"),
        ),
        ValueError,
        ["checkpoint_params='trainable'", "under pipeline parallelism", "checkpoint_params='all'", "mgpu_zero3"],
        id="pipeline-adapter-only-checkpoint",
    ),
    pytest.param(
        lambda: fit(_four_bit_base(), MGPUShardedStrategy(stage=3, checkpoint="sharded", start_method="fork")),
        ValueError,
        [
            "checkpoint='sharded' with checkpoint_params='all'",
            "4-bit base (net.0.weight",
            "'trainable'",
            "'consolidated'",
        ],
        id="four-bit-base-in-a-sharded-directory",
    ),
    pytest.param(
        lambda: fit(_four_bit_base(scaler_block_size=256), "mgpu_zero3"),
        ValueError,
        ["over 2 ranks", "net.0.weight ((128, 128), blocks of 16384", "scaler_block_size=128", "mgpu_zero1"],
        id="four-bit-base-shards-hold-whole-blocks",
    ),
    pytest.param(
        lambda: fit(_four_bit_base(), MGPUShardedStrategy(tensor_parallel_size=2, start_method="fork")),
        ValueError,
        ["has a 4-bit base", "tensor parallelism is not built yet", "mgpu_zero3"],
        id="four-bit-base-under-tensor-parallelism",
    ),
    pytest.param(
        lambda: fit(_four_bit_base(), MGPUShardedStrategy(pipeline_parallel_size=2, start_method="fork")),
        ValueError,
        ["has a 4-bit base", "pipeline parallelism is not built yet", "mgpu_zero3"],
        id="four-bit-base-under-pipeline-parallelism",
    ),
    pytest.param(
        lambda: fit(_lora_regressor(), MGPUShardedStrategy(tensor_parallel_size=2, start_method="fork")),
        ValueError,
        ["tensor_parallel_size=2 with adapters", "'net.0'", "strategy='mgpu_zero3'"],
        id="tensor-parallel-adapters",
    ),
    pytest.param(  # an MLP with a norm between its layers: the auto plan splits none of it; refused before launch
        lambda: fit(NormedRegressor(), MGPUShardedStrategy(tensor_parallel_size=2, start_method="fork")),
        ValueError,
        [
            "tensor_parallel_plan='auto': the auto plan splits 0 layers of NormedRegressor",
            "net.0 (Linear 6 -> 16)",
            "tensor_parallel_plan={'net.0': 'colwise', 'net.3': 'rowwise'}",
            "tensor_parallel_plan={}",
        ],
        id="tensor-parallel-auto-plan-splitting-nothing",
    ),
    pytest.param(
        lambda: fit(Unsplittable(), MGPUShardedStrategy(pipeline_parallel_size=2, start_method="fork")),
        ValueError,
        ["no nn.Sequential or nn.ModuleList in Unsplittable", "for block in self.blocks"],
        id="pipeline-model-without-blocks-says-what-shape-it-needs",
    ),
    pytest.param(
        lambda: fit(ManualRegressor(), MGPUShardedStrategy(pipeline_parallel_size=2, start_method="fork")),
        MisconfigurationException,
        ["manual optimization", "MGPUShardedStrategy does not support yet"],
        id="pipeline-manual-optimization",
    ),
    pytest.param(
        lambda: fit(
            Regressor().double(),
            MGPUShardedStrategy(pipeline_parallel_size=2, start_method="fork"),
            precision="64-true",
            gradient_clip_val=1.0,
        ),
        ValueError,
        ["gradient_clip_val by norm", "DoublePrecision", "precision='32-true'", "gradient_clip_algorithm='value'"],
        id="pipeline-norm-clipping-needs-mgpu-precision",
    ),
    pytest.param(
        lambda: fit(
            Regressor(),
            MGPUShardedStrategy(pipeline_parallel_size=2, start_method="fork"),
            callbacks=[StochasticWeightAveraging(swa_lrs=0.1)],
        ),
        ValueError,
        ["StochasticWeightAveraging under pipeline parallelism", "only the blocks of its own stages", "Remove"],
        id="pipeline-weight-averaging-callbacks",
    ),
    pytest.param(
        lambda: MGPUShardedStrategy(pipeline_parallel_size=2, stage=1),
        ValueError,
        ["pipeline_parallel_size=2 with stage=1 is not supported yet", "Remove stage=1", "stage=2 or 3"],
        id="pipeline-with-zero1-not-supported-yet",
    ),
    pytest.param(
        lambda: MGPUShardedStrategy(pipeline_parallel_size=2, stage=2, mesh="hybrid"),
        ValueError,
        ["pipeline_parallel_size=2 with mesh='hybrid' with stage=2 is not", "HSDP with mesh='hybrid'", "at stage=3"],
        id="pipeline-with-hsdp-needs-stage-3",
    ),
    pytest.param(
        lambda: fit(
            Regressor(),
            MGPUShardedStrategy(pipeline_parallel_size=2, stage=3, start_method="fork"),
            plugins=[MGPUPrecision("bf16-master")],
        ),
        ValueError,
        ["MGPUPrecision('bf16-master') with pipeline_parallel_size=2", "at stage=3", "precision='bf16-mixed'"],
        id="pipeline-zero3-with-master-weights",
    ),
    pytest.param(
        lambda: fit(
            Regressor(),
            MGPUShardedStrategy(pipeline_parallel_size=2, start_method="fork"),
            plugins=[MGPUPrecision("16-master")],
        ),
        ValueError,
        [
            "MGPUPrecision('16-master') with pipeline_parallel_size=2 is not supported yet",
            "never trained",
            "'16-mixed'",
        ],
        id="pipeline-with-master-weights",
    ),
    pytest.param(
        lambda: fit(
            TiedOutsideTheBlocks(), MGPUShardedStrategy(pipeline_parallel_size=2, stage=3, start_method="fork")
        ),
        ValueError,
        ["net.2.weight is tied to head.weight", "Untie them, or use stage=2"],
        id="pipeline-zero3-with-a-block-tied-outside",
    ),
    pytest.param(
        lambda: MGPUShardedStrategy(pipeline_parallel_size=2, checkpoint="sharded"),
        ValueError,
        ["checkpoint='sharded' with stage=2", "not supported yet", "checkpoint='consolidated' or, at stage=3"],
        id="pipeline-with-sharded-checkpoints-only-at-stage-3",
    ),
    pytest.param(
        lambda: MGPUShardedStrategy(pipeline_parallel_size=2, tensor_parallel_size=2, mesh="hybrid"),
        ValueError,
        ["mesh='hybrid' with stage=2 is not supported yet", "at stage=3, 'hybrid'"],
        id="pipeline-with-tensor-parallelism-on-a-hybrid-mesh-needs-stage-3",
    ),
    pytest.param(
        lambda: MGPUShardedStrategy(pipeline_parallel_size=2, tensor_parallel_size=2, checkpoint="sharded"),
        ValueError,
        ["checkpoint='sharded' with stage=2 is not supported yet", "at stage=3, 'sharded'"],
        id="pipeline-with-tensor-parallelism-writes-sharded-checkpoints-only-at-stage-3",
    ),
    pytest.param(
        lambda: MGPUShardedStrategy(pipeline_parallel_size=4, pipeline_microbatches=2),
        ValueError,
        ["pipeline_microbatches=2 < pipeline_parallel_size=4", "pipeline_microbatches=4", "'gpipe'"],
        id="pipeline-1f1b-needs-a-micro-batch-per-stage",
    ),
    pytest.param(
        lambda: MGPUShardedStrategy(pipeline_parallel_size=2, pipeline_split=["blocks.1", "blocks.2"]),
        ValueError,
        ["makes 3 stages", "equal to pipeline_parallel_size=2", "Give 1 module names"],
        id="pipeline-split-count-must-match-the-stages",
    ),
    pytest.param(
        lambda: MGPUShardedStrategy(pipeline_parallel_size=2, pipeline_schedule="zb"),  # type: ignore[arg-type]
        ValueError,
        ["pipeline_schedule='zb'", "'gpipe', '1f1b', 'interleaved_1f1b'"],
        id="pipeline-unknown-schedule",
    ),
]


def _rewritten_by_on_exception(strategy: Any, error: BaseException) -> None:
    """What the user reads when ``error`` ends a fit: the strategy's ``on_exception`` rewrites it first."""
    strategy.on_exception(error)
    raise error


def _load_sharded_directory_with(strategy: Any) -> None:
    """A sharded checkpoint directory (as MGPUShardedStrategy(stage=3, checkpoint='sharded') commits it) given
    to a strategy that reads one-file checkpoints."""
    import json
    import tempfile
    from pathlib import Path

    from lightning_mgpu.plugins.checkpoint_io import COMPLETE_MARKER

    path = Path(tempfile.mkdtemp()) / "last.ckpt"
    path.mkdir()
    (path / COMPLETE_MARKER).write_text(json.dumps({"stage": 3, "backend": "torch", "files": []}))
    strategy.load_checkpoint(path)


def _launched(*args: object, **kwargs: object) -> None:
    raise AssertionError("a worker process was launched before the bad input was refused")


@pytest.mark.parametrize(("call", "exc", "fragments"), CASES)
def test_bad_input_is_refused_before_launch_naming_the_value_and_the_fix(call, exc, fragments, monkeypatch):
    # Every way our strategies start workers fails the case: fork/spawn (torch.multiprocessing) and popen
    # (Lightning re-running the script). A refusal that came only from inside a worker would surface as this
    # AssertionError instead of the expected error.
    monkeypatch.setattr(torch.multiprocessing, "start_processes", _launched)
    monkeypatch.setattr(_SubprocessScriptLauncher, "_call_children_scripts", _launched)
    before = {p.pid for p in psutil.Process().children()}  # e.g. multiprocessing's resource tracker, kept by torch
    with pytest.raises(exc) as info:
        call()
    for fragment in fragments:
        assert fragment in str(info.value), f"{fragment!r} missing from: {info.value}"
    assert not torch.distributed.is_initialized()
    assert {p.pid for p in psutil.Process().children()} <= before


def test_bf16_hook_on_gloo_is_refused_before_launch_naming_the_alternative():
    strategy = MGPUDDPStrategy(comm_hook="bf16", start_method="fork")
    with pytest.raises(ValueError, match=r"comm_hook='bf16' cannot run on the 'gloo'.*comm_hook='fp16'") as info:
        pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False)
    assert "'bf16'" in str(info.value) and "'gloo'" in str(info.value) and "comm_hook='fp16'" in str(info.value)
    assert not torch.distributed.is_initialized()


def test_bf16_hook_is_accepted_where_the_backend_can_run_it():
    strategy = MGPUDDPStrategy(comm_hook="bf16", start_method="fork", process_group_backend="nccl")
    pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False)  # refused only for gloo
