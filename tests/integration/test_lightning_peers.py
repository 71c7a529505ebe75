"""A drop-in strategy passes the tests its host wrote for the strategy it replaces: the cases where Lightning's own
tests (``make test-lightning``, docs/development.md) told the mgpu presets apart from Lightning's DDP, each fixed
and kept here, with the checks of the suite's leftover fixture (tests/conftest.py)."""

from __future__ import annotations

import subprocess
import sys
import threading
from unittest.mock import Mock

import pytest
import pytorch_lightning as pl
import torch
from lightning_fabric.plugins.environments import ClusterEnvironment
from pytorch_lightning.demos.boring_classes import BoringModel
from pytorch_lightning.strategies.launchers import _MultiProcessingLauncher
from pytorch_lightning.trainer.connectors import accelerator_connector
from pytorch_lightning.trainer.states import TrainerFn
from pytorch_lightning.utilities.exceptions import MisconfigurationException

import lightning_mgpu
from lightning_mgpu import MGPUDDPStrategy, MGPUDiLoCoStrategy, MGPULocalSGDStrategy, MGPUShardedStrategy
from tests.conftest import leftovers


def _pack_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("mgpu")]


# --- no thread outlives the Trainer call ------------------------------------------------------------------
def test_a_one_device_popen_predict_leaves_no_observer_thread(tmp_path):
    """Lightning's loops/test_prediction_loop.py with strategy="mgpu_ddp", devices=1: rank 0 is this process and
    there is no child rank to watch; the launcher's observer thread used to outlive trainer.predict."""
    trainer = pl.Trainer(
        strategy="mgpu_ddp",
        accelerator="cpu",
        devices=1,
        limit_predict_batches=1,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
        default_root_dir=tmp_path,
    )
    try:
        trainer.predict(BoringModel())
        assert _pack_threads() == []
    finally:
        # rank 0 of a popen launch keeps its process group for the script's next Trainer call, as Lightning's DDP
        torch.distributed.destroy_process_group()


def test_one_device_predict_keeps_lightnings_sampler_and_sets_its_epoch(tmp_path):
    """Lightning's loops/test_prediction_loop.py::test_prediction_loop_batch_sampler_set_epoch_called: on one rank
    the exact-evaluation sampler has nothing to fix (nothing is padded), so the loader keeps Lightning's
    DistributedSampler inside its index-tracking batch sampler, and the sampler gets the fit loop's epoch."""
    from torch.utils.data import DistributedSampler, SequentialSampler

    trainer = pl.Trainer(
        strategy="mgpu_ddp",
        accelerator="cpu",
        devices=1,
        limit_predict_batches=1,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
        default_root_dir=tmp_path,
    )
    trainer.fit_loop.epoch_progress.current.processed = 2
    try:
        trainer.predict(BoringModel())
        assert isinstance(trainer.predict_dataloaders.sampler, SequentialSampler)
        batch_sampler = trainer.predict_dataloaders.batch_sampler
        assert isinstance(batch_sampler.sampler, DistributedSampler)
        assert batch_sampler.sampler.epoch == 2
    finally:
        torch.distributed.destroy_process_group()


_TWO_CALLS = """
import threading, pytorch_lightning as pl, lightning_mgpu
from pytorch_lightning.demos.boring_classes import BoringModel
trainer = pl.Trainer(strategy="mgpu_ddp", accelerator="cpu", devices=2, max_steps=2, limit_val_batches=0,
                     logger=False, enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False)
model = BoringModel()
trainer.fit(model)
after_fit = [t.name for t in threading.enumerate() if t.name.startswith("mgpu")]
trainer.validate(model)
after_validate = [t.name for t in threading.enumerate() if t.name.startswith("mgpu")]
if trainer.global_rank == 0:
    print("PACK THREADS AFTER FIT:", after_fit, "AFTER VALIDATE:", after_validate, flush=True)
"""


@pytest.mark.slow
def test_a_popen_launch_with_child_ranks_leaves_no_observer_thread_after_fit(tmp_path):
    """With child ranks, the observer watches them during each Trainer call (fit, then validate: the second
    call starts no children) and is joined when the call returns."""
    script = tmp_path / "job.py"
    script.write_text(_TWO_CALLS)
    out = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "PACK THREADS AFTER FIT: [] AFTER VALIDATE: []" in out.stdout, out.stdout[-2000:]


