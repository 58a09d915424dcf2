"""``qstream synth``: synthetic draft checkpoints and the text they are built from (docs/model.md,
"Synthetic checkpoints")."""
