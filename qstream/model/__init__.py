"""The DSpark draft model: configuration, reference forward, checkpoint loading, synthetic
checkpoints and weight statistics (docs/model.md; user guide in docs/model.md)."""
