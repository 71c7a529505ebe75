"""The shipped GAN sample, run as users run it: the README command with configs/gan.yaml (LightningCLI,
mgpu_ddp on 2 CPU processes, accumulate_grad_batches=4, manual optimization with two optimizers)."""

from __future__ import annotations

import math

import pytest

from tests.helpers import run_sample_config


@pytest.mark.slow
def test_gan_config_trains_with_accumulation_and_one_sync_per_optimizer_step(tmp_path):
    stdout = run_sample_config("gan", "gan.yaml", tmp_path)
    summary = stdout.split("test MMD^2 generated vs held-out digits: ")[1]
    trained = float(summary.split()[0])
    untrained = float(summary.split(", ")[1].split()[0])
    assert trained < 0.5 * untrained, summary  # measured: 0.29 vs 0.77
    ledger = stdout.split("comm ledger (rank 0): ")[1]
    # one all-reduce round per optimizer step (2 optimizers, 1 bucket each), nothing on the other micro-batches
    rounds = int(ledger.split("sync rounds ")[1].split(",")[0])
    steps = int(ledger.split("optimizer steps ")[1].split(";")[0])
    per_rank = math.ceil((1797 - 200 - 400) / 2)  # training images (config's val/test sizes), 2 ranks
    windows_per_epoch = math.ceil(math.ceil(per_rank / 16) / 4)  # batch 16, accumulate_grad_batches=4
    assert rounds == steps == 2 * windows_per_epoch * 40
