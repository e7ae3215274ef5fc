"""Tiny causal LMs and tokenizers built locally in Hugging Face format, and loading model folders."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
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
# The agent demo's extra tokens (model.vocab=arith_agent): a Hermes-style calculator call, as vLLM's hermes parser
# reads it, `<tool_call>{"name":"calculator","arguments":{"expression":"12*34"}}</tool_call>`; the JSON around the
# expression is one token each side, so a call is 10 tokens with its EOS.
AGENT_CALL_HEAD = '{"name":"calculator","arguments":{"expression":"'
AGENT_CALL_TAIL = '"}}'
AGENT_SYMBOLS = ["*", "<tool_call>", "</tool_call>", AGENT_CALL_HEAD, AGENT_CALL_TAIL]
AGENT_ROLES = ["<tool>"]  # a tool's result, as the endpoint renders it after an assistant turn
# The arith template, plus an assistant message's tool calls (arguments a JSON string or a mapping) and tool
# results. It renders nothing for the request's `tools`: the tiny model has no room for a schema, and the agent's
# first request then renders as the dataset's own prompt does (`<user>12*34=<assistant>`).
ARITH_AGENT_CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}<system>{{ m['content'] }}"
    "{% elif m['role'] == 'user' %}<user>{{ m['content'] }}"
    "{% elif m['role'] == 'tool' %}<tool>{{ m['content'] }}"
    "{% else %}<assistant>{{ m['content'] or '' }}"
    "{% for c in m.get('tool_calls') or [] %}{% set f = c['function'] if 'function' in c else c %}"
    '<tool_call>{"name": {{ f[\'name\'] | tojson }}, "arguments": '
    "{% if f['arguments'] is string %}{{ f['arguments'] }}{% else %}{{ f['arguments'] | tojson }}{% endif %}"
    "}</tool_call>{% endfor %}<eos>{% endif %}"
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


def build_arith_tokenizer(tool: bool = False, vocab: str = ""):
    """A word-level tokenizer over the arithmetic vocabulary (model.vocab: arith, arith_tool with the tool demo's
    tokens, arith_agent with the agent demo's; `tool`: arith_tool); decoding concatenates tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = vocab or ("arith_tool" if tool else "arith")
    extra = {"arith": [], "arith_tool": TOOL_SYMBOLS, "arith_agent": AGENT_SYMBOLS}[vocab]
    roles = ARITH_ROLES + (AGENT_ROLES if vocab == "arith_agent" else [])
    words = ARITH_SPECIALS + ARITH_SYMBOLS + roles + extra
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    if vocab == "arith":  # every symbol is its own token; whitespace is dropped
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.WhitespaceSplit(),
                pre_tokenizers.Split(Regex(r"\\boxed\{|[0-9]|\+|=|\}"), behavior="isolated"),
            ]
        )
    elif vocab == "arith_tool":  # the code fences keep their newline (the tool's stop string is "```\n")
        symbols = r"```python\n|```output\n|```\n|print\(|\\boxed\{|[0-9]|\+|\*|=|\}|\)|\n"
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(symbols), behavior="isolated"),
                pre_tokenizers.Split(Regex(r"[ \t]+"), behavior="removed"),
            ]
        )
    else:  # whitespace goes before splitting, so json.dumps's `{"name": "calculator", ...}` is the compact call
        tok.normalizer = normalizers.Replace(Regex(r"\s+"), "")
        json_pieces = "|".join(re.escape(w) for w in (AGENT_CALL_HEAD, AGENT_CALL_TAIL, "<tool_call>", "</tool_call>"))
        symbols = json_pieces + r"|\\boxed\{|[0-9]|\+|\*|=|\}"
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(symbols), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        unk_token="<unk>",
        bos_token="<bos>",
        eos_token="<eos>",
    )
    fast.add_special_tokens({"additional_special_tokens": roles})  # role markers are never split
    # <tool_call> and </tool_call> stay ordinary tokens: decoding with skip_special_tokens keeps them for the parser
    fast.chat_template = ARITH_AGENT_CHAT_TEMPLATE if vocab == "arith_agent" else ARITH_CHAT_TEMPLATE
    return fast


