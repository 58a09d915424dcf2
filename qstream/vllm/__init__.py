"""What vLLM 0.32.0 does with a checkpoint (docs/vllm.md): its serving profiles as data, the
shapes it builds, its loading decision replayed, the checks of ``qstream verify``, and its own
loader run on CPU.  Named for the engine; ``import vllm`` inside it is the real package."""