# --- the launch path asks only for what it needs ----------------------------------------------------------
def _cluster(local_rank: int, node_rank: int) -> Mock:
    env = Mock(spec=ClusterEnvironment)
    env.world_size.return_value = 4
    env.node_rank.return_value = node_rank
    env.local_rank.return_value = local_rank
    env.global_rank.return_value = 2 * node_rank + local_rank
    return env


@pytest.mark.parametrize(
    "make",
    [
        lambda env: MGPUDDPStrategy(cluster_environment=env, start_method="spawn"),
        lambda env: MGPUDDPStrategy(cluster_environment=env),
        lambda env: MGPULocalSGDStrategy(cluster_environment=env, start_method="spawn"),
        lambda env: MGPUDiLoCoStrategy(cluster_environment=env, start_method="spawn"),
        lambda env: MGPUShardedStrategy(stage=1, cluster_environment=env, start_method="spawn"),
        lambda env: MGPUShardedStrategy(stage=3, cluster_environment=env, start_method="spawn"),
    ],
    ids=["ddp_spawn", "ddp_popen", "local_sgd", "diloco", "zero1", "zero3"],
)
def test_a_local_rank_past_the_local_devices_builds_the_trainer(make, tmp_path):
    """Lightning's strategies/launchers/test_multiprocessing.py::test_collect_rank_zero_results: a cluster
    environment whose local rank (1) exceeds this machine's device count (1 CPU device). Trainer construction
    (which chooses the process-group backend) used to index the devices with the local rank: IndexError."""
    strategy = make(_cluster(local_rank=1, node_rank=1))
    pl.Trainer(accelerator="cpu", default_root_dir=tmp_path, strategy=strategy, logger=False)
    assert strategy.local_rank == 1 and strategy.global_rank == 3
    assert strategy._runtime.group_backend() == "gloo"


@pytest.mark.parametrize("ours", [False, True], ids=["lightning_launcher", "mgpu_launcher"])
@pytest.mark.parametrize("local_rank", [0, 1])
def test_collecting_rank_zero_results_needs_no_device_of_this_rank(ours, local_rank, tmp_path):
    model = Mock(wraps=BoringModel(), spec=BoringModel)
    strategy = MGPUDDPStrategy(cluster_environment=_cluster(local_rank, node_rank=0), start_method="spawn")
    trainer = pl.Trainer(accelerator="cpu", default_root_dir=tmp_path, strategy=strategy, logger=False)
    launcher = strategy.launcher if ours else _MultiProcessingLauncher(strategy=strategy)
    trainer.strategy.connect(model)
    trainer.state.fn = TrainerFn.FITTING
    output = launcher._collect_rank_zero_results(trainer, {})
    model.state_dict.assert_called_once()
    if local_rank == 0:
        assert output.weights_path.endswith(".temp.ckpt")
    else:
        assert output is None


def test_the_launch_path_reads_no_root_device(tmp_path, monkeypatch):
    """The negative control of the two tests above: the same construction with root_device made to raise."""

    def no_root_device(self):
        raise AssertionError("root_device read on the launch path")

    monkeypatch.setattr(MGPUDDPStrategy, "root_device", property(no_root_device))
    strategy = MGPUDDPStrategy(start_method="fork")
    pl.Trainer(accelerator="cpu", devices=2, default_root_dir=tmp_path, strategy=strategy, logger=False)
    strategy._runtime.check_before_launch(Mock(accumulate_grad_batches=1, state=Mock(fn=TrainerFn.PREDICTING)))


