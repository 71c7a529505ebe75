"""A new user's first hour, from the installed wheel (`make test-install`, run by .ci/test-install with the fresh
virtual environment's interpreter): a module written the way a tutorial writes one, in a folder of its own (its
datasets kept as attributes, `import lightning as L` or `import pytorch_lightning as pl`), then

1. a script: `Trainer(strategy="mgpu_ddp", devices=2)`, fit and test, the ledger printed once; then the README's
   example of the namespace, as written;
2. the command with a config written as the docs write it (`lightning_mgpu.DeviceMonitor`, `lightning_mgpu.
   MGPUDDPStrategy`, `pytorch_lightning.callbacks.ModelCheckpoint`, whatever the module's namespace);
3. a notebook (nbclient, a Jupyter kernel) with `mgpu_ddp_notebook`;
4. `lightning-mgpu plan --config`;
5. `mgpu_auto` from a script.

Each check asserts on what the user sees: exit code 0, no traceback, no warning that the pack causes (one naming a
file of the pack, or a message the pack is known to have caused), and the numbers (test accuracy, the logged
value's dtype, the ledger printed once). Usage: `python first_hour.py lightning|pytorch_lightning WORKDIR`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

MODULE = '''
"""A user's module, as tutorials write one: the data made in __init__ and kept as attributes."""
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

{import_line}


def make_split(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, (x.sum(dim=1) > 0).long())


class UserModel({base}.LightningModule):
    def __init__(self, hidden: int = 32, lr: float = 0.05):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 2))
        self.train_ds = make_split(512, 0)
        self.test_ds = make_split(203, 1)  # divides by neither the world size nor the batch size

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_acc", (self(x).argmax(dim=1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(self.train_ds, batch_size=32, shuffle=True)

    def test_dataloader(self):
        return DataLoader(self.test_ds, batch_size=32)
