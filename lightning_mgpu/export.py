"""Export a checkpoint of the pack for the rest of the ecosystem: a Hugging Face folder (``config.json`` and
``model.safetensors``, which ``AutoModel...from_pretrained`` loads) or one ``torch.save`` file of the weights.

    lightning-mgpu export CHECKPOINT --format hf DIR        # a folder for from_pretrained
    lightning-mgpu export CHECKPOINT --format torch FILE    # one torch.save file: {name: tensor}
    lightning-mgpu export CHECKPOINT --format hf DIR --ema  # the EMA callback's average instead of the weights

It reads every layout the pack writes: a one-file checkpoint (every ``mgpu_*`` strategy, ``checkpoint=
"consolidated"``) and a sharded directory (``MGPUShardedStrategy(checkpoint="sharded")``, saved at any world size
or mesh shape): the whole tensors are read back from the shards, one tensor at a time. Nothing is held whole: a
file is memory-mapped, a directory read tensor by tensor, and the output is written tensor by tensor (the
safetensors header first, from the shapes; a ``torch.save`` file is laid out first and filled in place), so the
memory it takes is about one tensor, whatever the model's size.

Where the configuration comes from: every ``mgpu_*`` strategy records, in each checkpoint it writes, the
configuration and class of every Hugging Face model the LightningModule holds (a module with ``save_pretrained``
and a ``config``), under the attribute path that holds it (``"model"`` for ``self.model = AutoModelFor...``). The
export writes that configuration and strips that attribute path from the weights' names, so the names are the
model's own. A checkpoint without it (another strategy's, or a model not built from transformers) needs
``--config`` (a ``config.json`` or the folder holding one) and ``--prefix`` (the attribute path, ``""`` for none).
The export itself needs neither transformers nor the LightningModule's code.

Example::

    from lightning_mgpu import export_checkpoint

    export_checkpoint("last.ckpt", "hf_model", format="hf")  # then AutoModelForCausalLM.from_pretrained("hf_model")
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import mmap
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Union, cast

import torch
from torch import nn

from lightning_mgpu._compat import fake_tensor_mode
from lightning_mgpu.parts.trainable_state import KEY as FROZEN_BASE_KEY
from lightning_mgpu.plugins.checkpoint_io import (
    EMA_STATE_KEY,
    check_sharded_metadata,
    load_file,
    load_sharded,
)
from lightning_mgpu.plugins.sharded_checkpoint import read_meta
from lightning_mgpu.quantization import dequantized, is_nf4

__all__ = ["HF_MODELS_KEY", "export_checkpoint", "hf_models", "main"]

PathLike = Union[str, "os.PathLike[str]"]

log = logging.getLogger(__name__)

HF_MODELS_KEY = "mgpu_hf_models"
"""The checkpoint entry the strategies write: attribute path -> ``{"class": ..., "config": <config.json text>}``
of every Hugging Face model the LightningModule holds."""

_WEIGHTS = "state_dict"
FORMATS = ("hf", "torch")

# torch dtype -> safetensors dtype name
_SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


# ----------------------------------------------------------------------------------------------------
# What a checkpoint records at save time


def hf_models(module: nn.Module) -> dict[str, dict[str, str]]:
    """The Hugging Face models ``module`` holds, outermost only: attribute path -> ``{"class": class name,
    "config": the configuration as its config.json text}``. A model is a module with a callable
    ``save_pretrained`` and a ``config`` with ``to_json_string`` (transformers is not imported)."""
    found: dict[str, dict[str, str]] = {}
    for name, sub in module.named_modules():
        if sub is module or any(name.startswith(f"{outer}.") for outer in found):
            continue
        config = getattr(sub, "config", None)
        if callable(getattr(sub, "save_pretrained", None)) and callable(getattr(config, "to_json_string", None)):
            try:
                entry = {"class": type(sub).__name__, "config": config.to_json_string()}  # type: ignore[union-attr]
                adapters = getattr(sub, "peft_config", None)
                base = getattr(sub, "get_base_model", None)
                if isinstance(adapters, dict) and callable(base):  # a peft model: its base's class, its adapters
                    entry["class"] = type(base()).__name__
                    entry["peft"] = json.dumps({k: _plain(v.to_dict()) for k, v in adapters.items()}, sort_keys=True)
            except Exception as err:  # never fail a save over what only the export uses
                log.warning("%s (%s): its configuration is not recorded for export: %s", name, type(sub).__name__, err)
                continue
            found[name] = entry
    return found


def _plain(value: Any) -> Any:
    """``value`` as JSON can hold it (peft's configurations hold sets and enums)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [_plain(v) for v in value]
        return sorted(items, key=str) if isinstance(value, (set, frozenset)) else items
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(getattr(value, "value", value))


def record_hf_models(checkpoint: dict[str, Any], module: Optional[nn.Module]) -> None:
    """Put :func:`hf_models` of ``module`` into ``checkpoint`` (what every ``mgpu_*`` strategy's save does)."""
    if module is None:
        return
    models = hf_models(module)
    if models:
        checkpoint[HF_MODELS_KEY] = models


# ----------------------------------------------------------------------------------------------------
# Reading: one entry per tensor, read when asked


@dataclass
class _Tensor:
    dtype: torch.dtype
    shape: tuple[int, ...]
    read: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _constant(tensor: torch.Tensor) -> Callable[[], torch.Tensor]:
    if is_nf4(tensor):  # a 4-bit base (quantize_frozen): its values in the dtype it was quantised from
        return lambda: dequantized(tensor)
    return lambda: tensor


def _cast(tensors: dict[str, _Tensor], dtype: Optional[torch.dtype]) -> dict[str, _Tensor]:
    """``tensors`` with each floating-point one read as ``dtype`` (None: as saved)."""
    if dtype is None:
        return tensors

    def as_dtype(t: _Tensor, dtype: torch.dtype) -> _Tensor:
        if not t.dtype.is_floating_point or t.dtype == dtype:
            return t
        return _Tensor(dtype, t.shape, lambda: t.read().to(dtype))

    return {n: as_dtype(t, dtype) for n, t in tensors.items()}


#: the dtypes ``export_checkpoint(dtype=...)`` writes
DTYPES = ("float32", "bfloat16", "float16", "float64")


def _dtype(name: Optional[str]) -> Optional[torch.dtype]:
    if name is None:
        return None
    if name not in DTYPES:
        raise ValueError(
            f"dtype={name!r} is not one the export writes: use one of {', '.join(DTYPES)} (or none: as saved)."
        )
    return cast(torch.dtype, getattr(torch, name))


def _open_file(path: Path, weights_only: Optional[bool]) -> tuple[dict[str, Any], dict[str, dict[str, _Tensor]]]:
    """A one-file checkpoint, memory-mapped: its tensors are read from the file when used."""
    try:
        checkpoint = load_file(path, weights_only, map_location="cpu", mmap=True)
    except RuntimeError as err:
        if "mmap" not in str(err):
            raise
        checkpoint = load_file(path, weights_only, map_location="cpu")  # an old (non-zip) file: read whole
    groups: dict[str, dict[str, _Tensor]] = {}
    for key in (_WEIGHTS, EMA_STATE_KEY):
        entries = checkpoint.get(key)
        if isinstance(entries, dict):
            groups[key] = {
                name: _Tensor(t.dtype, tuple(t.shape), _constant(t))
                for name, t in entries.items()
                if isinstance(t, torch.Tensor)
            }
    meta = {k: v for k, v in checkpoint.items() if k not in (_WEIGHTS, EMA_STATE_KEY, "optimizer_states")}
    return meta, groups


def _open_dir(path: Path, weights_only: Optional[bool]) -> tuple[dict[str, Any], dict[str, dict[str, _Tensor]]]:
    """A sharded directory: each tensor is read back whole from the shards of every rank when used."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta: dict[str, Any] = read_meta(path, weights_only)
    check_sharded_metadata(path, weights_only)
    metadata = FileSystemReader(str(path)).read_metadata()
    groups: dict[str, dict[str, _Tensor]] = {}
    for fqn, entry in metadata.state_dict_metadata.items():
        key, _, name = fqn.partition(".")
        if key not in (_WEIGHTS, EMA_STATE_KEY) or not isinstance(entry, TensorStorageMetadata):
            continue
        dtype, shape = entry.properties.dtype, tuple(entry.size)

        def read(key: str = key, name: str = name, dtype: torch.dtype = dtype, shape: tuple[int, ...] = shape) -> Any:
            template = {key: {name: torch.empty(shape, dtype=dtype)}}
            load_sharded(template, str(path), local=True)  # this process reads every rank's shards
            return template[key][name]

        groups.setdefault(key, {})[name] = _Tensor(dtype, shape, read)
    return meta, groups


def _open(path: Path, weights_only: Optional[bool]) -> tuple[dict[str, Any], dict[str, dict[str, _Tensor]]]:
    if path.is_dir():
        return _open_dir(path, weights_only)
    if path.is_file():
        return _open_file(path, weights_only)
    raise FileNotFoundError(f"{path} does not exist: pass a checkpoint file or a sharded checkpoint directory.")


# ----------------------------------------------------------------------------------------------------
# Choosing the weights, their names and the configuration


def _select(groups: dict[str, dict[str, _Tensor]], ema: bool, prefix: str, path: Path) -> dict[str, _Tensor]:
    weights = dict(groups.get(_WEIGHTS, {}))
    if not weights:
        raise ValueError(
            f"{path} holds no weights (no 'state_dict'): pass a checkpoint written by trainer.save_checkpoint."
        )
    if ema:
        average = groups.get(EMA_STATE_KEY)
        if not average:
            raise ValueError(
                f"{path} holds no EMA average (no {EMA_STATE_KEY!r}): it was saved without the EMA callback. Export "
                f"the weights (drop --ema / ema=True), or train with callbacks=[lightning_mgpu.EMA(...)]."
            )
        weights.update(average)  # the averaged trainable weights; buffers and frozen weights as saved
    if not prefix:
        return weights
    lead = prefix + "."
    chosen = {name[len(lead) :]: t for name, t in weights.items() if name.startswith(lead)}
    if not chosen:
        heads = sorted({name.split(".")[0] for name in weights})
        raise ValueError(
            f"No weight of {path} is under prefix {prefix!r}; the top-level names are {heads}. Pass --prefix with "
            f"the attribute of the LightningModule that holds the model (or '' for all)."
        )
    return chosen


def _choose_model(
    meta: dict[str, Any], prefix: Optional[str], config: Optional[PathLike], path: Path
) -> tuple[str, Optional[dict[str, Any]], Optional[str], Optional[dict[str, Any]]]:
    """(prefix, the configuration as a dict or None, the model class name or None, the recorded entry or None)."""
    models: dict[str, dict[str, str]] = meta.get(HF_MODELS_KEY) or {}
    if prefix is None:
        if len(models) == 1:
            prefix = next(iter(models))
        elif len(models) > 1:
            raise ValueError(
                f"{path} holds {len(models)} Hugging Face models, at {sorted(models)}: pass --prefix with the one "
                f"to export, e.g. --prefix {sorted(models)[0]}."
            )
    recorded = models.get(prefix) if prefix is not None else None
    return (prefix or "", *_config_of(recorded, config))


def _config_of(
    recorded: Optional[dict[str, str]], config: Optional[PathLike]
) -> tuple[Optional[dict[str, Any]], Optional[str], Optional[dict[str, Any]]]:
    """(the configuration, the model class, the recorded entry)."""
    if config is not None:
        source = Path(config)
        file = source / "config.json" if source.is_dir() else source
        if not file.is_file():
            raise FileNotFoundError(f"--config {config}: no such file; pass a config.json or the folder holding one.")
        return (json.loads(file.read_text()), recorded["class"] if recorded else None, recorded)
    if recorded is None:
        return (None, None, None)
    return (json.loads(recorded["config"]), recorded["class"], recorded)


# ----------------------------------------------------------------------------------------------------
# peft adapters: merged into the base weights, or kept as an adapter folder

_PEFT_ROOT = "base_model.model."
ADAPTERS = ("merge", "peft")
#: ``base_model_name_or_path`` of an adapter folder written alone whose base is not known (a model built from a
#: config, and no ``base_model`` given). transformers' ``AutoModel...from_pretrained(DIR)`` loads the base named
#: there: ``None`` made it ask the Hugging Face Hub for a model called "None", retrying for half a minute; this
#: value is neither a local path nor a valid Hub name, so that call (and peft's ``AutoPeftModel``) fails at once,
#: with this sentence in its message. ``PeftModel.from_pretrained(base_model, DIR)`` does not read it.
BASE_NOT_RECORDED = (
    "base model not recorded: load the base model, then PeftModel.from_pretrained(base_model, this folder); or "
    "export again with --base-model NAME_OR_PATH"
)


def _adapter_config(recorded: dict[str, Any], path: Path) -> tuple[str, dict[str, Any]]:
    adapters: dict[str, Any] = json.loads(recorded["peft"])
    if len(adapters) != 1:
        raise ValueError(
            f"{path} holds {len(adapters)} peft adapters ({sorted(adapters)}); the export writes one: keep one "
            f"adapter in the module (delete_adapter) before saving, or export with --format torch."
        )
    return next(iter(adapters.items()))


def _split_peft(
    tensors: dict[str, _Tensor], adapter: str, path: Path, with_base: bool = True
) -> tuple[dict[str, _Tensor], dict[str, dict[str, _Tensor]], dict[str, _Tensor]]:
    """(base weights by the model's own names, the LoRA pair of each adapted layer by its weight's name, the
    adapter's tensors by peft's saved names). ``with_base=False``: an adapter-only checkpoint, whose adapted
    layers' base weights are not in ``tensors``."""
    base: dict[str, _Tensor] = {}
    pairs: dict[str, dict[str, _Tensor]] = {}
    saved: dict[str, _Tensor] = {}
    for name, t in tensors.items():
        if not name.startswith(_PEFT_ROOT):
            raise ValueError(
                f"{name} is not under peft's {_PEFT_ROOT!r}: pass --prefix with the peft model's attribute."
            )
        own = name[len(_PEFT_ROOT) :]
        for part in ("lora_A", "lora_B"):
            marker = f".{part}.{adapter}."
            if marker in own:
                layer, _, leaf = own.partition(marker)
                pairs.setdefault(f"{layer}.{leaf}", {})[part] = t
                saved[f"{_PEFT_ROOT}{layer}.{part}.{leaf}"] = t
                break
        else:
            if ".lora_" in own or ".modules_to_save." in own or ".original_module." in own:
                raise ValueError(
                    f"{name}: this adapter part (other than LoRA's A and B of a Linear or Conv1D layer) is not "
                    f"exported; merge_and_unload in the module before saving, or export with --format torch."
                )
            base[own.replace(".base_layer.", ".")] = t
    for weight, pair in pairs.items():
        if set(pair) != {"lora_A", "lora_B"} or (with_base and weight not in base):
            raise ValueError(f"{path}: the LoRA pair of {weight} is incomplete ({sorted(pair)}).")
    return base, pairs, saved


def _merged(weight: _Tensor, pair: dict[str, _Tensor], config: dict[str, Any]) -> _Tensor:
    """``W + scaling * B @ A`` (transposed for ``fan_in_fan_out`` layers, GPT-2's Conv1D), computed as peft's
    ``merge_and_unload`` computes it."""
    r, alpha = int(config["r"]), float(config["lora_alpha"])
    scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    transpose = bool(config.get("fan_in_fan_out"))

    def read() -> torch.Tensor:
        w, a, b = weight.read(), pair["lora_A"].read(), pair["lora_B"].read()
        delta = b.to(w.dtype) @ a.to(w.dtype)
        delta = (delta.T if transpose else delta) * scaling
        return w + delta

    return _Tensor(weight.dtype, weight.shape, read)


def _check_lora(config: dict[str, Any]) -> None:
    unsupported = [k for k in ("use_dora", "rank_pattern", "alpha_pattern") if config.get(k)]
    if config.get("peft_type") != "LORA" or unsupported:
        kind = config.get("peft_type") if config.get("peft_type") != "LORA" else ", ".join(unsupported)
        raise ValueError(
            f"The adapter ({kind}) is not merged by the export (plain LoRA is): export with --adapters peft (an "
            f"adapter folder beside the base model), or merge_and_unload in the module before saving."
        )


# ----------------------------------------------------------------------------------------------------
# Writing, tensor by tensor


def _write_bytes(f: Any, tensor: torch.Tensor) -> None:
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    if flat.numel():
        f.write(flat.view(torch.uint8).numpy().data)


def write_safetensors(path: PathLike, tensors: dict[str, _Tensor]) -> None:
    """A safetensors file of ``tensors``, written one tensor at a time: the header from their shapes and dtypes,
    then each tensor's bytes as it is read (the format: an 8-byte little-endian header length, the JSON header,
    the data)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    names = sorted(tensors)
    for name in names:
        t = tensors[name]
        if t.dtype not in _SAFETENSORS_DTYPES:
            raise TypeError(f"{name} is a {t.dtype} tensor, which safetensors cannot hold; export with --format torch.")
        end = offset + t.nbytes
        header[name] = {"dtype": _SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, end]}
        offset = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for name in names:
            t = tensors[name]
            value = t.read()
            if value.dtype != t.dtype or tuple(value.shape) != t.shape:
                raise ValueError(f"{name}: read {value.dtype} {tuple(value.shape)}, expected {t.dtype} {t.shape}.")
            _write_bytes(f, value)
            del value
        f.flush()
        os.fsync(f.fileno())


def write_torch(path: PathLike, tensors: dict[str, _Tensor]) -> None:
    """One ``torch.save`` file of ``{name: tensor}``, written without holding the tensors: the file is laid out
    first (shapes and dtypes only), then memory-mapped and filled one tensor at a time."""
    from torch.serialization import set_default_mmap_options, skip_data

    with fake_tensor_mode():
        layout = {name: torch.empty(t.shape, dtype=t.dtype) for name, t in tensors.items()}
    with skip_data(materialize_fake_tensors=True):
        torch.save(layout, path)
    del layout
    with set_default_mmap_options(mmap.MAP_SHARED):
        target = torch.load(path, mmap=True, weights_only=True)
    for name in sorted(tensors):
        target[name].copy_(tensors[name].read())
    del target
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _dtype_name(tensors: dict[str, _Tensor]) -> Optional[str]:
    floats = {t.dtype for t in tensors.values() if t.dtype.is_floating_point}
    return str(floats.pop()).removeprefix("torch.") if len(floats) == 1 else None


def _staging(final: Path) -> Path:
    return final.with_name(f".{final.name}.tmp-{os.getpid()}")


def export_checkpoint(
    checkpoint: PathLike,
    output: PathLike,
    *,
    format: str = "hf",
    ema: bool = False,
    prefix: Optional[str] = None,
    config: Optional[PathLike] = None,
    adapters: str = "merge",
    base_model: Optional[str] = None,
    dtype: Optional[str] = None,
    weights_only: Optional[bool] = True,
) -> Path:
    """Write the weights of ``checkpoint`` (a file or a sharded directory of the pack) as a Hugging Face folder
    (``format="hf"``: ``config.json`` + ``model.safetensors``) or one ``torch.save`` file (``format="torch"``) at
    ``output``, which must not exist yet. Returns ``output``.

    Args:
        ema: the :class:`~lightning_mgpu.EMA` callback's average in place of the trained weights.
        prefix: the attribute path of the model in the LightningModule, stripped from the names; default: the
            one Hugging Face model the checkpoint recorded, else ``""`` (every name as saved).
        config: a ``config.json`` (or its folder) for ``format="hf"``; default: the configuration recorded in the
            checkpoint.
        adapters: a model with ``peft`` LoRA adapters: ``"merge"`` writes the base model with the adapters merged
            into its weights (what peft's ``merge_and_unload`` gives); ``"peft"`` writes the base model unmerged
            and the adapter beside it (``adapter_config.json``, ``adapter_model.safetensors``:
            ``PeftModel.from_pretrained(AutoModel...from_pretrained(DIR), DIR)``). An adapter-only checkpoint
            (``checkpoint_params="trainable"``) holds no base: ``"peft"`` writes the adapter folder alone
            (``PeftModel.from_pretrained(base_model, DIR)``); anything else is refused.
        base_model: the Hugging Face name or local folder of the base model, written as the adapter folder's
            ``base_model_name_or_path``, so that ``AutoModel...from_pretrained(DIR)`` of an adapter folder written
            alone loads that base and attaches the adapter; default: the one peft recorded (the name the base was
            loaded from). Unknown, the folder names :data:`BASE_NOT_RECORDED` there: that call fails at once,
            naming ``PeftModel.from_pretrained``.
        dtype: ``"bfloat16"``, ``"float16"``, ``"float32"`` or ``"float64"``: every floating-point weight written in
            it (LoRA adapters are merged first, in the dtype saved); default: as saved. A 4-bit base
            (:func:`~lightning_mgpu.quantize_frozen`) is written dequantised, in the dtype it was quantised from or
            this one.
        weights_only: ``torch.load``'s; ``False`` only for a checkpoint you trust.

    Example (a checkpoint without a recorded Hugging Face model, as one ``torch.save`` file of its weights):

        >>> import tempfile
        >>> from pathlib import Path
        >>> import torch
        >>> from lightning_mgpu import export_checkpoint
        >>> folder = Path(tempfile.mkdtemp())
        >>> torch.save({"state_dict": {"net.weight": torch.ones(2, 2), "net.bias": torch.zeros(2)}}, folder / "a.ckpt")
        >>> export_checkpoint(folder / "a.ckpt", folder / "weights.pt", format="torch", prefix="net").name
        'weights.pt'
        >>> sorted(torch.load(folder / "weights.pt", weights_only=True))  # the names without the attribute path
        ['bias', 'weight']
    """
    if format not in FORMATS:
        raise ValueError(f"format={format!r} is unknown: use 'hf' (a from_pretrained folder) or 'torch' (one file).")
    if adapters not in ADAPTERS:
        raise ValueError(
            f"adapters={adapters!r} is unknown: use 'merge' (merged weights) or 'peft' (an adapter folder)."
        )
    written = _dtype(dtype)
    source, final = Path(checkpoint), Path(output)
    if final.exists():
        raise FileExistsError(f"{final} exists: choose a new name (the export never overwrites), or remove it first.")
    meta, groups = _open(source, weights_only)
    prefix, hf_config, model_class, recorded = _choose_model(meta, prefix, config, source)
    tensors = _select(groups, ema, prefix, source)
    adapter: Optional[tuple[dict[str, Any], dict[str, _Tensor]]] = None
    has_peft = recorded is not None and "peft" in recorded
    adapter_only = FROZEN_BASE_KEY in meta  # checkpoint_params="trainable": no base weights in it
    if adapter_only and not (has_peft and adapters == "peft" and format == "hf"):
        raise ValueError(
            f"{source} is an adapter-only checkpoint (checkpoint_params='trainable'): it holds the trainable "
            f"parameters and a fingerprint of the frozen base, not the base's weights. "
            + (
                "Export its peft adapter alone with --adapters peft --format hf (load it with "
                "PeftModel.from_pretrained(base_model, DIR)); a merged model or a torch file needs the base: "
                if has_peft
                else "The export needs the base: "
            )
            + "load the checkpoint onto the base in your LightningModule (trainer.validate(model, ckpt_path=...)) "
            "and save a full checkpoint (checkpoint_params='all')."
        )
    if base_model is not None and not (has_peft and adapters == "peft"):
        raise ValueError(
            f"base_model={base_model!r} names the base of a peft adapter folder, which this export does not write: "
            f"it needs a checkpoint of a peft model and --adapters peft --format hf."
        )
    if recorded is not None and "peft" in recorded:
        name, peft_config = _adapter_config(recorded, source)
        if base_model is not None:
            peft_config["base_model_name_or_path"] = base_model
        elif adapter_only and not peft_config.get("base_model_name_or_path"):
            peft_config["base_model_name_or_path"] = BASE_NOT_RECORDED  # AutoModel...from_pretrained fails at once
        base, pairs, saved = _split_peft(tensors, name, source, with_base=not adapter_only)
        if adapter_only:
            tensors, adapter = {}, (peft_config, saved)
        elif adapters == "merge":
            _check_lora(peft_config)
            tensors = {n: _merged(t, pairs[n], peft_config) if n in pairs else t for n, t in base.items()}
        elif format == "torch":
            raise ValueError("adapters='peft' writes a folder (the base model and the adapter): use format='hf'.")
        else:
            tensors, adapter = base, (peft_config, saved)
    tensors = _cast(tensors, written)
    if adapter is not None:
        adapter = (adapter[0], _cast(adapter[1], written))
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = _staging(final)
    if staging.exists():  # a killed export of this process id
        shutil.rmtree(staging) if staging.is_dir() else staging.unlink()
    try:
        if format == "torch":
            write_torch(staging, tensors)
        else:
            if hf_config is None and not adapter_only:
                raise ValueError(
                    f"{source} records no Hugging Face model configuration (saved by another strategy, or the "
                    f"LightningModule holds no transformers model). Pass --config with the model's config.json (or "
                    f"its folder) and --prefix with the attribute that holds the model, or use --format torch."
                )
            staging.mkdir()
            if hf_config is not None and not adapter_only:  # an adapter-only export: the adapter folder alone
                if model_class is not None and not hf_config.get("architectures"):
                    hf_config["architectures"] = [model_class]
                if (dtype := _dtype_name(tensors)) is not None:
                    hf_config["dtype"] = dtype
                (staging / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
                write_safetensors(staging / "model.safetensors", tensors)
            if adapter is not None:
                peft_config, saved = adapter
                (staging / "adapter_config.json").write_text(json.dumps(peft_config, indent=2, sort_keys=True) + "\n")
                write_safetensors(staging / "adapter_model.safetensors", saved)
        os.replace(staging, final)
    except BaseException:
        if staging.is_dir():
            shutil.rmtree(staging, ignore_errors=True)
        elif staging.exists():
            staging.unlink()
        raise
    return final


def checkpoint_bytes(path: PathLike) -> int:
    """The bytes of a checkpoint file, or of every file of a sharded directory."""
    source = Path(path)
    if source.is_file():
        return source.stat().st_size
    return sum(p.stat().st_size for p in source.rglob("*") if p.is_file())


def main(argv: Optional[list[str]] = None) -> int:
    """``lightning-mgpu export``: exit 2 with the reason on bad input."""
    parser = argparse.ArgumentParser(
        prog="lightning-mgpu export",
        description="Write a checkpoint of the pack (a file, or a sharded directory of any world size) as a Hugging "
        "Face from_pretrained folder (--format hf DIR) or one torch.save file (--format torch FILE).",
    )
    parser.add_argument("checkpoint", help="a checkpoint file or a sharded checkpoint directory")
    parser.add_argument(
        "--format", choices=FORMATS, default="hf", help="hf: config.json + model.safetensors; torch: one file"
    )
    parser.add_argument("output", help="the folder (hf) or file (torch) to write; must not exist")
    parser.add_argument("--ema", action="store_true", help="the EMA callback's average instead of the trained weights")
    parser.add_argument("--prefix", help="the LightningModule attribute holding the model (default: the recorded one)")
    parser.add_argument("--config", help="config.json (or its folder) when the checkpoint records none")
    parser.add_argument(
        "--adapters",
        choices=ADAPTERS,
        default="merge",
        help="peft LoRA adapters: merge them into the weights (default), or write them as a peft adapter folder",
    )
    parser.add_argument(
        "--base-model",
        metavar="NAME_OR_PATH",
        help="with --adapters peft: the base model's Hugging Face name or folder, written in adapter_config.json "
        "(default: the one peft recorded) so that AutoModel...from_pretrained(DIR) of an adapter-only export loads it",
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        help="write every floating-point weight in this dtype (adapters merged first; a 4-bit base dequantised); "
        "default: as saved",
    )
    parser.add_argument(
        "--trust-checkpoint",
        action="store_true",
        help="load with weights_only=False (only for a checkpoint you trust: unpickling may run code)",
    )
    args = parser.parse_args(argv)
    try:
        out = export_checkpoint(
            args.checkpoint, args.output, format=args.format, ema=args.ema, prefix=args.prefix, config=args.config,
            adapters=args.adapters, base_model=args.base_model, dtype=args.dtype,
            weights_only=not args.trust_checkpoint,
        )  # fmt: skip
    except (ValueError, TypeError, FileNotFoundError, FileExistsError) as err:
        parser.exit(2, f"lightning-mgpu export: error: {err}\n")
    print(f"wrote {out}")
    return 0
