"""Load a whole model (for evaluation, calibration and fine-tuning) from a MODEL argument."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from ..errors import EffattnError, clip
from .checkpoint import Checkpoint
from .verify import verify_checkpoint
from .resolve import ModelRef, hub_kernels, resolve_model

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(name: str | None) -> torch.dtype | None:
    """'float32' / 'bf16' / ... -> torch dtype; 'auto' or None -> None (keep the checkpoint's)."""
    if name in (None, "auto"):
        return None
    if name not in DTYPES:
        raise EffattnError(f"unknown dtype {name!r}", f"use one of auto, {', '.join(sorted(set(DTYPES)))}")
    return DTYPES[name]


def as_ref(model: str | Path | ModelRef, *, trust_remote_code: bool = False, plan_only: bool = False) -> ModelRef:
    if isinstance(model, ModelRef):
        return model
    return resolve_model(str(model), trust_remote_code=trust_remote_code, plan_only=plan_only)


# The fix a refusal of a checkpoint's own code names; finetune, which has no such flag, names its own.
REMOTE_CODE_FIX = "pass --trust-remote-code if you trust it"

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json", "spiece.model",
                   "vocab.txt", "tekken.json")


def tokenizer_missing(folder: Path) -> str | None:
    """Why `folder` cannot give a tokenizer (None when it holds one). transformers does not refuse a
    folder without tokenizer files: it builds an empty tokenizer that turns any text into 0 tokens."""
    if any((Path(folder) / name).is_file() for name in TOKENIZER_FILES):
        return None
    return f"{Path(folder).name} has no tokenizer files ({', '.join(TOKENIZER_FILES[:4])}, ...)"


def load_tokenizer(source: str | Path | ModelRef, *, trust_remote_code: bool = False, option: str = "--tokenizer",
                   plan_only: bool = False):
    """The tokenizer of MODEL-like `source` (a folder, a built-in name, a hub id, a .gguf file); refuses a folder
    that has none, naming `option` as the way to give one. `plan_only` (dry runs): a .gguf file gives the
    tokenizer in its metadata without being dequantized (`resolve_model`)."""
    folder = Path(source) if isinstance(source, (str, Path)) else None
    if folder is not None and folder.is_dir() and not (folder / "config.json").is_file() \
            and tokenizer_missing(folder) is None:  # a folder of tokenizer files alone
        return _auto_tokenizer(folder, str(folder), trust_remote_code)
    ref = as_ref(source, trust_remote_code=trust_remote_code, plan_only=plan_only)
    why = tokenizer_missing(ref.path)
    if why:
        raise EffattnError(why, f"pass {option} FOLDER_OR_MODEL (e.g. the model it came from) or copy its tokenizer files there")
    return _auto_tokenizer(ref.path, ref.display, trust_remote_code)


def _auto_tokenizer(folder: Path, name: str, trust_remote_code: bool):
    """AutoTokenizer on `folder`, its failures one line each: a tokenizer's own code (not run without the flag),
    files that are incomplete or not valid JSON."""
    import json

    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
    except json.JSONDecodeError as exc:
        raise EffattnError(f"the tokenizer of {name} has a file that is not valid JSON ({exc})",
                           "fix or re-download its tokenizer files") from None
    except (ValueError, OSError, KeyError, TypeError, AttributeError) as exc:
        text = " ".join(str(exc).split())
        if "custom code" in text or "trust_remote_code" in text:
            raise EffattnError(f"the tokenizer of {name} needs its own code", REMOTE_CODE_FIX) from None
        raise EffattnError(f"cannot load the tokenizer of {name}: {text[:300]}",
                           "check its tokenizer files are complete (tokenizer.json, or the files its "
                           "tokenizer_config.json names), or pass --tokenizer FOLDER_OR_MODEL") from None


def check_tokenizer_fits(tokenizer, models, fix: str = "tokenize with the tokenizer of the model it came from") -> None:
    """Refuse a tokenizer whose ids reach past a model's embedding (another model's tokenizer, a vocabulary cut
    down): the first such id would fail deep inside a forward. `models` holds (name, config dict) pairs. The
    base vocabulary is compared: added tokens (a pad token some tokenizers add past the embedding) do not turn
    up in text."""
    size = tokenizer.vocab_size
    for name, config in models:
        vocab = config.get("vocab_size")
        if vocab is not None and size > vocab:
            raise EffattnError(f"the tokenizer has {size:,} tokens, more than {name}'s vocabulary of {vocab:,}", fix)


ATTN_IMPLEMENTATIONS = ("sdpa", "flex_attention", "eager")