TINY_CACHE_ENV = "AREAL_HPC_TINY_CACHE"
"""Where built tiny models are kept for the next build of the same one (default ~/.cache/areal-hpc/tiny-models;
set empty to build every time)."""


def _tiny_cache(shape: dict, tokenizer) -> Path | None:
    """The cache folder of a tiny model of this shape, seed, tokenizer and library versions (None: caching off).
    A build imports transformers' model code and writes the folder, 5-10 s on 2 cores; sweeps and the test suite
    build the same folder dozens of times, and every later one copies it (the same bytes: the build is seeded)."""
    root = os.environ.get(TINY_CACHE_ENV, str(Path.home() / ".cache" / "areal-hpc" / "tiny-models"))
    if not root:
        return None
    from importlib.metadata import version

    what = [shape, tokenizer.backend_tokenizer.to_str(), tokenizer.chat_template, torch.__version__]
    blob = json.dumps([*what, version("transformers"), version("safetensors")], sort_keys=True)
    return Path(root) / hashlib.sha256(blob.encode()).hexdigest()[:20]


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
    """Build a randomly initialised causal LM + tokenizer and save both as a HF folder (atomic); a copy of the
    same build when one is cached (TINY_CACHE_ENV).

    if_absent: keep a folder another process published meanwhile (array tasks sharing one model path).
    """
    if arch not in ("llama", "qwen2"):
        raise ValueError(f"tiny model arch must be 'llama' or 'qwen2', got {arch!r}")
    tokenizer = tokenizer or build_arith_tokenizer()
    shape = dict(arch=arch, hidden=hidden_size, mlp=intermediate_size, layers=num_layers, heads=num_heads, seed=seed)
    cached = _tiny_cache(shape, tokenizer)
    # Save into a temp dir next to the target and rename: a half-built folder never looks usable.
    tmp = new_tmp_dir_beside(Path(out_dir))
    torch.manual_seed(seed)  # as a build leaves it, copy or not
    if cached is not None and (cached / "config.json").is_file():
        shutil.copytree(cached, tmp, dirs_exist_ok=True)
    else:
        _build_into(tmp, tokenizer, arch, hidden_size, intermediate_size, num_layers, num_heads)
        if cached is not None:  # best effort: a cache that cannot be written only costs the next build its time
            with contextlib.suppress(OSError):
                cached.parent.mkdir(parents=True, exist_ok=True)
                keep = new_tmp_dir_beside(cached)
                shutil.copytree(tmp, keep, dirs_exist_ok=True)
                publish_dir_if_absent(keep, cached)
    if if_absent:
        publish_dir_if_absent(tmp, Path(out_dir))
        return Path(out_dir)
    return atomic_publish_dir(tmp, Path(out_dir))


def _build_into(tmp: Path, tokenizer, arch: str, hidden: int, mlp: int, layers: int, heads: int) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=mlp,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    config = LlamaConfig(**common) if arch == "llama" else Qwen2Config(**common)
    model = AutoModelForCausalLM.from_config(config)  # initialised from the seeded global generator
    with no_hf_progress_bars():
        model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)


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
            tokenizer=build_arith_tokenizer(vocab=model_cfg.vocab),
            if_absent=True,
        )
    return check_model_folder(p)


# tokenizer classes that name transformers' generic fast tokenizer, the class AutoTokenizer would pick for them
GENERIC_FAST = {"TokenizersBackend", "PreTrainedTokenizerFast"}


def load_tokenizer(path: str | Path):
    """The folder's tokenizer, as AutoTokenizer loads it. A folder whose tokenizer is transformers' generic fast one
    (the tiny models' is) gets that class straight away: importing AutoTokenizer costs 4-5 s of CPU more, paid by
    every process that only needs a tokenizer (the launcher, each Slurm world's prepare step, rank 0)."""
    p = Path(path)
    try:
        tc = json.loads((p / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        tc = {}
    tc = tc if isinstance(tc, dict) else {}  # a malformed file is AutoTokenizer's to report
    # a folder that maps its own tokenizer code (auto_map) is AutoTokenizer's to load
    if tc.get("tokenizer_class") in GENERIC_FAST and "auto_map" not in tc and (p / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(p))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(p))


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
