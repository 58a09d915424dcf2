"""A checkpoint on disk (docs/quantize.md): its files and safetensors shards read and written a
tensor at a time, the compressed-tensors block it declares, its integrity record, its weights'
statistics, and a Hugging Face target's config."""
