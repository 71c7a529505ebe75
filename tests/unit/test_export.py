"""The export in one process: the streamed safetensors and torch.save writers against the libraries' own readers
(every dtype, a 0-d and an empty tensor), a checkpoint without a recorded configuration (``--config``,
``--prefix``), and the refusals, each naming the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lightning_mgpu.export import _Tensor, export_checkpoint, main, write_safetensors, write_torch

TENSORS = {
    "a.weight": torch.randn(3, 5, dtype=torch.float64),
    "b": torch.randn(7).to(torch.bfloat16),
    "c": torch.tensor(3.5, dtype=torch.float16),
    "d": torch.arange(6, dtype=torch.int64).reshape(2, 3),
    "e": torch.tensor([True, False, True]),
    "f": torch.empty(0, 4),
    "g": torch.randn(4, 4).t(),  # not contiguous
}


def _entries(tensors: dict[str, torch.Tensor]) -> dict[str, _Tensor]:
    return {n: _Tensor(t.dtype, tuple(t.shape), (lambda t=t: t)) for n, t in tensors.items()}


def test_streamed_safetensors_reads_back_bit_for_bit(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    write_safetensors(tmp_path / "m.safetensors", _entries(TENSORS))
    loaded = load_file(tmp_path / "m.safetensors")
    assert sorted(loaded) == sorted(TENSORS)
    for name, t in TENSORS.items():
        assert loaded[name].dtype == t.dtype and torch.equal(loaded[name], t), name
    with pytest.raises(AssertionError):  # negative control: a changed tensor is seen
        torch.testing.assert_close(loaded["a.weight"], TENSORS["a.weight"] + 1e-12, rtol=0, atol=0)


def test_torch_file_laid_out_then_filled_reads_back_bit_for_bit(tmp_path: Path) -> None:
    write_torch(tmp_path / "w.pt", _entries(TENSORS))
    loaded = torch.load(tmp_path / "w.pt", weights_only=True)
    torch.testing.assert_close(loaded, TENSORS, rtol=0, atol=0)


def _plain_checkpoint(tmp_path: Path, **extra: object) -> Path:
    path = tmp_path / "plain.ckpt"
    state = {"net.lin.weight": torch.randn(2, 2), "net.lin.bias": torch.randn(2), "head.w": torch.randn(1)}
    torch.save({"state_dict": state, "epoch": 1, **extra}, path)
    return path


def test_a_checkpoint_without_a_recorded_config_takes_config_and_prefix(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    path = _plain_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="Pass --config"):
        export_checkpoint(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing half-written is left
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "toy"}))
    assert main([str(path), "--format", "hf", str(tmp_path / "out"), "--config", str(tmp_path), "--prefix", "net"]) == 0
    assert sorted(load_file(tmp_path / "out" / "model.safetensors")) == ["lin.bias", "lin.weight"]
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == {"model_type": "toy", "dtype": "float32"}


@pytest.mark.parametrize(
    ("kwargs", "error", "fragments"),
    [
        ({"ema": True}, ValueError, ["no EMA average", "lightning_mgpu.EMA"]),
        ({"prefix": "model", "format": "torch"}, ValueError, ["prefix 'model'", "['head', 'net']", "--prefix"]),
        ({"format": "onnx"}, ValueError, ["format='onnx'", "'hf'", "'torch'"]),
        ({"dtype": "int8"}, ValueError, ["dtype='int8'", "bfloat16", "as saved"]),
    ],
    ids=["ema-without-average", "unknown-prefix", "unknown-format", "unknown-dtype"],
)
def test_refusals_name_the_fix(tmp_path: Path, kwargs: dict, error: type, fragments: list[str]) -> None:
    path = _plain_checkpoint(tmp_path)
    with pytest.raises(error) as raised:
        export_checkpoint(path, tmp_path / "out", **kwargs)
    for fragment in fragments:
        assert fragment in str(raised.value)


def test_never_overwrites(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _plain_checkpoint(tmp_path)
    (tmp_path / "out.pt").write_text("mine")
    with pytest.raises(SystemExit) as raised:
        main([str(path), "--format", "torch", str(tmp_path / "out.pt")])
    assert raised.value.code == 2 and "never overwrites" in capsys.readouterr().err
    assert (tmp_path / "out.pt").read_text() == "mine"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        export_checkpoint(tmp_path / "missing.ckpt", tmp_path / "x")


def _lora_checkpoint(tmp_path: Path, **adapter: object) -> tuple[Path, dict[str, torch.Tensor]]:
    from lightning_mgpu.export import HF_MODELS_KEY

    root = "model.base_model.model.lin"
    state = {
        f"{root}.base_layer.weight": torch.randn(3, 4, dtype=torch.float64),
        f"{root}.base_layer.bias": torch.randn(3, dtype=torch.float64),
        f"{root}.lora_A.default.weight": torch.randn(2, 4, dtype=torch.float64),
        f"{root}.lora_B.default.weight": torch.randn(3, 2, dtype=torch.float64),
    }
    config = {"peft_type": "LORA", "r": 2, "lora_alpha": 6, "fan_in_fan_out": False, **adapter}
    record = {"class": "Toy", "config": json.dumps({"model_type": "toy"}), "peft": json.dumps({"default": config})}
    path = tmp_path / "lora.ckpt"
    torch.save({"state_dict": state, HF_MODELS_KEY: {"model": record}}, path)
    return path, state


def test_lora_merge_is_w_plus_scaled_b_times_a(tmp_path: Path) -> None:
    path, state = _lora_checkpoint(tmp_path)
    export_checkpoint(path, tmp_path / "merged.pt", format="torch")
    merged = torch.load(tmp_path / "merged.pt", weights_only=True)
    root = "model.base_model.model.lin"
    w, a, b = (state[f"{root}.{k}.weight"] for k in ("base_layer", "lora_A.default", "lora_B.default"))
    assert sorted(merged) == ["lin.bias", "lin.weight"]
    torch.testing.assert_close(merged["lin.weight"], w + (b @ a) * (6 / 2))
    with pytest.raises(AssertionError):  # negative control: the base alone is told apart
        torch.testing.assert_close(merged["lin.weight"], w)


@pytest.mark.parametrize(
    ("adapter", "kwargs", "fragments"),
    [
        ({"use_dora": True}, {}, ["use_dora", "--adapters peft"]),
        ({}, {"adapters": "peft", "format": "torch"}, ["adapters='peft'", "format='hf'"]),
        ({}, {"adapters": "unmerged"}, ["adapters='unmerged'", "'merge'", "'peft'"]),
    ],
    ids=["dora-is-not-merged", "adapter-folder-needs-hf", "unknown-adapters"],
)
def test_adapter_refusals_name_the_fix(tmp_path: Path, adapter: dict, kwargs: dict, fragments: list[str]) -> None:
    path, _ = _lora_checkpoint(tmp_path, **adapter)
    with pytest.raises(ValueError) as raised:
        export_checkpoint(path, tmp_path / "out", **kwargs)
    for fragment in fragments:
        assert fragment in str(raised.value)


def test_a_configuration_that_cannot_be_written_never_fails_a_save(caplog: pytest.LogCaptureFixture) -> None:
    from torch import nn

    from lightning_mgpu.export import hf_models

    class Broken:
        def to_json_string(self) -> str:
            raise TypeError("not serialisable")

    class Model(nn.Linear):
        config = Broken()

        def save_pretrained(self, folder: str) -> None: ...

    holder = nn.Module()
    holder.model = Model(2, 2)
    assert hf_models(holder) == {}
    assert "is not recorded for export" in caplog.text and "not serialisable" in caplog.text


def _adapter_only_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    """A checkpoint as ``checkpoint_params="trainable"`` saves it, of the LoRA GPT-2 (its base built from a config,
    so peft records no base name) with "trained" adapters; returns them."""
    from lightning_mgpu.export import record_hf_models
    from lightning_mgpu.parts.trainable_state import KEY
    from tests.corpus import LoRAGPT2

    module = LoRAGPT2()
    with torch.no_grad():  # "trained" adapters: unlike any fresh initialisation
        for p in module.model.parameters():
            if p.requires_grad:
                p.add_(0.5)
    trainable = {f"model.{n}": p.detach().clone() for n, p in module.model.named_parameters() if p.requires_grad}
    checkpoint: dict = {"state_dict": trainable, KEY: {"frozen": {}}}
    record_hf_models(checkpoint, module)
    torch.save(checkpoint, path)
    return trainable


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """Every attempt to resolve or reach a host is recorded and refused (no download, no retry can happen)."""
    import socket

    attempts: list[tuple] = []

    def refuse(*args: object, **kwargs: object) -> None:
        attempts.append(args[:2])
        raise OSError("no network in this test")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    return attempts


def test_an_adapter_only_checkpoint_exports_its_peft_adapter_folder_alone(tmp_path: Path) -> None:
    from peft import PeftModel

    from tests.corpus import HFGPT2, LoRAGPT2

    trainable = _adapter_only_checkpoint(tmp_path / "adapters.ckpt")
    assert main([str(tmp_path / "adapters.ckpt"), "--format", "hf", str(tmp_path / "out"), "--adapters", "peft"]) == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    loaded = PeftModel.from_pretrained(HFGPT2().model, tmp_path / "out")  # onto the base, as the user loads it
    lora = {f"model.{n}": v for n, v in loaded.state_dict().items() if ".lora_" in n}
    assert sorted(lora) == sorted(trainable)
    torch.testing.assert_close(lora, trainable, rtol=0, atol=0)
    fresh = {f"model.{n}": p.detach() for n, p in LoRAGPT2().model.named_parameters() if p.requires_grad}
    with pytest.raises(AssertionError):  # negative control: the untrained adapters are told apart
        torch.testing.assert_close(lora, fresh)
    # a merged model or a torch file needs the base, which the checkpoint does not hold
    for kwargs in ({"adapters": "merge"}, {"adapters": "peft", "format": "torch"}):
        with pytest.raises(ValueError, match=r"adapter-only checkpoint.*--adapters peft --format hf"):
            export_checkpoint(tmp_path / "adapters.ckpt", tmp_path / "refused", **kwargs)
        assert not (tmp_path / "refused").exists()


def test_an_adapter_folder_without_its_base_fails_at_once_in_automodel_naming_the_documented_call(
    tmp_path: Path, no_network: list[tuple]
) -> None:
    """``AutoModelForCausalLM.from_pretrained(DIR)`` loads the base named in adapter_config.json: unknown (None), it
    asked the Hub for a model called "None", retrying; now it fails before any network call, naming the call that
    loads the folder, which works (the documented one)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from lightning_mgpu.export import BASE_NOT_RECORDED
    from tests.corpus import HFGPT2

    trainable = _adapter_only_checkpoint(tmp_path / "adapters.ckpt")
    export_checkpoint(tmp_path / "adapters.ckpt", tmp_path / "out", adapters="peft")
    written = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert written["base_model_name_or_path"] == BASE_NOT_RECORDED
    with pytest.raises(OSError) as raised:
        AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert "PeftModel.from_pretrained(base_model, this folder)" in str(raised.value)
    assert "--base-model" in str(raised.value)
    assert no_network == []  # failed at once: no host was even looked up
    loaded = PeftModel.from_pretrained(HFGPT2().model, tmp_path / "out")  # the documented loading
    lora = {f"model.{n}": v for n, v in loaded.state_dict().items() if ".lora_" in n}
    torch.testing.assert_close(lora, trainable, rtol=0, atol=0)
    assert no_network == []


