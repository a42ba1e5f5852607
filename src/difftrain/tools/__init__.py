"""Commands around training: diagnose, lr-find, estimate. Each builds what it needs from a config."""