# --- every message that suggests a strategy suggests ours -------------------------------------------------
@pytest.mark.parametrize(
    ("flag", "suggested"),
    [
        ("mgpu_ddp", "'mgpu_ddp_notebook'"),
        ("mgpu_ddp_spawn", "'mgpu_ddp_notebook'"),
        ("mgpu_ddp_fp16_compress", "MGPUDDPStrategy(comm_hook='fp16', start_method='fork')"),
        ("mgpu_ddp_powersgd", "MGPUDDPStrategy(comm_hook='powersgd', start_method='fork')"),
        ("mgpu_local_sgd", "'mgpu_local_sgd_notebook'"),
        ("mgpu_diloco_spawn", "'mgpu_diloco_notebook'"),
        ("mgpu_sharded", "'mgpu_sharded_notebook'"),
        ("mgpu_zero1", "'mgpu_zero1_notebook'"),
        ("mgpu_zero3_spawn", "'mgpu_zero3_notebook'"),
        ("mgpu_auto", "'mgpu_auto_notebook'"),
    ],
)
def test_in_a_notebook_a_non_fork_preset_suggests_its_own_notebook_form(flag, suggested, monkeypatch, tmp_path):
    """Lightning's trainer/connectors/test_accelerator_connector.py::test_interactive_incompatible_backend_error:
    Lightning's refusal suggests its own 'ddp_notebook', which would drop the pack."""
    monkeypatch.setattr(accelerator_connector, "_IS_INTERACTIVE", True)
    with pytest.raises(MisconfigurationException) as refused:
        pl.Trainer(strategy=flag, accelerator="cpu", devices=2)
    message = str(refused.value)
    assert f"`Trainer(strategy={flag!r})` is not compatible with an interactive environment" in message
    assert f"`Trainer(strategy={suggested})`" in message
    assert "'ddp_notebook'" not in message
    # what it suggests works in a notebook
    namespace = {"MGPUDDPStrategy": MGPUDDPStrategy, "MGPUShardedStrategy": MGPUShardedStrategy}
    choice = eval(suggested, namespace)  # the test's own table
    trainer = pl.Trainer(strategy=choice, accelerator="cpu", devices=2, default_root_dir=tmp_path, logger=False)
    assert trainer.strategy.launcher.is_interactive_compatible


def test_in_a_notebook_a_strategy_instance_is_named_by_its_preset(monkeypatch):
    monkeypatch.setattr(accelerator_connector, "_IS_INTERACTIVE", True)
    with pytest.raises(MisconfigurationException, match=r"strategy='mgpu_ddp'\)`.*strategy='mgpu_ddp_notebook'"):
        pl.Trainer(strategy=MGPUDDPStrategy(static_graph=True), accelerator="cpu", devices=2)


def test_outside_a_notebook_nothing_is_refused(tmp_path):
    """The negative control: the refusal is the interactive check's, not the presets'."""
    assert not accelerator_connector._IS_INTERACTIVE
    trainer = pl.Trainer(strategy="mgpu_ddp", accelerator="cpu", devices=2, default_root_dir=tmp_path, logger=False)
    assert isinstance(trainer.strategy, lightning_mgpu.MGPUDDPStrategy)


# --- the leftover fixture catches what it is there for ----------------------------------------------------
def test_the_leftover_check_names_a_running_pack_thread():
    before, children = set(threading.enumerate()), set()
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, name="mgpu-left-behind", daemon=True)
    thread.start()
    try:
        assert leftovers(before, children) == ["thread 'mgpu-left-behind' still running"]
    finally:
        stop.set()
        thread.join()
    assert leftovers(before, children) == []


def test_the_leftover_check_names_a_running_child_and_a_zombie(monkeypatch):
    from tests import conftest

    monkeypatch.setattr(conftest, "_REAP_GRACE_S", 0.2)
    before, children = set(threading.enumerate()), conftest._children()
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        ended_pid = ended.pid
        import os

        os.waitid(os.P_PID, ended_pid, os.WEXITED | os.WNOWAIT)  # ended, not reaped
        found = leftovers(before, children)
        assert any(f"child process {running.pid}" in f and "still running" in f for f in found), found
        assert f"child process {ended_pid} ended and was never reaped (a zombie)" in found, found
    finally:
        running.kill()
        running.wait()
        ended.wait()
    assert leftovers(before, children) == []


def test_the_leftover_check_names_and_ends_a_process_group(tmp_path):
    before, children = set(threading.enumerate()), set()
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    assert leftovers(before, children) == ["a process group is still initialised in the test process"]
    assert not torch.distributed.is_initialized()
