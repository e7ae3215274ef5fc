"""`areal-hpc export`: a run's checkpoint (torch, or DeepSpeed ZeRO shards merged on CPU) as a Hugging Face folder."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from areal_hpc.model import untied
from areal_hpc.model.checkpoints import adapter_base_folder, is_lora_checkpoint, run_model_folder, run_of_checkpoint
from areal_hpc.rundir import CHECKPOINT_META, DEEPSPEED_TAG, WEIGHTS_FILE, RunDir

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# files of a model folder that hold weights: the export writes its own, everything else is copied
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".safetensors.index.json", ".bin.index.json", ".pt", ".pth", ".h5")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


class ExportError(ValueError):
    """A checkpoint or output folder the export cannot use; one line saying what is wrong."""


@dataclass
class Exported:
    out: Path
    kind: str  # "a torch trainer's checkpoint", "DeepSpeed ZeRO-3 shards of 2 trainers"
    version: int
    base: Path  # the run's model folder: config, tokenizer and generation config came from it
    n_params: int
    dtype: str
    bytes: int
    files: list[str]

    def summary(self) -> str:
        if "adapter_model.safetensors" in self.files:
            return (
                f"wrote {self.out} ({_size(self.bytes)}): adapter_model.safetensors with {self.n_params / 1e6:.3f}M "
                f"parameters in {self.dtype} from version {self.version} ({self.kind}) and adapter_config.json; "
                f"it applies to {self.base}"
            )
        others = ", ".join(f for f in self.files if f != WEIGHTS_FILE)
        return (
            f"wrote {self.out} ({_size(self.bytes)}): model.safetensors with {self.n_params / 1e6:.2f}M parameters "
            f"in {self.dtype} from version {self.version} ({self.kind}); {others} from {self.base}"
        )


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MB" if n < 2**30 else f"{n / 2**30:.2f} GB"


def _check_checkpoint(ckpt: Path) -> tuple[RunDir, int, dict]:
    """The run, version and meta.json of a complete trainer checkpoint; ExportError otherwise."""
    found = run_of_checkpoint(ckpt) if ckpt.is_dir() else None
    if found is None:
        where = RunDir("RUN_DIR").trainer_checkpoint(42)
        raise ExportError(f"{str(ckpt)!r} is not a run's checkpoint folder (like {where}, with RUN_DIR/config.yaml)")
    run, version = found
    try:  # the trainers write meta.json last, so without it the folder is not a finished checkpoint
        meta = json.loads((ckpt / CHECKPOINT_META).read_text())
    except (OSError, ValueError):
        raise ExportError(f"checkpoint {str(ckpt)!r} is incomplete: no readable meta.json") from None
    if "lora" in meta and not is_lora_checkpoint(ckpt):
        raise ExportError(f"checkpoint {str(ckpt)!r} is incomplete: no adapter.safetensors")
    if "zero_stage" not in meta:
        if "lora" not in meta and not (ckpt / WEIGHTS_FILE).is_file():
            raise ExportError(f"checkpoint {str(ckpt)!r} is incomplete: no model.safetensors")
        return run, version, meta
    shards = ckpt / DEEPSPEED_TAG
    world, stage = int(meta["world"]), int(meta["zero_stage"])
    optim = list(shards.glob("*_optim_states.pt"))
    model = list(shards.glob("*_model_states.pt"))
    if len(optim) != world or len(model) < (world if stage == 3 else 1):
        raise ExportError(
            f"checkpoint {str(ckpt)!r} is incomplete: ds/ holds {len(optim)} optimizer and {len(model)} model "
            f"shards of the {world} ZeRO-{stage} trainers that wrote it"
        )
    return run, version, meta


def _read_weights(ckpt: Path, meta: dict, base: Path) -> dict[str, torch.Tensor]:
    """The trainer's fp32 weights, on CPU: its safetensors file, the ZeRO shards consolidated by DeepSpeed, or
    a LoRA checkpoint's adapter merged into `base`."""
    if "lora" in meta:
        from areal_hpc.engines.lora import read_merged

        read = partial(read_merged, ckpt, base)
    elif "zero_stage" not in meta:
        from safetensors.torch import load_file

        read = partial(load_file, str(ckpt / WEIGHTS_FILE))
    else:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # a login node: no GPU, and none is needed
        try:
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        except ImportError:
            raise ExportError("exporting DeepSpeed shards needs DeepSpeed: pip install deepspeed==0.19.8") from None
        read = partial(get_fp32_state_dict_from_zero_checkpoint, str(ckpt), tag=DEEPSPEED_TAG)
    chatter = io.StringIO()  # DeepSpeed's progress prints and bars; the command prints lines of its own
    try:
        with contextlib.redirect_stdout(chatter), contextlib.redirect_stderr(chatter):
            return read()
    except Exception as err:  # a torn or damaged file: torch, safetensors and DeepSpeed each raise their own
        what = (str(err).splitlines() or [""])[0]
        raise ExportError(f"checkpoint {str(ckpt)!r} cannot be read ({type(err).__name__}: {what})") from None


