"""Tiny causal LMs and tokenizers built locally in Hugging Face format, and loading model folders."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

from areal_hpc.utils import atomic_publish_dir, new_tmp_dir_beside, publish_dir_if_absent

# The arithmetic task's vocabulary: special tokens, digits, operators and the answer wrapper.
ARITH_SPECIALS = ["<pad>", "<unk>", "<bos>", "<eos>"]
ARITH_SYMBOLS = [str(d) for d in range(10)] + ["+", "=", "\\boxed{", "}"]
# Chat turns for the tiny tokenizer's own chat template, so the chat-template path runs end to end on the demo.
ARITH_ROLES = ["<system>", "<user>", "<assistant>"]
# The tool demo's extra tokens (model.vocab=arith_tool): a code block calling print(), and its output block.
TOOL_SYMBOLS = ["*", "```python\n", "```output\n", "```\n", "print(", ")", "\n"]
ARITH_CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}<system>{{ m['content'] }}"
    "{% elif m['role'] == 'user' %}<user>{{ m['content'] }}"
    "{% else %}<assistant>{{ m['content'] }}<eos>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@contextlib.contextmanager
def no_hf_progress_bars():
    """transformers 5 draws progress bars on every save and load; tiny folders need none, and a command's
    stderr stays one clear line on failure."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


class ModelFolderError(ValueError):
    """A model folder that transformers cannot load; one line saying what is missing."""


def build_arith_tokenizer(tool: bool = False):
    """A word-level tokenizer over the arithmetic vocabulary (with `tool`: the tool demo's tokens too);
    decoding concatenates tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ARITH_SPECIALS + ARITH_SYMBOLS + ARITH_ROLES + (TOOL_SYMBOLS if tool else [])
    vocab = {tok: i for i, tok in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    if not tool:  # every symbol is its own token; whitespace is dropped
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.WhitespaceSplit(),
                pre_tokenizers.Split(Regex(r"\\boxed\{|[0-9]|\+|=|\}"), behavior="isolated"),
            ]
        )
    else:  # the code fences keep their newline (the tool's stop string is "```\n"); spaces are dropped
        symbols = r"```python\n|```output\n|```\n|print\(|\\boxed\{|[0-9]|\+|\*|=|\}|\)|\n"
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(symbols), behavior="isolated"),
                pre_tokenizers.Split(Regex(r"[ \t]+"), behavior="removed"),
            ]
        )
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        unk_token="<unk>",
        bos_token="<bos>",
        eos_token="<eos>",
    )
    fast.add_special_tokens({"additional_special_tokens": ARITH_ROLES})  # role markers are never split
    fast.chat_template = ARITH_CHAT_TEMPLATE
    return fast


def build_tiny_model(
    out_dir: str | Path,
    arch: str = "llama",
    hidden_size: int = 128,
    intermediate_size: int = 512,
    num_layers: int = 2,
    num_heads: int = 4,
    seed: int = 0,
    tokenizer=None,
    if_absent: bool = False,
) -> Path:
    """Build a randomly initialised causal LM + tokenizer and save both as a HF folder (atomic).

    if_absent: keep a folder another process published meanwhile (array tasks sharing one model path).
    """
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    tokenizer = tokenizer or build_arith_tokenizer()
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    if arch == "llama":
        config = LlamaConfig(**common)
    elif arch == "qwen2":
        config = Qwen2Config(**common)
    else:
        raise ValueError(f"tiny model arch must be 'llama' or 'qwen2', got {arch!r}")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    # Save into a temp dir next to the target and rename: a half-built folder never looks usable.
    tmp = new_tmp_dir_beside(Path(out_dir))
    with no_hf_progress_bars():
        model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    if if_absent:
        publish_dir_if_absent(tmp, Path(out_dir))
        return Path(out_dir)
    return atomic_publish_dir(tmp, Path(out_dir))


def check_model_folder(path: str | Path) -> Path:
    """Raise ModelFolderError (one line) unless `path` holds a loadable HF causal LM + tokenizer."""
    p = Path(path)
    if not p.is_dir():
        raise ModelFolderError(
            f"model folder {str(p)!r} does not exist "
            "(set model.path to a local Hugging Face folder, or model.build_tiny=true)"
        )
    if not (p / "config.json").is_file():
        raise ModelFolderError(f"model folder {str(p)!r} has no config.json; expected a Hugging Face model folder")
    weights = list(p.glob("*.safetensors")) + list(p.glob("*.bin"))
    if not weights:
        raise ModelFolderError(f"model folder {str(p)!r} has no weights (*.safetensors or *.bin)")
    if not any((p / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise ModelFolderError(
            f"model folder {str(p)!r} has no tokenizer files (tokenizer.json, tokenizer.model or vocab.json)"
        )
    try:
        json.loads((p / "config.json").read_text())
    except json.JSONDecodeError as err:
        raise ModelFolderError(f"model folder {str(p)!r}: config.json is not valid JSON ({err.msg})") from None
    return p


def ensure_model(model_cfg) -> Path:
    """Return the model folder named by the config, building the tiny model there if asked."""
    p = Path(model_cfg.path)
    # build only into a missing or empty folder: never replace what a user put there
    if model_cfg.build_tiny and (not p.exists() or (p.is_dir() and not any(p.iterdir()))):
        build_tiny_model(
            p,
            arch=model_cfg.arch,
            hidden_size=model_cfg.hidden_size,
            intermediate_size=model_cfg.intermediate_size,
            num_layers=model_cfg.num_layers,
            num_heads=model_cfg.num_heads,
            tokenizer=build_arith_tokenizer(tool=model_cfg.vocab == "arith_tool"),
            if_absent=True,
        )
    return check_model_folder(p)


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def text_decoder(tokenizer):
    """ids -> text without special tokens, as tokenizer.decode gives it; through the Rust tokenizer directly when
    that is the same text (a fast tokenizer without space clean-up): transformers' wrapper checks every id in
    Python first, which costs the generator's loop more than the decoding itself."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
    return lambda ids: backend.decode(ids, skip_special_tokens=True)


def _ids(value) -> list[int]:
    """An eos_token_id entry: one id, a list of ids, or absent."""
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def stop_token_ids(path: str | Path, tokenizer=None) -> list[int]:
    """Every token that ends an answer: generation_config.json's and config.json's eos_token_id (an id or a
    list; real models declare several, e.g. Qwen's <|im_end|> and <|endoftext|>) plus the tokenizer's EOS."""
    p = Path(path)
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        f = p / name
        if f.is_file():
            ids += _ids(json.loads(f.read_text()).get("eos_token_id"))
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(p)
    ids += _ids(tokenizer.eos_token_id)
    if not ids:
        raise ModelFolderError(f"model folder {str(p)!r} declares no EOS token (generation_config.json, tokenizer)")
    return sorted(set(ids))


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # model.dtype -> torch


def load_causal_lm(path: str | Path, dtype: str = "float32"):
    from transformers import AutoModelForCausalLM

    torch_dtype = DTYPES[dtype]
    with no_hf_progress_bars():
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype, attn_implementation="sdpa")


def untied(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict ready for safetensors, which refuses tensors that share storage (tied weights, ZeRO-1/2's
    views into one flat buffer): every tensor after the first of a storage becomes a copy."""
    out, seen = {}, set()
    for k, v in state.items():
        ptr = v.untyped_storage().data_ptr()
        out[k] = v.clone() if ptr in seen else v
        seen.add(ptr)
    return out
