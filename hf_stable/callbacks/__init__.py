"""Trainer callbacks (learning-rate control, and later merging, stability guards and monitors)."""