def checkpoint_model(checkpoint: str | Path, weights: bool = True) -> tuple[Path, dict[str, torch.Tensor] | None]:
    """A complete trainer checkpoint as a model: the folder its architecture and tokenizer come from (the run's
    model folder, or a LoRA run's base) and its fp32 weights on CPU (None unless `weights`); ExportError otherwise.
    (The distillation teacher loads a checkpoint this way.)"""
    ckpt = Path(checkpoint).resolve()
    run, _, meta = _check_checkpoint(ckpt)
    base = adapter_base_folder(run) if "lora" in meta else run_model_folder(run)
    if not weights:
        return base, None
    sd = _read_weights(ckpt, meta, base)
    _check_fits(sd, base, ckpt)
    return base, sd


def _check_fits(weights: dict[str, torch.Tensor], base: Path, ckpt: Path) -> int:
    """Every tensor the model folder's architecture has, of its shape, and no other (on the meta device: free);
    returns the architecture's parameter count (tied ones once)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(base))
    want = {k: tuple(v.shape) for k, v in skeleton.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in weights.items()}
    wrong = sorted(set(want) ^ set(got)) + sorted(k for k in set(want) & set(got) if want[k] != got[k])
    if wrong:
        raise ExportError(
            f"checkpoint {str(ckpt)!r} does not fit its run's model folder {str(base)!r}: "
            f"{wrong[0]} differs ({len(wrong)} tensors in all)"
        )
    return sum(p.numel() for p in skeleton.parameters())


def _open_as_umask_allows(folder: Path) -> None:
    """The temporary folder (and safetensors' file) are private to their owner; an export is for others too."""
    mask = os.umask(0)
    os.umask(mask)
    folder.chmod(0o777 & ~mask)
    for f in folder.iterdir():
        f.chmod(0o666 & ~mask)


def _export_adapter(ckpt: Path, out: Path, base: Path, version: int, kind: str) -> Exported:
    """The adapter alone, as PEFT writes one (PeftModel.from_pretrained(the base model, out) loads it)."""
    from areal_hpc.engines.lora import write_peft_adapter
    from areal_hpc.utils import new_tmp_dir_beside, publish_dir_if_absent

    tmp = new_tmp_dir_beside(out)
    try:
        n = write_peft_adapter(ckpt, base, tmp)
        _open_as_umask_allows(tmp)
        files = sorted(p.name for p in tmp.iterdir())
        size = sum((tmp / f).stat().st_size for f in files)
        if not publish_dir_if_absent(tmp, out):
            raise ExportError(f"OUT_DIR {str(out)!r} was written by someone else during the export; nothing written")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Exported(out, kind, version, base, n, "float32", size, files)


def _folder_dtype(config: dict) -> str:
    return config.get("dtype") or config.get("torch_dtype") or "float32"  # transformers 5 / 4 name it so


def export_checkpoint(
    checkpoint: str | Path,
    out_dir: str | Path,
    dtype: str = "auto",
    progress: Callable[[str], None] = print,
    adapter_only: bool = False,
) -> Exported:
    """Write RUN_DIR/checkpoints/vN as a Hugging Face folder in `out_dir` (new or empty), atomically.

    Weights: the checkpoint's, cast to `dtype` ("auto": the run's model folder's dtype); a LoRA checkpoint's
    adapter merged into the model it trained on. Everything else (config.json, tokenizer files,
    generation_config.json, chat template) is copied from that model folder, so the export loads and prompts
    exactly as the run's model did. `adapter_only`: a LoRA checkpoint's adapter in PEFT's format instead.
    """
    from safetensors.torch import save_file

    from areal_hpc.utils import new_tmp_dir_beside, publish_dir_if_absent

    ckpt, out = Path(checkpoint).resolve(), Path(out_dir).resolve()
    run, version, meta = _check_checkpoint(ckpt)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"OUT_DIR {str(out)!r} exists and is not empty; give a new or empty folder")
    lora = "lora" in meta
    if adapter_only and not lora:
        raise ExportError(f"--adapter: checkpoint {str(ckpt)!r} holds full weights, no LoRA adapter")
    base = adapter_base_folder(run) if lora else run_model_folder(run)
    if not (base / "config.json").is_file() or not any((base / f).is_file() for f in _TOKENIZER_FILES):
        raise ExportError(
            f"checkpoint {str(ckpt)!r}: its run's model folder {str(base)!r} (model.path in {run.config}) is gone "
            "or lacks config.json or tokenizer files; the export takes the architecture and tokenizer from it"
        )
    config = json.loads((base / "config.json").read_text())
    target = _folder_dtype(config) if dtype == "auto" else dtype
    if target not in DTYPES:
        raise ExportError(f"--dtype {target!r} is not one of {', '.join(DTYPES)}")
    sharded = "zero_stage" in meta
    kind = "a torch trainer's checkpoint"
    if sharded:
        kind = f"DeepSpeed ZeRO-{meta['zero_stage']} shards of {meta['world']} trainers"
    if lora:
        kind = f"a rank-{meta['lora']['rank']} LoRA adapter" + ("" if adapter_only else " merged into the base")
    if adapter_only:
        return _export_adapter(ckpt, out, base, version, kind)
    progress(f"reading {ckpt}: {kind}" + (", consolidated on CPU" if sharded and not lora else ""))
    weights = _read_weights(ckpt, meta, base)
    n_params = _check_fits(weights, base, ckpt)
    tmp = new_tmp_dir_beside(out)
    try:
        for f in base.iterdir():
            if f.is_file() and not f.name.endswith(_WEIGHT_SUFFIXES):
                shutil.copyfile(f, tmp / f.name)
        if target != _folder_dtype(config):  # say what the weights are, or transformers would load them as the base
            config["torch_dtype" if "torch_dtype" in config else "dtype"] = target
            (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if not (tmp / "generation_config.json").exists():
            from transformers import AutoConfig, GenerationConfig

            GenerationConfig.from_model_config(AutoConfig.from_pretrained(base)).save_pretrained(tmp)
        cast = {k: (v.to(DTYPES[target]) if v.is_floating_point() else v).contiguous() for k, v in weights.items()}
        save_file(untied(cast), str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        _open_as_umask_allows(tmp)
        files = sorted(p.name for p in tmp.iterdir())
        size = sum((tmp / f).stat().st_size for f in files)
        if not publish_dir_if_absent(tmp, out):  # another process filled OUT_DIR meanwhile: its files stay
            raise ExportError(f"OUT_DIR {str(out)!r} was written by someone else during the export; nothing written")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Exported(out, kind, version, base, n_params, target, size, files)
