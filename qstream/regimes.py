"""The regimes of docs/eval-drift.md (what stands in for the target's hidden states): the one place
a regime's name is spelled; code asks the object (``regime.causal``).  No torch: --help reads it."""

from dataclasses import dataclass


@dataclass(frozen=True)
class Regime:
    name: str
    description: str  # the card's words for it
    salt: int = 0  # seeds its noise generators with the run's seed (synthetic regimes)
    synthetic: bool = False  # drawn from noise, each stream from its own generator
    channel_scales: bool = False  # that noise times heavy's channel scales and sink (batches.py)
    causal: bool = False  # the reference's causal pass makes it (and adds its FLOPs)
    captured: bool = False  # read from captured target states


GAUSS = Regime("gauss", "iid normal aux states", 101, synthetic=True)
HEAVY = Regime(
    "heavy",
    "normal aux states times per-channel lognormal scales, a few outlier channels shared by "
    "every aux layer, and an attention-sink first token",
    202,
    synthetic=True,
    channel_scales=True,
)
BOOT = Regime(
    "boot",
    "the draft's own layers run causally over the real token stream (repeated until one per "
    "aux layer)",
    causal=True,
)
STATES = Regime(
    "states",
    "the target's own hidden states, captured (qstream capture or speculate --capture, or "
    "files vLLM, speculators or SpecForge wrote)",
    captured=True,
)
REGIMES: dict[str, Regime] = {r.name: r for r in (GAUSS, HEAVY, BOOT, STATES)}
AUX_REGIMES = tuple(n for n, r in REGIMES.items() if not r.captured)  # --regime's, in this order
ALL_REGIMES = "all"  # --regime all: every aux regime
DEFAULT_REGIME = HEAVY  # the pessimistic one (outlier channels, a massive first token)
