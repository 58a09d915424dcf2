"""The architecture interface (docs/model.md, "Architectures"): what eval, capture, synth and
vLLM's shape checks ask of a draft architecture, and the drafting outputs they read.  An
architecture is a folder under ``qstream/arch/`` whose descriptor satisfies
:class:`Architecture`; ``qstream/arch/registry.py`` lists the descriptors.

>>> arch = architecture_of(config)                   # qstream.arch.registry
>>> model = arch.build(config, weights, torch.float32, "cpu")
>>> blocks = model.draft(model.context(aux), stream, anchor, first_token)
>>> greedy = arch.rollout(model, blocks)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from qstream.serving import Variant

Shapes = dict[str, tuple[int, ...]]
# Every draft borrows its output head from the target, under this name; it is never the draft's
# own tensor (never quantized, never in its tensor table).
LM_HEAD = "lm_head.weight"
# The token embedding: the draft's own, or the target's when the draft carries none.
EMBED = "embed_tokens.weight"
# Where `qstream synth` puts the stand-in target, and where a draft's loader looks for its lm_head
# when no target is given: a checkpoint directory of its own holding lm_head.weight [V, H].
TARGET_HEAD_DIR = "target_head"


def causal_layers(num_layers: int, depth: int | None = None) -> list[int]:
    """Which of a draft's ``num_layers`` layers runs at each of ``depth`` steps of its causal
    pass (``causal_hidden``): its layers in order, repeated until there are ``depth`` (default:
    each once).  The boot regime asks for one output per target aux layer, so a draft with fewer
    layers than the target has aux layers runs its stack again on its own output
    (docs/eval-drift.md, "Regimes")."""
    steps = num_layers if depth is None else depth
    if num_layers < 1 or steps < 1:
        raise ValueError(f"a causal pass needs layers and steps, got {num_layers} and {steps}")
    return [j % num_layers for j in range(steps)]


@dataclass(frozen=True)
class Blocks:
    """The non-causal pass over N blocks: everything before the Markov head."""

    logits_base: torch.Tensor  # U [N, B, V] float32 (computed in the model's dtype)
    hidden: torch.Tensor  # hf [N, B, H] float32: final-normed block states
    first_token: torch.Tensor  # [N] int64: ids[p], the Markov head's prev_0


@dataclass(frozen=True)
class Rollout:
    """A Markov-head rollout of every block (greedy, sampled, or teacher-forced)."""

    tokens: torch.Tensor  # [N, B] drafted tokens d_k (teacher-forced: the supplied tokens)
    prev: torch.Tensor  # [N, B] token fed to markov_w1 at step k: [ids[p], d_0, ..., d_{B-2}]
    logits: torch.Tensor  # [N, B, V] float32: U_k + markov_w2 . markov_w1[prev_k]
    confidence: torch.Tensor | None  # [N, B] float32 sigmoid scores; None without the head


class AuxChunks(Protocol):
    """Aux states [S, T, A] too big to hold, produced a few positions at a time: a model's
    ``context`` calls ``rows`` once per consecutive range, in order from 0 to T."""

    shape: tuple[int, int, int]

    def rows(self, t0: int, t1: int) -> torch.Tensor:
        """Positions t0..t1-1 of every stream: [S, t1 - t0, A]."""
        ...


class DraftConfig(Protocol):
    """What the package reads of any DSpark-family draft's config.json (field names are
    config.json's; the Markov and confidence heads are the family's, qstream/arch/markov.py)."""

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
    """A draft built with its weights, computing in ``dtype`` on ``device``."""

    @property
    def config(self) -> Any: ...
    @property
    def device(self) -> torch.device: ...
    def context(self, aux: torch.Tensor | AuxChunks, lengths: torch.Tensor | None = None) -> Any:
        """aux [S, T, A] -> the per-stream context every block of those streams reads."""
        ...

    def draft(
        self, ctx: Any, stream: torch.Tensor, anchor: torch.Tensor, first_token: torch.Tensor
    ) -> Blocks:
        """N blocks at once: block n on stream[n] at anchor[n] from token first_token[n]."""
        ...

    def causal_hidden(self, ids: torch.Tensor, depth: int | None = None) -> torch.Tensor:
        """The draft's layers as a causal decoder over ids [S, T] -> [S, T, depth, H] fp32:
        every layer's output, the layers taken as :func:`causal_layers` orders them."""
        ...


class Architecture(Protocol):
    """One draft architecture: its config.json, tensor table, serving profile, loading,
    drafting calls and FLOP model (docs/model.md, "Architectures")."""

    config_type: type  # what parse_config returns
    quantize_include: tuple[str, ...]  # module kinds a shipped draft quantizes
    presets: Mapping[str, Any]  # name -> config, the sizes `qstream synth` builds
    # vLLM's serving profile as data (qstream/vllm/profiles.py's Profile fields), or None
    serving: Mapping[str, Any] | None
    final_norm: str  # the norm whose output the lm_head reads ("norm.weight")
    context_proj: str  # the module projecting the concatenated target states ("fc")
    # whether the architecture's published checkpoints carry embed_tokens (else the target's)
    ships_embed_tokens: bool

    def recognises(self, data: Mapping[str, Any]) -> bool:
        """Whether a config.json's contents name this architecture."""
        ...

    def parse_config(self, data: Mapping[str, Any]) -> Any:
        """config.json contents -> the config (ValueError naming the key and value)."""
        ...

    def tensor_shapes(self, config: Any) -> Shapes:
        """The checkpoint's tensors and shapes, in checkpoint order."""
        ...

    def shape_hint(self, config: Any, name: str, shape: tuple[int, ...]) -> str:
        """Why a tensor of a wrong shape does not fit, when the config explains it ("" else)."""
        ...

    def load_weights(self, model_dir: str | Path, target: str | Path | None, config: Any) -> dict:
        """Every tensor the model needs (quantized ones dequantized, lm_head borrowed)."""
        ...

    def build(
        self, config: Any, weights: Mapping[str, torch.Tensor], variant: Variant, device: Any
    ) -> DraftModel:
        """The draft served as ``variant`` (qstream/serving.py) says, on ``device``."""
        ...

    def host_head(self, model: Any) -> Any:
        """What :meth:`teacher_forced` reads, on the host whatever device drafted."""
        ...

    def rollout(
        self,
        model: Any,
        blocks: Blocks,
        noise: torch.Tensor | None = None,
        temperature: float = 1.0,
        top_p: float = 1.0,
    ) -> Rollout:
        """Greedy (``noise`` None) or sampled (Exp(1) race noise [N, B, V]) rollout."""
        ...

    def teacher_forced(self, head: Any, blocks: Blocks, tokens: torch.Tensor) -> Rollout: ...

    def causal_stream(
        self, model: Any, ids: torch.Tensor, dtype: torch.dtype, depth: int | None = None
    ) -> AuxChunks:
        """:meth:`DraftModel.causal_hidden` a range of positions at a time, flattened."""
        ...

    def context_flops(self, config: Any) -> float:
        """FLOPs of one context position (docs/eval-drift.md, "FLOP model")."""
        ...

    def drafted_flops(self, config: Any, anchor: torch.Tensor) -> float: ...

    def causal_flops(self, config: Any, T: int) -> float: ...