def check_loadable(model: str | Path | ModelRef, *, trust_remote_code: bool = False, allow_pickle: bool = False,
                   attn_implementation: str | None = None, dtype: str | None = None,
                   plan_only: bool = False) -> Checkpoint:
    """The checks `load_model` makes before it reads any weights: the checkpoint's tensors against its config,
    pickles, a checkpoint's own code, the attention kernel, the dtype it is to run in. Returns the checkpoint
    (headers and config only); dry runs call it to refuse what the run would, with `plan_only`: a .gguf not
    dequantized yet is then planned from its metadata (the tensors' shapes from its config), as `convert
    --dry-run` plans it."""
    import effattn.attention  # noqa: F401 - registers effattn's own model classes with transformers

    ref = as_ref(model, trust_remote_code=trust_remote_code, plan_only=plan_only)
    # validates weights and refuses pickles
    ckpt = Checkpoint(ref.path, allow_pickle=allow_pickle, shapes_only=plan_only and ref.kind == "gguf")
    verify_checkpoint(ckpt)
    if ckpt.config.get("auto_map") and not trust_remote_code and not _registered(ckpt.config.get("model_type")):
        raise EffattnError(f"{ref.display} needs its own modeling code (auto_map in config.json)",
                           REMOTE_CODE_FIX)
    if not ckpt.config.get("auto_map") and not _registered(ckpt.config.get("model_type")):
        import transformers

        raise EffattnError(f"{ref.display} has model_type {ckpt.config.get('model_type')!r}, which transformers "
                           f"{transformers.__version__} does not know",
                           "check config.json's model_type, or upgrade transformers")
    if attn_implementation is not None:
        from ..models import model_spec

        if model_spec(ckpt.config.get("model_type")) or ckpt.config.get("auto_map"):
            raise EffattnError(f"--attn-implementation applies to native transformers models; {ref.display} runs its "
                               "own attention", "drop --attn-implementation")
        if attn_implementation not in ATTN_IMPLEMENTATIONS:
            raise EffattnError(f"--attn-implementation {attn_implementation!r} is not one effattn runs",
                               f"one of {', '.join(ATTN_IMPLEMENTATIONS)}")
    mla_from_effattn = ckpt.config.get("kv_lora_rank") and (ref.path / "effattn.json").is_file()
    if parse_dtype(dtype) == torch.float16 and mla_from_effattn:
        # effattn's MLA keeps the latent rows of kv_a_proj_with_mqa at ~1e-9 (the latent norm stays linear,
        # attention/mla.py): below float16's smallest number (6e-8), they would round to 0. A tiny MLA model
        # measured 3,012 perplexity in float16 against 3,370 in float32 and 3,367 in bfloat16.
        raise EffattnError(f"{ref.display} is an MLA model from effattn, whose latent projection holds values near "
                           "1e-9, below float16's range", "use --dtype bfloat16 (float32's range) or float32")
    return ckpt


def load_model(model: str | Path | ModelRef, *, dtype: str | None = "float32", trust_remote_code: bool = False,
               allow_pickle: bool = False, device: str | torch.device = "cpu", tokenizer: str | Path | bool = True,
               attn_implementation: str | None = None):
    """(model, tokenizer, ref) for a MODEL argument, in eval mode. The tokenizer is MODEL's
    (tokenizer=True), another folder's or MODEL argument's (a path or name), or None (False).
    `attn_implementation` picks transformers' attention kernel (sdpa by default; flex_attention runs a
    sliding window block-sparse; eager) for native architectures; effattn's own models keep theirs. An
    MLA model (DeepseekV3 with a latent cache) runs effattn's absorbed attention (attention/mla.py)
    unless a kernel is named: `sdpa` then gives transformers' own path, which re-expands the cache."""
    from transformers import AutoModelForCausalLM

    ref = as_ref(model, trust_remote_code=trust_remote_code)
    ckpt = check_loadable(ref, trust_remote_code=trust_remote_code, allow_pickle=allow_pickle,
                          attn_implementation=attn_implementation, dtype=dtype)
    torch_dtype = parse_dtype(dtype) or ckpt.dtype
    extra = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            lm = AutoModelForCausalLM.from_pretrained(
                str(ref.path), dtype=torch_dtype, trust_remote_code=trust_remote_code,
                use_safetensors=None if allow_pickle else True, **extra, **hub_kernels(),
            )
    except EffattnError:
        raise
    except Exception as exc:  # noqa: BLE001 - one line for the user, --debug shows the rest
        raise EffattnError(f"transformers could not load {ref.display} ({type(exc).__name__}: {clip(exc)})",
                           "check the checkpoint is complete and matches its config.json") from exc
    lm.to(device).eval()
    from ..attention.mla import absorb, is_mla

    if is_mla(lm) and attn_implementation is None:  # MLA decodes in latent space unless a kernel was asked for
        absorb(lm)
    if tokenizer is False:
        return lm, None, ref
    return lm, load_tokenizer(ref if tokenizer is True else tokenizer, trust_remote_code=trust_remote_code), ref


def load_empty(model: str | Path | ModelRef, *, dtype: str | None = "float32", trust_remote_code: bool = False):
    """The model `load_model` gives, in eval mode, with its parameters on the meta device and its buffers
    computed: for a process of a sharded run whose weights arrive from the first process (nothing of the
    checkpoint is read here beyond its headers and config)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    import effattn.attention  # noqa: F401 - registers effattn's own model classes with transformers

    ref = as_ref(model, trust_remote_code=trust_remote_code)
    ckpt = Checkpoint(ref.path)
    verify_checkpoint(ckpt)
    config = AutoConfig.from_pretrained(str(ref.path), trust_remote_code=trust_remote_code)
    with init_empty_weights(include_buffers=False), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lm = AutoModelForCausalLM.from_config(config, dtype=parse_dtype(dtype) or ckpt.dtype,
                                              trust_remote_code=trust_remote_code)
    lm.tie_weights()  # init_empty_weights registers every parameter anew, which unties the output embeddings
    lm.eval()
    from ..attention.mla import absorb, is_mla

    if is_mla(lm):
        absorb(lm)
    return lm


def _registered(model_type: str | None) -> bool:
    from transformers import CONFIG_MAPPING

    return model_type in CONFIG_MAPPING
