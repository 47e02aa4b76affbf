"""Many LoRA adapters on one base model in the paged engine (vLLM's multi-LoRA serving).

    llm = LLM(enable_lora=True, max_loras=4, max_lora_rank=16)
    llm.load_lora("sql", "/adapters/sql")                       # read and checked once
    llm.generate(prompts, params, lora_request=["sql", None])   # per prompt; None: base model

Three parts, host to device:

- `LoRARegistry` (one per `LLM`): the loaded adapters by name, as host arrays. A request names
  one (or gives a `LoRARequest` with its path); the processor resolves it to a `LoadedLoRA`,
  which the request carries while it runs (unloading the name affects later requests only).
- `AdapterSlots` (one per engine): the device stack (`model.lora.LoRAWeights`, `max_loras`
  slots of rank `max_lora_rank` over fixed target linears: one shape, so a step's program never
  changes as adapters come and go) and which adapter each slot holds. The scheduler admits a
  request only once its adapter has a slot (`acquire`); a slot is pinned while a running
  sequence uses its adapter, and a slot nobody uses is reused least-recently-used first. As in
  vLLM, a request whose adapter finds every slot pinned waits in the queue while later requests
  whose adapters are resident go ahead. The engine writes newly assigned slots (`commit`, one
  jitted in-place scatter) before it packs the step.
- Each packed token's slot (i32[N], -1: base model or padding) is written by the step packer;
  the step passes `LoRABatch(weights, ids[None])` to the model.

Prefix caching keys a request's pages by its adapter too (`Request.cache_salt`, vLLM's LoRA id
in its block hash): the adapter changes every K/V after the first layer.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp

from jaxgen.engine.config import LoRAConfig
from jaxgen.errors import LoRANotLoaded
from jaxgen.model.errors import LoRAError
from jaxgen.model.lora import LoRAAdapter, check_fits, load_adapter, stack_adapters


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """An adapter for a request, by name; with a path, it is loaded on first use (vLLM's
    ``LoRARequest``, whose integer id jaxgen does not need: the name identifies it)."""

    lora_name: str
    lora_path: str | None = None


@dataclasses.dataclass(frozen=True, eq=False)
class LoadedLoRA:
    """One loaded adapter: what a request carries while it runs (compared by identity)."""

    name: str
    path: str
    uid: int  # unique per load: an adapter loaded again under the same name is a new one
    adapter: LoRAAdapter  # host arrays, written into a slot when a request needs it


class LoRARegistry:
    """The adapters an `LLM` has loaded, by name (host only)."""

    def __init__(self, cfg, lora_cfg: LoRAConfig):
        self.cfg, self.lora_cfg = cfg, lora_cfg
        self._loaded: dict[str, LoadedLoRA] = {}
        self._uids = itertools.count(1)

    @property
    def names(self) -> list[str]:
        return list(self._loaded)

    @property
    def loaded(self) -> list[LoadedLoRA]:
        return list(self._loaded.values())

    def get(self, name: str) -> LoadedLoRA | None:
        return self._loaded.get(name)

    def load(self, name: str, path: str) -> LoadedLoRA:
        """Reads and checks the PEFT adapter at `path` under `name`. Raises LoRAError."""
        if not isinstance(name, str) or not name:
            raise LoRAError(f"a LoRA adapter's name must be a non-empty string, got {name!r}")
        if name in self._loaded:
            raise LoRAError(
                f"a LoRA adapter named {name!r} is already loaded (from "
                f"{self._loaded[name].path}); unload it first or pick another name"
            )
        adapter = load_adapter(path, self.cfg)
        try:
            check_fits(adapter, self.lora_cfg.max_lora_rank, self.lora_cfg.target_modules)
        except LoRAError as e:
            raise LoRAError(
                f"{e} (the engine's max_lora_rank / lora_target_modules: LLM(max_lora_rank=..., "
                "lora_target_modules=...), jaxgen serve --max-lora-rank)"
            ) from None
        loaded = LoadedLoRA(name, path, next(self._uids), adapter)
        self._loaded[name] = loaded
        return loaded

    def unload(self, name: str) -> None:
        """Forgets `name` (requests already holding it finish with it). Raises LoRANotLoaded."""
        if self._loaded.pop(name, None) is None:
            raise LoRANotLoaded(f"no LoRA adapter named {name!r} is loaded (loaded: {self.names})")

    def resolve(self, request) -> LoadedLoRA | None:
        """A request's adapter: None (the base model), a loaded name, or a `LoRARequest`
        (loaded from its path if its name is not loaded yet)."""
        if request is None:
            return None
        if isinstance(request, LoRARequest):
            loaded = self._loaded.get(request.lora_name)
            if loaded is None and request.lora_path:
                return self.load(request.lora_name, request.lora_path)
            if loaded is not None and request.lora_path and request.lora_path != loaded.path:
                raise LoRAError(
                    f"LoRA adapter {request.lora_name!r} is loaded from {loaded.path}, not "
                    f"{request.lora_path}; unload it first to load another under that name"
                )
            request = request.lora_name
        if not isinstance(request, str):
            raise LoRANotLoaded(
                f"a LoRA request is an adapter name, a LoRARequest or None, got "
                f"{type(request).__name__}"
            )
        loaded = self._loaded.get(request)
        if loaded is None:
            raise LoRANotLoaded(
                f"no LoRA adapter named {request!r} is loaded (loaded: {self.names}); load it "
                "first (LLM.load_lora(name, path), POST /v1/load_lora_adapter)"
            )
        return loaded


@functools.partial(jax.jit, donate_argnums=0)
def _write_slot(weights, slot, one):
    """weights with slot `slot` (traced: one program for every slot) set to `one`'s only slot."""
    return jax.tree.map(lambda w, u: w.at[:, slot].set(u[:, 0]), weights, one)