def test_an_adapter_folder_with_its_base_named_loads_with_automodel(tmp_path: Path, no_network: list[tuple]) -> None:
    """``--base-model`` (a local folder here, a Hub name in practice) makes
    ``AutoModelForCausalLM.from_pretrained(DIR)`` load that base and attach the adapter; peft's own record of the
    base, when it has one, is written likewise."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from lightning_mgpu.export import record_hf_models
    from lightning_mgpu.parts.trainable_state import KEY
    from tests.corpus import HFGPT2

    HFGPT2().model.save_pretrained(tmp_path / "base")  # the base LoRAGPT2 adapts
    trainable = _adapter_only_checkpoint(tmp_path / "adapters.ckpt")
    assert main([str(tmp_path / "adapters.ckpt"), str(tmp_path / "out"), "--adapters", "peft", "--base-model",
                 str(tmp_path / "base")]) == 0  # fmt: skip
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    lora = {f"model.base_model.model.{n}": v for n, v in loaded.state_dict().items() if ".lora_" in n}
    torch.testing.assert_close(lora, trainable, rtol=0, atol=0)
    # a base loaded with from_pretrained: peft recorded its name, and the export keeps it
    module = torch.nn.Module()
    module.model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tmp_path / "base"), LoraConfig(r=2, target_modules=["c_attn"])
    )
    state = {f"model.{n}": p.detach() for n, p in module.model.named_parameters() if p.requires_grad}
    checkpoint: dict = {"state_dict": state, KEY: {"frozen": {}}}
    record_hf_models(checkpoint, module)
    torch.save(checkpoint, tmp_path / "recorded.ckpt")
    export_checkpoint(tmp_path / "recorded.ckpt", tmp_path / "recorded", adapters="peft")
    written = json.loads((tmp_path / "recorded" / "adapter_config.json").read_text())
    assert written["base_model_name_or_path"] == str(tmp_path / "base")
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path / "recorded")).__name__ == "GPT2LMHeadModel"
    assert no_network == []
    full, _ = _lora_checkpoint(tmp_path)  # merged, there is no adapter folder to name the base in
    with pytest.raises(ValueError, match=r"base_model='gpt2' names the base of a peft adapter folder.*--adapters peft"):
        export_checkpoint(full, tmp_path / "merged", base_model="gpt2")
    assert not (tmp_path / "merged").exists()
