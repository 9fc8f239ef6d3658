"""Token selection from a step's logits, and verification of draft tokens."""