class AdapterSlots:
    """An engine's device stack of adapters and which adapter each slot holds.

    Args:
      sharding: where the stack lives (a mesh's replicated sharding; None: the default device).
      note_program: the engine's `aot.ProgramLog`, told about the slot-writing program.
    """

    def __init__(self, cfg, lora_cfg: LoRAConfig, dtype, *, sharding=None, note_program=None):
        self.cfg, self.lora_cfg, self.dtype = cfg, lora_cfg, dtype
        self.sharding = sharding
        self._note_program = note_program
        self.weights = self._stack([])  # LoRAWeights, leaves [L, A, ...]
        self.held: list[LoadedLoRA | None] = [None] * lora_cfg.max_loras  # adapter per slot
        self._slot_of: dict[LoadedLoRA, int] = {}
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # oldest first
        self._writes: dict[int, LoadedLoRA] = {}  # slots assigned, not written yet
        self.loads = 0
        self.evictions = 0

    def _stack(self, adapters):
        c = self.lora_cfg
        weights = stack_adapters(
            self.cfg,
            adapters,
            num_slots=len(adapters) or c.max_loras,
            max_rank=c.max_lora_rank,
            targets=c.target_modules,
            dtype=self.dtype,
        )
        return weights if self.sharding is None else jax.device_put(weights, self.sharding)

    def slot(self, lora: LoadedLoRA | None) -> int:
        """The slot of a running request's adapter (-1: the base model)."""
        return -1 if lora is None else self._slot_of[lora]

    def acquire(self, lora: LoadedLoRA | None, in_use: set) -> bool:
        """Gives `lora` a slot: the one holding it, a free one, or the least recently used one
        whose adapter is not in `in_use` (the adapters of running sequences). False when every
        slot is pinned (the request waits)."""
        if lora is None:
            return True
        slot = self._slot_of.get(lora)
        if slot is None:
            free = [i for i, held in enumerate(self.held) if held is None]
            if free:
                slot = free[0]
            else:
                slot = next((s for s in self._lru if self.held[s] not in in_use), None)
                if slot is None:
                    return False
                del self._slot_of[self.held[slot]]
                self.evictions += 1
            self.held[slot] = lora
            self._slot_of[lora] = slot
            self._writes[slot] = lora
            self.loads += 1
        self._lru.pop(slot, None)
        self._lru[slot] = None
        return True

    def commit(self) -> None:
        """Writes the adapters of slots assigned since the last call into the device stack."""
        for slot, lora in self._writes.items():
            if self._note_program is not None:
                self._note_program("lora_write_slot")
            one = self._stack([lora.adapter])
            self.weights = _write_slot(self.weights, jnp.int32(slot), one)
        self._writes.clear()

    def stats(self) -> dict:
        return {
            "lora_slots": [None if h is None else h.name for h in self.held],
            "lora_loads": self.loads,
            "lora_evictions": self.evictions,
        }
