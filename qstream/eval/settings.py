"""What one ``evaluate_drift`` or ``run_speculate`` run is asked to do: frozen objects whose fields
are the command's options by name, each value checked once, where built, with the message the
command prints.  :class:`Selection` is what eval-drift and speculate share."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from qstream.errors import QStreamError
from qstream.eval.vocabulary import VARIANT_FORMATS
from qstream.formats import FORMATS
from qstream.regimes import ALL_REGIMES, AUX_REGIMES, DEFAULT_REGIME
from qstream.serving import DEFAULTS, Variant

DEFAULT_EDGES = "default"  # --context-lengths given bare: drift.default_edges(config)

# The kinds of pass whose work a run plans, each timed at its own pace (qstream/progress.py);
# STEPS: the sensitivity steps, drift only (no verifier).
REFERENCE, VARIANTS, STEPS = "reference", "variants", "steps"


@dataclass(frozen=True)
class Sampling:
    """Sampling as a deployment runs it (docs/vllm.md): the temperature applies to both sides,
    top-p / top-k to the verifier's only; vLLM's DSpark drafter samples the full tempered softmax
    (gumbel_sample, vllm/config/speculative.py); ``draft_top_p`` < 1 models other engines."""

    temperature: float = 1.0
    top_p: float = 1.0  # verifier
    top_k: int | None = None  # verifier; None: off
    draft_top_p: float = 1.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise QStreamError(f"--temperature must be finite and > 0, got {self.temperature}")
        for name, value in (("--top-p", self.top_p), ("--draft-top-p", self.draft_top_p)):
            if not 0 < value <= 1:
                raise QStreamError(f"{name} must be in (0, 1], got {value}")
        if self.top_k is not None and self.top_k < 1:
            raise QStreamError(f"--top-k must be >= 1 (or off), got {self.top_k}")

    def to_json(self) -> dict:
        return {
            "temperature": self.temperature,
            "drafter": {
                "top_p": self.draft_top_p,
                "top_k": None,
                "distribution": "softmax(logits / temperature)"
                + ("" if self.draft_top_p == 1 else ", top-p cut"),
            },
            "verifier": {"top_p": self.top_p, "top_k": self.top_k},
            "noise": "common random numbers: exponential race (Gumbel-max), the same Exp(1) "
            "variate per block, position and token for every model",
        }


@dataclass(frozen=True)
class AdaptiveBudget:
    """Adaptive verification's batches (docs/acceptance.md): shuffled blocks verified ``requests``
    at a time, their verified draft tokens ``budget_share`` of those drafted (vLLM sizes that
    budget from profiled step costs; here it is given)."""

    requests: int = 8
    budget_share: float = 0.5

    def __post_init__(self) -> None:
        if self.requests < 1:
            raise QStreamError(f"--adaptive-requests must be at least 1, got {self.requests}")
        if not (math.isfinite(self.budget_share) and 0 <= self.budget_share <= 1):
            raise QStreamError(f"--adaptive-budget must be in [0, 1], got {self.budget_share}")

    def to_json(self) -> dict:
        return {"requests": self.requests, "budget_share": self.budget_share}


@dataclass(frozen=True, kw_only=True)
class Selection:
    """The variants a run builds and what they quantize: simulated ``formats``, checkpoints
    (``variant``, ``NAME=DIR``, parsed into ``variant_dirs``), whether a foreign one is compared
    (qstream/eval/variants.py) or its sha256s go unchecked (qstream/checkpoint/integrity.py), and
    the include (() = the architecture's shipped quantize_include) and ignore patterns."""

    formats: tuple[str, ...] = VARIANT_FORMATS  # serving configuration tokens (serving.py)
    kv_cache_dtype: str | None = None  # every variant's KV cache unless its token names one
    variant: tuple[str, ...] = ()
    allow_foreign_variant: bool = False
    no_integrity_check: bool = False
    include_layers: tuple[str, ...] = ()
    ignore_layers: tuple[str, ...] = ()
    variant_dirs: tuple[tuple[str, str], ...] = field(init=False)

    def __post_init__(self) -> None:
        dirs = []
        for value in self.variant:  # NAME=DIR, each dir checked to exist
            name, sep, path = value.partition("=")
            if not sep or not name or not path:
                raise QStreamError(f"--variant expects NAME=DIR, got {value!r}")
            if not Path(path).is_dir():
                raise QStreamError(f"--variant {name}: {path} is not a directory")
            dirs.append((name, path))
        object.__setattr__(self, "variant_dirs", tuple(dirs))
        names = [v.name for v in self.simulated] + [name for name, _ in self.variant_dirs]
        if not names:
            raise QStreamError("nothing to evaluate: --formats names no format and no --variant")
        if len(set(names)) != len(names):
            raise QStreamError(f"variant names must be unique, got {', '.join(names)}")

    @property
    def simulated(self) -> tuple[Variant, ...]:
        return tuple(Variant.parse(t, self.kv_cache_dtype) for t in self.formats)

    @property
    def n_variants(self) -> int:
        return len(self.formats) + len(self.variant_dirs)


@dataclass(frozen=True, kw_only=True)
class DriftSettings(Selection):
    """eval-drift's options (docs/eval-drift.md); None ``model``, ``tokenizer`` or ``corpus``: the
    built-in draft, the draft's own, the built-in GSM8K split.  ``regime``: a name, ``all``, names,
    or None (the default; none with ``states``)."""

    model: str | None = None
    target: str | None = None  # the target whose lm_head (and embed_tokens) the draft borrows
    tokenizer: str | None = None
    corpus: str | None = None
    regime: str | tuple[str, ...] | None = None
    blocks: int = 1024
    seed: int = 0
    temperature: float = 1.0
    top_p: float = 1.0  # verifier
    top_k: int | None = None  # verifier; None: off
    draft_top_p: float = 1.0
    # the FP32 reference verifies each variant's drafts (captured states add the target anyway)
    acceptance: bool = False
    adaptive_requests: int = 8
    adaptive_budget: float = 0.5
    # captured target states (regime "states"), their layout (None: auto), layer-id convention
    # and the ids to check them against (docs/states.md)
    states: str | None = None
    states_format: str | None = None
    states_layer_convention: str | None = None
    states_layer_ids: str | None = None
    # a JSON file naming the states regime's blocks (corpus.read_anchor_plan), not drawn ones
    states_anchors: str | None = None
    # per-module sensitivity (qstream/eval/sensitivity.py); None: sensitivity_format picks
    sensitivity: bool = False
    sensitivity_format: str | None = None
    tolerance: float = 0.1  # greedy ceiling (tokens) below bf16 the include list may lose
    # long-context sweep bucket edges in tokens, or DEFAULT_EDGES (from the config); () = none
    context_lengths: tuple[int, ...] | str = ()
    context_blocks: int = 256  # blocks per context bucket (each bucket is a full evaluation)
    device: str = "cpu"  # where the models compute: cpu, cuda or cuda:N (qstream/device.py)
    # where per-block outputs too big for memory go (qstream/bounded.py; None: the temp dir)
    scratch_dir: str | None = None
    regimes: tuple[str, ...] = field(init=False)
    sampling: Sampling = field(init=False)
    adaptive: AdaptiveBudget = field(init=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        regimes: tuple[str, ...]
        if self.regime is None:  # the default; none when states are given
            regimes = () if self.states else (DEFAULT_REGIME.name,)
        elif isinstance(self.regime, str):
            regimes = AUX_REGIMES if self.regime == ALL_REGIMES else (self.regime,)
        else:
            regimes = tuple(self.regime)
        object.__setattr__(self, "regimes", regimes)
        for regime in self.regimes:
            if regime not in AUX_REGIMES:
                raise QStreamError(
                    f"unknown regime {regime!r}; choose from {', '.join(AUX_REGIMES)} or all"
                )
        if self.blocks < 1:
            raise QStreamError(f"--blocks must be at least 1, got {self.blocks}")
        if not self.regimes and self.states is None:
            raise QStreamError("nothing to evaluate: no regime and no --states file")
        if self.states_anchors is not None and self.states is None:
            raise QStreamError("--states-anchors names blocks of --states, which is not given")
        probed: tuple[Variant, ...] = ()  # --sensitivity-format's, its weights a format
        if self.sensitivity_format is not None:
            probed = (Variant.parse(self.sensitivity_format, self.kv_cache_dtype),)
            if not probed[0].simulated:
                raise QStreamError(
                    f"--sensitivity-format {self.sensitivity_format!r}: its weights must be one "
                    f"of {', '.join(FORMATS)} (the steps quantize them module kind by module kind)"
                )
        if not (math.isfinite(self.tolerance) and self.tolerance >= 0):
            raise QStreamError(f"--tolerance must be >= 0 tokens, got {self.tolerance}")
        self._check_context()
        for v in (*self.simulated, *probed):  # the target serves states and verifies, no aux
            if v.target != DEFAULTS["target"] and self.regimes:
                raise QStreamError(
                    f"variant {v.name}: target={v.target} reaches eval-drift only through the "
                    f"target's own states, which regime {', '.join(self.regimes)} lacks: capture "
                    f"them with qstream capture --target-format {v.target} and pass --states DIR "
                    "(no --regime), or run qstream speculate"
                )
        sampling = Sampling(self.temperature, self.top_p, self.top_k, self.draft_top_p)
        object.__setattr__(self, "sampling", sampling)
        adaptive = AdaptiveBudget(self.adaptive_requests, self.adaptive_budget)
        object.__setattr__(self, "adaptive", adaptive)

    def _check_context(self) -> None:  # order and range of --context-lengths
        if self.context_lengths is None:  # the command's value when --context-lengths is absent
            object.__setattr__(self, "context_lengths", ())
        edges = self.context_lengths
        if isinstance(edges, str):
            if edges == DEFAULT_EDGES:
                return
            try:
                edges = tuple(int(part) for part in edges.split(",") if part.strip())
            except ValueError:
                raise QStreamError(
                    "--context-lengths expects comma-separated token counts, "
                    f"got {self.context_lengths!r}"
                ) from None
            object.__setattr__(self, "context_lengths", edges)
        if edges and (
            len(edges) < 2 or edges[0] < 1 or any(a >= b for a, b in zip(edges, edges[1:]))
        ):
            raise QStreamError(
                "--context-lengths needs at least two increasing bucket edges "
                f">= 1, got {','.join(map(str, edges))}"
            )
        if self.context_blocks < 1:
            raise QStreamError(f"--context-blocks must be at least 1, got {self.context_blocks}")

    @property
    def edges(self) -> tuple[int, ...]:
        """The sweep's bucket edges, once ``evaluate_drift`` has resolved DEFAULT_EDGES."""
        return () if isinstance(self.context_lengths, str) else self.context_lengths

    def planned_blocks(self) -> int | None:
        """Blocks to report before the corpus is read (a reference pass and one per variant, per
        regime and bucket); None with sensitivity, whose steps depend on the checkpoint."""
        if self.sensitivity:
            return None
        buckets = max(0, len(self.edges) - 1)
        synthetic = len(self.regimes) * (self.blocks + buckets * self.context_blocks)
        states = self.blocks if self.states is not None else 0
        return (synthetic + states) * (1 + self.n_variants)
