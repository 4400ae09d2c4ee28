"""Searches over the model's next-token scores (§6.1), their batch shapes and compiled programs."""
