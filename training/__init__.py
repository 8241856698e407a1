"""Training the shipped target + drafter pair (docs/training.md). Not part of the runtime package."""
