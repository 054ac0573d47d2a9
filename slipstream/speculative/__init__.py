"""Speculative decoding: proposals of the next tokens that one target forward verifies."""
