"""Import a GGUF target once into a transformers directory that every stage reads.

The engines (SGLang, vLLM, the in-process hf backend) and every stage of this pipeline (tokenize, extract,
train, export, evaluate) want an HF directory: config.json, safetensors, tokenizer, chat template.
transformers reads a GGUF (`gguf_file=`), but a model loaded that way refuses `save_pretrained` ("quantized
with gguf, not serializable"), and its loader needs `accelerate`. So: the config and the tokenizer (with the
GGUF's chat template) come from transformers' GGUF readers, a fresh model of that config is built, and the
GGUF's tensors, dequantized (and un-permuted for llama.cpp's Q/K layout) by transformers' own converter, are
copied into it and saved in float32 (exactly the dequantized values) or bfloat16. The GGUF's sha256 is
recorded in `target_import.json`, beside what was converted.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import json
import logging
import os
import time
from pathlib import Path

from dflash_pipeline import package_paths
from dflash_pipeline.errors import PipelineError
from dflash_pipeline.storage import atomic_dir, write_json

log = logging.getLogger(__name__)

# every file the import writes (the workflow declares them all, so they travel together on S3)
IMPORTED_FILES = ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                  "tokenizer_config.json", "chat_template.jinja", "target_import.json")
RECORD = "target_import.json"
DTYPES = ("float32", "bfloat16")


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def _check_readable(path: Path) -> None:
    if not path.is_file():
        raise PipelineError(f"{path}: GGUF target not found")
    with open(path, "rb") as fh:
        if fh.read(4) != b"GGUF":
            raise PipelineError(f"{path}: not a GGUF file (no GGUF magic in its first bytes)")
    try:
        import gguf  # noqa: F401  (transformers' GGUF readers need it)
    except ImportError:
        raise PipelineError(f"{path}: reading a GGUF target needs the `gguf` package "
                            f"(pip install 'dflash-pipeline[gguf]')") from None


def load_gguf_config(path: Path):
    """The transformers config of a GGUF, or a one-line error naming an architecture transformers cannot take."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(path.parent), gguf_file=str(path))
    except (ValueError, KeyError, NotImplementedError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise PipelineError(f"{path}: cannot take this GGUF's architecture ({reason}); transformers converts "
                            f"the architectures listed in transformers.integrations.ggml") from None


def load_gguf_tokenizer(path: Path):
    """The GGUF's tokenizer with its chat template; a GGUF without either is refused (tokenize needs both)."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=str(path))
    except (ValueError, KeyError, NotImplementedError, OSError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise PipelineError(f"{path}: no usable tokenizer in the GGUF ({reason})") from None
    if not getattr(tok, "chat_template", None):
        raise PipelineError(f"{path}: the GGUF has no tokenizer.chat_template: the pipeline renders conversations "
                            f"with the target's own template; import the model as a transformers directory instead")
    return tok


# the special tokens a GGUF states; its word wins over the tokenizer reader's (transformers 5.17 reads
# SmolLM2-135M-Instruct's end of sequence as <|im_start|> (id 1) where the file says <|im_end|> (id 2): generation and
# the evaluator then stopped at the next turn's start, past the answer's end)
GGUF_SPECIAL_IDS = {"bos": "tokenizer.ggml.bos_token_id", "eos": "tokenizer.ggml.eos_token_id",
                    "pad": "tokenizer.ggml.padding_token_id", "unk": "tokenizer.ggml.unknown_token_id"}


def gguf_special_ids(path: Path) -> dict[str, int]:
    """{bos, eos, pad, unk: token id} as the GGUF's metadata states them (those it states)."""
    from gguf import GGUFReader

    fields = GGUFReader(str(path)).fields
    out = {}
    for name, key in GGUF_SPECIAL_IDS.items():
        field = fields.get(key)
        if field is not None and field.data:
            out[name] = int(field.parts[field.data[0]][0])
    return out


def set_special_tokens(tokenizer, config, special: dict[str, int]) -> dict[str, list[int]]:
    """The GGUF's special-token ids on the tokenizer and the config; {name: [read, stated]} where the tokenizer
    reader had read another id."""
    corrected = {}
    for name, tid in special.items():
        if not 0 <= tid < len(tokenizer):
            raise PipelineError(f"GGUF {name} token id {tid} is outside its vocabulary of {len(tokenizer)} tokens")
        read = getattr(tokenizer, f"{name}_token_id", None)
        if read != tid:
            setattr(tokenizer, f"{name}_token", tokenizer.convert_ids_to_tokens(tid))
            corrected[name] = [read, tid]
        setattr(config, f"{name}_token_id", tid)
    return corrected


def load_gguf_state(path: Path, model) -> dict:
    """The GGUF's tensors, dequantized to float32 and named as `model`'s parameters."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    try:
        tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    except NotImplementedError as exc:  # gguf.quants: a quantization type it cannot dequantize
        raise PipelineError(f"{path}: cannot dequantize this GGUF ({str(exc).splitlines()[0]})") from None
    params = model.state_dict()
    unexpected = sorted(set(tensors) - set(params))
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    missing = sorted(set(params) - set(tensors) - tied)
    if unexpected or missing:
        raise PipelineError(f"{path}: GGUF tensors do not match the {type(model).__name__} of its config "
                            f"(missing {missing[:5]}, unexpected {unexpected[:5]})")
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != tuple(params[name].shape):
            raise PipelineError(f"{path}: tensor {name} has shape {tuple(tensor.shape)}, the config says "
                                f"{tuple(params[name].shape)}")
    return tensors


@contextlib.contextmanager
def gguf_parsed_once():
    """transformers parses a GGUF's metadata anew for the config, the tokenizer and the tensors, and this module
    once more for the special ids (4.9 s each for the 98 MB SmolLM2 file on 2 cores), and it builds gguf's
    tensor-name map once per module of the model (397 times, 6.9 s). Both are pure functions of their arguments
    (the reader only reads its memory map): memoized while the import runs, through the `gguf` module's names,
    which transformers imports inside its functions (5.17-5.25). A version that binds them otherwise just
    parses as often as before."""
    import gguf

    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict = {}

    def reader(path, *args, **kwargs):
        key = (os.path.realpath(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = real_reader(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.cache(real_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_map


def import_gguf(gguf_path: str | Path, out_dir: str | Path, dtype: str = "float32") -> dict:
    """Convert `gguf_path` into the transformers directory `out_dir` (written whole, then renamed into place)."""
    with gguf_parsed_once():
        return _import_gguf(gguf_path, out_dir, dtype)


def _import_gguf(gguf_path: str | Path, out_dir: str | Path, dtype: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    if dtype not in DTYPES:
        raise PipelineError(f"target import dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    path = Path(package_paths.resolve(str(gguf_path), must_exist=False)).resolve()
    _check_readable(path)
    t0 = time.monotonic()
    digest = sha256_file(path)
    config = load_gguf_config(path)
    tokenizer = load_gguf_tokenizer(path)
    special = gguf_special_ids(path)
    try:
        corrected = set_special_tokens(tokenizer, config, special)
    except PipelineError as exc:
        raise PipelineError(f"{path}: {exc}") from None
    if corrected:
        log.warning("%s: special tokens as the GGUF states them, not as transformers read them: %s", path,
                    ", ".join(f"{k} {read} -> {tid}" for k, (read, tid) in corrected.items()))
    with torch.device("meta"):  # no random init of weights that are overwritten at once
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(load_gguf_state(path, model), strict=False, assign=True)
    model.tie_weights()
    leftover = [n for n, p in model.named_parameters() if p.is_meta]
    if leftover:
        raise PipelineError(f"{path}: the GGUF has no tensor for {leftover[:5]}")
    model = model.to(getattr(torch, dtype))
    generation = GenerationConfig.from_model_config(config)
    if tokenizer.eos_token_id is not None:
        generation.eos_token_id = tokenizer.eos_token_id
    record = {"source": str(gguf_path), "sha256": digest, "bytes": path.stat().st_size, "dtype": dtype,
              "model_type": config.model_type, "tensors": len(model.state_dict()),
              "parameters": sum(p.numel() for p in model.parameters()), "tokenizer_tokens": len(tokenizer),
              "special_token_ids": special, "special_tokens_corrected": corrected, "seconds": None}
    with atomic_dir(out_dir) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        generation.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        missing = [f for f in IMPORTED_FILES if f != RECORD and not (tmp / f).exists()]
        if missing:
            raise PipelineError(f"{path}: the import wrote no {', '.join(missing)} (transformers "
                                f"{__import__('transformers').__version__})")
        record["seconds"] = round(time.monotonic() - t0, 1)
        write_json(tmp / RECORD, record)
    return record


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gguf", required=True, help="the target as a GGUF file")
    p.add_argument("--out", required=True, help="the transformers directory to write")
    p.add_argument("--dtype", choices=DTYPES,
                   help="weights' dtype (float32: exactly the dequantized GGUF values)")


def run(args) -> int:
    record = import_gguf(args.gguf, args.out, args.dtype)
    print(json.dumps(record, indent=2))
    return 0
