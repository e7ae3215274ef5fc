"""LoRA: adapters on a trainer's linear layers (PEFT), and a published adapter merged into a generator's weights."""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from areal_hpc.model import load_causal_lm
from areal_hpc.rundir import ADAPTER_FILE, CHECKPOINT_META

# PEFT names the one adapter it holds; the published names leave it out (PEFT's own saved format does too)
_ADAPTER = "default"


@dataclass(frozen=True)
class LoraSpec:
    """An adapter's shape: rank r, scale alpha / r, and which linear layers carry one (by leaf name)."""

    rank: int
    alpha: float
    targets: tuple[str, ...] = ()  # leaf names (q_proj, down_proj); () = every linear layer but the output layer

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def target_modules(model: nn.Module, targets: tuple[str, ...] | list[str] = ()) -> list[str]:
    """Full names of the linear layers an adapter goes on, in the model's order.

    The output layer is never adapted: the trainer projects it chunk by chunk (engines/forward.py), and an
    adapter there would be a second vocabulary-sized matrix. ValueError (one line) when nothing matches.
    """
    out_layer = model.get_output_embeddings()
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and m is not out_layer]
    names = [n for n in linears if not targets or n.rsplit(".", 1)[-1] in targets]
    unknown = sorted(set(targets) - {n.rsplit(".", 1)[-1] for n in linears})
    if unknown or not names:
        leaves = sorted({n.rsplit(".", 1)[-1] for n in linears})
        raise ValueError(
            f"config trainer.lora_targets names {unknown or list(targets)}, which match no linear layer of the "
            f"model; its linear layers are {leaves} ([] = all of them)"
        )
    return names


def model_skeleton(model_dir: str | Path) -> nn.Module:
    """The model folder's architecture on the meta device: names and shapes, no memory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))


def adapter_shapes(model_dir: str | Path, spec: LoraSpec) -> dict[str, tuple[int, ...]]:
    """The published adapter's tensors (name -> shape), known from the model folder alone: what a generator's
    receive buffers must hold before the first adapter arrives."""
    skeleton = model_skeleton(model_dir)
    shapes: dict[str, tuple[int, ...]] = {}
    for name in target_modules(skeleton, spec.targets):
        layer = skeleton.get_submodule(name)
        shapes[f"{name}.lora_A.weight"] = (spec.rank, layer.in_features)
        shapes[f"{name}.lora_B.weight"] = (layer.out_features, spec.rank)
    return shapes


def attach(model: nn.Module, spec: LoraSpec) -> list[str]:
    """Put an adapter on each targeted layer, in place, and freeze every other weight; returns the layers.

    PEFT's initialisation: A random, B zero, so the adapted model starts as the base model.
    """
    from peft import LoraConfig, inject_adapter_in_model

    names = target_modules(model, spec.targets)
    config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=names, lora_dropout=0.0, bias="none")
    inject_adapter_in_model(config, model, adapter_name=_ADAPTER)
    for n, p in model.named_parameters():
        p.requires_grad_(".lora_" in n)
    return names


def _lora_layers(model: nn.Module):
    from peft.tuners.lora import LoraLayer

    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoraLayer)]


def adapter_params(model: nn.Module) -> dict[str, nn.Parameter]:
    """The adapter's parameters by published name ({layer}.lora_A.weight, {layer}.lora_B.weight)."""
    out: dict[str, nn.Parameter] = {}
    for name, layer in _lora_layers(model):
        out[f"{name}.lora_A.weight"] = layer.lora_A[_ADAPTER].weight
        out[f"{name}.lora_B.weight"] = layer.lora_B[_ADAPTER].weight
    return out


def base_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The base model's weights under their Hugging Face names (PEFT's `.base_layer` taken out, no adapter)."""
    return {k.replace(".base_layer.", "."): v for k, v in model.state_dict().items() if ".lora_" not in k}


def merged_state(model: nn.Module, scale: float) -> dict[str, torch.Tensor]:
    """The weights of the adapted model as one plain model would hold them: W0 + scale * B A per layer."""
    state = {k: v.detach() for k, v in base_state(model).items()}
    adapter = {k: v.detach() for k, v in adapter_params(model).items()}
    return state | merge(state, adapter, scale)


def merge(base: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """{layer}.weight = W0 + scale * B A for each adapted layer, in fp32, then in W0's dtype on the adapter's device."""
    out: dict[str, torch.Tensor] = {}
    for key in adapter:
        if not key.endswith(".lora_A.weight"):
            continue
        layer = key.removesuffix(".lora_A.weight")
        a, b = adapter[key], adapter[f"{layer}.lora_B.weight"]
        w0 = base[f"{layer}.weight"]
        w = w0.to(a.device, torch.float32) + scale * (b.float() @ a.float())
        out[f"{layer}.weight"] = w.to(w0.dtype)
    return out


@contextlib.contextmanager
def adapters_off(model: nn.Module):
    """The base model for the duration: the KL term's reference policy, with no second copy of the weights."""
    layers = [m for _, m in _lora_layers(model)]
    trainable = {id(p): p.requires_grad for m in layers for p in m.parameters()}
    for m in layers:
        m.enable_adapters(False)
    try:
        yield
    finally:
        for m in layers:
            m.enable_adapters(True)
            for p in m.parameters():  # PEFT's toggle changes requires_grad; the base stays frozen
                p.requires_grad_(trainable[id(p)])


