"""strategies/runtime.py, what every rank does at set-up, seen as users see it: a script run on 2 processes (the popen
launch: rank 0 is the script, rank 1 runs it again), its stderr holding what every rank printed."""

from __future__ import annotations

import re
import sys
from collections import Counter
from pathlib import Path

import pytest

from tests.helpers import run_isolated

ROOT = Path(__file__).resolve().parents[3]

SCRIPT = """
import sys
sys.path.insert(0, {root!r})
import pytorch_lightning as pl
from lightning_mgpu.examples import DigitsCNN, DigitsDataModule

trainer = pl.Trainer(accelerator="cpu", devices=2, strategy={strategy!r}, max_steps=2, limit_val_batches=2,
                     logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
model, data = DigitsCNN(), DigitsDataModule()
trainer.fit(model, data)
trainer.validate(model, data, verbose=False)
"""


@pytest.mark.timeout(300)
def test_no_warning_is_printed_once_per_rank(tmp_path):
    """Each warning printed (``file.py:line: message``) appears once in the job's output, whichever ranks ran into
    it. Before, Lightning's ``LeafSpec()`` under torch 2.13 printed its FutureWarning in every rank, and twice in each
    (train and val loaders: the pack's change of the warning filters in between made it print again)."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(root=str(ROOT), strategy="mgpu_zero3"))
    proc, leftovers = run_isolated([sys.executable, str(script)], timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not leftovers
    assert "`Trainer.fit` stopped: `max_steps=2` reached" in proc.stderr  # both ranks ran: rank 1's stderr is here
    printed = Counter(line for line in proc.stderr.splitlines() if re.match(r"\S+\.py:\d+: ", line))
    assert [line for line, n in printed.items() if n > 1] == []
    assert "LeafSpec" not in proc.stderr  # Lightning's call no longer builds the deprecated class
