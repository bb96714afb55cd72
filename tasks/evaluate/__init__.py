"""The evaluate stage: held-out accuracy at serving precision, the champion gate, and promotion with approval."""
