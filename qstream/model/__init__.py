"""The DSpark draft model: configuration, reference forward, checkpoint loading, synthetic
checkpoints and weight statistics (DESIGN.md section 5; user guide in docs/model.md)."""
