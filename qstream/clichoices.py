"""The names the commands' options offer (choices, defaults, a version in a help text) as plain
constants.  The library defines each of them beside the code that uses it, in modules that
import torch; the option declarations take them from here instead, so that ``qstream --help``
and every ``qstream COMMAND --help`` load no heavy library (evals/bench_help.py).  Each
constant equals the library's own: tests/test_help.py checks them one by one."""

from __future__ import annotations

from qstream.serving import FLOOR, REFERENCE

WEIGHT_FORMATS = ("fp8", "mxfp4", "nvfp4")  # qstream.formats.FORMATS
VARIANT_FORMATS = (FLOOR, *WEIGHT_FORMATS)  # qstream.eval.vocabulary.VARIANT_FORMATS
EVAL_FORMATS = (REFERENCE, *VARIANT_FORMATS)  # qstream.eval.vocabulary.ALLOWED_FORMATS
DEFAULT_EDGES = "default"  # qstream.eval.run.DEFAULT_EDGES: --context-lengths given bare
# qstream.arch.dspark_mla.QUANTIZE_INCLUDE: the module kinds a shipped DSpark quantizes
QUANTIZE_INCLUDE = (
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
    "self_attn.o_proj",
    "self_attn.q_b_proj",
    "context_proj",
)
STATES_AUTO = "auto"  # qstream.eval.states.AUTO
STATES_FORMATS = ("qstream", "vllm", "specforge")  # qstream.eval.states.FORMATS
# qstream.eval.states.CONVENTIONS and qstream.capture.target.CONVENTIONS
LAYER_CONVENTIONS = ("layer-output", "hidden-states-index")
CAPTURE_DTYPES = ("float32", "bfloat16", "float16")  # qstream.capture.target.DTYPES
CAPTURE_EXPORTS = ("qstream", "vllm")  # qstream.capture.layout.EXPORTS
CARD_FORMATS = ("md", "json", "html")  # qstream.card.build.FORMATS
# qstream.speculate.decode.RULES
SPECULATE_RULES = ("greedy", "greedy-sampling", "probabilistic", "block")
VLLM_VERSION = "0.32.0"  # qstream.vllm.loader.VLLM_VERSION
