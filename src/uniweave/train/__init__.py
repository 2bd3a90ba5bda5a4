"""The trainer loop and what it shares across methods: forward, checkpoints, logging."""
