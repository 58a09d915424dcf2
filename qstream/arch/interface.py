"""The architecture interface (docs/model.md, "Architectures"): what the package asks of a draft
architecture (:class:`Architecture`, listed in qstream/arch/registry.py) and of its drafter kind,
and the rollouts it reads.

>>> arch = architecture_of(config)                   # qstream.arch.registry
>>> model = arch.build(config, weights, REFERENCE_VARIANT, "cpu")   # qstream.serving
>>> state = arch.drafter.propose(model, aux, stream, anchor, first_token)   # opaque
>>> greedy = arch.drafter.rollout(state)             # Rollout: tokens, prev, logits, confidence
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from qstream.serving import Variant

Shapes = dict[str, tuple[int, ...]]
LM_HEAD = "lm_head.weight"  # the output head, borrowed from the target unless the draft has its own
EMBED = "embed_tokens.weight"  # the draft's own, or the target's when the draft carries none
# Where `qstream synth` puts the stand-in target (lm_head.weight [V, H]), and where a draft's
# loader looks for its lm_head when no target is given.
TARGET_HEAD_DIR = "target_head"


def causal_layers(num_layers: int, depth: int | None = None) -> list[int]:
    """The layer run at each of ``depth`` steps of a causal pass: the layers in order, repeated
    (default: each once; the boot regime asks one step per target aux layer, docs/eval-drift.md)."""
    steps = num_layers if depth is None else depth
    if num_layers < 1 or steps < 1:
        raise ValueError(f"a causal pass needs layers and steps, got {num_layers} and {steps}")
    return [j % num_layers for j in range(steps)]


@dataclass(frozen=True)
class Blocks:
    """A block drafter's non-causal pass over N blocks (qstream/arch/markov.py reads it)."""

    logits_base: torch.Tensor  # U [N, B, V] float32 (computed in the model's dtype)
    hidden: torch.Tensor  # hf [N, B, H] float32: final-normed block states
    first_token: torch.Tensor  # [N] int64: ids[p], the Markov head's prev_0


@dataclass(frozen=True)
class Rollout:
    """The k tokens drafted at each of N anchors (greedy, sampled or teacher-forced)."""

    tokens: torch.Tensor  # [N, B] drafted tokens d_k (teacher-forced: the supplied tokens)
    prev: torch.Tensor  # [N, B] token fed back before step k: [ids[p], d_0, ..., d_{B-2}]
    logits: torch.Tensor  # [N, B, V] float32 (block drafter: U_k + markov_w2 . markov_w1[prev_k])
    confidence: torch.Tensor | None  # [N, B] float32 sigmoid scores; None without the head


class AuxChunks(Protocol):
    """Aux states [S, T, A] too big to hold: ``context`` calls ``rows`` on consecutive ranges."""

    shape: tuple[int, int, int]

    def rows(self, t0: int, t1: int) -> torch.Tensor:
        """Positions t0..t1-1 of every stream: [S, t1 - t0, A]."""
        ...