# Layers vLLM fuses into one matrix (qkv_proj, gate_up_proj): a load that names one of a group must name them all,
# since vLLM rebuilds a fused layer from the tensors a load gives it and leaves the rest of it uninitialised
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def fused_siblings(layers: list[str]) -> list[str]:
    """The layers fused with these ones (same module, another member of a FUSED_GROUPS group), not among them."""
    given, out = set(layers), []
    for name in layers:
        prefix, _, leaf = name.rpartition(".")
        for group in FUSED_GROUPS:
            if leaf in group:
                out += [f"{prefix}.{s}" for s in group if f"{prefix}.{s}" not in given and f"{prefix}.{s}" not in out]
    return out


class AdapterMerger:
    """A generator's side of LoRA: host copies of the adapted layers' base weights, and each received
    adapter turned into full weights for the engine's ordinary in-place load (so decoding runs on plain
    merged matrices, at full-weight speed, with no LoRA kernel).

    Built from the base weights, so `base` is W0 whatever was merged since. An adapted layer's unadapted fused
    siblings (k_proj beside adapted q_proj and v_proj) go with every load too, as their base weights.
    """

    def __init__(self, engine_state: dict[str, torch.Tensor], layers: list[str], scale: float):
        self.scale = scale
        self.base = {f"{n}.weight": engine_state[f"{n}.weight"].detach().to("cpu", copy=True) for n in layers}
        self.siblings = {
            f"{n}.weight": engine_state[f"{n}.weight"].detach().to("cpu", copy=True) for n in fused_siblings(layers)
        }

    def merged(self, adapter: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        want = {f"{k.removesuffix('.weight')}.lora_{ab}.weight" for k in self.base for ab in "AB"}
        if set(adapter) != want:
            raise RuntimeError(
                f"received adapter tensors {sorted(set(adapter) ^ want)[:2]} do not fit the adapted layers "
                f"({len(self.base)} layers, {len(want)} tensors expected)"
            )
        return merge(self.base, adapter, self.scale) | self.siblings


# -- checkpoints (their adapter in ADAPTER_FILE: alone, fp32, published names) ----------------------


def checkpoint_meta(spec: LoraSpec | None) -> dict:
    """meta.json's record of the adapter (export and eval merge it into the run's base model)."""
    if spec is None:
        return {}
    return {"lora": {"rank": spec.rank, "alpha": spec.alpha, "targets": list(spec.targets)}}


def spec_of(meta: dict) -> LoraSpec | None:
    lo = meta.get("lora")
    return LoraSpec(int(lo["rank"]), float(lo["alpha"]), tuple(lo["targets"])) if lo else None


def checkpoint_spec(path: Path) -> LoraSpec | None:
    """The adapter a checkpoint's meta.json records (None: full weights)."""
    return spec_of(json.loads((Path(path) / CHECKPOINT_META).read_text()))


def check_checkpoint(path: Path, spec: LoraSpec | None) -> None:
    """ValueError (one line) when a checkpoint's adapter, or its lack of one, is not what this run trains."""
    found = checkpoint_spec(path)
    if found != spec:
        what = lambda s: f"a rank-{s.rank} adapter (alpha {s.alpha})" if s else "full weights"  # noqa: E731
        raise ValueError(
            f"checkpoint {str(path)!r} holds {what(found)} and this run trains {what(spec)} (trainer.lora_*); "
            "resume with the settings it was written with"
        )


@torch.no_grad()
def load_adapter(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    for name, p in adapter_params(model).items():
        p.copy_(state[name])


def read_merged(checkpoint: Path, base_dir: Path) -> dict[str, torch.Tensor]:
    """A LoRA checkpoint's policy as plain fp32 weights: the base folder's weights with its adapter merged
    (tied weights still share storage: model.untied before safetensors writes them)."""
    spec, adapter = checkpoint_spec(checkpoint), load_file(str(Path(checkpoint) / ADAPTER_FILE))
    base = {k: v.detach() for k, v in load_causal_lm(base_dir, "float32").state_dict().items()}
    return base | merge(base, adapter, spec.scale)


def write_peft_adapter(checkpoint: Path, base_dir: Path, out: Path) -> int:
    """The checkpoint's adapter in PEFT's own format (adapter_config.json + adapter_model.safetensors), for
    `PeftModel.from_pretrained(base model, out)`; returns its parameter count."""
    from peft import LoraConfig

    spec, adapter = checkpoint_spec(checkpoint), load_file(str(Path(checkpoint) / ADAPTER_FILE))
    layers = sorted({k.rsplit(".lora_", 1)[0] for k in adapter})
    config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=layers, lora_dropout=0.0, bias="none")
    config.base_model_name_or_path = str(base_dir)
    config.save_pretrained(str(out))
    save_file(
        {f"base_model.model.{k}": v.contiguous() for k, v in adapter.items()}, str(out / "adapter_model.safetensors")
    )
    return sum(v.numel() for v in adapter.values())
