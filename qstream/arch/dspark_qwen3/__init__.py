"""The Qwen3-style DSpark draft (and DFlash, without a Markov head): docs/qwen3-dspark.md."""