class DraftConfig(Protocol):
    """What the package reads of any DSpark-family draft's config.json (its field names)."""

    @property
    def hidden_size(self) -> int: ...
    @property
    def num_hidden_layers(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def max_position_embeddings(self) -> int: ...
    @property
    def original_max_position_embeddings(self) -> int: ...
    @property
    def target_hidden_size(self) -> int: ...
    @property
    def target_num_hidden_layers(self) -> int | None: ...  # None: the config does not say
    @property
    def target_layer_ids(self) -> tuple[int, ...]: ...
    @property
    def num_target_layers(self) -> int: ...
    @property
    def eos_token_id(self) -> int | None: ...
    @property
    def markov_rank(self) -> int: ...
    @property
    def enable_confidence_head(self) -> bool: ...
    @property
    def confidence_head_with_markov(self) -> bool: ...
    @property
    def aux_size(self) -> int: ...
    def to_json(self) -> dict[str, Any]: ...


class DraftModel(Protocol):
    """A draft built with its weights for a serving configuration, on ``device``."""

    @property
    def config(self) -> Any: ...
    @property
    def device(self) -> torch.device: ...
    # aux [S, T, A] -> the per-stream context every block of those streams reads
    def context(
        self, aux: torch.Tensor | AuxChunks, lengths: torch.Tensor | None = None
    ) -> Any: ...
    # the layers as a causal decoder over ids [S, T] -> [S, T, depth, H] fp32
    def causal_hidden(self, ids: torch.Tensor, depth: int | None = None) -> torch.Tensor: ...


class Drafter(Protocol):
    """A drafter kind: how a built draft proposes k tokens at each of N anchors, in a state
    opaque to its callers, and the rollouts read of it (docs/model.md, "Architectures")."""

    # proposal n on stream[n] of aux [S, T, A] at anchor[n], from first_token[n] (ids[p]);
    # ids [S, >= T+1]: the streams' tokens, which a chain drafter's prefill reads
    def propose(
        self,
        model: Any,
        aux: torch.Tensor | AuxChunks,
        stream: Any,
        anchor: Any,
        first_token: Any,
        ids: torch.Tensor | None = None,
    ) -> Any: ...
    # greedy (noise None) or sampled (Exp(1) race noise [N, B, V])
    def rollout(
        self, state: Any, noise: torch.Tensor | None = None, temperature: float = 1.0,
        top_p: float = 1.0,
    ) -> Rollout: ...  # fmt: skip
    # the rollout when the drafted tokens are given (e.g. the reference's)
    def teacher_forced(self, state: Any, tokens: torch.Tensor) -> Rollout: ...
    def on_host(self, state: Any) -> Any: ...  # the state where the metrics and verifiers run

    # The FP32 reference verifier (--acceptance): what it keeps of the reference's state between
    # passes, and of the reference itself instead of the model; the reference's logits
    # [N, B, V] on another rollout's drafted prefixes, exactly as its own rollout computes them.
    def keep(self, state: Any) -> tuple[torch.Tensor, ...]: ...
    def reference_head(self, weights: Mapping[str, torch.Tensor], config: Any) -> Any: ...
    def replay(
        self, head: Any, kept: tuple[torch.Tensor, ...], drafted: Rollout
    ) -> torch.Tensor: ...


class Architecture(Protocol):
    """One draft architecture (docs/model.md, "Architectures")."""

    config_type: type  # what parse_config returns
    quantize_include: tuple[str, ...]  # module kinds a shipped draft quantizes
    presets: Mapping[str, Any]  # name -> config, the sizes `qstream synth` builds
    # vLLM's serving profiles as data (qstream/vllm/profiles.py's Profile fields), one per
    # class vLLM serves the architecture as (EAGLE-3: its Llama and Qwen3 forms); () for none
    serving: tuple[Mapping[str, Any], ...]
    final_norm: str  # the norm whose output the lm_head reads ("norm.weight")
    context_proj: str  # the module projecting the concatenated target states ("fc")
    # whether the architecture's published checkpoints carry embed_tokens (else the target's)
    ships_embed_tokens: bool
    # whether vLLM embeds with the target's embed_tokens even when the draft stores its own
    embeds_with_target: bool
    not_evaluated: str | None  # why eval-drift and speculate cannot run it yet (None: they can)
    not_captured: str | None  # why capture cannot run it yet (None: it can)
    # why calibration (static activation and KV-cache scales) cannot yet (None: it can)
    not_calibrated: str | None

    def recognises(self, data: Mapping[str, Any]) -> bool: ...  # config.json contents name it
    # config.json contents -> the config (ValueError naming the key and value)
    def parse_config(self, data: Mapping[str, Any]) -> Any: ...
    # the checkpoint's tensors and shapes, in checkpoint order
    def tensor_shapes(self, config: Any) -> Shapes: ...
    # why a tensor of a wrong shape does not fit, when the config explains it ("" else)
    def shape_hint(self, config: Any, name: str, shape: tuple[int, ...]) -> str: ...
    # every tensor the model needs (quantized ones dequantized, lm_head borrowed); noted gets
    # a record when the target's embed_tokens replaced a different stored one
    def load_weights(
        self,
        model_dir: str | Path,
        target: str | Path | None,
        config: Any,
        noted: Callable[[dict], None] | None = None,
    ) -> dict: ...
    # the draft served as variant (qstream/serving.py) says, on device; served: how its linears
    # take their inputs (qstream/arch/weights.py, ServedLinears)
    def build(
        self,
        config: Any,
        weights: Mapping[str, torch.Tensor],
        variant: Variant,
        device: Any,
        served: Any = None,
    ) -> DraftModel: ...
    @property
    def drafter(self) -> Drafter: ...
    # DraftModel.causal_hidden a range of positions at a time, flattened
    def causal_stream(
        self, model: Any, ids: torch.Tensor, dtype: torch.dtype, depth: int | None = None
    ) -> AuxChunks: ...
    # the FLOP model (docs/eval-drift.md, "FLOP model"): one context position, blocks, causal pass
    def context_flops(self, config: Any) -> float: ...
    def drafted_flops(self, config: Any, anchor: torch.Tensor) -> float: ...
    def causal_flops(self, config: Any, T: int) -> float: ...
