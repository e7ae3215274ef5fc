"""A generator's intake of new weights: where they come from (buffers, a file, or its engine's own workers) and
which versions wait to be loaded."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from areal_hpc.config import Config
from areal_hpc.engines import GenerationEngine
from areal_hpc.runtime.build import lora_spec
from areal_hpc.runtime.comm.transfer_groups import (
    direct_transfer,
    posted_key,
    ready_key,
    transfer_backend,
    update_fields,
    worker_init_info,
)
from areal_hpc.runtime.comm.weight_sync import BucketPlan, WeightReceiver, published_layout
from areal_hpc.runtime.generation.adapters import AdapterLoader


@dataclass
class WeightIntake:
    """Where this generator's weights stand: received and not loaded yet (`staged`), loaded at least once, and
    the engine's counters at the last WEIGHTS_OK (each WEIGHTS_OK reports what was prefilled since)."""

    receiver: WeightReceiver | None  # None when the engine receives itself
    adapters: AdapterLoader | None  # with LoRA an adapter arrives each version, merged here into the base weights
    nbytes: int = 0  # what one version moves (the bucket plan's bytes): the sync limit is derived from it
    staged: tuple[int, dict] | None = None  # (version, state dict; {} when the engine receives it itself)
    direct: bool = False  # the engine receives itself (vLLM's workers, through its weight-transfer API)
    queued: list[int] = field(default_factory=list)  # direct, over the group: versions sent, in order, not loaded
    loaded: bool = False
    prefilled: int = 0  # engine.prefill_tokens at the last WEIGHTS_OK
    prefill_shared: int = 0  # engine.prefill_shared_tokens at the last WEIGHTS_OK
    interrupted: int = 0  # requests a recompute load interrupted after they had started
    sync: object = None  # the sync group (its store carries the direct path's posted / ready handshake)
    wire: dict = field(default_factory=dict)  # direct, over the group: what each update tells the workers to expect

    @classmethod
    def open(cls, cfg: Config, engine: GenerationEngine, run_dir, model_dir: Path, sync_group) -> WeightIntake:
        """The receive side of weight sync, its buffers shaped like the engine's weights (or the adapter's); an
        engine that receives itself (vLLM's workers) gets the address and bucket layout instead, and no buffers.
        With a sync group, this pairs with trainer 0's start-up: the layout check, the bandwidth measurement and,
        for such an engine, trainer 0's TransferGroups."""
        sc, spec = cfg.sync, lora_spec(cfg)
        adapters = AdapterLoader(spec, run_dir, model_dir, cfg.model.dtype) if spec else None
        direct = direct_transfer(cfg)
        if direct:  # names, shapes and dtypes only: the plan's buffers are on the meta device
            receiver = None
            plan = BucketPlan(published_layout(model_dir, cfg.model.dtype), sc.bucket_mb << 20, "meta")
        else:
            template = adapters.template() if adapters else engine.state_dict()
            receiver = WeightReceiver(sc.method, sync_group, run_dir, template, sc.bucket_mb, cfg.cluster.device)
            plan = receiver.plan
        wire = {}
        if sync_group is not None:
            sync_group.check_layout(plan.layout, cfg.cluster.device)
            sync_group.raw_bandwidth(plan.nbytes, cfg.cluster.device)
            if direct:
                tp, backend = cfg.cluster.devices_per_generator, transfer_backend(cfg.cluster.device)
                engine.connect(worker_init_info(sync_group, plan, tp, sync_group.timeout_s, backend))
                wire = update_fields(plan, backend)
        nbytes = plan.nbytes if plan is not None else 0
        return cls(receiver, adapters, nbytes=nbytes, direct=direct, sync=sync_group, wire=wire)

    def posted(self, version: int) -> bool:
        """Trainer 0 has put `version` on the wire for the engine's workers (always true for a file)."""
        return self.sync is None or self.sync.store.check([posted_key(version)])

    def receiving(self, version: int) -> None:
        """Tell trainer 0 this generator's workers start to receive `version` (its send limit starts counting)."""
        self.sync.store.set(ready_key(self.sync.rank, version), "1")

    def stage_direct(self, version: int, method: str) -> int | None:
        """A version the engine will take itself: over the group every version in turn (trainer 0 sent each), from
        disk only the newest. Returns the version this one replaces (skipped, as on the other path), else None."""
        if method == "broadcast":
            self.queued.append(version)
            self.staged = (self.queued[0], {})
            return None
        skipped = self.staged[0] if self.staged is not None else None
        self.staged = (version, {})
        return skipped
