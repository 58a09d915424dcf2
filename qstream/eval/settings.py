"""What one ``evaluate_drift`` run is asked to do (:class:`DriftSettings`), one frozen object
per concern, each checked once, where it is built: how the drafter and the verifier sample
(:class:`Sampling`), what verifies the drafts (:class:`Verification`), where outputs too big for
memory go (:class:`Scratch`).

>>> settings = DriftSettings(regimes=("heavy",), formats=("bf16", "fp8"), n_blocks=256,
...                          sampling=Sampling(temperature=0.7, top_p=0.95))
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from qstream.errors import QStreamError
from qstream.eval.vocabulary import ALLOWED_FORMATS, VARIANT_FORMATS
from qstream.formats import FORMATS
from qstream.regimes import AUX_REGIMES, DEFAULT_REGIME

# The kinds of pass whose work a run plans: each is timed at its own pace (qstream/progress.py).
# STEPS: the sensitivity steps, which measure drift only (no verifier), so run at a pace of
# their own beside the variants' when --acceptance or captured states verify those.
REFERENCE, VARIANTS, STEPS = "reference", "variants", "steps"


@dataclass(frozen=True)
class Sampling:
    """Sampling as a deployment runs it (docs/model.md, docs/vllm.md): the request's temperature
    applies to both sides; top-p / top-k cut the verifier's (target's) distribution only.  vLLM's
    DSpark drafter, under draft_sample_method "probabilistic" (its default is "greedy",
    vllm/config/speculative.py), samples the full tempered softmax (gumbel_sample);
    ``draft_top_p`` < 1 models other engines."""

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
        """The results' ``sampling`` block: which side sampled what (vLLM's probabilistic DSpark
        drafter has no top-p or top-k: ``gumbel_sample``)."""
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
    """How adaptive verification is simulated (docs/acceptance.md): the blocks, shuffled by the
    run's seed, are verified ``requests`` at a time as one batch's requests, whose verified
    draft tokens are ``budget_share`` of those drafted (rounded to the nearest token).  vLLM
    sizes that budget from step costs profiled on its GPU; here it is given."""

    requests: int = 8
    budget_share: float = 0.5

    def __post_init__(self) -> None:
        if self.requests < 1:
            raise QStreamError(f"--adaptive-requests must be at least 1, got {self.requests}")
        if not (math.isfinite(self.budget_share) and 0 <= self.budget_share <= 1):
            raise QStreamError(f"--adaptive-budget must be in [0, 1], got {self.budget_share}")

    def to_json(self) -> dict:
        return {"requests": self.requests, "budget_share": self.budget_share}


@dataclass(frozen=True)
class Verification:
    """What verifies the drafts (docs/acceptance.md).  ``acceptance``: the FP32 reference
    verifies each variant's drafts, in every mode vLLM serves (captured states add the target
    as a verifier whatever this says); ``adaptive``: adaptive verification's budget, for
    either verifier."""

    acceptance: bool = False
    adaptive: AdaptiveBudget = AdaptiveBudget()


@dataclass(frozen=True)
class Scratch:
    """Where per-block outputs too big for memory are kept for a regime (qstream/bounded/store.py;
    None: the system's temporary directory).  Never in the results: it changes no number."""

    directory: str | None = None


@dataclass(frozen=True)
class DriftSettings:
    regimes: tuple[str, ...] = (DEFAULT_REGIME.name,)  # AUX_REGIMES names
    formats: tuple[str, ...] = VARIANT_FORMATS  # simulated variants; bf16 is the floor
    variant_dirs: tuple[tuple[str, str], ...] = ()  # (name, quantized checkpoint directory)
    # compare a variant that is not derived from the model (qstream/eval/provenance.py)
    allow_foreign_variant: bool = False
    # check each variant directory against the sha256s quantize recorded; False:
    # --no-integrity-check, recorded in the results (qstream/checkpoint/integrity.py)
    integrity_check: bool = True
    # modules the simulated formats quantize; () = the draft architecture's own shipped list
    # (its descriptor's quantize_include), resolved by evaluate_drift once it reads config.json
    include: tuple[str, ...] = ()
    ignore: tuple[str, ...] = ()
    n_blocks: int = 1024
    seed: int = 0
    sampling: Sampling = Sampling()
    verification: Verification = Verification()
    # captured target states, a file or a directory (qstream/eval/states/): regime "states";
    # its layout (auto: from the contents), the convention of the layer ids it names, and layer
    # ids to check it against (docs/states.md)
    states: str | None = None
    states_format: str | None = None
    states_layer_convention: str | None = None
    states_layer_ids: str | None = None
    # the blocks of the states regime, a JSON file (qstream.eval.corpus.read_anchor_plan) in
    # place of uniformly drawn anchors: e.g. the anchors a speculative decoder visited
    states_anchors: str | None = None
    # Per-module sensitivity (qstream/eval/sensitivity.py): one format, one module kind at a
    # time, then cumulatively; None picks nvfp4 or the first 4-bit format of ``formats``.
    sensitivity: bool = False
    sensitivity_format: str | None = None
    tolerance: float = 0.1  # greedy ceiling (tokens) below bf16 the include list may lose
    # Long-context sweep (qstream/eval/context_sweep.py): bucket edges in tokens; () = no sweep
    context_lengths: tuple[int, ...] = ()
    context_blocks: int = 256  # blocks per context bucket (each bucket is a full evaluation)
    device: str = "cpu"  # where the models compute: cpu, cuda or cuda:N (qstream/device.py)
    scratch: Scratch = Scratch()

    def __post_init__(self) -> None:
        for regime in self.regimes:
            if regime not in AUX_REGIMES:
                raise QStreamError(
                    f"unknown regime {regime!r}; choose from {', '.join(AUX_REGIMES)} or all"
                )
        for fmt in self.formats:
            if fmt not in ALLOWED_FORMATS:
                raise QStreamError(
                    f"unknown format {fmt!r}; choose from {', '.join(ALLOWED_FORMATS)}"
                )
        names = [*self.formats, *(name for name, _ in self.variant_dirs)]
        if not names:
            raise QStreamError("nothing to evaluate: --formats names no format and no --variant")
        if len(set(names)) != len(names):
            raise QStreamError(f"variant names must be unique, got {', '.join(names)}")
        if self.n_blocks < 1:
            raise QStreamError(f"--blocks must be at least 1, got {self.n_blocks}")
        if not self.regimes and self.states is None:
            raise QStreamError("nothing to evaluate: no regime and no --states file")
        if self.states_anchors is not None and self.states is None:
            raise QStreamError("--states-anchors names blocks of --states, which is not given")
        if self.sensitivity_format is not None and self.sensitivity_format not in FORMATS:
            raise QStreamError(
                f"--sensitivity-format {self.sensitivity_format!r}: choose from "
                f"{', '.join(FORMATS)}"
            )
        if not (math.isfinite(self.tolerance) and self.tolerance >= 0):
            raise QStreamError(f"--tolerance must be >= 0 tokens, got {self.tolerance}")
        self._check_context()

    def _check_context(self) -> None:
        edges = self.context_lengths
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
    def n_variants(self) -> int:
        return len(self.formats) + len(self.variant_dirs)

    def planned_blocks(self) -> int | None:
        """Blocks ``evaluate_drift`` reports to its progress, as far as the settings tell before
        the corpus is read: a reference pass and one pass per variant, per regime, and per
        bucket of a context sweep; None with sensitivity, whose steps depend on the checkpoint.
        Once the blocks are planned, ``evaluate_drift`` reports the exact count."""
        if self.sensitivity:
            return None
        buckets = max(0, len(self.context_lengths) - 1)
        synthetic = len(self.regimes) * (self.n_blocks + buckets * self.context_blocks)
        states = self.n_blocks if self.states is not None else 0
        return (synthetic + states) * (1 + self.n_variants)
