"""parts/ddp.py: DDP wrapping, comm hooks, the static-graph switch and the buffer broadcast."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_mgpu.ledger import Ledger
from lightning_mgpu.parts.ddp import DDPWrapping
from lightning_mgpu.settings import DDPSettings
from tests.parts_harness import in_one_rank_group


def _hooks() -> None:
    ddp = DistributedDataParallel(nn.Linear(2, 2), gradient_as_bucket_view=True)
    ledger = Ledger()
    assert DDPWrapping(DDPSettings()).register_hooks(ddp, ledger, manual=False) is None  # counted from buckets
    assert DDPWrapping(DDPSettings(comm_hook="fp16")).register_hooks(ddp, ledger, manual=True) is None
    DDPWrapping(DDPSettings(comm_hook="fp16")).register_hooks(ddp, ledger, manual=False)
    ddp(torch.ones(1, 2)).sum().backward()
    assert ledger.stats.allreduce_calls == 1  # the hook counted the one bucket


def test_a_hook_is_registered_only_where_the_ledger_cannot_count_from_buckets():
    in_one_rank_group(_hooks)


def _static_graph() -> None:
    ddp = DistributedDataParallel(nn.Linear(2, 2))
    wrapping = DDPWrapping(DDPSettings(static_graph=True))
    with ddp.no_sync():
        wrapping.before_training_step(ddp)  # a micro-batch that does not sync: still normal mode
    assert not ddp.static_graph
    wrapping.before_training_step(ddp)  # the first synchronised forward
    assert ddp.static_graph
    plain = DistributedDataParallel(nn.Linear(2, 2))
    DDPWrapping(DDPSettings()).before_training_step(plain)
    assert not plain.static_graph


def test_static_graph_is_switched_on_at_the_first_synchronised_forward_only():
    in_one_rank_group(_static_graph)


class _Built(Exception):
    """Raised where DistributedDataParallel would be built: what happened before it is what counts."""


def _record_streams(monkeypatch: Any, *modules: Any) -> tuple[list[str], list[dict[str, Any]]]:
    """CUDA streams made or entered (``made``) and the keywords DistributedDataParallel is built with (``built``;
    the build raises ``_Built``), recorded without a GPU in ``torch.cuda`` and the given modules."""
    made: list[str] = []
    built: list[dict[str, Any]] = []

    class _Stream:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            made.append("Stream")

    def _enter(stream: Any) -> nullcontext[None]:
        made.append("stream")
        return nullcontext()

    def _ddp(**kwargs: Any) -> None:
        built.append(kwargs)
        raise _Built

    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "stream", _enter)
    for module in modules:
        monkeypatch.setattr(module, "DistributedDataParallel", _ddp)
    return made, built


def test_ddp_is_built_on_the_current_stream_not_a_side_stream(monkeypatch):
    """On CUDA, DDP built in a side stream owns gradient accumulators of that stream, and torch >= 2.10 warns
    "AccumulateGrad node's stream does not match" on every backward (the GPU tier's ``stream_warning`` case checks the
    warning itself). Here, without a GPU: ``wrap`` for a CUDA device creates no stream and enters none; the negative
    control shows that the recorder sees a side stream when one is made."""
    import pytest

    import lightning_mgpu.parts.ddp as ddp_part

    made, built = _record_streams(monkeypatch, ddp_part)
    with pytest.raises(_Built):
        DDPWrapping(DDPSettings()).wrap(nn.Linear(2, 2), torch.device("cuda", 3))
    assert built[0]["device_ids"] == [3] and made == []
    torch.cuda.stream(torch.cuda.Stream())  # negative control: the recorder sees a side stream
    assert made == ["Stream", "stream"]


def test_mgpu_ddp_builds_its_ddp_on_the_current_stream_where_lightning_builds_it_on_a_side_stream(monkeypatch):
    """``MGPUDDPStrategy`` derives from Lightning's ``DDPStrategy``, whose ``configure_ddp`` builds the wrapper with
    ``_setup_model`` inside ``torch.cuda.stream(torch.cuda.Stream())`` (Lightning 2.6): on CUDA the one "AccumulateGrad
    node's stream does not match" warning per fit the GPU tier saw. The strategy's ``configure_ddp`` builds it through
    the DDP part (``DDPWrapping.wrap``) instead, for a CUDA device too; Lightning's own strategy is the negative
    control."""
    import pytest
    import pytorch_lightning as pl
    import pytorch_lightning.strategies.ddp as lightning_ddp

    import lightning_mgpu.parts.ddp as ddp_part
    from lightning_mgpu import MGPUDDPStrategy

    class _Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(2, 2)

    made, built = _record_streams(monkeypatch, ddp_part, lightning_ddp)
    cuda = [torch.device("cuda", 3)]
    ours = MGPUDDPStrategy(parallel_devices=cuda)
    ours.model = _Module()
    with pytest.raises(_Built):
        ours.configure_ddp()
    assert made == [] and built[0]["device_ids"] == [3] and built[0]["gradient_as_bucket_view"] is True
    lightnings = lightning_ddp.DDPStrategy(parallel_devices=cuda)
    lightnings.model = _Module()
    with pytest.raises(_Built):
        lightnings.configure_ddp()
    assert made == ["Stream", "stream"]  # negative control: Lightning's builds it in a side stream


def test_a_4bit_base_is_left_out_of_ddp_which_would_corrupt_it() -> None:
    """torch's DDP broadcasts the module's state at construction through a flat copy that writes through torchao's
    ``NF4Tensor`` and corrupts its packed bytes (on every rank, in a one-rank group too): the negative control. The DDP
    part leaves the 4-bit weights out of DDP and broadcasts their plain parts itself; the dequantised base is then
    bit for bit the one built."""

    def body() -> None:
        from lightning_mgpu.quantization import dequantized, quantize_frozen

        def model() -> nn.Module:
            torch.manual_seed(0)
            built = nn.Sequential(nn.Linear(128, 256, bias=False), nn.Linear(256, 4)).double()
            built[0].requires_grad_(False)
            quantize_frozen(built, scaler_block_size=64)
            return built

        plain = model()
        before = dequantized(plain[0].weight).clone()
        DistributedDataParallel(plain)  # torch alone
        assert not torch.equal(dequantized(plain[0].weight), before)
        ours = model()
        DDPWrapping(DDPSettings()).wrap(ours, torch.device("cpu"))
        assert torch.equal(dequantized(ours[0].weight), before)

    in_one_rank_group(body)
