"""A base loaded in 4 bits by bitsandbytes (the Hugging Face QLoRA tutorial's path), trained and refused as a user's
script runs it: ``python bitsandbytes_qlora.py OUT SITE ROOT``. SITE holds bitsandbytes: the Makefile installs it
there, outside the test environment, because peft imports bitsandbytes whenever it can, which would cost seconds in
every other process of the suite that imports peft. ROOT is this repository. Run by
``tests/integration/test_quantization.py``, which asserts on what this writes into OUT:

* ``start.pt``, ``one.pt``, ``ddp0.pt``, ``ddp1.pt``, ``half.pt``: the adapters as built, after one process on the
  global batch, after each of 2 ``mgpu_ddp`` ranks (forked) on half of it, and after one process on half of it (the
  negative control);
* ``base.json``: the weights bitsandbytes quantized and their classes;
* ``refused.json``: per FSDP2 layout (``zero2``, ``hsdp``), the refusal's message (``null`` where it trained);
* ``auto.json``: the strategy ``mgpu_auto`` became, and why.

bitsandbytes computes its 4-bit layers in float32 at most on the CPU (float64 gives NaN), so this runs in float32.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

OUT, SITE, ROOT = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
sys.path[:0] = [SITE, ROOT]  # bitsandbytes, then the repository (tests.*)

import pytorch_lightning as pl  # noqa: E402
import torch  # noqa: E402

from lightning_mgpu import MGPUAutoStrategy, MGPUDDPStrategy, MGPUShardedStrategy  # noqa: E402
from lightning_mgpu.quantization import bitsandbytes_weights  # noqa: E402
from tests.helpers import fit  # noqa: E402
from tests.integration.test_quantization import GLOBAL, SEQ, VOCAB, tokens  # noqa: E402


def gpt2_folder() -> str:
    """A tiny random GPT-2 saved as a pretrained folder (no dropout: ranks and one process draw no random numbers)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2, n_head=2, n_embd=64, vocab_size=VOCAB, n_positions=SEQ, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    folder = tempfile.mkdtemp()
    GPT2LMHeadModel(config).save_pretrained(folder)
    return folder


FOLDER = gpt2_folder()


class BitsAndBytesQLoRA(pl.LightningModule):
    """As the Hugging Face tutorial writes it: ``from_pretrained`` with ``BitsAndBytesConfig(load_in_4bit=True)``
    (NF4), then peft's LoRA on the attention and MLP input projections."""

    def __init__(self) -> None:
        super().__init__()
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM, BitsAndBytesConfig

        quantization = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32
        )
        base = AutoModelForCausalLM.from_pretrained(
            FOLDER, quantization_config=quantization, device_map="cpu", dtype=torch.float32
        )
        torch.manual_seed(100)  # random adapters, B included: every adapter matrix moves from the first step
        lora = LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["c_attn", "c_fc"], init_lora_weights=False
        )
        self.model = get_peft_model(base, lora)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, _ = batch
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0)


def adapters(strategy: Any, name: str, devices: int, batch: int) -> list[dict[str, torch.Tensor]]:
    ranks = fit(BitsAndBytesQLoRA(), strategy, OUT / name, dataset=tokens(), batch_size=batch, devices=devices)
    return [{k: v for k, v in rank["state"].items() if "lora_" in k} for rank in ranks]


def main() -> None:
    torch.set_num_threads(1)  # the ranks are forked from this process (OpenMP is not fork-safe)
    model = BitsAndBytesQLoRA()
    quantized = bitsandbytes_weights(model)
    start = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    kinds = sorted({type(model.get_parameter(n)).__name__ for n in quantized})
    (OUT / "base.json").write_text(json.dumps({"quantized": quantized, "kinds": kinds}))
    torch.save(start, OUT / "start.pt")
    torch.save(adapters("auto", "one", 1, GLOBAL)[0], OUT / "one.pt")
    for rank, state in enumerate(adapters(MGPUDDPStrategy(start_method="fork"), "ddp", 2, GLOBAL // 2)):
        torch.save(state, OUT / f"ddp{rank}.pt")
    torch.save(adapters("auto", "half", 1, GLOBAL // 2)[0], OUT / "half.pt")
    refused: dict[str, Any] = {}
    for name, strategy in {
        "zero2": MGPUShardedStrategy(stage=2, start_method="fork"),
        "hsdp": MGPUShardedStrategy(stage=3, mesh="hybrid", shard_size=1, start_method="fork"),
    }.items():
        trainer = pl.Trainer(
            strategy=strategy, accelerator="cpu", devices=2, max_steps=1, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        try:
            trainer.fit(BitsAndBytesQLoRA(), torch.utils.data.DataLoader(tokens(), batch_size=4))
            refused[name] = None
        except ValueError as err:
            refused[name] = str(err)
    (OUT / "refused.json").write_text(json.dumps(refused))
    # mgpu_auto: no plan for such a base, and the one strategy that trains it, with the reason
    auto = MGPUAutoStrategy(start_method="fork")
    trainer = pl.Trainer(
        strategy=auto, accelerator="cpu", devices=2, max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(BitsAndBytesQLoRA(), torch.utils.data.DataLoader(tokens(), batch_size=4))
    decision = trainer.strategy.auto_decision  # sent back from the ranks
    chosen = {"strategy": decision.strategy, "reason": decision.reason}
    (OUT / "auto.json").write_text(json.dumps(chosen))


if __name__ == "__main__":
    main()
