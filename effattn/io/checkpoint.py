"""Read a Hugging Face checkpoint folder lazily, one tensor at a time.

Only safetensors are read by default. Pickled weights (`pytorch_model*.bin`) can execute code when
loaded, so they are refused unless the caller passes `allow_pickle=True` (the CLI's
`--allow-pickle`), and even then they are read with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from ..errors import EffattnError

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5")


# The fix a pickle refusal names; commands without --allow-pickle (finetune) name their own (finetune/preflight.py).
PICKLE_FIX = "convert them to safetensors, or pass --allow-pickle if you trust this checkpoint"


class Checkpoint:
    """A checkpoint folder: its config.json and a lazy view of its tensors.

    `get(name)` reads one tensor from disk (memory-mapped by safetensors); nothing else is held, so a
    conversion that walks the tensors layer by layer needs memory for one layer, not the model.

    `shapes_only=True` also accepts a folder holding a config.json alone (a model to plan for, e.g. a
    70B shape on a laptop): its tensors' names and shapes are the ones the config implies, in the
    config's dtype, and reading one is an error. Dry runs plan from such folders.
    """

    def __init__(self, folder: Path, *, allow_pickle: bool = False, shapes_only: bool = False):
        self.folder = Path(folder)
        self.config = read_config(self.folder)
        self._location: dict[str, Path] = {}
        self._pickled: dict[str, torch.Tensor] | None = None
        self._handles: dict[Path, Any] = {}
        self._shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None
        if shapes_only and not any(p.name.endswith(WEIGHT_SUFFIXES) for p in self.folder.iterdir()):
            self._shapes = _implied_shapes(self.config)
            return
        self._index_weights(allow_pickle)

    # -- discovery ---------------------------------------------------------------------------
    def _index_weights(self, allow_pickle: bool) -> None:
        folder = self.folder
        index = folder / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as exc:
                raise EffattnError(f"{index} is not a valid safetensors index ({exc})",
                                   "re-save the checkpoint or remove the broken index") from None
            for name, file in weight_map.items():
                self._location[name] = folder / file
            missing = sorted({p.name for p in self._location.values() if not p.exists()})
            if missing:
                raise EffattnError(f"{index.name} lists shard(s) that are missing: {', '.join(missing[:3])}",
                                   "download the complete checkpoint")
        else:
            files = sorted(folder.glob("*.safetensors"))
            for file in files:
                for name in self._handle(file).keys():
                    self._location[name] = file
        if self._location:
            for file in sorted(set(self._location.values())):
                self._handle(file)  # validates every shard's header up front
            return
        pickles = sorted(folder.glob("pytorch_model*.bin"))
        if pickles and not allow_pickle:
            raise EffattnError(
                f"{folder} holds only pickled weights ({pickles[0].name}), which can run code when loaded",
                PICKLE_FIX,
            )
        if pickles:
            self._pickled = {}
            for file in pickles:
                self._pickled.update(torch.load(file, map_location="cpu", weights_only=True))
            return
        raise EffattnError(f"{folder} has a config.json but no weights (*.safetensors)",
                           "point to a complete checkpoint folder")

    def _handle(self, file: Path):
        if file not in self._handles:
            try:
                self._handles[file] = safe_open(str(file), framework="pt")
            except SafetensorError as exc:
                raise EffattnError(f"{file} is corrupt or truncated ({exc})",
                                   "re-download or re-save this checkpoint") from None
        return self._handles[file]

    # -- access ------------------------------------------------------------------------------
    @property
    def has_weights(self) -> bool:
        """False for a config.json alone (shapes_only)."""
        return self._shapes is None

    def files(self) -> list[Path]:
        """The safetensors files holding the weights (empty for pickled checkpoints)."""
        return sorted(set(self._location.values())) if self._pickled is None else []

    def _entries(self):
        return self._shapes if self._shapes is not None else self._pickled if self._pickled is not None else self._location

    def names(self) -> list[str]:
        return list(self._entries())

    def __contains__(self, name: str) -> bool:
        return name in self._entries()

    def get(self, name: str) -> torch.Tensor:
        if self._shapes is not None:
            raise EffattnError(f"{self.folder} has a config.json but no weights, so there is no {name} to read",
                               "point to a complete checkpoint folder (a config.json alone serves --dry-run)")
        if self._pickled is not None:
            return self._pickled[name]
        try:
            return self._handle(self._location[name]).get_tensor(name)
        except KeyError:
            raise EffattnError(f"tensor {name!r} is missing from {self.folder}",
                               "the checkpoint does not match its config.json") from None
        except SafetensorError as exc:
            raise EffattnError(f"reading {name} from {self._location[name].name} failed ({exc})",
                               "re-download or re-save this checkpoint") from None

    def release(self) -> None:
        """Close the memory maps. Pages read so far stay mapped (and counted as resident) while a map
        is open; layer-by-layer conversions call this after each layer so they do not add up."""
        self._handles.clear()

    def meta(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        """Shape and dtype without reading the data."""
        if self._shapes is not None:
            return self._shapes[name]
        if self._pickled is not None:
            t = self._pickled[name]
            return tuple(t.shape), t.dtype
        sl = self._handle(self._location[name]).get_slice(name)
        return tuple(sl.get_shape()), _DTYPES[sl.get_dtype()]

    @cached_property
    def nbytes(self) -> int:
        total = 0
        for name in self.names():
            shape, dtype = self.meta(name)
            total += _numel(shape) * dtype.itemsize
        return total

    @cached_property
    def num_params(self) -> int:
        return sum(_numel(self.meta(n)[0]) for n in self.names())

    @cached_property
    def dtype(self) -> torch.dtype:
        """The dtype of most floating-point bytes in the checkpoint."""
        counts: dict[torch.dtype, int] = {}
        for name in self.names():
            shape, dtype = self.meta(name)
            if dtype.is_floating_point:
                counts[dtype] = counts.get(dtype, 0) + _numel(shape)
        return max(counts, key=counts.get) if counts else torch.float32

    def side_files(self) -> list[Path]:
        """Files that travel with the weights unchanged: tokenizer, generation config, templates."""
        skip = {"config.json", "README.md", "effattn.json", "model.safetensors.index.json",
                "pytorch_model.bin.index.json", "effattn-source.txt"}
        return sorted(p for p in self.folder.iterdir()
                      if p.is_file() and p.name not in skip and not p.name.endswith(WEIGHT_SUFFIXES)
                      and not p.name.startswith(".") and p.suffix != ".py")


_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
SAFETENSORS_DTYPE = {v: k for k, v in _DTYPES.items()}


def _implied_shapes(config: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    from .verify import expected_tensors

    expected = expected_tensors(config)
    if expected is None:
        raise EffattnError(f"model type {config.get('model_type')!r} is not one transformers knows here, so its "
                           "tensors cannot be planned from config.json alone", "point to a complete checkpoint folder")
    name = config.get("dtype") or config.get("torch_dtype") or "bfloat16"
    dtype = getattr(torch, str(name).replace("torch.", ""), None)
    dtype = dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.bfloat16
    return {n: (shape, dtype) for n, shape in expected.items()}


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def read_config(folder: Path) -> dict[str, Any]:
    """config.json of a causal LM checkpoint, validated enough to give a clear error."""
    path = Path(folder) / "config.json"
    if not path.exists():
        raise EffattnError(f"{folder} has no config.json", "point to a Hugging Face model folder")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise EffattnError(f"{path} is not valid JSON ({exc.msg}, line {exc.lineno})", "fix or re-download it") from None
    if not isinstance(config, dict):
        raise EffattnError(f"{path} holds a JSON {type(config).__name__}, not an object of settings", "fix or re-download it")
    archs = config.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise EffattnError(f"{path}: 'architectures' is {archs!r}, not a list of class names", "fix or re-download it")
    if archs and not any(a.endswith("ForCausalLM") for a in archs):
        if config.get("auto_map"):  # --trust-remote-code would not help: say so
            from ..families import supported_types

            raise EffattnError(f"{folder} is not a causal LM (architectures: {', '.join(archs)}; its modeling code "
                               "is remote: auto_map in config.json)",
                               "effattn reads decoder-only *ForCausalLM checkpoints and converts these model types "
                               f"only: {supported_types()}; --trust-remote-code does not change that")
        raise EffattnError(f"{folder} is not a causal LM (architectures: {', '.join(archs)})",
                           "effattn converts decoder-only *ForCausalLM checkpoints")
    for key in ("num_attention_heads", "hidden_size", "num_hidden_layers"):
        if key not in config:
            raise EffattnError(f"{path} has no {key!r}, so it is not a decoder LM config effattn can read",
                               "point to a causal LM checkpoint")
    _check_sizes(config, path)
    return config


# sizes every family reads: (key, required); each must be a positive whole number where present
SIZE_KEYS = (("num_attention_heads", True), ("hidden_size", True), ("num_hidden_layers", True),
             ("num_key_value_heads", False), ("head_dim", False), ("vocab_size", False), ("intermediate_size", False),
             ("max_position_embeddings", False))


def _check_sizes(config: dict[str, Any], path: Path) -> None:
    """The sizes a conversion computes with are whole, positive and consistent (transformers would fail
    later, or build a different model than the weights hold)."""
    for key, required in SIZE_KEYS:
        value = config.get(key)
        if value is None and not required:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise EffattnError(f"{path}: {key} is {value!r}, not a positive whole number", "fix or re-download it")
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    if heads % kv:
        raise EffattnError(f"{path}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}",
                           "fix or re-download it")
    if config.get("head_dim") is None and config["hidden_size"] % heads:
        raise EffattnError(f"{path}: hidden_size {config['hidden_size']} is not a multiple of num_attention_heads "
                           f"{heads} and there is no head_dim", "fix or re-download it")
    theta = config.get("rope_theta")
    if theta is not None and (isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0):
        raise EffattnError(f"{path}: rope_theta is {theta!r}, not a positive number", "fix or re-download it")
    if not isinstance(config.get("model_type", ""), str):
        raise EffattnError(f"{path}: model_type is {config['model_type']!r}, not a name", "fix or re-download it")