'''

SCRIPT = """
import sys
{import_line}
import lightning_mgpu  # registers the presets

from usermodule import UserModel

strategy = sys.argv[1] if len(sys.argv) > 1 else "mgpu_ddp"
trainer = {base}.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=4, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
model = UserModel()
trainer.fit(model)
result = trainer.test(model, verbose=False)
if trainer.is_global_zero:
    print("test_acc", round(float(result[0]["test_acc"]), 4), "dtype", trainer.callback_metrics["test_acc"].dtype)
    print("strategy", type(trainer.strategy).__name__)
    print("ledger", trainer.strategy.comm_stats.summary())
"""

CONFIG = """
model:
  class_path: usermodule.UserModel
trainer:
  accelerator: cpu
  devices: 2
  max_epochs: 2
  logger: false
  enable_progress_bar: false
  strategy:
    class_path: lightning_mgpu.MGPUDDPStrategy
    init_args: {comm_hook: fp16}
  callbacks:
    - class_path: lightning_mgpu.DeviceMonitor
    - class_path: pytorch_lightning.callbacks.ModelCheckpoint
      init_args: {dirpath: checkpoints, save_last: true}
"""

NOTEBOOK_CELLS = [
    "{import_line}\nimport lightning_mgpu\nfrom usermodule import UserModel",
    (
        'trainer = {base}.Trainer(accelerator="cpu", devices=2, strategy="mgpu_ddp_notebook", max_epochs=4,\n'
        "                     logger=False, enable_checkpointing=False, enable_progress_bar=False)\n"
        "model = UserModel()\ntrainer.fit(model)\nresult = trainer.test(model, verbose=False)\n"
        'print("notebook test_acc", round(result[0]["test_acc"], 4))'
    ),
]

# warnings the pack caused or let every rank print before (each fixed); a warning printed from a file of the pack is
# caught by its path
PACK_WARNINGS = ("replicates some samples", "`isinstance(treespec, LeafSpec)` is deprecated")
MIN_ACCURACY = 0.85


def fail(what: str, text: str) -> None:
    print(text[-6000:])
    print(f"first-hour check failed: {what}", file=sys.stderr)
    sys.exit(1)


def check_output(name: str, text: str) -> None:
    if "Traceback (most recent call last)" in text:
        fail(f"{name}: a traceback", text)
    for line in text.splitlines():
        if re.search(r"lightning_mgpu[/\\][\w/\\]+\.py:\d+: \w*Warning", line) or any(w in line for w in PACK_WARNINGS):
            fail(f"{name}: a warning the pack causes: {line.strip()}", text)


def accuracy(name: str, text: str, label: str) -> float:
    found = re.search(rf"{label} ([0-9.]+)", text)
    if found is None:
        fail(f"{name}: no '{label}' line", text)
    value = float(found.group(1))  # type: ignore[union-attr]
    if value < MIN_ACCURACY:
        fail(f"{name}: {label} {value} < {MIN_ACCURACY}", text)
    return value


def readme_example(namespace: str) -> str:
    """The README's example for ``namespace`` (its ```python block that starts with the namespace's import)."""
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    first = "import lightning as L\n" if namespace == "lightning" else "import pytorch_lightning as pl\n"
    examples = [b for b in re.findall(r"^```python\n(.*?)^```", text, re.M | re.S) if b.startswith(first)]
    if len(examples) != 1:
        fail(f"README: {len(examples)} examples start with {first.strip()!r}, expected 1", text)
    return examples[0]


def run(name: str, cmd: list[str], cwd: Path, timeout: float = 600) -> str:
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    text = proc.stdout + proc.stderr
    if proc.returncode != 0:
        fail(f"{name}: exit code {proc.returncode}", text)
    check_output(name, text)
    print(f"[first hour] {name}: ok in {time.monotonic() - start:.0f} s")
    return text


def main() -> None:
    namespace, work = sys.argv[1], Path(sys.argv[2])
    import_line, base = (
        ("import lightning as L", "L") if namespace == "lightning" else ("import pytorch_lightning as pl", "pl")
    )
    folder = work / f"first_hour_{namespace}"
    folder.mkdir(parents=True)
    (folder / "usermodule.py").write_text(MODULE.format(import_line=import_line, base=base))
    (folder / "train.py").write_text(SCRIPT.format(import_line=import_line, base=base))
    (folder / "cfg.yaml").write_text(CONFIG)
    python = sys.executable
    command = str(Path(python).parent / "lightning-mgpu")

    out = run("script, mgpu_ddp", [python, "train.py"], folder)
    acc = accuracy("script", out, "test_acc")
    if "dtype torch.float32" not in out:
        fail("script: the logged test_acc is not float32 (plain Lightning's dtype)", out)
    if out.count("ledger ") != 1:
        fail("script: the ledger is not printed once", out)
    print(f"[first hour] script: test_acc {acc}, float32, one ledger line")

    (folder / "readme_example.py").write_text(readme_example(namespace))
    run(f"the README's {import_line} example", [python, "readme_example.py"], folder)

    out = run("lightning-mgpu fit --config cfg.yaml", [command, "fit", "--config", "cfg.yaml"], folder)
    if "lightning-mgpu fit: MGPUDDPStrategy on 2 process(es)" not in out:
        fail("cli: no fit summary", out)
    if not (folder / "checkpoints" / "last.ckpt").is_file():
        fail("cli: no checkpoint from the config's ModelCheckpoint", out)

    out = run(
        "lightning-mgpu plan --config cfg.yaml",
        [command, "plan", "--config", "cfg.yaml", "--devices", "2", "--device-memory", "1GiB"],
        folder,
    )
    if (
        "Recommended: mgpu_ddp 2," not in out
        or "Trainer(strategy='mgpu_ddp'" not in out
        or "usermodule.UserModel" not in out
    ):
        fail("plan: no recommendation for the user's class", out)

    notebook(folder, import_line, base)

    # mgpu_auto plans on the module at set-up (this module keeps its datasets as attributes)
    out = run("script, mgpu_auto", [python, "train.py", "mgpu_auto"], folder)
    acc = accuracy("mgpu_auto", out, "test_acc")
    print(f"[first hour] mgpu_auto: test_acc {acc}")


def notebook(folder: Path, import_line: str, base: str) -> None:
    import nbformat
    from nbclient import NotebookClient

    start = time.monotonic()
    cells = [
        nbformat.v4.new_code_cell(textwrap.dedent(c.format(import_line=import_line, base=base))) for c in NOTEBOOK_CELLS
    ]
    nb = nbformat.v4.new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    env_path = os.environ.get("PATH", "")
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env_path}"  # the kernel of this environment
    try:
        NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(folder)}}).execute()
    except Exception as error:  # a cell raised: its traceback is in the error
        fail(f"notebook: {type(error).__name__}", str(error))
    text = ""
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            text += output.get("text", "") + "\n".join(output.get("traceback", [])) + json.dumps(output.get("data", {}))
    check_output("notebook", text)
    acc = accuracy("notebook", text, "notebook test_acc")
    print(f"[first hour] notebook, mgpu_ddp_notebook: ok in {time.monotonic() - start:.0f} s, test_acc {acc}")


if __name__ == "__main__":
    main()
